"""Pipeline stages of fixed cost (they sleep), to measure a schedule's bubble on real ranks.

Used by tests/distributed/test_pipeline.py and bench/pipeline_bubble.py.
"""

from __future__ import annotations

import statistics
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn

from mlm.config import ParallelConfig
from mlm.model import Chunk
from mlm.parallel import Mesh
from mlm.parallel.pipeline import Pipeline, rank_chunks


class _SleepBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.seconds)
        return g, None


class SleepStage(nn.Module):
    """A pipeline stage of fixed cost: each chunk's forward sleeps f / vpp, its backward b / vpp."""

    def __init__(self, chunks: list[Chunk], f: float, b: float, hidden: int = 4):
        super().__init__()
        self.cfg = SimpleNamespace(
            hidden_size=hidden, tie_embeddings=False, mtp_num_layers=0, mtp_loss_scaling_factor=0.1
        )
        self.chunks, self.sequence_shards = chunks, 1
        self.w = nn.Parameter(torch.ones(()))
        self.f, self.b = f / len(chunks), b / len(chunks)

    def forward(self, x, positions=None, cache=None, chunk=0, documents=None):
        if self.chunks[chunk].first:
            x = torch.ones(*x.shape, self.cfg.hidden_size)
        time.sleep(self.f)
        return _SleepBackward.apply(x * self.w, self.b)

    hidden_states = forward

    def head_loss(self, h, labels, weights=None):
        return h.mean()

    def tied_weight(self):
        return None


def measure_bubble(rank: int, world: int, vpp: int, m: int, f: float, steps: int = 1) -> float:
    """On `world` gloo ranks (pipeline rank = rank): the idle fraction of a step of sleeping stages
    (forward f, backward 2f per rank), after a warm-up step; the median over `steps` steps."""
    mesh = Mesh.build(ParallelConfig(pp=world, vpp=vpp))
    stage = SleepStage(rank_chunks([1] * (world * vpp), world, rank), f, 2 * f)
    pipe = Pipeline(stage, mesh, vpp)
    micro = [torch.zeros(1, 5, dtype=torch.long)] * m
    pipe.train_step(micro)  # warm-up: the first backward starts autograd's threads
    idle = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        pipe.train_step(micro)
        dist.barrier()
        busy = sum(end - begin for _, begin, end in pipe.trace)
        idle.append(1 - busy / (time.perf_counter() - start))
    return statistics.median(idle)
