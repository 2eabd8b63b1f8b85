"""FSDP's bytes per step against the formula, and how much of its all-gather overlaps compute.

    .venv/bin/python bench/fsdp_comm.py [--steps 8] [--rounds 4] [--warmup 1] [--layers 4] [--hidden 256]
                                        [--seq 128] [--dtype bf16] [--no-hsdp]

Trains a small Llama (`--layers` layers of hidden `--hidden`, vocabulary 4096, seq `--seq`,
global batch 8, micro-batch 2: two micro-batches per step and rank on 2 ranks) with mlm's
`Trainer.train_step` on CPU gloo ranks over loopback, in these settings, in the same run:

    zero1          parallel.distributed_optimizer (the baseline: ZeRO-1 on the same 2 ranks)
    fsdp           parallel.fsdp (reshard after forward: the default)
    fsdp keep      parallel.fsdp, parallel.fsdp_reshard_after_forward=false
    fsdp async*    parallel.fsdp with FSDP2's asynchronous unshard (its private
                   `_set_unshard_async_op(True)`), set by this bench from outside: not what mlm
                   runs; it shows what mlm's prefetch does once a gather does not block the CPU
    zero1 dp4, hsdp 2x2   (4 ranks, micro-batch 1; unless --no-hsdp) parallel.fsdp_shard_size=2

Bytes: inside every rank torch.distributed's all_gather_single / reduce_scatter_single /
all_reduce (and the deprecated names) are wrapped; a call counts as FSDP's when torch's FSDP
package made it, as the data-parallel one's when mlm/parallel/data_parallel.py did. Counted: the
gathered buffer (an all-gather's output), a reduce-scatter's input and an all-reduce's tensor:
buffer sizes, not bytes on the wire (a ring moves (S − 1) / S of the buffer through each rank for
an all-gather or reduce-scatter, 2 (R − 1) / R for an all-reduce). Every timed step's FSDP bytes
must equal `formula` (below, from the parameter shapes alone); the bench exits 1 otherwise.

Overlap: one more step per setting runs under torch.profiler. An all-gather is in flight from its
call to its completion (the call's return, or for an asynchronous one its future's completion,
noted from gloo's thread; the duration by perf_counter, placed where the call's profiler range
starts). Compute: the profiler's top-level aten ops on the rank's main thread, outside FSDP's own
ranges (copy-in, copy-out, reduce) and the collective calls. Overlap = |in flight ∩ compute| /
|in flight|, over the step's all-gathers, per rank. Step time: median over the timed steps of the
slower rank (between barriers), without the profiler.

Why mlm's FSDP shows no overlap here: mlm prefetches (each layer's forward issues the next
layer's all-gather, each layer's backward the one before's), but FSDP2 unshards with
async_op=False unless told otherwise, and on CPU gloo a synchronous collective blocks the calling
thread until the bytes have arrived (FSDP2's streams are no-ops on CPU): the prefetched gather
runs earlier, not alongside compute. On a GPU the same call only enqueues the NCCL kernel on
FSDP's all-gather stream and returns; the CPU runs ahead, and the prefetched gather runs while
the current layer's kernels run on the compute stream, which waits only on the gather's event.
The async* row is the nearest CPU analogue: gloo's own thread moves the bytes while the main
thread computes.

Each rank runs one compute thread; 2 (or 4) ranks share 2 cores with gloo's threads, so the step
times show overhead, not speed. The ranks of every setting are started once and take turns, so a
shared machine's slow phases fall on all of them. The defaults take about 2 minutes on 2 cores.
Results: bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rank_pool import Pool, make_data, micro_batches  # noqa: E402

from mlm.config import load_config  # noqa: E402
from mlm.train.trainer import Trainer  # noqa: E402

VOCAB = 4096
GLOBAL_BATCH = 8
FP32 = 4
DTYPE_BYTES = {"fp32": 4, "bf16": 2}

# name → (ranks, micro-batch, --set overrides, bench-only FSDP2 tweak)
SETTINGS = {
    "zero1": (2, 2, {"parallel.distributed_optimizer": "true"}, None),
    "fsdp": (2, 2, {"parallel.fsdp": "true"}, None),
    "fsdp keep": (2, 2, {"parallel.fsdp": "true", "parallel.fsdp_reshard_after_forward": "false"}, None),
    "fsdp async*": (2, 2, {"parallel.fsdp": "true"}, "async"),
}
HSDP_SETTINGS = {
    "zero1 dp4": (4, 1, {"parallel.distributed_optimizer": "true"}, None),
    "hsdp 2x2": (4, 1, {"parallel.fsdp": "true", "parallel.fsdp_shard_size": 2}, None),
}
BASELINE = {"fsdp": "zero1", "fsdp keep": "zero1", "fsdp async*": "zero1", "hsdp 2x2": "zero1 dp4"}

# ---------------------------------------------------------------------- the formula


def unit_of(name: str, tied: bool) -> str:
    """The FSDP unit a parameter belongs to, as mlm.parallel.fsdp.apply_fsdp makes them."""
    if name.startswith("layers."):
        return "layers." + name.split(".")[1]
    if not tied and name.startswith("embed."):
        return "embed"
    if not tied and name.startswith(("final_norm.", "output.")):
        return "final_norm+output"
    return "root"


def formula(
    shapes: dict[str, tuple[int, ...]],
    tied: bool,
    shard: int,
    replicas: int,
    micro: int,
    param_bytes: int,
    reshard_after_forward: bool,
) -> dict[str, int]:
    """FSDP's buffer bytes per step and rank. Each parameter is cut along dim 0 into `shard`
    chunks of ceil(n0 / S) rows (the last padded), so a unit's gathered buffer holds
    G_u = Σ_p ceil(n0 / S)·S·(n1·…) elements. Per micro-batch every unit is gathered for forward
    and, when it was resharded after forward (the layers and the embedding under
    fsdp_reshard_after_forward; never the root nor [final_norm, output]), again for backward; the
    step's last backward reduce-scatters each unit's fp32 gradients once (HSDP: then all-reduces
    the 1 / S shard across the R replicas). Dense models without pipeline or expert parallelism
    (there the root holds the output layer, and experts are units of their own).

        all-gather     = m · Σ_u G_u · (1 + resharded_u) · bytes(param_dtype)
        reduce-scatter = Σ_u G_u · 4
        all-reduce     = (R > 1) · Σ_u G_u / S · 4
    """
    units: dict[str, int] = {}
    for name, shape in shapes.items():
        n0, rest = (shape[0], math.prod(shape[1:])) if shape else (1, 1)
        units[unit_of(name, tied)] = units.get(unit_of(name, tied), 0) + math.ceil(n0 / shard) * shard * rest
    resharded = {u for u in units if reshard_after_forward and u not in ("root", "final_norm+output")}
    gathered = sum(n * (2 if u in resharded else 1) for u, n in units.items())
    total = sum(units.values())
    return {
        "units": units,
        "resharded": sorted(resharded),
        "all_gather": micro * gathered * param_bytes,
        "reduce_scatter": total * FP32,
        "all_reduce": (total // shard) * FP32 if replicas > 1 else 0,
    }


# ---------------------------------------------------------------------- counting, in the ranks

CALLS: list[list] = []  # [op, source, bytes, t_call, t_done] of this rank's step
TIMELINE = {"on": False}


def _source(filename: str) -> str:
    if f"{os.sep}distributed{os.sep}fsdp{os.sep}" in filename:
        return "fsdp"
    if filename.endswith(os.path.join("mlm", "parallel", "data_parallel.py")):
        return "zero1"
    return "other"


def count_collectives() -> None:
    """Wrap torch.distributed's tensor collectives with byte counters and in-flight timers."""
    import torch.distributed as dist
    from torch.profiler import record_function

    def wrap(op: str, orig, index: int, key: str):
        def counted(*args, **kwargs):
            t = kwargs[key] if key in kwargs else args[index]
            rec = [op, _source(sys._getframe(1).f_code.co_filename), t.numel() * t.element_size(), 0.0, None]
            CALLS.append(rec)
            with record_function("bench::collective"):
                rec[3] = time.perf_counter()
                work = orig(*args, **kwargs)
            if work is None or not TIMELINE["on"]:
                rec[4] = time.perf_counter()
            else:  # in flight until gloo's thread completes it
                try:
                    future = work.get_future()
                except RuntimeError:  # gloo's reduce-scatter has none: the launch only
                    rec[4] = time.perf_counter()
                else:
                    future.add_done_callback(lambda _f, rec=rec: rec.__setitem__(4, time.perf_counter()))
            return work

        return counted

    # the deprecated names call the new ones through distributed_c10d's (unwrapped) globals
    for name, op, index, key in (
        ("all_reduce", "all_reduce", 0, "tensor"),
        ("all_gather_single", "all_gather", 0, "output_tensor"),
        ("all_gather_into_tensor", "all_gather", 0, "output_tensor"),
        ("reduce_scatter_single", "reduce_scatter", 1, "input"),
        ("reduce_scatter_tensor", "reduce_scatter", 1, "input"),
    ):
        if hasattr(dist, name):
            setattr(dist, name, wrap(op, getattr(dist, name), index, key))


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """|a ∩ b| for two sorted unions of intervals."""
    total, j = 0.0, 0
    for s, e in a:
        while j < len(b) and b[j][1] <= s:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            total += min(e, b[k][1]) - max(s, b[k][0])
            k += 1
    return total


