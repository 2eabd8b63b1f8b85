"""The cost of tensor and data parallelism on CPU: one process vs tp=2 vs dp=2, same model and data.

    .venv/bin/python bench/parallel_overhead.py [--steps N] [--rounds 5] [--warmup 2] [--batch 8] [--seq 256]

Builds a synthetic indexed dataset (random token documents) in a temporary directory, then times
`Trainer.train_step` (forward, backward, gradient reduction, clipping, AdamW) for the tiny-llama
preset at the same global batch (`--batch` sequences of `--seq` tokens, one micro-batch per step
and rank) in three settings, in the same run:

    1 process          this process, one thread per core (torch's default)
    1 proc, 1 thread   this process, one thread: what one core does, so that the rows below can
                       be read apart from how well intra-op threading scales
    tp=2               2 gloo ranks (spawned), tensor parallelism, each rank on the whole batch
    dp=2               2 gloo ranks, data parallelism (bucketed all-reduce, default 25 MB buckets:
                       one bucket for this model), each rank on half the batch

All of them are built first (the ranks are spawned once and kept); then they take turns, --steps /
--rounds steps at a time in a rotating order, while the others wait idle on a queue: on a shared
VM whose speed drifts (measured: a 2-thread step stalling from 0.24 s to 2 s for a while), taking
turns lets every setting see the same slow phases.

Inside the ranks torch.distributed's collectives (all_reduce, all_gather_single,
reduce_scatter_single, and mlm.parallel.tensor's aliases of the latter two) are wrapped with
timers; an asynchronous one (dp's bucket all-reduce) counts its launch and the time spent in its
`wait()`. Per setting it prints the median step time, tokens/s, the ratio of tokens/s to one
process, the collectives per step and their bytes, and each rank's share of step time spent
inside collectives. That share includes waiting for the other rank to arrive, not only moving
bytes. Steps begin after a barrier, so that both ranks start together.

This measures overhead, not speed-up: on a 2-core machine the 2 ranks (1 compute thread each,
plus gloo's threads) share the same two cores that the single process's 2 threads use, so no
setting has more hardware than another. A rank can still beat the 2-thread process (two
independent processes scale better than intra-op threads on these small matmuls); the gap to the
ideal of 2 x the 1-thread row is the cost of the collectives and of the smaller per-rank work.
The defaults finish in about a minute on 2 cores.
"""

from __future__ import annotations

import argparse
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
from mlm.errors import MlmError  # noqa: E402
from mlm.train.trainer import Trainer  # noqa: E402

PRESET = "tiny-llama"
SETTINGS = {  # name → (ranks, threads per rank: None = cores / ranks, overrides)
    "1 process": (1, None, {}),
    "1 proc, 1 thread": (1, 1, {}),  # what one core does: separates thread scaling from parallelism
    "tp=2": (2, None, {"parallel.tp": 2}),
    "dp=2": (2, None, {}),
}

# ---------------------------------------------------------------------- timing the collectives

COMM = {"seconds": 0.0, "calls": 0, "bytes": 0}


