"""Data parallelism and the distributed optimizer, proven against one process.

The same tiny model, data and seed train for STEPS AdamW steps (lr 1e-2, weight decay 0.1 with
Megatron's no-decay groups, clip 1.0, global batch 8) once in this process on the whole global
batch and once on 2 gloo ranks, each rank on its contiguous half with the loss averaged over that
half (so the dp-averaged gradient is the global-batch gradient). All dp runs share one spawn of 2
ranks (module fixture `runs`) to keep the file fast; each test checks one aspect.

Not bitwise: one process sums the 8 samples' gradients in one reduction, dp=2 sums two halves of
4 and then adds the halves in the all-reduce; fp32 addition is not associative, so the gradients
differ in the last bits (~1e-7 relative) and Adam, which divides by sqrt(v), carries that on.
At dp=1 with one micro-batch nothing is reordered, and the buffer's gradients are checked bit for
bit against autograd's own.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mlm.config import ModelConfig, OptimizerConfig
from mlm.errors import MlmError
from mlm.model import build_model
from mlm.parallel.data_parallel import ALL_GATHER, REDUCE_SCATTER, GradBuckets
from mlm.parallel.dist_optim import DistributedOptimizer, owned_range
from mlm.train.adamw import adam_state_tensors, make_optimizer
from tests.helpers.distributed import run_ranks

MODEL = ModelConfig(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=64,
    vocab_size=100,
)
SEED, STEPS, GLOBAL_BATCH, SEQ = 7, 8, 8, 16
LR, WD, CLIP = 1e-2, 0.1, 1.0
BUCKET_BYTES = 16_000  # ~32k parameters (128 KB) → 8 buckets
# Tolerances, relative: losses and grad norms elementwise, weights and Adam moments as ‖Δ‖ / ‖w‖ per
# tensor. Measured at dp=2 in fp32 (Adam's eps 1e-4, `opt_cfg`): losses 1.1e-7, grad norms 1.5e-7,
# weights 5.6e-7. (With eps 1e-8 the weights differed by up to 1.1e-5 per tensor after the
# initialisation became per-shard: on elements whose gradient nearly cancels Adam divides by
# sqrt(v) + eps, so there the last-bit differences of the gradient became the update.)
FP32_RTOL = 1e-5
# bf16 reduction rounds every rank's gradient to 8 significant bits before the sum. Where the ranks'
# gradients cancel, the rounding error is all that is left, and Adam turns it into an lr-sized step
# (lr 1e-2 against init std 0.02): measured losses 2.8e-4, grad norms 1.1e-2, weights 4.6e-2. The
# reduced gradient itself is checked elementwise against the bf16 rounding bound.
BF16_TOL = {"loss": 1e-3, "norm": 3e-2, "weight": 1e-1}
FP32_TOL = {"loss": FP32_RTOL, "norm": FP32_RTOL, "weight": FP32_RTOL}


def opt_cfg() -> OptimizerConfig:
    # Adam's eps 1e-4 (as tests/distributed/test_parallel_training.py, for its reason): with 1e-8 an element
    # whose gradient nearly cancels takes an lr-sized step in whichever direction its last-bit
    # rounding points, which measures Adam's sensitivity, not the data-parallel reduction
    return OptimizerConfig(lr=LR, min_lr=0.0, weight_decay=WD, clip_grad=CLIP, adam_eps=1e-4)


def data() -> torch.Tensor:
    """[STEPS, GLOBAL_BATCH, SEQ + 1] arithmetic sequences mod vocab: learnable, so the loss falls
    (4.60 → 3.82 in 8 steps) and the gradient norm grows past CLIP from step 5 on."""
    g = torch.Generator().manual_seed(SEED)
    start = torch.randint(0, MODEL.vocab_size, (STEPS, GLOBAL_BATCH, 1), generator=g)
    stride = torch.randint(1, 4, (STEPS, GLOBAL_BATCH, 1), generator=g)
    return (start + stride * torch.arange(SEQ + 1)) % MODEL.vocab_size


def lm_loss(model: nn.Module, tokens_BT1: torch.Tensor) -> torch.Tensor:
    logits = model(tokens_BT1[:, :-1])[..., : MODEL.vocab_size]
    return F.cross_entropy(logits.flatten(0, 1), tokens_BT1[:, 1:].flatten())


def weights(model: nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().clone().numpy() for k, v in model.state_dict().items()}


def reference() -> dict:
    """One process, the whole global batch, the single-process trainer's step."""
    torch.manual_seed(SEED)
    model = build_model(MODEL, seed=SEED)
    opt = make_optimizer(model, opt_cfg(), torch.device("cpu"))
    losses, norms = [], []
    for tokens in data():
        loss = lm_loss(model, tokens)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    state = {k: v.clone().numpy() for k, v in adam_state_tensors(model, opt, STEPS).items()}
    return {"losses": losses, "norms": norms, "weights": weights(model), "state": state}