def timeline(prof) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """(compute, FSDP's all-gathers in flight) of the profiled step, in the profiler's seconds.
    Compute: the main thread's top-level aten ops outside FSDP's ranges and the collective calls.
    A gather starts where its call's `bench::collective` range starts and lasts until it completed
    (`CALLS`: perf_counter, which only gives the duration: no clocks to align)."""
    events = list(prof.events())
    main = next(e for e in events if e.name == "bench::anchor").thread
    calls = sorted(
        (e for e in events if e.name == "bench::collective" and e.thread == main),
        key=lambda e: e.time_range.start,
    )
    assert len(calls) == len(CALLS), (
        f"{len(calls)} collective ranges in the profile, {len(CALLS)} calls counted"
    )
    gathers = [
        (e.time_range.start / 1e6, e.time_range.start / 1e6 + (r[4] - r[3]))
        for e, r in zip(calls, CALLS, strict=True)
        if r[1] == "fsdp" and r[0] == "all_gather"
    ]

    def counts(e) -> bool:
        if e.thread != main or not e.name.startswith("aten::"):
            return False
        p = e.cpu_parent
        while p is not None:
            if p.name.startswith(("aten::", "FSDP::", "bench::collective")):
                return False
            p = p.cpu_parent
        return True

    compute = _union([(e.time_range.start / 1e6, e.time_range.end / 1e6) for e in events if counts(e)])
    return compute, gathers


