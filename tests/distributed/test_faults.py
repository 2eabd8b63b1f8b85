"""Faults in the numbers (`mlm.train.faults`): a NaN loss or gradient, or a loss spike, injected at
step K on real gloo ranks (dp 2, with and without the distributed optimizer, tp 2, pp 2), is skipped, rolled back or stops the run as
train.resilience.fault_action says; a skipped or rolled-back run then equals a run with
train.resilience.skip_iterations=[K], which never trains on step K's data.

Tolerance: none. Both runs are on the same mesh and CPU, fp32, so the same numbers are summed in
the same order: later losses, the final weights and Adam's step count are compared bit for bit. The
tiny model keeps its hidden dropout (0.1), so a skipped step must also leave the RNG where it was.

Injection: the loss of step K is multiplied on some ranks after the (vocabulary-parallel) loss, by
NaN (the loss and, through backward, the gradients become NaN) or by 100 (a spike); or one element
of one rank's gradient of a norm weight is set to NaN after the dp reduction (then only that rank's
norm is NaN: the decision must still be the same on every rank).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from mlm.checkpoint import read_manifest, resolve_checkpoint
from mlm.config import load_config
from mlm.errors import MlmError
from mlm.train.trainer import Trainer
from tests.helpers.common import tiny_sets
from tests.helpers.distributed import run_ranks

K = 4  # the faulty step
BASE = {"train.train_iters": 7, "optimizer.adam_eps": 1e-4}
RUNS = {
    "listed": {"train.resilience.skip_iterations": f"[{K}]"},
    "nan-loss": {},
    "nan-grad": {},
    "spike": {"train.resilience.loss_spike_zscore": 20.0, "train.resilience.loss_spike_window": 3},
    "rollback": {"train.resilience.fault_action": "rollback", "checkpoint.save_interval": 2},
    "stop": {"train.resilience.fault_action": "stop"},
}


def _scale_loss(trainer: Trainer, factor: float, ranks: set[int]) -> None:
    """Step K's loss times `factor` on `ranks` (on every stage that computes it)."""
    head_loss = trainer.model.head_loss

    def patched(h, labels, weights=None):
        loss = head_loss(h, labels, weights)
        if trainer.iteration + 1 == K and trainer.mesh.rank in ranks:
            return loss * factor
        return loss

    trainer.model.head_loss = patched


def _nan_gradient(trainer: Trainer, rank: int) -> None:
    """At step K, one element of `rank`'s reduced gradient of a tp-replicated weight becomes NaN."""
    grads = trainer.optimizer.all_grads
    finish = grads.finish

    def patched():
        finish()
        if trainer.iteration + 1 == K and trainer.mesh.rank == rank:
            replicated = next(g for g, kind in trainer.optimizer.pieces() if kind is False)
            replicated.view(-1)[0] = float("nan")

    grads.finish = patched


def _inject(name: str, trainer: Trainer, world: int) -> None:
    if name in ("nan-loss", "rollback", "stop"):
        _scale_loss(trainer, float("nan"), {world - 1})
    elif name == "nan-grad":
        _nan_gradient(trainer, world - 1)
    elif name == "spike":
        _scale_loss(trainer, 100.0, set(range(world)))


def _runs(rank, world, tmp, data, parallel, names):
    """Each named run on this rank: its losses, data position, counts, Adam's step, weights."""
    out = {}
    for name in names:
        run = Path(tmp) / name
        sets = {**BASE, **parallel, **RUNS[name], "checkpoint.save": f"'{run / 'ckpt'}'"}
        trainer = Trainer(load_config(None, tiny_sets(run, data, **sets)))
        _inject(name, trainer, world)
        try:
            losses = trainer.train()
        except MlmError as e:
            out[name] = {"error": str(e), "iteration": trainer.iteration}
            continue
        out[name] = {
            "losses": losses,
            "consumed": trainer.consumed_samples,
            "counts": dict(trainer.faults.counts),
            "optimizer_step": trainer.optimizer_step,
            "weights": {k: v.detach().float().numpy().copy() for k, v in trainer.model.state_dict().items()},
        }
        if trainer.fp8 is not None:  # delayed scaling's state
            out[name]["weights"]["fp8.amax_history"] = trainer.fp8.amax_history.numpy().copy()
            out[name]["weights"]["fp8.scale"] = trainer.fp8.scale.numpy().copy()
    return out


def _same_as_listed(run: dict, listed: dict) -> None:
    """Every step but K has the listed run's loss, bit for bit; so have the final weights."""
    assert len(run["losses"]) == len(listed["losses"]) == BASE["train.train_iters"]
    assert math.isnan(listed["losses"][K - 1])
    for step, (a, b) in enumerate(zip(run["losses"], listed["losses"], strict=True), start=1):
        assert step == K or a == b, f"step {step}: {a} != {b}"
    assert run["consumed"] == listed["consumed"] == BASE["train.train_iters"] * 4
    assert run["optimizer_step"] == listed["optimizer_step"] == BASE["train.train_iters"] - 1
    for k, v in listed["weights"].items():
        assert (run["weights"][k] == v).all(), k


