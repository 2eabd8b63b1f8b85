"""Every collective of one training step on a mesh, counted and checked against the model's shape.

Inside each spawned gloo rank the torch.distributed collectives are wrapped with counters that
note (collective, process group, bytes): all_reduce, all_gather_single / reduce_scatter_single
(and their deprecated names), and, so that nothing goes unseen, every other collective or
point-to-point call mlm could make (mlm looks every collective up on torch.distributed at call
time, so wrapping it there sees all of them). Then `Trainer.train()` runs
with `train.train_iters=1`: exactly one `train_step` (with its fault test's agreement), the
loop's per-step agreement on a stop signal, and the straggler detector's gathering of host names
(once per `train()`; its window, every 20 steps, is not reached). The counts must equal formulas written below from B, T, D, layers, heads and vocabulary
— so an extra all-reduce in one layer, a gather too many, or a gradient all-reduce under the
distributed optimizer fails the test. Bytes: an all-reduce counts its tensor, an all-gather its
(full) output, a reduce-scatter its (full) input. All three meshes share one spawn of 2 ranks.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from mlm.config import load_config
from mlm.train.trainer import Trainer
from tests.helpers.common import tiny_sets
from tests.helpers.distributed import run_ranks

FP32 = 4  # bytes; the tiny runs are fp32 (train.precision=fp32)
BASE = {
    "model.num_layers": 3,  # odd, so that per-layer counts (2L, 4L) differ from the constants
    "model.hidden_dropout": 0.0,
    "train.micro_batch_size": 2,
    "train.train_iters": 1,
}
MESHES = {  # name → overrides; all with one micro-batch per step and rank
    "tp2": {"parallel.tp": 2, "train.global_batch_size": 2},
    "tp2-sp": {"parallel.tp": 2, "parallel.sequence_parallel": "true", "train.global_batch_size": 2},
    "dp2-distopt": {
        "parallel.distributed_optimizer": "true",
        "parallel.bucket_size_mb": 0.1,  # ~26k fp32 elements per bucket: several buckets
        "train.global_batch_size": 4,
    },
}

# ---------------------------------------------------------------------- in the ranks

CALLS: list[tuple[str, object, int]] = []  # (collective, group, bytes) in this rank


def count_collectives() -> None:
    """Replace torch.distributed's collectives by counters."""
    import inspect

    import torch.distributed as dist

    def wrap(name: str, orig, tensor_arg: str | None):
        sig = inspect.signature(orig)

        def counted(*args, **kwargs):
            bound = sig.bind(*args, **kwargs)
            t = bound.arguments.get(tensor_arg) if tensor_arg else None
            nbytes = t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0
            CALLS.append((name, bound.arguments.get("group"), nbytes))
            return orig(*args, **kwargs)

        return counted

    # The deprecated names call the new ones through distributed_c10d's globals, which stay
    # unwrapped: each call is counted once, whichever name the code uses.
    wrapped = {
        "all_reduce": ("all_reduce", "tensor"),
        "all_gather_single": ("all_gather", "output_tensor"),
        "all_gather_into_tensor": ("all_gather", "output_tensor"),
        "reduce_scatter_single": ("reduce_scatter", "input"),
        "reduce_scatter_tensor": ("reduce_scatter", "input"),
    }
    others = ["all_gather", "reduce_scatter", "broadcast", "reduce", "barrier", "all_to_all",
              "all_to_all_single", "all_gather_object", "broadcast_object_list", "gather", "scatter",
              "send", "recv", "isend", "irecv", "batch_isend_irecv"]  # fmt: skip
    for fn in wrapped:
        name, arg = wrapped[fn]
        setattr(dist, fn, wrap(name, getattr(dist, fn), arg))
    for fn in others:
        if hasattr(dist, fn):
            setattr(dist, fn, wrap(fn, getattr(dist, fn), None))


