"""The tensor layouts foreign checkpoints use where mlm keeps tensors apart, one home for each:
q/k/v fused per KV group (Megatron's `linear_qkv`, torchtitan's `wqkv`), RoPE's adjacent-pair
order (torchtitan, Meta's Llama: dims (0, 1), (2, 3), … rotate together; mlm, as Hugging Face and
Megatron, rotates halves: dims (i, i + K/2)), and tensor-parallel pieces. Every function is exact
(a reshape, a cut, a concatenation), so an import followed by an export gives the same bits.
"""

from __future__ import annotations

import torch


def split_grouped(w: torch.Tensor, sizes: list[int], groups: int) -> tuple[torch.Tensor, ...]:
    """Rows fused per group → the pieces: each of the `groups` groups holds its share of every
    piece in turn (q/k/v: [G·(H/G + 2)·K, …] with `sizes` [H·K, G·K, G·K] → q, k, v: per group its
    H/G query heads, then its key head, then its value head)."""
    rest = w.shape[1:]
    parts = w.reshape(groups, -1, *rest).split([n // groups for n in sizes], dim=1)
    return tuple(t.reshape(-1, *rest).contiguous() for t in parts)


def fuse_grouped(parts: list[torch.Tensor], groups: int) -> torch.Tensor:
    """The inverse of `split_grouped`."""
    rest = parts[0].shape[1:]
    return torch.cat([t.reshape(groups, -1, *rest) for t in parts], dim=1).reshape(-1, *rest)


def rope_pairs_to_halves(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a q or k projection from adjacent-pair RoPE order to rotate-half order, per head."""
    return (
        t.view(heads, t.shape[0] // heads // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape).contiguous()
    )


def tp_shard(t: torch.Tensor, dim: int, tp: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s piece of `t` cut in `tp` along `dim` (0: column-parallel, 1: row-parallel)."""
    return t.chunk(tp, dim)[rank].contiguous()


def tp_join(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The inverse of `tp_shard` over every rank's piece."""
    return torch.cat(parts, dim)


def tp_shard_pair(a: torch.Tensor, b: torch.Tensor, dim: int, tp: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s piece of the fused pair [a; b] along `dim`: [a_rank; b_rank]."""
    return torch.cat([a.chunk(tp, dim)[rank], b.chunk(tp, dim)[rank]], dim)


def tp_join_pair(parts: list[torch.Tensor], dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `tp_shard_pair`: every rank's [a_r; b_r] → (a, b)."""
    halves = [p.chunk(2, dim) for p in parts]
    return torch.cat([h[0] for h in halves], dim), torch.cat([h[1] for h in halves], dim)
