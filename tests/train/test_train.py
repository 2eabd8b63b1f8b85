"""`mlm train` on one process: determinism, exact resume, crash-safe checkpoints, schedules,
loss scaling, metrics and bad input."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from mlm.config import OptimizerConfig, load_config
from mlm.errors import MlmError
from mlm.train.schedule import lr_at
from mlm.train.trainer import Trainer
from tests.helpers.common import ROOT, mlm, tiny_sets


def tiny_config(tmp_path, data, **extra):
    return load_config(None, tiny_sets(tmp_path / "run", data, **extra))


def weights(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def test_same_seed_same_losses_bitwise(tmp_path, tiny_data):
    a = Trainer(tiny_config(tmp_path, tiny_data)).train()
    b = Trainer(tiny_config(tmp_path, tiny_data)).train()
    assert a == b and len(a) == 6
    c = Trainer(tiny_config(tmp_path, tiny_data, **{"train.seed": 7})).train()
    assert c != a


@pytest.mark.parametrize("precision,async_save", [("fp32", "false"), ("bf16", "false"), ("fp32", "true")])
def test_resume_is_exact(tmp_path, tiny_data, precision, async_save):
    ckpt = tmp_path / "ckpt"
    sets = {
        "train.precision": precision,
        "checkpoint.save": f"'{ckpt}'",
        "checkpoint.save_interval": 3,
        "checkpoint.async_save": async_save,
    }
    straight = Trainer(tiny_config(tmp_path, tiny_data, **sets))
    losses = straight.train()
    resumed = Trainer(tiny_config(tmp_path, tiny_data, **sets), load=str(ckpt / "iter_0000003"))
    assert resumed.iteration == 3 and resumed.consumed_samples == 12
    assert resumed.train() == losses[3:]  # bitwise: float equality
    for k, v in weights(straight).items():
        assert torch.equal(v, weights(resumed)[k]), k


def test_sigkill_during_save_keeps_previous_checkpoint(tmp_path, tiny_data):
    ckpt = tmp_path / "ckpt"
    sets = tiny_sets(
        tmp_path / "run", tiny_data, **{"checkpoint.save": f"'{ckpt}'", "checkpoint.save_interval": 2}
    )
    child = f"""
import sys, time
import mlm.checkpoint.store as store
from mlm.config import load_config
from mlm.train.trainer import Trainer
original = Trainer.save
def save(self, root):
    if self.iteration == 4:  # the second save hangs half-way through writing tensors
        write = store.write_slice
        state = {{"n": 0}}
        def slow(*a, **k):
            state["n"] += 1
            if state["n"] == 5:
                print("KILL ME", flush=True)
                time.sleep(120)
            return write(*a, **k)
        store.write_slice = slow
    return original(self, root)