@pytest.mark.parametrize(
    "parallel,names",
    [
        ({}, ["listed", "nan-loss", "nan-grad", "stop"]),
        ({"parallel.tp": 2}, ["listed", "nan-loss", "rollback"]),
        ({"parallel.pp": 2}, ["listed", "nan-grad", "spike"]),
        ({"parallel.distributed_optimizer": "true", "parallel.bucket_size_mb": 0.05}, ["listed", "nan-grad"]),
    ],
    ids=["dp2", "tp2", "pp2", "dp2-distopt"],
)
def test_faults_on_two_ranks(tmp_path, tiny_data, parallel, names):
    per_rank = run_ranks(2, _runs, str(tmp_path), tiny_data, parallel, names)
    for name in names:  # every rank decided alike (step K's loss may differ: NaN on one tp rank only)
        a, b = ([repr(x) for i, x in enumerate(r[name].get("losses", [])) if i != K - 1] for r in per_rank)
        assert a == b, name
    for r in per_rank:
        listed = r["listed"]
        assert listed["counts"] == {"nonfinite": 0, "spikes": 0, "skipped": 1, "rollbacks": 0}
        for name in names[1:]:
            run = r[name]
            if name == "stop":
                assert run["iteration"] == K - 1
                assert run["error"].startswith(f"step {K}: nan loss")
                assert "train.resilience.fault_action=stop" in run["error"]
                continue
            _same_as_listed(run, listed)
            expected = {
                "nan-loss": {"nonfinite": 1, "spikes": 0, "skipped": 1, "rollbacks": 0},
                "nan-grad": {"nonfinite": 1, "spikes": 0, "skipped": 1, "rollbacks": 0},
                "spike": {"nonfinite": 0, "spikes": 1, "skipped": 1, "rollbacks": 0},
                # the fault, then step K skipped as listed after rolling back to step 2
                "rollback": {"nonfinite": 1, "spikes": 0, "skipped": 1, "rollbacks": 1},
            }[name]
            assert run["counts"] == expected, name
    if "rollback" in names:  # the checkpoints go on skipping; the log has the counts
        final = read_manifest(resolve_checkpoint(tmp_path / "rollback" / "ckpt"))
        assert final["faults"]["skip_iterations"] == [K]
        assert final["optimizer_step"] == BASE["train.train_iters"] - 1
        records = [
            json.loads(line) for line in (tmp_path / "rollback" / "metrics.jsonl").read_text().splitlines()
        ]
        steps = [r["step"] for r in records if r["split"] == "train"]
        assert steps == [1, 2, 3, 3, 4, 5, 6, 7]  # step 3 ran twice; step 4 logged as skipped
        assert records[-1]["faults.rollbacks"] == 1 and records[-1]["faults.nonfinite"] == 1


MOE_BIAS = {
    "model.mlp_kind": "moe",
    "model.moe.num_experts": 4,
    "model.moe.ffn_hidden_size": 48,
    "model.moe.router_topk": 2,
    "model.moe.router_score_function": "sigmoid",
    "model.moe.router_enable_expert_bias": "true",
    "model.moe.router_bias_update_rate": 0.01,
}
FP8 = {"train.precision": "bf16", "train.fp8.format": "hybrid", "train.fp8.amax_history_len": 4}


@pytest.mark.parametrize("model", [MOE_BIAS, FP8], ids=["moe-expert-bias", "fp8-delayed"])
def test_a_skipped_step_leaves_no_trace_of_expert_biases_or_fp8_amaxes(tmp_path, tiny_data, model):
    """The state updated before the fault test: MoE routers' expert biases (in the weights) and
    fp8 delayed scaling's amax histories and scales; one process."""
    out = _runs(0, 1, str(tmp_path), tiny_data, model, ["listed", "nan-loss"])
    _same_as_listed(out["nan-loss"], out["listed"])
    state = out["listed"]["weights"]
    moved = [k for k in state if k.endswith("expert_bias") or k == "fp8.amax_history"]
    assert moved and all(state[k].any() for k in moved)  # the state exists and has moved


def test_resume_keeps_skipping_and_adam_step(tmp_path, tiny_data):
    """A checkpoint after a skipped step holds the skip list and Adam's step count (one below the
    iteration): a run resumed before the listed step, without the setting, skips it too."""
    ckpt = tmp_path / "ckpt"
    sets = {
        **BASE,
        "train.resilience.skip_iterations": "[3]",
        "checkpoint.save": f"'{ckpt}'",
        "checkpoint.save_interval": 2,
    }
    straight = Trainer(load_config(None, tiny_sets(tmp_path / "a", tiny_data, **sets)))
    losses = straight.train()
    assert read_manifest(ckpt / "iter_0000004")["optimizer_step"] == 3
    resumed_sets = {**BASE, "checkpoint.save": f"'{tmp_path / 'ckpt2'}'"}
    resumed = Trainer(
        load_config(None, tiny_sets(tmp_path / "b", tiny_data, **resumed_sets)),
        load=str(ckpt / "iter_0000002"),
    )
    assert resumed.faults.skip == {3}
    again = resumed.train()
    assert math.isnan(again[0]) and again[1:] == losses[3:]  # bitwise
    for k, v in straight.model.state_dict().items():
        assert torch.equal(v, resumed.model.state_dict()[k]), k


