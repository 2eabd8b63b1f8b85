"""A resume with settings other than the checkpoint's (mlm/train/resume.py): refused by name,
unless allowed (layout, outputs, length on the same schedule) or accepted with
`checkpoint.resume_changes`; weights-only checkpoints start new runs and are not checked."""

from __future__ import annotations

import pytest

from mlm.checkpoint import save_checkpoint
from mlm.config import load_config
from mlm.errors import MlmError
from mlm.train.resume import check_resume, resume_changes
from mlm.train.trainer import Trainer
from tests.helpers.common import tiny_sets


def _cfg(**sets):
    return load_config(None, [f"{k}={v}" for k, v in sets.items()])


def _keys(changes) -> list[str]:
    return [c.key for c in changes]


def test_refused_allowed_and_accepted_settings():
    saved = _cfg(**{"train.train_iters": 50, "optimizer.lr": 3e-3})
    same = _cfg(
        **{"train.train_iters": 50, "optimizer.lr": 3e-3, "parallel.tp": 2, "logging.log_interval": 1}
    )
    assert resume_changes(saved, same, 50, 50, 20)[0] == []  # the layout and the outputs may change
    bf16 = _cfg(**{"train.train_iters": 50, "optimizer.lr": 1e-3, "train.precision": "bf16", "train.seed": 7})
    refused, _ = resume_changes(saved, bf16, 50, 50, 20)
    assert _keys(refused) == ["optimizer.lr", "train.precision", "train.seed"]
    with pytest.raises(MlmError) as e:
        check_resume(saved, bf16, 50, 50, 20, "CKPT")
    msg = str(e.value)
    assert "optimizer.lr: 0.003 in the checkpoint, 0.001 here" in msg
    assert "train.precision: 'fp32' in the checkpoint, 'bf16' here" in msg
    assert "--set optimizer.lr=0.003 --set train.precision=fp32 --set train.seed=1234" in msg
    assert """'checkpoint.resume_changes=["optimizer.lr", "train.precision", "train.seed"]'""" in msg
    accepted = _cfg(**{
        "train.train_iters": 50,
        "optimizer.lr": 1e-3,
        "train.precision": "bf16",
        "train.seed": 7,
        "checkpoint.resume_changes": '["optimizer", "train.precision", "train.seed"]',
    })  # fmt: skip
    notes = check_resume(saved, accepted, 50, 50, 20, "CKPT")
    assert notes == [
        "optimizer.lr: 0.003 in the checkpoint, 0.001 here",
        "train.precision: 'fp32' in the checkpoint, 'bf16' here",
        "train.seed: 1234 in the checkpoint, 7 here",
    ]
    typo = _cfg(**{"checkpoint.resume_changes": '["optimizer.lrr"]'})
    with pytest.raises(MlmError, match="'optimizer.lrr' is not a setting"):
        resume_changes(saved, typo, 50, 50, 20)


def test_a_longer_run_keeps_its_schedule_or_is_refused():
    """docs/train.md's trap: 50 steps of cosine over 50, resumed for 300 steps, jumped from lr
    3.1e-4 to 2.9e-3. A longer run is allowed where the schedule does not follow its length."""
    base = {"optimizer.lr": 3e-3, "optimizer.min_lr": 3e-4, "optimizer.warmup_iters": 20}
    saved = _cfg(**base, **{"train.train_iters": 50})
    longer = _cfg(**base, **{"train.train_iters": 300})
    refused, _ = resume_changes(saved, longer, 50, 300, 50)
    assert _keys(refused) == ["train.train_iters"]
    assert "learning rate at step 50: 0.0003 in the checkpoint's run, 0.00292 here" in str(refused[0])
    assert "optimizer.decay_iters=50" in str(refused[0])
    same_schedule = _cfg(**base, **{"train.train_iters": 300, "optimizer.decay_iters": 50})
    refused, allowed = resume_changes(saved, same_schedule, 50, 300, 50)
    assert refused == [] and _keys(allowed) == ["optimizer.decay_iters", "train.train_iters"]
    constant = {**base, "optimizer.decay_style": "constant"}
    assert (
        resume_changes(_cfg(**constant), _cfg(**constant, **{"train.train_iters": 300}), 100, 300, 100)[0]
        == []
    )


def test_trainer_refuses_a_changed_resume_and_takes_an_accepted_one(tmp_path, tiny_data):
    ckpt = tmp_path / "ckpt"
    sets = {"train.train_iters": 2, "checkpoint.save": f"'{ckpt}'", "optimizer.decay_style": "'constant'"}
    first = Trainer(load_config(None, tiny_sets(tmp_path / "a", tiny_data, **sets)))
    first.train()
    changed = {**sets, "optimizer.lr": 1e-3, "train.train_iters": 3}
    with pytest.raises(MlmError, match=r"optimizer.lr: 0.01 in the checkpoint, 0.001 here") as e:
        Trainer(load_config(None, tiny_sets(tmp_path / "b", tiny_data, **changed)), load=str(ckpt))
    assert "train_iters" not in str(e.value)  # a longer run on a constant schedule is allowed
    accept = {**changed, "checkpoint.resume_changes": "['optimizer.lr']"}
    resumed = Trainer(load_config(None, tiny_sets(tmp_path / "c", tiny_data, **accept)), load=str(ckpt))
    assert resumed.iteration == 2
    # weights only (as an import writes them): a new run from them, whatever its settings
    model = {"model": first._groups()["model"]}
    save_checkpoint(tmp_path / "weights", 0, model, {"config": first.cfg.to_dict()})
    new = Trainer(
        load_config(None, tiny_sets(tmp_path / "d", tiny_data, **changed)), load=str(tmp_path / "weights")
    )
    assert new.iteration == 0