# ---------------------------------------------------------------------- in the ranks

CALLS: list[tuple[str, int]] = []  # (collective, bytes) in this rank, while counting


def count_collectives() -> None:
    import torch.distributed as dist

    def wrap(name, orig, tensor_arg):
        def counted(*args, **kwargs):
            t = args[tensor_arg]
            CALLS.append((name, t.numel() * t.element_size()))
            return orig(*args, **kwargs)

        return counted

    dist.all_reduce = wrap("all_reduce", dist.all_reduce, 0)
    setattr(dist, REDUCE_SCATTER, wrap("reduce_scatter", getattr(dist, REDUCE_SCATTER), 1))  # input
    setattr(dist, ALL_GATHER, wrap("all_gather", getattr(dist, ALL_GATHER), 0))  # output


def train(group, *, sharded: bool, reduce_dtype=torch.float32, num_micro: int = 1) -> tuple[dict, object]:
    """STEPS steps on this rank's half of each global batch; the collectives of step 0 by phase."""
    import torch.distributed as dist

    dp, rank = dist.get_world_size(group), dist.get_rank(group)
    torch.manual_seed(SEED)
    model = build_model(MODEL, seed=SEED)
    opt = make_optimizer(model, opt_cfg(), torch.device("cpu"))
    grads = GradBuckets(model, group, BUCKET_BYTES, reduce_dtype, reduce_scatter=sharded)
    if sharded:
        opt = DistributedOptimizer.from_adamw(opt, grads)
    share = GLOBAL_BATCH // dp
    losses, norms, phases = [], [], {}
    for step, tokens in enumerate(data()):
        mine = tokens[rank * share : (rank + 1) * share]
        total = 0.0
        CALLS.clear()
        for i, micro in enumerate(mine.chunk(num_micro)):
            grads.set_last_microbatch(i == num_micro - 1)
            loss = lm_loss(model, micro)
            (loss / num_micro).backward()
            total += float(loss.detach()) / num_micro
            if step == 0:
                phases[f"backward{i}"] = list(CALLS)
            CALLS.clear()
        grads.finish()
        if step == 0:
            phases["finish"] = list(CALLS)
            CALLS.clear()
        if sharded:
            norms.append(opt.clip_grad_norm(CLIP))
            opt.set_schedule(LR, WD)
            opt.step()
            opt.zero_grad()
        else:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
            opt.step()
            grads.zero_grad()
        if step == 0:
            phases["step"] = list(CALLS)
        losses.append(total)
    out = {
        "losses": losses,
        "norms": norms,
        "weights": weights(model),
        "phases": phases,
        "buckets": len(grads.buckets),
        "grad_bytes": grads.buffer.numel() * grads.buffer.element_size(),
        "numel": sum(p.numel() for p in model.parameters()),
    }
    if sharded:
        out["param_bytes"] = opt.buffer.numel() * opt.buffer.element_size()
    return out, opt


def unused_params(group) -> dict:
    """Rank 0 uses `a` and `b`, rank 1 only `b`: no deadlock, and `a`'s gradient is averaged."""
    import torch.distributed as dist

    rank = dist.get_rank(group)
    torch.manual_seed(0)
    # buckets in backward order: b, a, never. Rank 0 launches b and a inside backward, rank 1 only b;
    # finish() launches the rest, in the same order on both.
    model = nn.ModuleDict({"never": nn.Linear(8, 8), "a": nn.Linear(8, 8), "b": nn.Linear(8, 8)})
    grads = GradBuckets(model, group, bucket_size_bytes=200)  # one bucket per layer
    x = torch.ones(2, 8) * (rank + 1)
    y = model["b"](x) + (model["a"](x) if rank == 0 else 0)
    y.sum().backward()
    grads.finish()
    return {n: p.grad.clone().numpy() for n, p in model.named_parameters()}