def test_rollback_without_an_earlier_checkpoint_stops(tmp_path, tiny_data):
    sets = {
        **BASE,
        **RUNS["rollback"],
        "checkpoint.save_interval": 0,
        "checkpoint.save": f"'{tmp_path / 'c'}'",
    }
    trainer = Trainer(load_config(None, tiny_sets(tmp_path / "run", tiny_data, **sets)))
    _scale_loss(trainer, float("inf"), {0})
    with pytest.raises(MlmError, match=f"step {K}: .*inf loss.*holds no checkpoint yet"):
        trainer.train()


@pytest.mark.parametrize(
    "sets,message",
    [
        (
            {"train.resilience.fault_action": "retry"},
            "train.resilience.fault_action='retry': must be one of skip, rollback, stop",
        ),
        (
            {"train.resilience.fault_action": "rollback"},
            "fault_action=rollback with checkpoint.save empty.*checkpoint.save=DIR",
        ),
        ({"train.resilience.loss_spike_zscore": -1.0}, "loss_spike_zscore=-1.0: must be 0"),
        ({"train.resilience.loss_spike_window": 1}, "loss_spike_window=1: must be at least 2"),
        (
            {"train.resilience.skip_iterations": "[0, 5]"},
            r"skip_iterations=\[0, 5\]: steps count from 1.*remove \[0\]",
        ),
        ({"train.resilience.skip_iterations": "5"}, "skip_iterations=5: expected a list"),
    ],
)
def test_config_is_checked(tmp_path, sets, message):
    with pytest.raises(MlmError, match=message):
        load_config(None, tiny_sets(tmp_path, "data", **sets))


def test_a_rollback_starts_a_new_straggler_window(tmp_path, tiny_data, monkeypatch):
    """The steps rolled back over leave the straggler window under way: each window reported
    counts the steps it names once, and its compute (the faulty step's included before) stays
    within its wall time. The reload is progress for the hang detector."""
    from mlm.train import stragglers

    seen = []
    summarize = stragglers.summarize

    def spy(first, last, sums, hosts, steps, threshold):
        seen.append((first, last, steps, sums[0][1]))
        return summarize(first, last, sums, hosts, steps, threshold)

    monkeypatch.setattr(stragglers, "summarize", spy)
    sets = {
        **BASE,
        **RUNS["rollback"],
        "train.resilience.straggler_window": 5,
        "checkpoint.save": f"'{tmp_path / 'c'}'",
    }
    trainer = Trainer(load_config(None, tiny_sets(tmp_path / "run", tiny_data, **sets)))
    _scale_loss(trainer, float("nan"), {0})
    phases = []
    beat = trainer.watchdog.beat
    trainer.watchdog.beat = lambda phase, step=None: (phases.append(phase), beat(phase, step))
    trainer.train()
    assert trainer.faults.counts["rollbacks"] == 1
    # the hang detector sees the reload as progress (a large checkpoint loads as slowly as it saves)
    assert phases.count("checkpoint load") == 1
    # steps 1-3, the fault at 4, back to 2: the window restarts at 3 and ends at 5
    assert [(first, last, steps) for first, last, steps, _ in seen] == [(3, 5, 3)]
    assert all(wait >= 0 for *_, wait in seen)


def test_a_spike_seen_on_another_rank_only_is_named_as_such(monkeypatch):
    """The decision is the MAX over ranks: a rank whose own test found no spike (its window's
    losses all equal: no z) still names the fault, instead of failing to format its z."""
    import torch.distributed as dist

    from mlm.train import faults

    class OtherRankSpikes:
        ReduceOp = dist.ReduceOp

        @staticmethod
        def is_initialized():
            return True

        @staticmethod
        def get_world_size():
            return 2

        @staticmethod
        def all_reduce(flags, op):
            flags[2] = 1.0  # the other rank's spike flag

    monkeypatch.setattr(faults, "dist", OtherRankSpikes)
    t = load_config(
        None, ["train.resilience.loss_spike_zscore=6", "train.resilience.loss_spike_window=2"]
    ).train
    monitor = faults.FaultMonitor(t)
    monitor.applied(5.0)
    monitor.applied(5.0)
    fault = monitor.test(3, 5.0, 1.0, torch.device("cpu"))
    assert fault == faults.Fault(3, "loss spike on another rank (train.resilience.loss_spike_zscore=6)")
    assert monitor.counts["spikes"] == 1
