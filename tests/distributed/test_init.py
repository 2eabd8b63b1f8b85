"""Per-shard initialisation (`mlm.model.init`): a rank draws only its own slices, and the global
weights are the same under every layout as in one process, bit for bit.

1. A slice drawn alone equals that slice of the whole tensor: odd shapes, offsets along dim 0
   and dim 1, rows longer than a block, 1-d and 3-d tensors, bf16 parameters, vocabulary padding.
2. The tiny presets built by the real path (`build_rank_model`, which initialises with `init_weights`) on 2 gloo ranks at
   tp2, pp2, pp2 × vpp2, dp2, cp2 and ep2, their slices put together by placement, equal the
   one-process model's weights (`torch.equal`; padded vocabulary rows zero).
3. Initialising a rank allocates nothing larger than one block: no full tensor of a sharded
   parameter (the old init drew each one whole and kept its slice).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import mlm.model.init as init
from mlm.build import build_rank_model
from mlm.config import load_config
from mlm.model.init import draw_normal
from mlm.parallel.mesh import Mesh
from mlm.parallel.placement import placements
from tests.helpers.distributed import run_ranks

SEED = 1234


def _whole(shape, rows=None, std=0.02, name="w"):
    full = torch.empty(shape)
    draw_normal(full, shape, (0,) * len(shape), std, SEED, name, rows)
    return full


def _alone(shape, offset, local, rows=None, dtype=torch.float32, std=0.02, name="w"):
    out = torch.empty(local, dtype=dtype)
    draw_normal(out, shape, offset, std, SEED, name, rows)
    return out


def _slice(full, offset, local):
    return full[tuple(slice(o, o + n) for o, n in zip(offset, local, strict=True))]


# shape, offset, local shape: blocks of 24 values (BLOCK patched), so 7-column rows come 3 to a
# block and 100-column rows in pieces of 24 (the last 4)
SLICES = [
    ((53, 7), (10, 0), (17, 7)),  # rows, starting and ending inside blocks
    ((53, 7), (0, 2), (53, 3)),  # columns (row-parallel)
    ((5, 100), (1, 0), (3, 100)),  # rows longer than a block
    ((5, 100), (0, 30), (5, 41)),  # columns across pieces of a row
    ((6, 4, 9), (1, 0, 0), (4, 4, 9)),  # stacked experts: whole trailing dims
    ((50,), (13,), (30,)),
    ((1, 3), (0, 1), (1, 1)),
]


@pytest.mark.parametrize("shape, offset, local", SLICES, ids=[str(s) for s in SLICES])
def test_a_slice_drawn_alone_equals_the_slice_of_the_whole(monkeypatch, shape, offset, local):
    monkeypatch.setattr(init, "BLOCK", 24)
    full = _whole(shape)
    assert torch.equal(_alone(shape, offset, local), _slice(full, offset, local))
    # a bf16 parameter: drawn in fp32, rounded on copy
    bf16 = _alone(shape, offset, local, dtype=torch.bfloat16)
    assert torch.equal(bf16, _slice(full, offset, local).to(torch.bfloat16))


def test_slices_of_full_size_blocks():
    shape = (3000, 700)  # 1497 rows a block: two blocks and a part
    full = _whole(shape, std=1.0)
    assert abs(full.std().item() - 1.0) < 0.01 and abs(full.mean().item()) < 0.01
    for offset, local in (((1500, 0), (1500, 700)), ((0, 350), (3000, 350)), ((1, 3), (2998, 695))):
        assert torch.equal(_alone(shape, offset, local, std=1.0), _slice(full, offset, local))


def test_padding_rows_are_zero_and_the_real_rows_do_not_depend_on_the_padding(monkeypatch):
    monkeypatch.setattr(init, "BLOCK", 24)
    real = 45  # e.g. a vocabulary of 45 padded to 48 at tp 1 and 64 at tp 2
    one = _whole((48, 7), rows=real)
    two = _whole((64, 7), rows=real)
    assert torch.equal(one[:real], two[:real]) and one[real:].eq(0).all() and two[real:].eq(0).all()
    assert torch.equal(_alone((64, 7), (32, 0), (32, 7), rows=real), two[32:])  # tp rank 1's half
    assert _alone((64, 7), (48, 0), (16, 7), rows=real).eq(0).all()  # all padding


def test_every_name_draws_its_own_values():
    assert not torch.equal(_whole((4, 5), name="a.weight"), _whole((4, 5), name="b.weight"))


# ---------------------------------------------------------------- 2. layouts, on gloo ranks

LLAMA = ("preset=tiny-llama", "model.vocab_size=3900")  # padded to 3968 at tp 1, 4096 at tp 2
GPT2 = ("preset=tiny-gpt2",)  # biases, learned positions, tied embedding (pp: a copy on the last stage)
MOE = ("preset=tiny-moe",)
DEEPSEEK = ("preset=tiny-deepseek",)  # MLA, sigmoid router with an expert bias, one MTP depth
LAYOUTS = {
    "llama-tp2": (LLAMA, ("parallel.tp=2",)),
    "llama-pp2": (LLAMA, ("parallel.pp=2",)),
    "llama-pp2vpp2": (LLAMA, ("parallel.pp=2", "parallel.vpp=2")),
    "llama-dp2": (LLAMA, ()),
    "llama-cp2": (LLAMA, ("parallel.cp=2",)),
    "gpt2-tp2": (GPT2, ("parallel.tp=2",)),
    "gpt2-pp2": (GPT2, ("parallel.pp=2",)),
    "moe-ep2": (MOE, ("parallel.ep=2",)),
    "moe-tp2": (MOE, ("parallel.tp=2",)),
    "deepseek-tp2-ep2": (DEEPSEEK, ("parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=2")),
    "deepseek-pp2": (DEEPSEEK, ("parallel.pp=2", "parallel.first_stage_layers=2")),
    "deepseek-cp2": (DEEPSEEK, ("parallel.cp=2",)),
}


def _build(sets, mesh=None):
    cfg = load_config(None, list(sets))
    mesh = mesh or Mesh.build(cfg.parallel)
    model = build_rank_model(cfg.model, cfg.parallel, mesh, torch.device("cpu"))
    model.init_weights(SEED)
    return cfg, mesh, model


def _rank_slices(rank, world, sets):
    """(name, global shape, offset, this rank's slice) of every parameter of this rank's model
    (slices as numpy arrays: a tensor would go back through shared memory that dies with the rank)."""
    _, mesh, model = _build(sets)
    places = placements(model, mesh)
    return [
        (n, places[n].global_shape, places[n].offset, p.detach().numpy().copy())
        for n, p in model.named_parameters()
    ]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_global_weights_are_those_of_one_process(layout):
    model_sets, parallel_sets = LAYOUTS[layout]
    cfg, _, one = _build(model_sets)
    glued: dict[str, torch.Tensor] = {}
    for slices in run_ranks(2, _rank_slices, (*model_sets, *parallel_sets)):
        for name, shape, offset, array in slices:
            local = torch.from_numpy(array)
            full = glued.setdefault(name, torch.full(shape, float("nan")))
            part = _slice(full, offset, local.shape)
            assert part.isnan().all() or torch.equal(part, local), f"{name}: two ranks' copies differ"
            part.copy_(local)
    expected = dict(one.named_parameters())
    assert glued.keys() == expected.keys()
    V = cfg.model.vocab_size
    for name, full in glued.items():
        want = expected[name].detach()
        if full.shape != want.shape:  # the vocabulary, padded for tp: the rows beyond are zeros
            assert name in ("embed.weight", "output.weight"), name
            assert full[V:].eq(0).all() and want[V:].eq(0).all(), name
            full, want = full[:V], want[:V]
        assert torch.equal(full, want), f"{layout}: {name} differs from one process"


# ---------------------------------------------------------------- 3. memory


class _Allocations(TorchDispatchMode):
    """Records the bytes of every tensor an op allocates (outputs not sharing an input's storage)."""

    def __init__(self):
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            a.untyped_storage().data_ptr()
            for a in torch.utils._pytree.tree_leaves((args, kwargs))
            if isinstance(a, torch.Tensor)
        }
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.sizes.append(t.untyped_storage().nbytes())
        return out


def test_a_rank_allocates_one_block_at_a_time(monkeypatch):
    # tp rank 1 of tp 2 × ep 2 (dp 2) of tiny-deepseek, without torch.distributed: the mesh's
    # coordinates are all that building and initialising a rank reads
    mesh = Mesh(world_size=4, rank=3, tp=2, dp=2, ep=2, tp_rank=1, dp_rank=1)
    sets = (*DEEPSEEK, "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=2")
    cfg = load_config(None, list(sets))
    model = build_rank_model(cfg.model, cfg.parallel, mesh, torch.device("cpu"))
    monkeypatch.setattr(init, "BLOCK", 1024)
    with _Allocations() as allocations:
        model.init_weights(SEED)
    sharded = [p for p in placements(model, mesh).values() if p.sharded_over]
    largest_global = max(torch.Size(p.global_shape).numel() for p in sharded) * 4
    assert max(allocations.sizes) <= 1024 * 4 < largest_global, (max(allocations.sizes), largest_global)
