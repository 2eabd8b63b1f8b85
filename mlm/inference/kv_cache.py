"""The paged key/value cache: fixed-size blocks drawn from one pre-allocated pool.

A sequence owns a list of block ids (its block table); token t of the sequence lives in block
`table[t // block_size]` at offset `t % block_size`. Sequences of any length share the pool
without fragmentation, and a finished or cancelled sequence gives its blocks back at once.

What a token leaves per layer is its mixer kind's `TokenCache` (`mlm.model.kinds`): for
multi-head and grouped-query attention, keys and values of G = query groups / tp heads of head_dim
each (every tp rank holds its own heads); for multi-latent attention, one tensor of one head holding
the normed latent and the roped rope key, kv_lora_rank + qk_rope_head_dim values, and no value
tensor: the latent's columns are the values (the up-projections are absorbed into the query and
the output, see `mlm.model.kinds.mla`). Every head reads that latent, so each tp rank holds all of it.
`bytes_per_token` is the figure `mlm serve` reports.

Blocks are reference-counted and full blocks are cached by their prefix (`BlockAllocator`), so
requests that share a prompt prefix share its blocks (see `scheduler`). All tp ranks use the same
blocks; rank 0's allocator hands out the block ids and sends each step's tables to the others,
whose allocators stay unused (they compute the same steps, so their cached blocks hold the same
prefixes).

Shape legend: L layers, N blocks, S block size, G this rank's key heads, K key dims, T tokens.
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from collections.abc import Iterable

import torch

from mlm.config import ModelConfig
from mlm.errors import MlmError
from mlm.model import kinds
from mlm.model.kinds.spec import TokenCache


class BlockAllocator:
    """Blocks with reference counts, and the prefix cache over them.

    A block is referenced by every running sequence whose table holds it; at 0 references it goes
    to the free queue. A full block whose keys and values are computed can be `register`ed under
    its key, (parent id, its token ids): the parent id names the whole prefix before the block (the
    id `register` gave the previous block, ROOT for the first), so a key names a prefix exactly
    (vLLM chains the parent's hash instead; an id handed out once has nothing to collide with).
    The cache is a dict over these keys: Python hashes the key (within this one process) and
    compares it in full on a match, so a hash collision costs a probe, never another prefix's
    tokens. A registered block keeps its
    key and contents in the free queue, where `match` still finds it and `take` revives it;
    `allocate` hands out the least recently freed block and evicts its key then. Unregistered
    blocks go to the front of the queue, so blocks worth keeping are evicted last. The ids are
    never reused: the children of an evicted block are keyed under an id that nobody computes
    again, so they are found no more and wait in the queue for their own eviction.
    """

    ROOT = -1
    """The parent id of a sequence's first block."""

    def __init__(self, num_blocks: int):
        assert num_blocks > 0
        self.num_blocks = num_blocks
        self.refs = [0] * num_blocks
        """References to each block (running sequences whose tables hold it)."""
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # first out first
        self._key: list[tuple | None] = [None] * num_blocks  # the key a block is registered under
        self._id = [self.ROOT] * num_blocks  # the prefix id its children are keyed by
        self._cached: dict[tuple, int] = {}  # key -> block
        self._ids = itertools.count()

    @property
    def num_free(self) -> int:
        """Blocks that `allocate` can hand out: unreferenced ones, cached or not."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Blocks that some sequence references."""
        return self.num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks registered under a key (referenced or not)."""
        return len(self._cached)

    def allocate(self, n: int) -> list[int]:
        """`n` blocks of one reference each, evicting the keys of cached ones."""
        assert n <= len(self._free), f"{n} blocks asked, {len(self._free)} free"
        blocks = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            if self._key[b] is not None:
                del self._cached[self._key[b]]
                self._key[b], self._id[b] = None, self.ROOT
            self.refs[b] = 1
            blocks.append(b)
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; a sequence's last blocks are evicted first."""
        for b in reversed(blocks):
            assert self.refs[b] > 0, f"block {b} was freed twice"
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self._free[b] = None
                if self._key[b] is None:
                    self._free.move_to_end(b, last=False)

    def match(self, parent: int, chunks: Iterable[list[int]]) -> list[int]:
        """The cached blocks holding the leading `chunks` (each a full block's token ids), the
        first chunk following prefix id `parent`; stops at the first chunk not cached."""
        blocks = []
        for tokens in chunks:
            b = self._cached.get((parent, tuple(tokens)))
            if b is None:
                break
            blocks.append(b)
            parent = self._id[b]
        return blocks

    def take(self, blocks: list[int]) -> None:
        """One more reference to each of `blocks` (cached blocks found by `match`)."""
        for b in blocks:
            if self.refs[b] == 0:
                del self._free[b]
            self.refs[b] += 1

    def num_reviving(self, blocks: list[int]) -> int:
        """How many of `blocks` are unreferenced: `take` removes them from the free queue."""
        return sum(self.refs[b] == 0 for b in blocks)

    def prefix_id(self, block: int) -> int:
        """The id `block`'s children are keyed by (ROOT if it is not registered)."""
        return self._id[block]

    def register(self, block: int, parent: int, tokens: list[int]) -> int:
        """Cache `block`, which holds the computed full block `tokens` after prefix id `parent`;
        the prefix id of its contents. When another block already holds that key, that one stays
        cached (and its id is returned) and `block` stays unregistered."""
        assert self.refs[block] > 0 and self._key[block] is None, f"block {block}: not a fresh block"
        key = (parent, tuple(tokens))
        if (other := self._cached.get(key)) is not None:
            return self._id[other]
        self._cached[key], self._key[block], self._id[block] = block, key, next(self._ids)
        return self._id[block]


def token_layers(cfg: ModelConfig) -> list[int]:
    """The layers whose mixer caches per token (attention); recurrent mixers keep a per-sequence
    state instead (`state_cache`)."""
    return [
        i
        for i, spec in enumerate(cfg.layer_specs())
        if spec.mixer is not None and isinstance(kinds.mixer(spec.mixer).cache(cfg, 1), TokenCache)
    ]


def cache_layout(cfg: ModelConfig, tp: int = 1) -> TokenCache:
    """The per-token cache layout of `cfg`'s mixers on one of `tp` ranks (their specs' `cache`),
    which the layers that cache per token share."""
    specs = cfg.layer_specs()
    layouts = []
    for i in token_layers(cfg):
        if (layout := kinds.mixer(specs[i].mixer).cache(cfg, tp)) not in layouts:
            layouts.append(layout)
    if len(layouts) > 1:
        raise MlmError(
            f"the mixers {', '.join(cfg.mixer_kinds())} cache tokens in {len(layouts)} layouts; serving "
            "keeps one paged pool of one layout (not built: a pool per layout)"
        )
    return layouts[0] if layouts else TokenCache(0, 0, description="no layer caches tokens")


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def bytes_per_token(cfg: ModelConfig, dtype: torch.dtype, tp: int = 1) -> int:
    """Cache bytes one token takes over every layer, on one of `tp` ranks: MLA (kv_lora_rank +
    qk_rope_head_dim) · layers · itemsize; otherwise 2 · (query groups / tp) · head_dim · layers · itemsize."""
    return len(token_layers(cfg)) * cache_layout(cfg, tp).per_token * _itemsize(dtype)


def describe_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype, tp: int = 1) -> str:
    """`bytes_per_token` with its factors, for `mlm serve`'s log. DeepSeek-V3 in bf16: "70272 bytes
    per token (MLA: (latent 512 + rope key 64) × 61 layers × 2 bytes)"; Llama-3-8B in bf16 at tp 2:
    "65536 bytes per token (keys and values: 2 × 4 heads × 128 dims × 32 layers × 2 bytes; 4 of
    the 8 key/value heads on each of 2 tp ranks)"."""
    n, size, L = bytes_per_token(cfg, dtype, tp), _itemsize(dtype), len(token_layers(cfg))
    layout = cache_layout(cfg, tp)
    return f"{n} bytes per token ({layout.description} × {L} layers × {size} bytes{layout.split})"


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype, tp: int = 1) -> int:
    """The cache of every layer for `block_size` tokens, on one of `tp` ranks."""
    return block_size * bytes_per_token(cfg, dtype, tp)


