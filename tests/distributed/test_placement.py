"""Placements: a tensor sharded over a data-parallel-like group (as experts will be over ep) is
written exactly once — each distinct slice by its replica 0 — and loads back at another layout.

The test module's weight [8, 3] is split by rows over dp; its bias is replicated. Saved from
tp 2 × dp 2 (4 gloo ranks: every dp slice has two tp replicas), loaded at dp 4 (4 ranks, 2 rows
each) and in one process (whole). The old rule, "dp rank 0 writes", would leave rows 4-7 unwritten.
"""

from __future__ import annotations

import torch
from torch import nn

from mlm.checkpoint import ShardedTensor, load_checkpoint, save_checkpoint
from mlm.config import ParallelConfig
from mlm.parallel import Mesh
from mlm.parallel.parallelize import model_shards
from mlm.parallel.placement import placements, sharded
from tests.helpers.distributed import run_ranks

FULL_WEIGHT = torch.arange(24, dtype=torch.float32).view(8, 3)
FULL_BIAS = torch.tensor([0.5, -1.0, 2.0])


class DataParallelSharded(nn.Module):
    def __init__(self, mesh: Mesh):
        super().__init__()
        self.placements = {"weight": sharded(mesh, (8, 3), 0, over="dp")}
        self.weight = nn.Parameter(self.placements["weight"].slice_of(FULL_WEIGHT).clone())
        self.bias = nn.Parameter(FULL_BIAS.clone())


def _save(rank, world, root):
    dist = torch.distributed
    mesh = Mesh.build(ParallelConfig(tp=2))
    module = DataParallelSharded(mesh)
    place = placements(module, mesh)["weight"]
    assert (place.sharded_over, place.replicated_over) == (("dp",), ("cp", "tp"))
    shards = model_shards(module, mesh)
    save_checkpoint(root, 1, {"model": shards}, {}, rank=rank, barrier=dist.barrier)
    return [(t.key, t.global_offset, t.writer) for t in shards]


def _load(rank, world, root):
    mesh = Mesh.build(ParallelConfig())
    module = DataParallelSharded(mesh)
    with torch.no_grad():
        for p in module.parameters():
            p.zero_()
    load_checkpoint(root, {"model": model_shards(module, mesh)})
    return module.weight.detach().clone(), module.bias.detach().clone()


def test_tensor_sharded_over_dp_is_written_once_and_loads_at_another_layout(tmp_path):
    root = tmp_path / "ckpt"
    per_rank = run_ranks(4, _save, root)
    writers: dict[tuple, int] = {}
    for shards in per_rank:
        for key, offset, writer in shards:
            writers[(key, offset)] = writers.get((key, offset), 0) + writer
    # two distinct weight slices (rows 0-3, 4-7) and one bias, each written by exactly one rank
    assert writers == {("weight", (0, 0)): 1, ("weight", (4, 0)): 1, ("bias", (0,)): 1}

    for rank, (weight, bias) in enumerate(run_ranks(4, _load, root)):  # dp 4: two rows each
        assert torch.equal(weight, FULL_WEIGHT[2 * rank : 2 * rank + 2]), rank
        assert torch.equal(bias, FULL_BIAS)
    whole = {"weight": torch.zeros(8, 3), "bias": torch.zeros(3)}
    load_checkpoint(root, {"model": [ShardedTensor.full(k, v) for k, v in whole.items()]})
    assert torch.equal(whole["weight"], FULL_WEIGHT) and torch.equal(whole["bias"], FULL_BIAS)