def one_step(trainer: Trainer) -> list[tuple[str, str, int]]:
    """The collectives of `trainer.train()` for one step, with groups named tp / dp / world."""
    import torch.distributed as dist

    names = {id(dist.group.WORLD): "world"}
    names.update(
        {id(g): n for n, g in (("dp", trainer.mesh.dp_group), ("tp", trainer.mesh.tp_group)) if g is not None}
    )
    CALLS.clear()
    trainer.train()
    return [(c, "world" if g is None else names.get(id(g), "other"), b) for c, g, b in CALLS]


def worker(rank: int, world: int, sets: dict[str, list[str]]) -> dict:
    torch.set_num_threads(1)
    count_collectives()
    out = {}
    for name, s in sets.items():
        trainer = Trainer(load_config(None, s))
        res = {"num_micro": trainer.num_micro, "calls": one_step(trainer)}
        g = trainer.optimizer.grads
        res["numel"] = sum(p.numel() for p in g.params)
        res["buffer_bytes"] = g.buffer.numel() * g.buffer.element_size()
        res["bucket_params"] = [sum(g.params[i].numel() for i in b.params) for b in g.buckets]
        if trainer.optimizer.dists:
            res["param_buffer_bytes"] = trainer.optimizer.dists[0].buffer.numel() * FP32
        out[name] = res
    return out


# ---------------------------------------------------------------------- checks


def _sets(tmp_path, data, name: str) -> list[str]:
    return tiny_sets(tmp_path / name, data, **{**BASE, **MESHES[name]})


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_data) -> list[dict]:
    tmp = tmp_path_factory.mktemp("comm")
    return run_ranks(2, worker, {name: _sets(tmp, tiny_data, name) for name in MESHES})


@pytest.fixture
def shape(tmp_path, tiny_data):
    def get(name: str) -> dict:
        cfg = load_config(None, _sets(tmp_path, tiny_data, name))
        m = cfg.model
        return dict(
            B=cfg.train.micro_batch_size,
            T=cfg.data.seq_length,
            D=m.hidden_size,
            L=m.num_layers,
            H=m.num_attention_heads,
            G=m.query_groups,
            K=m.head_dim,
            F=m.ffn_size,
            V=m.padded_vocab_size(cfg.parallel.tp),
            cfg=cfg,
        )

    return get


def check(runs, name: str, expected: Counter) -> list[tuple[str, str, int]]:
    r0, r1 = runs[0][name], runs[1][name]
    assert r0["num_micro"] == 1
    assert r0["calls"] == r1["calls"], "the ranks issued different collectives (or in another order)"
    got = Counter(r0["calls"])
    extra, missing = got - expected, expected - got
    assert got == expected, f"{name}: unexpected {dict(extra)}, missing {dict(missing)}"
    return r0["calls"]


def trainer_small(group_norm: str, norm_bytes: int, loss_mean: bool) -> Counter:
    """The trainer's own small all-reduces per step (one process: none of them)."""
    c = Counter({("all_reduce", group_norm, norm_bytes): 1})  # grad norm: the sum of squares
    c[("all_reduce", "world", FP32)] += 1  # the stop flag (MAX), issued only when world > 1
    c[("all_reduce", "world", 3 * FP32)] += 1  # the fault test's flags (MAX): loss, norm, spike
    c[("all_gather_object", "world", 0)] += 1  # the straggler table's host names, once per train()
    if loss_mean:
        c[("all_reduce", "dp", FP32)] += 1  # the logged loss, averaged over dp
    return c


def test_tp2_allreduces_per_step(runs, shape):
    s = shape("tp2")
    B, T, D, L = s["B"], s["T"], s["D"], s["L"]
    act = B * T * D * FP32  # one [B, T, D] fp32 activation or its gradient
    model = Counter(
        {
            # forward: the embedding (1) and each layer's row-parallel attn.out and mlp.down (2L);
            # backward: each layer's tp-region entry of attn and of mlp (2L, one per sub-block thanks
            # to the enter_tp pre-hook, not one per q/k/v or gate/up) and the output projection's (1)
            ("all_reduce", "tp", act): 1 + 2 * L + 2 * L + 1,
            ("all_reduce", "tp", B * T * FP32): 1,  # vocab-parallel cross-entropy: max logit per token
            ("all_reduce", "tp", 2 * B * T * FP32): 1,  # ... and [target logit, sum of exp] stacked
        }
    )
    # grad norm over tp: only the tensor-parallel part of the sum of squares (a scalar)
    calls = check(runs, "tp2", model + trainer_small("tp", FP32, loss_mean=False))
    gathers = [c for c in calls if c[0] != "all_reduce" and c[0] != "all_gather_object"]  # host names
    assert not gathers, "no gathers without sequence parallelism"
    assert sum(b for c, g, b in calls if g == "tp") == (4 * L + 2) * act + 3 * B * T * FP32 + FP32