def blocks_for_memory(
    cfg: ModelConfig, block_size: int, dtype: torch.dtype, memory_bytes: int, tp: int = 1
) -> int:
    """Blocks that `memory_bytes` per rank hold."""
    need = bytes_per_block(cfg, block_size, dtype, tp)
    if need == 0:
        raise MlmError("no layer of this model caches tokens: blocks take no memory, give their number")
    if memory_bytes < need:
        raise MlmError(f"KV cache memory of {memory_bytes} bytes holds no block (one takes {need} bytes)")
    return memory_bytes // need


BOOKKEEPING_BYTES = 128
"""Host memory the allocator keeps per block (reference count, key, prefix id, free-queue entry)."""


def _check_fits(
    cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device, tp: int
) -> None:
    """MlmError before allocating a cache larger than the memory free on `device` (by default it
    holds max-seqs whole contexts, which a config's context length can make any size)."""
    need = num_blocks * bytes_per_block(cfg, block_size, dtype, tp)
    free = free_memory(torch.device(device))
    if free is not None and need + num_blocks * BOOKKEEPING_BYTES > free:
        raise MlmError(
            f"the KV cache of {num_blocks} blocks of {block_size} tokens takes {need / 2**30:.3g} GiB, more than "
            f"the {free / 2**30:.3g} GiB free on {device}: by default it holds --max-seqs contexts of "
            f"model.max_position_embeddings={cfg.max_position_embeddings} tokens; `mlm serve` takes "
            "--kv-memory SIZE or --kv-blocks N"
        )


