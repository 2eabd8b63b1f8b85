"""The mesh: Megatron's rank order and clear errors."""

from __future__ import annotations

import pytest

from mlm.config import ParallelConfig
from mlm.errors import MlmError
from mlm.parallel import Mesh
from tests.helpers.distributed import run_ranks


def _coords(rank, world, tp, pp):
    import torch
    import torch.distributed as dist

    mesh = Mesh.build(ParallelConfig(tp=tp, pp=pp))
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=mesh.tp_group)  # sum of my tp group's ranks
    return (mesh.pp_rank, mesh.dp_rank, mesh.cp_rank, mesh.tp_rank, mesh.dp, float(t))


def test_rank_order_tp_fastest_then_dp_then_pp():
    got = run_ranks(8, _coords, 2, 2)
    # world 8 = pp 2 × dp 2 × tp 2: rank = pp·4 + dp·2 + tp
    for rank, (pp, dp, cp, tp, dp_size, tp_sum) in enumerate(got):
        assert (pp, dp, cp, tp, dp_size) == (rank // 4, (rank // 2) % 2, 0, rank % 2, 2)
        assert tp_sum == 2 * (rank // 2) * 2 + 1  # the tp group is {2k, 2k+1}


def test_shape_errors_show_the_product():
    with pytest.raises(MlmError, match=r"tp\(2\) × pp\(2\) × cp\(1\) = 4 does not divide world size 6"):
        Mesh.shape_for(ParallelConfig(tp=2, pp=2), 6)
    assert Mesh.shape_for(ParallelConfig(tp=2), 6) == {"pp": 1, "dp": 3, "cp": 1, "tp": 2}
    with pytest.raises(MlmError, match=r"ep\(4\) must divide dp\(2\) × cp\(1\) × tp\(1\) = 2"):
        Mesh.shape_for(ParallelConfig(ep=4), 2)


def _expert_groups(rank, world):
    import torch
    import torch.distributed as dist

    mesh = Mesh.build(ParallelConfig(tp=2, ep=2), gloo_group=True)
    sums = {}
    for name in ("ep", "edp", "gloo"):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=mesh.group(name))
        sums[name] = float(t)
    return mesh.ep_rank, mesh.edp_rank, mesh.edp, sums, mesh.group("pp_grad")


def test_expert_groups_fold_the_stage_as_edp_by_ep():
    """World 8 = dp 4 × tp 2 with ep 2 (Megatron's folding, expert tensor parallelism 1): the
    stage's ranks in rank order (tp fastest) as edp 4 × ep 2, so an ep group is a tp group
    {2d, 2d+1} and an edp group holds every other rank {e, 2+e, 4+e, 6+e}."""
    for rank, (ep_rank, edp_rank, edp, sums, pp_grad) in enumerate(run_ranks(8, _expert_groups)):
        assert (ep_rank, edp_rank, edp) == (rank % 2, rank // 2, 4), rank
        ep_mates = [2 * (rank // 2) + e for e in range(2)]
        edp_mates = [2 * d + rank % 2 for d in range(4)]
        assert sums == {"ep": sum(ep_mates), "edp": sum(edp_mates), "gloo": sum(range(8))}, rank
        assert pp_grad is None  # pp 1: no pipeline groups