def test_tp2_sequence_parallel_gathers_and_scatters(runs, shape):
    s = shape("tp2-sp")
    B, T, D, L = s["B"], s["T"], s["D"], s["L"]
    act = (
        B * T * D * FP32
    )  # the full [B, T, D]: what one all-gather along T yields / one reduce-scatter takes
    model = Counter(
        {
            # forward: attn and mlp entries gather T (2L) and so does the output projection's (1);
            # backward: attn.out and mlp.down's reduce-scatters become gathers (2L), and so does
            # the embedding's (1)
            ("all_gather", "tp", act): (2 * L + 1) + (2 * L + 1),
            # forward: the vocab-parallel embedding's partial sums are reduce-scattered along T by
            # enter_layers (1; no all-reduce), attn.out and mlp.down reduce-scatter T (2L); backward:
            # the gathers of the attn / mlp entries (2L) and of the output projection's entry (1)
            # become reduce-scatters
            ("reduce_scatter", "tp", act): (2 * L + 1) + (2 * L + 1),
            ("all_reduce", "tp", B * T * FP32): 1,  # vocab-parallel cross-entropy, as without SP
            ("all_reduce", "tp", 2 * B * T * FP32): 1,
            # the norms saw one sequence shard each: attn_norm and mlp_norm per layer and the final
            # norm (RMSNorm: D weights, no bias; no linear biases), summed over tp in one flat tensor
            ("all_reduce", "tp", (2 * L + 1) * D * FP32): 1,
        }
    )
    check(runs, "tp2-sp", model + trainer_small("tp", FP32, loss_mean=False))


def test_dp2_distributed_optimizer_buckets(runs, shape):
    s = shape("dp2-distopt")
    D, L, H, G, K, F, V = (s[k] for k in "DLHGKFV")
    r = runs[0]["dp2-distopt"]
    # parameters: embedding and untied output V·D each; per layer two RMSNorms (2D), q (D·HK),
    # k and v (D·GK each), out (HK·D), SwiGLU gate, up and down (3·D·F); the final norm D
    P = 2 * V * D + L * (2 * D + D * H * K + 2 * D * G * K + H * K * D + 3 * D * F) + D
    assert r["numel"] == sum(r["bucket_params"]) == P
    dp = 2
    pad = math.lcm(dp, 128)  # each bucket is padded to a multiple of lcm(dp, 128) elements
    padded = [-(-n // pad) * pad * FP32 for n in r["bucket_params"]]
    n = len(padded)
    assert n >= 3, "the bucket size is meant to give several buckets"
    assert r["buffer_bytes"] == r["param_buffer_bytes"] == sum(padded)
    model = Counter()
    for b in padded:
        model[("reduce_scatter", "dp", b)] += 1  # one per gradient bucket, during backward
        model[("all_gather", "dp", b)] += 1  # one per parameter bucket, after AdamW on the shard
    # grad norm over dp: [tp part, replicated part] of this shard's sum of squares (2 floats)
    calls = check(runs, "dp2-distopt", model + trainer_small("dp", 2 * FP32, loss_mean=True))
    assert sum(b for c, _, b in calls if c == "reduce_scatter") == r["buffer_bytes"]
    small = 3 * FP32  # the largest of the trainer's own: the fault test's flags
    assert not [c for c in calls if c[0] == "all_reduce" and c[2] > small], "no gradient all-reduce"
    assert P * FP32 <= r["buffer_bytes"] < (P + pad * n) * FP32