def free_memory(device: torch.device) -> int | None:
    """Bytes free on `device`: CUDA's own count, or the host's MemAvailable; None where unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            line = next(line for line in f if line.startswith("MemAvailable:"))
        return int(line.split()[1]) * 1024
    except (OSError, StopIteration, ValueError):
        return None


def blocks_needed(tokens: int, block_size: int) -> int:
    return math.ceil(tokens / block_size)


class PagedKVCache:
    """Per layer that caches tokens (`layer_index`), keys and values [N, S, G, K] in one tensor
    each, allocated once (`layout`: G the query groups of one of `tp` ranks, K the head dim); for
    MLA keys [N, S, 1, latent + rope] and no values (`v_LNSGK` None)."""

    def __init__(
        self,
        cfg: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        tp: int = 1,
        scratch: bool = False,
    ):
        self.block_size = block_size
        _check_fits(cfg, num_blocks + int(scratch), block_size, dtype, device, tp)
        self.allocator = BlockAllocator(num_blocks)
        self.scratch_block = num_blocks if scratch else None
        """With `scratch`, one more block that the allocator never hands out: where padding rows
        of a fixed-shape step (`decode_graphs`) write."""
        self.layout = layout = cache_layout(cfg, tp)
        self.layer_index = {layer: i for i, layer in enumerate(token_layers(cfg))}
        """Layer number → its index in the pools (the layers that cache per token)."""
        self.bytes_per_token = bytes_per_token(cfg, dtype, tp)
        self.description = describe_bytes_per_token(cfg, dtype, tp)
        shape = (len(self.layer_index), num_blocks + int(scratch), block_size, layout.heads, layout.key_dim)
        self.k_LNSGK = torch.zeros(shape, dtype=dtype, device=device)
        self.v_LNSGK = None if layout.values_in_keys else torch.zeros(shape, dtype=dtype, device=device)

    def summary(self) -> str:
        """One line for `mlm serve`'s log: blocks, bytes on this rank, bytes per token."""
        total = self.k_LNSGK.nbytes + (0 if self.v_LNSGK is None else self.v_LNSGK.nbytes)
        n, S = self.allocator.num_blocks, self.block_size
        extra = " (and 1 scratch block)" if self.scratch_block is not None else ""
        return (
            f"KV cache: {n} blocks of {S} tokens{extra}, {total / 2**20:.2f} MiB per rank; {self.description}"
        )

    def slots(self, table: list[int], start: int, n: int) -> list[int]:
        """Flat slot index (block · S + offset) of tokens start .. start + n - 1 of a sequence."""
        S = self.block_size
        return [table[t // S] * S + t % S for t in range(start, start + n)]

    def write(
        self, layer: int, slots_T: torch.Tensor, k_TGK: torch.Tensor, v_TGK: torch.Tensor | None
    ) -> None:
        """Store the keys (and values, unless the layout keeps them in the keys) of T tokens."""
        assert (v_TGK is None) == (self.v_LNSGK is None), "values given to a latent cache, or missing"
        self.k_LNSGK[layer].view(-1, *k_TGK.shape[1:]).index_copy_(0, slots_T, k_TGK)
        if v_TGK is not None:
            self.v_LNSGK[layer].view(-1, *v_TGK.shape[1:]).index_copy_(0, slots_T, v_TGK)

    def read(self, layer: int, blocks: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Keys and values [length, G, K] of the first `length` tokens of a sequence whose first
        blocks (at least ⌈length / S⌉ of them) are `blocks`, a tensor of block ids; values None
        when they are the keys' first columns."""
        k = self.k_LNSGK[layer].index_select(0, blocks).flatten(0, 1)[:length]
        if self.v_LNSGK is None:
            return k, None
        v = self.v_LNSGK[layer].index_select(0, blocks).flatten(0, 1)[:length]
        return k, v