class Stepper:
    def __init__(self, sets: list[str], tweak: str | None):
        self.trainer = Trainer(load_config(None, sets))
        if tweak == "async":  # bench-only: FSDP2's asynchronous unshard (mlm's prefetch as it is)
            self.trainer.model._set_unshard_async_op(True)
        self.batches = micro_batches(self.trainer)

    def step(self) -> float:
        import torch.distributed as dist

        batches = [next(self.batches) for _ in range(self.trainer.num_micro)]
        dist.barrier()
        CALLS.clear()
        t0 = time.perf_counter()
        self.trainer.train_step(batches)
        return time.perf_counter() - t0

    def bytes_by(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for op, source, n, *_ in CALLS:
            out[f"{source} {op}"] = out.get(f"{source} {op}", 0) + n
        return out

    def run(self, n: int) -> dict:
        steps, blocked, bytes_ = [], [], []
        for _ in range(n):
            steps.append(self.step())
            blocked.append(sum(r[4] - r[3] for r in CALLS if r[1] == "fsdp"))
            bytes_.append(self.bytes_by())
        return {"steps": steps, "blocked": blocked, "bytes": bytes_}

    def profile(self) -> dict:
        from torch.profiler import ProfilerActivity, profile, record_function

        TIMELINE["on"] = True
        saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 2)  # the profiler's start/stop lines (kineto, on fd 2) would fill the report
        try:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                with record_function("bench::anchor"):  # names the main thread
                    pass
                step = self.step()
        finally:
            TIMELINE["on"] = False
            os.dup2(saved, 2)
            os.close(saved)
            os.close(null)
        deadline = time.perf_counter() + 5  # a future's callback may still be running in gloo's thread
        while any(r[4] is None for r in CALLS if r[1] == "fsdp") and time.perf_counter() < deadline:
            time.sleep(0.001)
        assert all(r[4] is not None for r in CALLS if r[1] == "fsdp"), "an FSDP collective never completed"
        compute, gathers = timeline(prof)
        flight = sum(b - a for a, b in gathers)
        both = sum(_overlap([g], compute) for g in gathers)
        return {"flight": flight, "overlap": both, "gathers": len(gathers), "step": step}

    def formula(self, shard: int, replicas: int, param_bytes: int) -> dict[str, int]:
        cfg = self.trainer.cfg
        shapes = {n: tuple(p.shape) for n, p in self.trainer.model.named_parameters()}
        return formula(
            shapes,
            cfg.model.tie_embeddings,
            shard,
            replicas,
            self.trainer.num_micro,
            param_bytes,
            cfg.parallel.fsdp_reshard_after_forward,
        )


