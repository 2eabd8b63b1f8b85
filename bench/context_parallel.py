"""Context parallelism's two attention implementations on CPU: ring (p2p) against all_gather,
forward + backward time, bytes each rank sends, and how much of the ring's transfers the
computation hides.

    .venv/bin/python bench/context_parallel.py [--seqs 4096 8192 16384] [--cps 2 4] [--heads 4]
                                               [--groups 2] [--head-dim 32] [--steps 3] [--warmup 1]

For each cp, cp gloo ranks are spawned on this machine (one compute thread each when cp ≥ the
cores); each holds its zigzag part, t = T / cp tokens, of random queries [1, t, H, K], keys and
values [1, t, G, K] (fp32; the defaults are tiny-llama's attention: H 4, G 2, K 32) and runs
the attention core alone, forward then backward with a random output gradient, after a barrier:

    p2p          `mlm.parallel.ring_attention.ring_attention` as built: the transfer of step
                 i + 1 started before step i's compute and waited after it
    p2p serial   the same ring with every transfer waited as soon as it is started (no overlap)
    all_gather   `mlm.parallel.context.allgather_attention`: keys and values gathered, one masked
                 SDPA over the whole sequence; backward reduce-scatters their gradients

Time: per step the slowest rank's forward + backward; the median over --steps (after --warmup).
The first step's outputs are checked equal between p2p and all_gather (1e-4).

Bytes: every send is counted on the way out of each rank, by wrapping torch.distributed's
`batch_isend_irecv` (the ring's isends) and its all-gather and reduce-scatter (for those, the
(cp − 1) / cp of the whole buffer that a ring algorithm moves per rank). The formulas, per rank
per step (forward + backward), b bytes per element of the model's dtype:

    p2p         2·t·G·K · (2·(cp − 1)·b + cp·4): keys and values go cp − 1 hops forward and again
                backward; their gradient accumulators (fp32) go cp hops, the last one back to the
                keys' owner
    all_gather  4·(cp − 1)·t·G·K·b: keys and values gathered, their gradients reduce-scattered

Overlap ("wait s", "overlap"): W is the time a rank spends blocked in the ring's waits per
step (forward and backward, key/value and gradient transfers; mean over ranks of the median
step). The overlap fraction is 1 − W(p2p) / W(p2p serial): the share of the blocking that the
ring removes by computing a block while the next transfer is in flight (1: none left; 0: as if
serial). W also counts waiting for a neighbour that is still computing, not only moving bytes,
so on a loaded machine it can swing either way. (gloo's `Work.is_completed()` stays False until
`wait()`, so whether a transfer had finished before its wait cannot be asked directly; its
transfers do progress in the background: measured, a 128 MiB send waited after a 1 s sleep
returns in 15 µs, against 0.4 s when waited at once.)

The defaults took 26 minutes on 2 cores shared with another job (load average 5-10), most of
it the ring at T 16384: it materialises fp32 score blocks (up to 1 GiB each at cp 2) where
all_gather's SDPA runs a fused kernel; `--seqs 4096 8192 --cps 2` takes about 2.5 minutes.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

IMPLS = ("p2p", "p2p serial", "all_gather")
SENT: list[int] = []
WAITED: list[float] = []


def _instrument(cp: int) -> None:
    """Count the bytes every send carries and time the ring's waits."""
    import torch.distributed as dist

    from mlm.parallel import data_parallel, ring_attention

    real_batch = dist.batch_isend_irecv

    def batch_isend_irecv(ops):
        SENT.extend(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
        return real_batch(ops)

    dist.batch_isend_irecv = batch_isend_irecv
    for name in (data_parallel.ALL_GATHER, data_parallel.REDUCE_SCATTER):
        real = getattr(dist, name)

        def ring(out, inp, group=None, _real=real, _gather=name == data_parallel.ALL_GATHER, **kw):
            full = out if _gather else inp
            SENT.append(full.numel() * full.element_size() * (cp - 1) // cp)
            return _real(out, inp, group=group, **kw)

        setattr(dist, name, ring)

    real_wait = ring_attention._Ring.wait

    def wait(pending):
        t0 = time.perf_counter()
        out = real_wait(pending)
        WAITED.append(time.perf_counter() - t0)
        return out

    ring_attention._Ring.wait = staticmethod(wait)


def _serial(ring_cls, on: bool) -> None:
    """Make the ring wait on every transfer right after starting it (on) or restore it (off)."""
    if on:
        start = ring_cls.start

        def start_and_wait(self, x, tag=0):
            pending = start(self, x, tag)
            return ring_cls.wait(pending), []  # the receive buffer, nothing left to wait on

        ring_cls._overlapped = start
        ring_cls.start = start_and_wait
    elif hasattr(ring_cls, "_overlapped"):
        ring_cls.start = ring_cls._overlapped
        del ring_cls._overlapped


def _rank(rank: int, world: int, port: int, args, queue) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    from mlm.parallel import ring_attention
    from mlm.parallel.context import allgather_attention

    _instrument(world)
    impls = {
        "p2p": ring_attention.ring_attention,
        "p2p serial": ring_attention.ring_attention,
        "all_gather": allgather_attention,
    }
    H, G, K = args.heads, args.groups, args.head_dim
    results = {}
    for T in args.seqs:
        t = T // world
        gen = torch.Generator().manual_seed(rank)
        q, k, v, grad = (torch.randn(1, t, n, K, generator=gen) for n in (H, G, G, H))
        runs = {name: ([], [], []) for name in IMPLS}  # times, waits, bytes
        outs = {}
        for step in range(args.warmup + args.steps):
            shift = step % len(IMPLS)  # a rotating order: every implementation sees the slow phases
            for name in IMPLS[shift:] + IMPLS[:shift]:
                _serial(ring_attention._Ring, name == "p2p serial")
                qs, ks, vs = (x.clone().requires_grad_() for x in (q, k, v))
                SENT.clear()
                WAITED.clear()
                dist.barrier()
                t0 = time.perf_counter()
                out = impls[name](qs, ks, vs, group=None, cp=world, rank=rank)
                out.backward(grad)
                dt = time.perf_counter() - t0
                if step == 0:
                    outs[name] = out.detach()
                if step >= args.warmup:
                    for values, x in zip(runs[name], (dt, sum(WAITED), sum(SENT)), strict=True):
                        values.append(x)
                del out, qs, ks, vs
        _serial(ring_attention._Ring, False)
        torch.testing.assert_close(outs["p2p"], outs["all_gather"], rtol=1e-4, atol=1e-4)
        for name, (times, waits, sent) in runs.items():
            results[(T, name)] = (times, waits, sent[0])
    queue.put((rank, results))
    dist.destroy_process_group()


def _run(cp: int, args) -> dict[int, dict]:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, cp, port, args, queue)) for r in range(cp)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=3600) for _ in procs)
    for p in procs:
        p.join()
    return results


