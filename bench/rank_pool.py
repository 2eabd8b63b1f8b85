"""Spawned CPU gloo ranks driven by commands, and a random corpus: shared by the distributed benches.

A `Pool` starts `world` processes on a free localhost port; each joins the gloo group and builds
one object, `factory(*args)`, then calls the methods this process names. Every rank runs every
command, so the collectives inside them match up. `micro_batches` feeds a rank's trainer. Used by bench/fsdp_comm.py and
bench/parallel_overhead.py, which put the repository root on sys.path before importing this.
"""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from mlm.datasets.indexed import IndexedDatasetWriter, data_paths
from mlm.datasets.sampler import PretrainingSampler


def micro_batches(trainer):
    """This rank's micro-batches of sample indices for every step of `trainer`'s run, in order."""
    t = trainer.cfg.train
    return iter(
        PretrainingSampler(
            trainer.total_iters * t.global_batch_size, 0, t.micro_batch_size, trainer.dp_rank, trainer.dp_size
        )
    )


def make_data(prefix: Path, vocab: int, tokens: int) -> None:
    """Random documents of 100–1000 tokens, about `tokens` in all, with a fixed seed: the data only
    has to be the same for every setting."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(100, 1000, tokens // 550 + 1)
    w = IndexedDatasetWriter(*data_paths(prefix), np.uint16)
    w.add_documents(rng.integers(0, vocab, int(lengths.sum())), lengths)
    w.finalize()


def _rank_main(rank, world, port, threads, factory, args, commands, results) -> None:
    """One rank: join the group, build the object, report ready, then answer commands until `None`
    (blocked, idle, in between). A failure goes back as its traceback."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    try:
        torch.set_num_threads(threads)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        obj = factory(*args)
        results.put((rank, "ready", None))
        while (cmd := commands.get()) is not None:
            method, margs = cmd
            results.put((rank, getattr(obj, method)(*margs), None))
        results.put((rank, "stopped", None))
    except BaseException:
        results.put((rank, None, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class Pool:
    """`world` spawned gloo ranks with `threads` compute threads each, each holding `factory(*args)`
    (built after the process group, so it may use it). `factory` and `args` must pickle: a
    module-level class or function. `timeout`: seconds to wait for each rank's answer."""

    def __init__(
        self, world: int, factory: Callable, args: tuple = (), threads: int = 1, timeout: float = 600
    ):
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.world, self.timeout = world, timeout
        self.results = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(world)]
        self.procs = [
            ctx.Process(
                target=_rank_main,
                args=(r, world, port, threads, factory, tuple(args), self.commands[r], self.results),
            )
            for r in range(world)
        ]
        for p in self.procs:
            p.start()

    def _collect(self) -> list:
        """Every rank's answer, in rank order; a rank's traceback raises."""
        got = {}
        for _ in range(self.world):
            rank, value, err = self.results.get(timeout=self.timeout)
            if err:
                raise RuntimeError(f"rank {rank} failed:\n{err}")
            got[rank] = value
        return [got[r] for r in range(self.world)]

    def ready(self) -> None:
        """Wait until every rank has built its object (start several pools first: they build together)."""
        self._collect()

    def call(self, method: str, *args) -> list:
        """`obj.method(*args)` on every rank; their return values, in rank order."""
        for q in self.commands:
            q.put((method, args))
        return self._collect()

    def close(self) -> None:
        """Stop the ranks (each leaves the group) and wait for them to exit."""
        for q in self.commands:
            q.put(None)
        self._collect()
        for p in self.procs:
            p.join(timeout=30)

    def kill(self) -> None:
        """Kill the ranks still alive (after a failure: `close` waits for them)."""
        for p in self.procs:
            if p.is_alive():
                p.kill()