def bf16_gradients(group) -> dict:
    """One backward, reduced in fp32 and in bf16 (all-reduce and reduce-scatter): the largest
    |bf16 − fp32| as a fraction of the rounding bound 2⁻⁷ · mean over ranks of |local gradient|
    (bf16 keeps 8 significant bits, so a rounding errs by at most 2⁻⁸ relative: once when each
    rank's g/dp is cast, once when the sum is)."""
    import torch.distributed as dist

    dp, rank = dist.get_world_size(group), dist.get_rank(group)
    tokens = data()[0][rank * GLOBAL_BATCH // dp : (rank + 1) * GLOBAL_BATCH // dp]
    models = [build_model(MODEL, seed=SEED) for _ in range(3)]
    grads = [
        GradBuckets(models[0], group, BUCKET_BYTES),
        GradBuckets(models[1], group, BUCKET_BYTES, torch.bfloat16),
        GradBuckets(models[2], group, BUCKET_BYTES, torch.bfloat16, reduce_scatter=True),
    ]
    for m, g in zip(models, grads, strict=True):
        g.set_last_microbatch(False)  # keep the local gradient to compute the bound
        lm_loss(m, tokens).backward()
    bound = [p.grad.abs() for p in models[0].parameters()]
    for b in bound:
        dist.all_reduce(b)
        b.mul_(2.0**-7 / dp)
    for g in grads:
        g.finish()
    worst = {"all_reduce": 0.0, "reduce_scatter": 0.0, "differs": False}
    for i, (p32, pa, ps, b) in enumerate(
        zip(models[0].parameters(), models[1].parameters(), models[2].parameters(), bound, strict=True)
    ):
        a, z = owned_range(grads[2], i, rank)
        for kind, got, ref32, lim in (
            ("all_reduce", pa.grad.flatten(), p32.grad.flatten(), b.flatten()),
            ("reduce_scatter", ps.grad.flatten()[a:z], p32.grad.flatten()[a:z], b.flatten()[a:z]),
        ):
            err = (got - ref32).abs()
            worst["differs"] |= bool((err > 0).any())
            ratio = err / lim.clamp_min(1e-30)
            worst[kind] = max([worst[kind], *ratio.tolist()])
    return worst


def checkpoint_round_trip(group, opt: DistributedOptimizer, root: str) -> dict:
    """Save the sharded Adam state in one process's layout, load it into a fresh optimizer."""
    import torch.distributed as dist

    from mlm.checkpoint import load_checkpoint, save_checkpoint

    tensors = opt.checkpoint_save_tensors()
    saved = {st.key: st.local.clone().numpy() for st in tensors}
    path = save_checkpoint(root, STEPS, {"optim": tensors}, {}, rank=dist.get_rank(), barrier=dist.barrier)
    model = build_model(MODEL, seed=SEED + 1)
    fresh = DistributedOptimizer.from_adamw(
        make_optimizer(model, opt_cfg(), torch.device("cpu")),
        GradBuckets(model, group, BUCKET_BYTES, reduce_scatter=True),
    )
    load_checkpoint(path, {"optim": fresh.checkpoint_load_targets()}, strict=True)
    fresh.finish_load(STEPS)
    return {
        "saved": saved,
        "same": all(torch.equal(getattr(opt, m), getattr(fresh, m)) for m in ("exp_avg", "exp_avg_sq")),
        "steps": sorted({float(s["step"]) for s in fresh._adam.state.values()}),
    }


def worker(rank: int, world: int, root: str) -> dict:
    from mlm.config import ParallelConfig
    from mlm.parallel import Mesh

    torch.set_num_threads(1)
    group = Mesh.build(ParallelConfig()).dp_group
    count_collectives()
    res = {}
    res["a"], _ = train(group, sharded=False)
    res["b"], opt = train(group, sharded=True)
    res["c_allreduce"], _ = train(group, sharded=False, num_micro=2)
    res["c_sharded"], _ = train(group, sharded=True, num_micro=2)
    res["d_allreduce"], _ = train(group, sharded=False, reduce_dtype=torch.bfloat16)
    res["d_sharded"], _ = train(group, sharded=True, reduce_dtype=torch.bfloat16)
    res["bf16_grads"] = bf16_gradients(group)
    res["unused"] = unused_params(group)
    res["ckpt"] = checkpoint_round_trip(group, opt, root)
    return res


# ---------------------------------------------------------------------- checks


@pytest.fixture(scope="module")
def ref() -> dict:
    return reference()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    return run_ranks(2, worker, str(tmp_path_factory.mktemp("ckpt")))


def rel(a, b) -> float:
    """Largest elementwise error relative to the reference."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float((np.abs(a - b) / np.abs(b)).max())


def norm_rel(a, b) -> float:
    """‖a − b‖ / ‖b‖ (0 when both are zero)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b)) if b.any() else float(np.abs(a).max())