def formula(name: str, T: int, cp: int, args, b: int = 4) -> int:
    tGK = T // cp * args.groups * args.head_dim
    if name == "all_gather":
        return 4 * (cp - 1) * tGK * b
    return 2 * tGK * (2 * (cp - 1) * b + cp * 4)


def report(cp: int, results: dict[int, dict], args) -> None:
    threads = max(1, (os.cpu_count() or 1) // cp)
    print(
        f"\ncp {cp}: {cp} gloo ranks, {threads} thread(s) each; attention H {args.heads}, G {args.groups}, "
        f"K {args.head_dim}, fp32, batch 1; forward + backward, median of {args.steps} step(s)"
    )
    print(
        f"{'seq':>6}  {'impl':<11} {'step s':>8} {'/ p2p':>6} {'MiB sent/rank':>14} {'/ formula':>9}  "
        f"{'wait s':>7} {'overlap':>8}"
    )
    for T in args.seqs:
        row = {}
        for name in IMPLS:
            per_rank = [results[r][(T, name)] for r in range(cp)]
            step = statistics.median(
                max(s) for s in zip(*(r[0] for r in per_rank), strict=True)
            )  # slowest rank
            wait = statistics.mean(statistics.median(r[1]) for r in per_rank)
            sent = max(r[2] for r in per_rank)
            row[name] = (step, wait, sent)
        for name in IMPLS:
            step, wait, sent = row[name]
            ring = name != "all_gather"
            waited = f"{wait:7.3f}" if ring else " " * 7
            overlap = f"{1 - wait / row['p2p serial'][1]:8.2f}" if name == "p2p" else ""
            print(
                f"{T:>6}  {name:<11} {step:8.3f} {step / row['p2p'][0]:6.2f} {sent / 2**20:14.2f} "
                f"{sent / formula(name, T, cp, args):9.3f}  {waited} {overlap}".rstrip()
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", type=int, nargs="+", default=[4096, 8192, 16384])
    p.add_argument("--cps", type=int, nargs="+", default=[2, 4])
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    args = p.parse_args()
    for cp in args.cps:
        if any(T % (2 * cp) for T in args.seqs):
            raise SystemExit(f"every --seqs value must be a multiple of 2 × cp = {2 * cp}")
        report(cp, _run(cp, args), args)


if __name__ == "__main__":
    main()
