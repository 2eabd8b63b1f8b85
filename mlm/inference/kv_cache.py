"""The paged key/value cache: fixed-size blocks drawn from one pre-allocated pool.

A sequence owns a list of block ids (its block table); token t of the sequence lives in block
`table[t // block_size]` at offset `t % block_size`. Sequences of any length share the pool
without fragmentation, and a finished or cancelled sequence gives its blocks back at once.

Under tensor parallelism every tp rank holds the keys and values of its own heads (G = query
groups / tp) in a pool of the same blocks; rank 0's allocator hands out the block ids and sends
each step's tables to the others, whose allocators stay unused.

Shape legend: L layers, N blocks, S block size, G this rank's key/value heads, K head dim, T tokens.
"""

from __future__ import annotations

import math

import torch

from mlm.config import ModelConfig
from mlm.errors import MlmError


class BlockAllocator:
    """Free list of block ids; `allocate` hands out ids, `free` takes them back."""

    def __init__(self, num_blocks: int):
        assert num_blocks > 0
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ...

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int]:
        assert n <= len(self._free), f"{n} blocks asked, {len(self._free)} free"
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))
        assert len(self._free) <= self.num_blocks, "a block was freed twice"


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype, tp: int = 1) -> int:
    """Keys and values of every layer for `block_size` tokens, on one of `tp` ranks."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * (cfg.query_groups // tp) * cfg.head_dim * itemsize


def blocks_for_memory(
    cfg: ModelConfig, block_size: int, dtype: torch.dtype, memory_bytes: int, tp: int = 1
) -> int:
    """Blocks that `memory_bytes` per rank hold."""
    need = bytes_per_block(cfg, block_size, dtype, tp)
    if memory_bytes < need:
        raise MlmError(f"KV cache memory of {memory_bytes} bytes holds no block (one takes {need} bytes)")
    return memory_bytes // need


def blocks_needed(tokens: int, block_size: int) -> int:
    return math.ceil(tokens / block_size)


class PagedKVCache:
    """Per layer, keys and values [N, S, G, K] in one tensor each, allocated once (G: the
    query groups of one of `tp` ranks)."""

    def __init__(
        self,
        cfg: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        tp: int = 1,
    ):
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        shape = (cfg.num_layers, num_blocks, block_size, cfg.query_groups // tp, cfg.head_dim)
        self.k_LNSGK = torch.zeros(shape, dtype=dtype, device=device)
        self.v_LNSGK = torch.zeros(shape, dtype=dtype, device=device)

    def slots(self, table: list[int], start: int, n: int) -> list[int]:
        """Flat slot index (block · S + offset) of tokens start .. start + n - 1 of a sequence."""
        S = self.block_size
        return [table[t // S] * S + t % S for t in range(start, start + n)]

    def write(self, layer: int, slots_T: torch.Tensor, k_TGK: torch.Tensor, v_TGK: torch.Tensor) -> None:
        self.k_LNSGK[layer].view(-1, *k_TGK.shape[1:])[slots_T] = k_TGK
        self.v_LNSGK[layer].view(-1, *v_TGK.shape[1:])[slots_T] = v_TGK

    def read(self, layer: int, blocks: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [length, G, K] of the first `length` tokens of a sequence whose first
        blocks (at least ⌈length / S⌉ of them) are `blocks`, a tensor of block ids."""
        k = self.k_LNSGK[layer].index_select(0, blocks).flatten(0, 1)[:length]
        v = self.v_LNSGK[layer].index_select(0, blocks).flatten(0, 1)[:length]
        return k, v