def check_matches(runs, ref, name: str, tol: dict) -> None:
    assert ref["losses"][-1] < ref["losses"][0] - 0.5, "the reference must learn"
    assert min(ref["norms"]) < CLIP < max(ref["norms"]), "steps with and without clipping"
    r0, r1 = runs[0][name], runs[1][name]
    losses = [(a + b) / 2 for a, b in zip(r0["losses"], r1["losses"], strict=True)]
    assert rel(losses, ref["losses"]) <= tol["loss"], (losses, ref["losses"])
    assert r0["norms"] == r1["norms"], "ranks disagree on the grad norm"
    assert rel(r0["norms"], ref["norms"]) <= tol["norm"], (r0["norms"], ref["norms"])
    for k, w in ref["weights"].items():
        assert np.array_equal(r0["weights"][k], r1["weights"][k]), f"{k}: ranks disagree"
        err = norm_rel(r0["weights"][k], w)
        assert err <= tol["weight"], f"{name} {k}: relative error {err:.2e}"


def test_bucketed_allreduce_matches_one_process(runs, ref):
    assert runs[0]["a"]["buckets"] >= 4
    check_matches(runs, ref, "a", FP32_TOL)


def test_distributed_optimizer_matches_one_process(runs, ref):
    check_matches(runs, ref, "b", FP32_TOL)


@pytest.mark.parametrize("name", ["c_allreduce", "c_sharded"])
def test_grad_accumulation_communicates_only_on_last_microbatch(runs, ref, name):
    check_matches(runs, ref, name, FP32_TOL)
    r = runs[0][name]
    kind = "reduce_scatter" if name == "c_sharded" else "all_reduce"
    assert r["phases"]["backward0"] == []  # the first micro-batch only accumulates
    during, after = r["phases"]["backward1"], r["phases"]["finish"]
    # overlapped: every bucket (one collective each) starts inside the last backward; finish() waits
    assert [c for c, _ in during] == [kind] * r["buckets"] and after == []


@pytest.mark.parametrize("name", ["d_allreduce", "d_sharded"])
def test_bf16_gradient_reduction_stays_close(runs, ref, name):
    check_matches(runs, ref, name, BF16_TOL)
    r = runs[0][name]
    bf16_bytes = sum(b for c, b in r["phases"]["backward0"] + r["phases"]["finish"] if c != "all_gather")
    assert bf16_bytes == r["grad_bytes"] // 2  # half the fp32 traffic


def test_bf16_reduced_gradient_within_rounding_bound(runs):
    for r in runs:
        w = r["bf16_grads"]
        assert w["differs"], "bf16 reduction must actually round"
        assert w["all_reduce"] <= 1.0 and w["reduce_scatter"] <= 1.0, w


def test_distributed_optimizer_communication_volume(runs):
    r = runs[0]["b"]
    reduce = r["phases"]["backward0"] + r["phases"]["finish"]
    assert [c for c, _ in reduce] == ["reduce_scatter"] * r["buckets"]
    assert sum(b for _, b in reduce) == r["grad_bytes"]  # padded buffer: each bucket a multiple of 128·dp
    assert r["numel"] * 4 <= r["grad_bytes"] < (r["numel"] + 128 * r["buckets"]) * 4
    gathers = [b for c, b in r["phases"]["step"] if c == "all_gather"]
    assert len(gathers) == r["buckets"] and sum(gathers) == r["param_bytes"] == r["grad_bytes"]
    assert [c for c, _ in r["phases"]["step"] if c != "all_gather"] == ["all_reduce"]  # the grad norm


def test_unused_parameters_do_not_deadlock(runs):
    g0, g1 = runs[0]["unused"], runs[1]["unused"]
    x0, x1 = torch.ones(2, 8), torch.ones(2, 8) * 2
    assert np.allclose(g0["a.weight"], (x0.sum(0).expand(8, 8) / 2).numpy())  # rank 1 contributes zero
    assert np.allclose(g0["b.weight"], ((x0 + x1).sum(0).expand(8, 8) / 2).numpy())
    assert not g0["never.weight"].any()
    for k in g0:
        assert np.array_equal(g0[k], g1[k])