class _TimedWork:
    """An async collective's handle whose `wait()` adds to the communication time."""

    def __init__(self, work):
        self._work = work

    def wait(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            COMM["seconds"] += time.perf_counter() - t0

    def __getattr__(self, name):
        return getattr(self._work, name)


def time_collectives() -> None:
    """Wrap the collectives mlm's training step calls with timers (and call / byte counters)."""
    import torch.distributed as dist

    def wrap(orig, tensor_index: int):  # bytes: all_reduce's tensor, a gather's output, a scatter's input
        def timed(*args, **kwargs):
            t = args[tensor_index]
            COMM["calls"] += 1
            COMM["bytes"] += t.numel() * t.element_size()
            t0 = time.perf_counter()
            work = orig(*args, **kwargs)
            COMM["seconds"] += time.perf_counter() - t0
            return None if work is None else _TimedWork(work)

        return timed

    # the deprecated names call the new ones through distributed_c10d's (unwrapped) globals
    for name, index in (
        ("all_reduce", 0),
        ("all_gather_single", 0),
        ("all_gather_into_tensor", 0),
        ("reduce_scatter_single", 1),
        ("reduce_scatter_tensor", 1),
    ):
        setattr(dist, name, wrap(getattr(dist, name), index))


# ---------------------------------------------------------------------- the settings


class Stepper:
    """A trainer and its micro-batches; `run(n)` times n steps (after a barrier each, on a mesh)."""

    def __init__(self, sets: list[str], world: int, threads: int):
        self.world, self.threads = world, threads
        self.trainer = Trainer(load_config(None, sets))
        self.batches = micro_batches(self.trainer)
        self.first_loss: float | None = None

    def run(self, n: int, keep: bool = True) -> dict[str, list[float]]:
        import torch.distributed as dist

        torch.set_num_threads(self.threads)  # settings in one process differ in threads
        out: dict[str, list[float]] = {"steps": [], "comm": [], "calls": [], "bytes": []}
        for _ in range(n):
            batches = [next(self.batches) for _ in range(self.trainer.num_micro)]
            if self.world > 1:
                dist.barrier()
            COMM.update(seconds=0.0, calls=0, bytes=0)
            t0 = time.perf_counter()
            loss = self.trainer.train_step(batches)["loss"]
            dt = time.perf_counter() - t0
            self.first_loss = loss if self.first_loss is None else self.first_loss
            if keep:
                for key, value in (("steps", dt), ("comm", COMM["seconds"]), ("calls", COMM["calls"])):
                    out[key].append(value)
                out["bytes"].append(COMM["bytes"])
        return out

    def info(self) -> dict:
        """The first step's loss and the threads torch runs on now (in a rank: the steps' threads)."""
        return {"first_loss": self.first_loss, "threads": torch.get_num_threads()}


def rank_stepper(sets: list[str], world: int, threads: int) -> Stepper:
    """A pool rank's Stepper, its collectives timed."""
    time_collectives()
    return Stepper(sets, world, threads)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20, help="timed steps per setting")
    ap.add_argument("--rounds", type=int, default=5, help="the settings take turns, steps/rounds each")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per setting")
    ap.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    ap.add_argument("--seq", type=int, default=256)
    args = ap.parse_args()
    if args.batch % 2:
        raise MlmError(f"--batch {args.batch}: must be even, so that dp=2 splits it")
    if args.steps % args.rounds:
        raise MlmError(f"--steps {args.steps} is not a multiple of --rounds {args.rounds}")

    cores = os.cpu_count() or 1
    iters = args.warmup + args.steps
    tmp = Path(tempfile.mkdtemp(prefix="mlm-bench-"))
    vocab = load_config(None, [f"preset={PRESET}"]).model.vocab_size
    make_data(tmp / "corpus", vocab, tokens=2 * iters * args.batch * (args.seq + 1) + 100_000)
    print(
        f"preset {PRESET}, global batch {args.batch} x seq {args.seq} = {args.batch * args.seq} tokens/step, "
        f"fp32, {args.steps} timed steps after {args.warmup} in {args.rounds} rounds, "
        f"torch {torch.__version__}, {cores} cores, load average {os.getloadavg()[0]:.2f}"
    )
    print("2 ranks share the cores the single process's threads use: this shows overhead, not speed-up\n")

    def sets_for(name: str, world: int, parallel: dict) -> list[str]:
        micro = args.batch // (world if "parallel.tp" not in parallel else 1)
        return [
            f"preset={PRESET}",
            f"run_dir='{tmp / ''.join(c for c in name if c.isalnum())}'",
            f"data.data_path=['{tmp / 'corpus'}']",
            f"data.seq_length={args.seq}",
            f"train.micro_batch_size={micro}",
            f"train.global_batch_size={args.batch}",
            f"train.train_iters={iters}",
            "logging.tensorboard=false",
            *(f"{k}={v}" for k, v in parallel.items()),
        ]

    # The ranks start (imports, trainer, data index) together, then the settings take turns:
    # whoever is not running blocks on a queue, idle. Rotating the order each round spreads the
    # machine's slow phases (this is a shared VM) over all settings.
    runners: dict[str, object] = {}
    pools: list[Pool] = []
    try:
        for name, (world, threads, parallel) in SETTINGS.items():
            threads = threads or max(1, cores // world)
            if world == 1:
                runners[name] = Stepper(sets_for(name, 1, parallel), 1, threads)
            else:
                pools.append(
                    Pool(
                        world,
                        rank_stepper,
                        (sets_for(name, world, parallel), world, threads),
                        threads=threads,
                        timeout=300,
                    )
                )
                runners[name] = pools[-1]
        for pool in pools:
            pool.ready()
        per_rank: dict[str, list[dict]] = {}

        def turn(name: str, n: int, keep: bool) -> None:
            r = runners[name]
            got = r.call("run", n, keep) if isinstance(r, Pool) else [r.run(n, keep)]
            if keep:
                acc = per_rank.setdefault(name, [{k: [] for k in got[0]} for _ in got])
                for a, g in zip(acc, got, strict=True):
                    for k, v in g.items():
                        a[k] += v

        names = list(SETTINGS)
        for name in names:
            turn(name, args.warmup, keep=False)
        for i in range(args.rounds):
            for name in names[i % len(names) :] + names[: i % len(names)]:
                turn(name, args.steps // args.rounds, keep=True)
        info = {
            name: [{"first_loss": r.first_loss, "threads": r.threads}]
            for name, r in runners.items()
            if isinstance(r, Stepper)
        }
        for name, r in runners.items():
            if isinstance(r, Pool):
                info[name] = r.call("info")
                r.close()
    finally:
        for pool in pools:
            pool.kill()
        shutil.rmtree(tmp, ignore_errors=True)

    tokens = args.batch * args.seq
    base = None
    header = (
        f"{'setting':<16} {'threads':>7} {'step ms':>8} {'tokens/s':>9} {'vs 1 proc':>9} "
        f"{'colls/step':>10} {'MB/step':>8}  {'comm share (ranks)':<18} {'first loss':>10}"
    )
    print(header)
    print("-" * len(header))
    for name, ranks in per_rank.items():
        r0 = ranks[0]
        # a step ends when the slower rank ends: the per-step maximum over ranks
        step_s = [max(ts) for ts in zip(*(r["steps"] for r in ranks), strict=True)]
        med = statistics.median(step_s)
        tps = tokens / med
        base = base or tps
        share = (
            ", ".join(f"{sum(r['comm']) / sum(r['steps']):4.0%}" for r in ranks) if len(ranks) > 1 else "-"
        )
        threads = "x".join(str(r["threads"]) for r in info[name])
        print(
            f"{name:<16} {threads:>7} {med * 1e3:8.1f} {tps:9,.0f} {tps / base:8.2f}x "
            f"{statistics.median(r0['calls']):10.0f} {statistics.median(r0['bytes']) / 1e6:8.2f}  "
            f"{share:<18} {info[name][0]['first_loss']:10.6f}"
        )
    print(
        f"\n{sum(p.numel() for p in runners['1 process'].trainer.model.parameters()) / 1e6:.2f} M parameters; "
        "step time: median over steps of the slower rank; comm share: time inside collectives "
        f"(async: launch + wait) / step time; load average at the end {os.getloadavg()[0]:.2f}"
    )


if __name__ == "__main__":
    try:
        main()
    except MlmError as e:
        sys.exit(f"error: {e}")