def rank_stepper(sets: list[str], tweak: str | None) -> Stepper:
    """A pool rank's Stepper, its collectives counted."""
    count_collectives()
    return Stepper(sets, tweak)


# ---------------------------------------------------------------------- the run


def mb(n: float) -> str:
    return f"{n / 1e6:8.3f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8, help="timed steps per setting")
    ap.add_argument("--rounds", type=int, default=4, help="the settings take turns, steps/rounds each")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bf16", help="train.param_dtype")
    ap.add_argument("--no-hsdp", action="store_true", help="skip the 4-rank settings")
    args = ap.parse_args()
    assert args.steps % args.rounds == 0, "--steps must be a multiple of --rounds"

    settings = {**SETTINGS, **({} if args.no_hsdp else HSDP_SETTINGS)}
    iters = args.warmup + args.steps + 1
    tmp = Path(tempfile.mkdtemp(prefix="mlm-bench-"))
    make_data(tmp / "corpus", VOCAB, tokens=2 * iters * GLOBAL_BATCH * (args.seq + 1) + 100_000)
    precision = "bf16" if args.dtype == "bf16" else "fp32"

    def sets_for(name: str, micro: int, parallel: dict) -> list[str]:
        return [
            "preset=tiny-llama",
            f"run_dir='{tmp / ''.join(c for c in name if c.isalnum())}'",
            f"model.num_layers={args.layers}",
            f"model.hidden_size={args.hidden}",
            f"model.ffn_hidden_size={args.hidden * 11 // 4}",
            f"model.vocab_size={VOCAB}",
            "model.hidden_dropout=0.0",
            f"data.data_path=['{tmp / 'corpus'}']",
            f"data.seq_length={args.seq}",
            f"train.micro_batch_size={micro}",
            f"train.global_batch_size={GLOBAL_BATCH}",
            f"train.train_iters={iters}",
            f"train.precision={precision}",
            f"train.param_dtype={args.dtype}",
            "logging.tensorboard=false",
            *(f"{k}={v}" for k, v in parallel.items()),
        ]

    print(
        f"tiny-llama: {args.layers} layers, hidden {args.hidden}, ffn {args.hidden * 11 // 4}, vocab {VOCAB}; "
        f"seq {args.seq}, global batch {GLOBAL_BATCH}; param_dtype {args.dtype}, gradients reduced in fp32; "
        f"{args.steps} timed steps after {args.warmup}, then 1 profiled; torch {torch.__version__}, "
        f"{os.cpu_count()} cores, gloo on loopback, 1 compute thread per rank"
    )
    pools: dict[str, Pool] = {}
    per: dict[str, dict] = {}
    try:
        for name, (world, micro, parallel, tweak) in settings.items():
            pools[name] = Pool(world, rank_stepper, (sets_for(name, micro, parallel), tweak))
        for pool in pools.values():
            pool.ready()
        for pool in pools.values():
            pool.call("run", args.warmup)
        names = list(pools)
        for i in range(args.rounds):
            for name in names[i % len(names) :] + names[: i % len(names)]:
                got = pools[name].call("run", args.steps // args.rounds)
                acc = per.setdefault(
                    name, {"ranks": [{"steps": [], "blocked": [], "bytes": []} for _ in got]}
                )
                for a, g in zip(acc["ranks"], got, strict=True):
                    for k in a:
                        a[k] += g[k]
        for name, pool in pools.items():
            per[name]["profile"] = pool.call("profile")
            world, _, parallel, _ = settings[name]
            if "parallel.fsdp" in parallel:
                shard = int(parallel.get("parallel.fsdp_shard_size", world))
                per[name]["formula"] = pool.call("formula", shard, world // shard, DTYPE_BYTES[args.dtype])[0]
        for pool in pools.values():
            pool.close()
    finally:
        for pool in pools.values():
            pool.kill()
        shutil.rmtree(tmp, ignore_errors=True)

    ok = report(per, settings)
    return 0 if ok else 1


def report(per: dict, settings: dict) -> bool:
    ok = True
    print(
        "\nbytes per step and rank (MB = 1e6 bytes; buffer sizes: gathered output, reduce-scatter input, all-reduce tensor)"
    )
    head = f"{'setting':<12} {'ranks':>5} {'kind':<20} {'measured':>9} {'formula':>9} {'wire':>9}  equal"
    print(head)
    print("-" * len(head))
    totals: dict[str, float] = {}
    for name, r in per.items():
        ranks = r["ranks"]
        world, _, parallel, _ = settings[name]
        shard = int(parallel.get("parallel.fsdp_shard_size", world))
        wire = {  # the share of a buffer a ring moves through each rank, each way
            "all_gather": (shard - 1) / shard,
            "reduce_scatter": (shard - 1) / shard,
            "all_reduce": 2 * (world // shard - 1) / (world // shard),
        }
        kinds = sorted({k for rank in ranks for b in rank["bytes"] for k in b if not k.startswith("other")})
        want_kinds = [
            f"fsdp {k}" for k in ("all_gather", "reduce_scatter", "all_reduce") if r.get("formula", {}).get(k)
        ]
        for kind in sorted(set(kinds) | set(want_kinds)):
            values = {b.get(kind, 0) for rank in ranks for b in rank["bytes"]}
            measured = max(values)
            want = r.get("formula", {}).get(kind.split(" ", 1)[1]) if kind.startswith("fsdp") else None
            equal = "-" if want is None else ("yes" if values == {want} else "NO")
            ok &= equal != "NO"
            spread = "" if len(values) == 1 else f" (varies: {sorted(values)})"
            print(
                f"{name:<12} {len(ranks):>5} {kind:<20} {mb(measured):>9} "
                f"{'' if want is None else mb(want):>9} {mb(measured * wire[kind.split(' ', 1)[1]]):>9}  {equal}{spread}"
            )
        totals[name] = max(
            sum(v for k, v in b.items() if not k.startswith("other")) for rank in ranks for b in rank["bytes"]
        )

    for name, r in per.items():
        if "formula" in r:
            f = r["formula"]
            sizes = ", ".join(f"{u} {n:,}" for u, n in sorted(f["units"].items()))
            print(
                f"{name}: units (padded elements G_u): {sizes}; gathered again for backward: {', '.join(f['resharded']) or 'none'}"
            )
    print("\nstep time (median of the slower rank) and the all-gathers' overlap with compute (profiled step)")
    head = (
        f"{'setting':<12} {'step ms':>8} {'MB/step':>8} {'vs zero1 bytes':>14} {'vs zero1 time':>13} "
        f"{'in collectives':>14} {'gathers':>7} {'gather ms':>9} {'overlapped':>10}"
    )
    print(head)
    print("-" * len(head))
    med = {}
    for name, r in per.items():
        ranks = r["ranks"]
        step_s = [max(ts) for ts in zip(*(k["steps"] for k in ranks), strict=True)]
        med[name] = statistics.median(step_s)
    for name, r in per.items():
        ranks, prof = r["ranks"], r["profile"]
        base = BASELINE.get(name)
        vs_b = f"{totals[name] / totals[base]:13.2f}x" if base in per else f"{'-':>14}"
        vs_t = f"{med[name] / med[base]:12.2f}x" if base in per else f"{'-':>13}"
        share = (
            ", ".join(f"{sum(k['blocked']) / sum(k['steps']):.0%}" for k in ranks)
            if "formula" in r and not settings[name][3]
            else "-"
        )
        gathers = prof[0]["gathers"]
        flight = ", ".join(f"{p['flight'] * 1e3:.0f}" for p in prof) if gathers else "-"
        over = (
            ", ".join(f"{p['overlap'] / p['flight']:.1%}" if p["flight"] else "-" for p in prof)
            if gathers
            else "-"
        )
        print(
            f"{name:<12} {med[name] * 1e3:8.1f} {totals[name] / 1e6:8.2f} {vs_b} {vs_t} "
            f"{share:>14} {gathers:>7} {flight:>9} {over:>10}"
        )
    print(
        "\nin collectives: each rank's time blocked inside FSDP's collective calls / step time (waiting for the "
        "other ranks included; not shown for async*, whose waits are inside FSDP's copy-out); gather ms: the "
        "profiled step's all-gathers in flight, per rank; overlapped: the share of that time a compute op ran on "
        "the rank's main thread. * fsdp async: FSDP2's private _set_unshard_async_op(True), set by this "
        "bench; mlm does not set it."
    )
    print("bytes measured == formula for every FSDP setting and timed step:", "yes" if ok else "NO")
    return ok


if __name__ == "__main__":
    sys.exit(main())