Trainer.save = save
Trainer(load_config(None, {sets!r})).train()
"""
    proc = subprocess.Popen(
        [sys.executable, "-c", child], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.time() + 120
    for line in proc.stdout:
        if "KILL ME" in line or time.time() > deadline:
            break
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (ckpt / "latest").read_text().strip() == "iter_0000002"
    assert (ckpt / "iter_0000004").exists() and not (ckpt / "iter_0000004" / "manifest.json").exists()
    cfg = load_config(None, sets)
    resumed = Trainer(cfg, load=str(ckpt))
    assert resumed.iteration == 2
    tail = resumed.train()
    straight = Trainer(load_config(None, tiny_sets(tmp_path / "run2", tiny_data))).train()
    assert tail == straight[2:]
    assert (ckpt / "latest").read_text().strip() == "iter_0000006"


def test_metrics_jsonl_tensorboard_and_sample(tmp_path, tiny_data):
    cfg = tiny_config(
        tmp_path,
        tiny_data,
        **{
            "logging.tensorboard": "true",
            "train.eval_interval": 3,
            "logging.log_interval": 2,
            "logging.sample_prompt": "'def '",
            "logging.sample_tokens": 5,
        },
    )
    Trainer(cfg).train()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["split"] == "train"]
    assert [r["step"] for r in train] == [2, 4, 6]
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "memory_gib", "eta_s"):
        assert all(math.isfinite(r[key]) for r in train), key
    assert [r["step"] for r in records if r["split"] == "valid"] == [3, 6]
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
    assert "[data]" in (tmp_path / "run" / "config.toml").read_text()


def test_mfu_is_model_flops_per_second_over_the_profile_peak(tmp_path, tiny_data):
    from mlm.model import flops_per_token
    from mlm.train.metrics import peak_flops

    cfg = tiny_config(tmp_path, tiny_data, **{"logging.hardware": "'h100-80g'", "train.train_iters": 3})
    Trainer(cfg).train()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["split"] == "train"]
    tokens = cfg.train.global_batch_size * cfg.data.seq_length
    flops_per_step = flops_per_token(cfg.model, cfg.data.seq_length) * tokens
    assert len(train) == 3
    for r in train:  # one rank: the H100 datasheet's dense bf16 peak, 989 TFLOP/s
        assert r["mfu"] == pytest.approx(flops_per_step / r["step_time_s"] / 989e12, rel=1e-6)
        assert r["tokens_per_s"] == pytest.approx(tokens / r["step_time_s"], rel=1e-6)
    # the short names of earlier configs are aliases of the plan files' profiles
    assert peak_flops("h100") == peak_flops("h100-80g") == 989e12 and peak_flops("a100") == 312e12
    assert load_config(None, ["logging.hardware='a100'"]).logging.hardware == "a100-80g"
    with pytest.raises(MlmError, match="logging.hardware='h900': must be one of cpu, a100-40g"):
        load_config(None, ["logging.hardware='h900'"])


def test_fp16_overflow_skips_the_step(tmp_path, tiny_data):
    cfg = tiny_config(tmp_path, tiny_data, **{"train.precision": "fp16", "train.initial_loss_scale": 1e38})
    trainer = Trainer(cfg)
    before = weights(trainer)
    r = trainer.train_step([range(0, 2), range(2, 4)])
    assert r["skipped"] and trainer.scaler.skipped == 1 and trainer.scaler.scale == 5e37
    assert all(torch.equal(v, weights(trainer)[k]) for k, v in before.items())


def test_grad_accumulation_matches_one_big_micro_batch(tmp_path, tiny_data):
    exact = {"model.hidden_dropout": 0.0, "optimizer.adam_eps": 1e-4}
    small = Trainer(tiny_config(tmp_path, tiny_data, **exact))
    big = Trainer(tiny_config(tmp_path, tiny_data, **exact, **{"train.micro_batch_size": 4}))
    a = small.train_step([range(0, 2), range(2, 4)])
    b = big.train_step([range(0, 4)])
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
    # fp32, summation order differs. Adam's g / (sqrt(v) + eps) turns a 1e-9 gradient difference on
    # a near-zero gradient into a large fraction of the step when eps is tiny (measured: 1.3e-5 at
    # eps 1e-8); eps 1e-4 keeps the update smooth in g (as in test_parallel_training.py).
    for k, v in weights(small).items():
        torch.testing.assert_close(v, weights(big)[k], rtol=1e-5, atol=1e-6)


def test_lr_schedules():
    cos = OptimizerConfig(lr=1.0, min_lr=0.1, warmup_iters=10, decay_style="cosine")
    assert lr_at(0, cos, 110) == pytest.approx(0.1) and lr_at(9, cos, 110) == pytest.approx(1.0)
    assert lr_at(60, cos, 110) == pytest.approx(0.55) and lr_at(110, cos, 110) == pytest.approx(0.1)
    lin = OptimizerConfig(lr=1.0, min_lr=0.0, decay_style="linear")
    assert lr_at(50, lin, 100) == pytest.approx(0.5)
    wsd = OptimizerConfig(lr=1.0, min_lr=0.0, decay_style="wsd", wsd_decay_iters=20)
    assert lr_at(79, wsd, 100) == 1.0 and lr_at(90, wsd, 100) == pytest.approx(0.5)
    assert lr_at(5, OptimizerConfig(lr=2.0, min_lr=0.0, decay_style="constant"), 100) == 2.0


def test_schedule_settings_validate_and_old_configs_read():
    """The schedule settings refuse what Megatron's scheduler would assert on, naming the field;
    a config written before `weight_decay_exempt` (a checkpoint's manifest) still reads."""
    for sets, words in [
        (["optimizer.warmup_fraction=0.1", "optimizer.warmup_iters=5"], "give one or the other"),
        (["optimizer.warmup_samples=10", "optimizer.warmup_iters=5"], "give one length, in samples or in"),
        (
            ["optimizer.decay_samples=10", "optimizer.decay_iters=5"],
            "optimizer.decay_samples=10 with optimizer",
        ),
        (["optimizer.wsd_decay_samples=0"], "optimizer.wsd_decay_samples=0: must be positive"),
        (["optimizer.start_weight_decay=0.1"], "set optimizer.weight_decay_incr_style=linear or cosine"),
        (["optimizer.weight_decay_incr_style=linear"], "needs 0 <= start_weight_decay <= end_weight_decay"),
        (["optimizer.lr_warmup_init=1.0"], "optimizer.lr_warmup_init=1.0: must be within [0, lr=0.0003]"),
        (["optimizer.wsd_decay_style=step"], "optimizer.wsd_decay_style='step': must be one of linear"),
    ]:
        with pytest.raises(MlmError, match=re.escape(words)):
            load_config(None, ["data.seq_length=8", *sets])
    for old, new in [(True, "1d_and_embeddings"), (False, "none")]:
        cfg = load_config(
            None, ["data.seq_length=8", f"optimizer.no_decay_norms_biases_embeddings={str(old).lower()}"]
        )
        assert cfg.optimizer.weight_decay_exempt == new


def test_bad_input(tmp_path, tiny_data):
    def err(*sets):
        with pytest.raises(MlmError) as e:
            Trainer(load_config(None, tiny_sets(tmp_path / "run", tiny_data) + list(sets)))
        return str(e.value)

    assert "unknown preset 'llama9'" in err("preset=llama9")
    assert "did you mean optimizer.lr?" in err("optimizer.lrr=1")
    assert "train.micro_batch_size='four': expected int" in err("train.micro_batch_size='four'")
    assert "dataset file not found" in err(f"data.data_path=['{tmp_path}/none']")
    assert "vocabulary of 512 but model.vocab_size=256" in err("model.vocab_size=256")
    assert "is not divisible by model.num_query_groups=3" in err("model.num_query_groups=3")
    ckpt = tmp_path / "ckpt"
    Trainer(
        tiny_config(tmp_path, tiny_data, **{"checkpoint.save": f"'{ckpt}'", "train.train_iters": 1})
    ).train()
    with pytest.raises(
        MlmError, match="saved from another model: model.hidden_size: 64 in the checkpoint, 32 here"
    ):
        Trainer(tiny_config(tmp_path, tiny_data, **{"model.hidden_size": 32}), load=str(ckpt))


def test_cli_train_and_errors(tmp_path, tiny_data):
    r = mlm(
        "train",
        *[
            a
            for s in tiny_sets(tmp_path / "run", tiny_data, **{"train.train_iters": 2})
            for a in ("--set", s)
        ],
    )
    assert r.returncode == 0, r.stderr
    assert "step 2/2" in r.stderr
    r = mlm("train", "--set", "preset=nope")
    assert r.returncode == 2 and "unknown preset 'nope'" in r.stderr


def test_train_tokens_sets_the_number_of_steps(tmp_path, tiny_data):
    trainer = Trainer(
        tiny_config(tmp_path, tiny_data, **{"train.train_iters": "none", "train.train_tokens": 300})
    )
    assert trainer.total_iters == 3  # ceil(300 / (global batch 4 × seq 32))


def test_sigterm_saves_and_auto_resume_finishes_the_same_run(tmp_path, tiny_data):
    ckpt = tmp_path / "ckpt"
    sets = tiny_sets(tmp_path / "run", tiny_data, **{"train.train_iters": 40, "checkpoint.save": f"'{ckpt}'"})
    args = [sys.executable, "-m", "cli.main", "train", *[a for s in sets for a in ("--set", s)]]
    env = {**os.environ, "COLUMNS": "200", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        args, cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env
    )
    for line in proc.stderr:
        if line.startswith("step  3/"):
            proc.send_signal(signal.SIGTERM)
            break
    rest = proc.stderr.read()
    assert proc.wait(timeout=120) == 3, rest
    assert "stopped by SIGTERM after step" in rest
    stopped_at = int((ckpt / "latest").read_text().strip().removeprefix("iter_"))
    assert 3 <= stopped_at < 40
    r = subprocess.run([*args, "--auto-resume"], cwd=ROOT, capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert f"iter_{stopped_at:07d} at step {stopped_at}" in r.stderr
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    resumed = {r["step"]: r["loss"] for r in records if r["split"] == "train"}
    straight = Trainer(
        load_config(None, tiny_sets(tmp_path / "run2", tiny_data, **{"train.train_iters": 40}))
    ).train()
    assert resumed[40] == straight[39] and resumed[stopped_at + 1] == straight[stopped_at]
