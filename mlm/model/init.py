"""Megatron's initialisation, drawn per shard: every rank materialises only its own slices, and
the global weights are the same under every layout (tp, pp, vpp, dp, cp, ep) as in one process.

    init_parameters(model, seed, cfg, vocab_rows=("embed.weight", "output.weight"))
    draw_normal(out, global_shape, offset, std, seed, name)   # one slice of one tensor

Megatron's rule: normal(0, init_std); a module that declares `init_values` (`mlm.model.contract`)
draws the parameters it names its own way (Mamba's A_log, D, dt_bias, convolutions); output projections (the linears a module declares in its
`residual_projections`, `mlm.model.contract`: attention's out, the MLP's down) init_std /
√(2 · layers); norm weights 1, biases 0. The vocabulary's padding rows
(beyond `cfg.vocab_size`; their number depends on tp) are zeros drawn from no stream, unless
`model.train_padded_vocab` (Megatron's loss), where they are drawn like every row.

How a slice is drawn: a parameter's global tensor, seen as rows × columns (dim 0 × the other
dims flattened), is cut into blocks that depend only on its global shape (the vocabulary's: on
its unpadded rows, so every tp's padding draws the same values): runs of `BLOCK // columns`
whole rows (at most all of them), and rows longer than BLOCK in pieces of BLOCK columns. Block b
is drawn whole from its own generator, seeded by crc32("seed:name:b").
A rank draws only the blocks that meet its slice, one at a time in fp32, and copies (casting to
the parameter's dtype) the part it holds: the memory is its parameters plus one block (4 MiB).
A slice along dim 0 (column-parallel and vocabulary-parallel weights, experts over ep) draws
only its own rows; a slice along dim 1 (row-parallel weights) draws
every block of its rows and keeps its columns, tp times the draws of its own elements (a
llama3-405b layer at tp 8 draws 3.5 times its rank's parameters). Blocks are drawn on the CPU
whatever the parameter's device, so every device starts from the same weights.

torch's CPU generator keeps 32 bits of its seed, so among the n ≈ 4 × 10⁵ blocks of a 405B model
about n² / 2³³ ≈ 19 pairs share a stream: a repeated run of 1M values, harmless for breaking
symmetry.
"""

from __future__ import annotations

import math
import zlib

import torch
from torch import nn

from mlm.config import ModelConfig
from mlm.model.contract import declaring, submodule

BLOCK = 1 << 20
"""Values per block (4 MiB in fp32), whatever the layout."""


@torch.no_grad()
def draw_normal(
    out: torch.Tensor,
    global_shape: tuple[int, ...],
    offset: tuple[int, ...],
    std: float,
    seed: int,
    name: str,
    rows: int | None = None,
) -> None:
    """Fill `out`, the slice at `offset` of a tensor of `global_shape`, with its values of
    normal(0, `std`) drawn block by block for (`seed`, `name`); global rows from `rows` on are
    zero (the vocabulary's padding). A slice of three or more dims must hold whole trailing dims."""
    assert len(global_shape) == len(offset) == out.ndim >= 1, (global_shape, offset, out.shape)
    columns = math.prod(global_shape[1:])
    real_rows = global_shape[0] if rows is None else rows
    width = min(columns, BLOCK)  # block: `height` rows × `width` columns
    height = max(1, min(BLOCK // columns, real_rows))
    pieces = -(-columns // width)  # blocks across a row
    if out.ndim == 2:
        out2, c0 = out, offset[1]
    else:
        assert out.shape[1:] == global_shape[1:], f"{name}: {tuple(out.shape)} of {global_shape}"
        out2, c0 = out.view(out.shape[0], -1), 0
    r0, c1 = offset[0], c0 + out2.shape[1]
    r1 = max(r0, min(r0 + out2.shape[0], real_rows))
    out2[r1 - r0 :].zero_()
    if r1 == r0:  # all padding
        return
    block = torch.empty(height * width, dtype=torch.float32)
    for i in range(r0 // height, -(-r1 // height)):
        for j in range(c0 // width, -(-c1 // width)):
            b0, w = j * width, min(width, columns - j * width)  # the block's first column, width
            gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}:{i * pieces + j}".encode()))
            drawn = block[: height * w].view(height, w).normal_(0.0, std, generator=gen)
            lo, hi = max(r0, i * height), min(r1, (i + 1) * height)
            left, right = max(c0, b0), min(c1, b0 + w)
            out2[lo - r0 : hi - r0, left - c0 : right - c0].copy_(
                drawn[lo - i * height : hi - i * height, left - b0 : right - b0]
            )


@torch.no_grad()
def init_parameters(model: nn.Module, seed: int, cfg: ModelConfig, vocab_rows: tuple[str, ...] = ()) -> None:
    """Megatron's init of every parameter of `model`, each rank its own slices: a parameter its
    module describes in `placements` (the parallel layers, experts over ep) is that slice of its
    global tensor, any other is whole. `vocab_rows`: parameters whose rows beyond
    `cfg.vocab_size` are padding."""
    std = cfg.init_std
    out_std = std / math.sqrt(2.0 * cfg.num_layers)
    scaled = {  # the weights that project into the residual stream (Megatron's scaled init)
        id(child.weight)
        for _, module, paths in declaring(model, "residual_projections")
        for path in paths
        if (child := submodule(module, path)) is not None
    }
    for module_name, module in model.named_modules():
        described = getattr(module, "placements", {})
        own = getattr(module, "init_values", None)
        for local, p in module.named_parameters(recurse=False):  # p: an FSDP shard once sharded
            name = f"{module_name}.{local}" if module_name else local
            place = described.get(local)
            assert place is None or tuple(p.shape) == place.shape, f"{name}: {tuple(p.shape)}, {place}"
            shape, offset = (place.global_shape, place.offset) if place else (tuple(p.shape), (0,) * p.ndim)
            out, row0 = p, 0
            if hasattr(p, "to_local"):  # an FSDP shard: its rows of this rank's slice
                from mlm.parallel.fsdp import first_row

                out, row0 = p.to_local(), first_row(p)
            offset = (offset[0] + row0, *offset[1:])
            whole = own(local, shape, seed, name) if own is not None else None
            if whole is not None:  # the module's own rule, drawn whole (small per-head tensors)
                index = tuple(slice(o, o + n) for o, n in zip(offset, out.shape, strict=True))
                out.copy_(whole[index])
                continue
            if p.ndim == 1 and name.endswith(("norm.weight", "bias")):  # norm weights and biases
                p.fill_(1.0 if name.endswith("norm.weight") else 0.0)
                continue
            if out.numel() == 0:
                continue
            s = out_std if id(p) in scaled else std
            rows = cfg.vocab_size if name in vocab_rows else None
            draw_normal(out, shape, offset, s, seed, name, rows)