def test_optimizer_checkpoint_uses_one_process_layout_and_round_trips(runs, ref):
    saved = {**runs[0]["ckpt"]["saved"], **runs[1]["ckpt"]["saved"]}
    assert len(saved) == len(runs[0]["ckpt"]["saved"]) + len(runs[1]["ckpt"]["saved"])  # one writer each
    assert saved.keys() == ref["state"].keys()
    for k, v in ref["state"].items():
        assert saved[k].shape == v.shape
        assert norm_rel(saved[k], v) <= FP32_RTOL, f"{k}: {norm_rel(saved[k], v):.2e}"
    for r in runs:
        assert r["ckpt"]["same"] and r["ckpt"]["steps"] == [float(STEPS)]


# ---------------------------------------------------------------------- one process


def test_dp1_buckets_accumulate_like_autograd(ref):
    """dp=1 (group None): the buffer backs param.grad and nothing is communicated."""
    torch.manual_seed(SEED)
    model = build_model(MODEL, seed=SEED)
    opt = make_optimizer(model, opt_cfg(), torch.device("cpu"))
    grads = GradBuckets(model, None, BUCKET_BYTES)
    for tokens in data():
        for i, half in enumerate(tokens.chunk(2)):
            grads.set_last_microbatch(i == 1)
            (lm_loss(model, half) / 2).backward()
        grads.finish()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        grads.zero_grad()
    # two micro-batches of 4 sum in another order than one batch of 8: close, not bitwise
    for k, w in weights(model).items():
        assert norm_rel(w, ref["weights"][k]) <= FP32_RTOL, k

    torch.manual_seed(SEED)
    a, b = build_model(MODEL, seed=SEED), build_model(MODEL, seed=SEED)
    GradBuckets(b, None, BUCKET_BYTES)
    tokens = data()[0]  # one backward: the same bits as autograd's own .grad
    lm_loss(a, tokens).backward()
    lm_loss(b, tokens).backward()
    for (n, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa.grad, pb.grad), n


def test_layout_reverse_order_buckets_and_padding():
    model = build_model(MODEL, seed=SEED)
    grads = GradBuckets(model, None, BUCKET_BYTES, reduce_scatter=True)
    names = [n for n, _ in model.named_parameters()]
    assert grads.ranges[names.index("output.weight")][0] == 0  # the last parameter comes first
    assert grads.bucket_of[names.index("embed.weight")] == len(grads.buckets) - 1
    assert all(b.numel % 128 == 0 and b.numel * 4 >= BUCKET_BYTES for b in grads.buckets[:-1])
    assert [b.start for b in grads.buckets[1:]] == [b.end for b in grads.buckets[:-1]]
    for p, (s, e) in zip(grads.params, grads.ranges, strict=True):
        assert p.grad.data_ptr() == grads.buffer[s:].data_ptr() and e - s == p.numel()


def test_misuse_is_caught():
    model = build_model(MODEL, seed=SEED)
    with pytest.raises(MlmError, match=r"float16.*torch.bfloat16"):
        GradBuckets(model, None, reduce_dtype=torch.float16)
    grads = GradBuckets(model, None)
    model.zero_grad(set_to_none=True)  # detaches param.grad from the buffer
    with pytest.raises(AssertionError, match="GradBuckets.zero_grad"):
        lm_loss(model, data()[0]).backward()
    grads.zero_grad()  # re-attaches
    lm_loss(model, data()[0]).backward()
    assert grads.buffer.abs().sum() > 0
    with pytest.raises(MlmError, match=r"float64\) are not"):  # bf16/fp16: train.param_dtype
        GradBuckets(nn.Linear(2, 2).double(), None)


def test_distributed_optimizer_dp1_matches_adamw(ref):
    torch.manual_seed(SEED)
    model = build_model(MODEL, seed=SEED)
    grads = GradBuckets(model, None, BUCKET_BYTES, reduce_scatter=True)
    opt = DistributedOptimizer.from_adamw(make_optimizer(model, opt_cfg(), torch.device("cpu")), grads)
    for step, tokens in enumerate(data()):
        lm_loss(model, tokens).backward()
        grads.finish()
        norm = opt.clip_grad_norm(CLIP)
        assert math.isclose(norm, ref["norms"][step], rel_tol=FP32_RTOL)
        opt.step()
        opt.zero_grad()
    for k, w in weights(model).items():
        assert norm_rel(w, ref["weights"][k]) <= FP32_RTOL, k
