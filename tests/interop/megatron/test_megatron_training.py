"""mlm trains like Megatron-LM, step for step: megatron-core 0.16.1's own GPTModel, DDP, Adam
(`get_megatron_optimizer`, its weight-decay groups), clipping and OptimizerParamScheduler
(tests/interop/megatron/megatron_ref.py, `init_and_train`, on CPU) against `mlm train` from the
same initial weights (imported with `mlm convert from-megatron`) on the same batches (mlm's
sampler's, fed to both), with the run config `mlm config from-megatron` makes of the Megatron-LM
argument list. Skipped where megatron-core is not installed.

Tolerance: per-step |Δloss| / loss ≤ 1e-5 (measured 7.8e-8 with cosine, 1.2e-7 with WSD, over a
loss going 6.21 → 6.05 / 5.90), gradient norms within 1e-4 relative, and the learning rate equal
(relative 1e-12) at every step, for a cosine schedule with warm-up and weight decay 0.1, for WSD
with a cosine final decay, and for the cosine run resumed in mlm from Megatron's checkpoint at
step 3, mid-warm-up. About 11 s a case on 2 cores, 17 s with the resume."""

import argparse
import shlex

import pytest
import torch

from mlm.config import load_config
from mlm.convert.megatron.command_line import command_line_sets, parse
from mlm.convert.megatron.importer import import_megatron
from mlm.train.trainer import Trainer

from distributed import run_ranks  # noqa: E402
from megatron_helpers import SETS, megatron  # noqa: E402, F401 (the fixture)
from megatron_ref import SEQ, init_and_train  # noqa: E402

MODEL = f"""--num-layers 2 --hidden-size 64 --num-attention-heads 4 --group-query-attention --num-query-groups 2
--ffn-hidden-size 96 --normalization RMSNorm --norm-epsilon 1e-5 --swiglu --position-embedding-type rope
--rotary-base 10000 --disable-bias-linear --untie-embeddings-and-output-weights --seq-length {SEQ}
--max-position-embeddings {SEQ} --vocab-size 512 --make-vocab-size-divisible-by 128 --attention-dropout 0.0
--hidden-dropout 0.0 --micro-batch-size 2 --global-batch-size 4 --train-iters 20 --lr 1e-3 --min-lr 1e-4
--weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --clip-grad 1.0 --split 100,0,0"""

SCHEDULES = {
    "cosine": "--lr-warmup-iters 5 --lr-decay-iters 20 --lr-decay-style cosine",
    "wsd": "--lr-warmup-iters 3 --lr-decay-iters 20 --lr-decay-style WSD --lr-wsd-decay-style cosine "
    "--lr-wsd-decay-iters 8",
}


def _mlm_run(cfg, load, monkeypatch) -> list:
    """`mlm train` of `cfg` from the checkpoint `load`: per step (its micro-batches' tokens, the step's result)."""
    steps = []
    train_step = Trainer.train_step

    def recorded(self, batches):
        result = train_step(self, batches)
        steps.append(([self._batch(self.train_data, b).clone() for b in batches], result))
        return result

    monkeypatch.setattr(Trainer, "train_step", recorded)
    Trainer(cfg, load=str(load)).train()
    monkeypatch.setattr(Trainer, "train_step", train_step)
    return steps


def _assert_same(steps, theirs) -> None:
    ours = {k: [r[k] for _, r in steps] for k in ("loss", "lr", "grad_norm")}
    assert ours["lr"] == pytest.approx(theirs["lr"], rel=1e-12, abs=0)
    rel = [abs(a - b) / b for a, b in zip(ours["loss"], theirs["loss"], strict=True)]
    assert max(rel) <= 1e-5, rel
    assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-4)


@pytest.mark.slow
@pytest.mark.usefixtures("megatron")
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_twenty_steps_as_megatron(tmp_path, tiny_data, monkeypatch, schedule):
    """From the same weights: the 20 steps of each side. For cosine, Megatron's run is also saved
    at step 3 (mid-warm-up) with its optimizer, imported with `mlm convert from-megatron`, and
    `mlm train` goes on from it: steps 4 to 20 as Megatron's."""
    argv = shlex.split(f"{MODEL} {SCHEDULES[schedule]}")
    run_ranks(1, init_and_train, str(tmp_path / "init"), 512, None, None)
    import_megatron(tmp_path / "init", tmp_path / "ckpt", SETS, weights_only=True)
    sets, _ = command_line_sets([*argv, "--data-path", tiny_data])
    run = [f"run_dir='{tmp_path / 'run'}'", "train.eval_interval=0", "logging.tensorboard=false"]
    cfg = load_config(None, [*sets, *run])
    assert (cfg.optimizer.warmup_offset, cfg.optimizer.weight_decay_exempt) == (0, "1d")
    steps = _mlm_run(cfg, tmp_path / "ckpt", monkeypatch)
    assert len(steps) == 20 and steps[0][0][0].shape == (2, SEQ + 1)
    args = argparse.Namespace(
        **{"lr_warmup_init": 0.0, "lr_wsd_decay_iters": 0, "lr_wsd_decay_style": None, **parse(argv)}
    )
    save_at = 3 if schedule == "cosine" else 0
    batches = [b for b, _ in steps]
    theirs = run_ranks(1, init_and_train, str(tmp_path / "init"), 512, batches, args, save_at)[0]
    assert theirs["lr"][0] == 0.0  # Megatron's first step runs at lr_warmup_init
    _assert_same(steps, theirs)
    if not save_at:
        return
    import_megatron(tmp_path / "init-resumed", tmp_path / "resumed")
    data = [f"data.data_path=['{tiny_data}']", "data.split='100,0,0'", "train.seed=1234"]
    resumed = load_config(
        tmp_path / "resumed" / "config.toml", [*data, *run[1:], f"run_dir='{tmp_path / 'run2'}'"]
    )
    later = _mlm_run(resumed, tmp_path / "resumed", monkeypatch)
    assert len(later) == 20 - save_at and all(
        torch.equal(a, b)
        for (x, _), y in zip(later, batches[save_at:], strict=True)
        for a, b in zip(x, y, strict=True)
    )
    _assert_same(later, {k: v[save_at:] for k, v in theirs.items()})
