"""Attention over the paged KV cache for one engine step: what the model's attention layers see
as `cache` (`attend`) while `ModelRunner` runs a packed step.

Every layer first writes the step's keys and values to their cache slots, then attends:
- **Decoding sequences** (one new token each) run as one batch, or two when their lengths differ
  enough (`width_groups`): one gather of the group's cached blocks from the layer's pool and one
  `scaled_dot_product_attention` per layer for all of them. The block tables are padded to the
  group's longest (with a block the sequence owns) and turned into a [B, 1, 1, L] additive
  length mask once per step, not per layer. Grouped-query heads ride in the query
  dimension: the R = H / G query heads of a key head are R queries against that one head, so no
  key or value is repeated; multi-latent attention is the case G = 1.
- **Prompts** (several new tokens) run per sequence. A whole prompt (start 0) attends causally
  over its own fresh keys and values without reading the cache back; a later part of a prompt
  (a chunk after the first, or the rest after a prefix-cache hit) reads its blocks and masks
  query i to keys up to start + i. One call per prompt is where per-sequence wins: a padded
  batch of prompts would compute the padding.

Where a decoding sequence's numbers could depend on its batch: the padded key length changes the
reduction's blocking inside the attention kernel, so outputs agree with the sequence run alone
to rounding (fp32: ~1e-7 relative), not bit for bit; greedy tokens are the same in the tests.

Shape legend: T packed tokens, n a segment's tokens, B decoding sequences, L keys (padded), N
blocks, S block size, H query heads, G key heads, R = H / G, K key dims, E value dims.
"""

from __future__ import annotations

import contextlib
from itertools import accumulate

import torch
import torch.nn.functional as F

from mlm.inference.kv_cache import PagedKVCache, blocks_needed
from mlm.inference.state_cache import StatePool, StateView


class PagedAttention:
    """The KV cache as the model's attention layers see it during one step of `segments`
    (`model_runner.Segment`s packed in order into T tokens, whose cache slots are `slots_T`)."""

    def __init__(self, cache: PagedKVCache, segments, slots_T: torch.Tensor, states: StatePool | None = None):
        self.cache, self.slots_T, self.states = cache, slots_T, states
        dev, S = slots_T.device, cache.block_size
        rows, tables, lengths = [], [], []
        self.prompts: list[tuple[int, int, int, torch.Tensor | None]] = []  # (offset, n, start, blocks)
        offset = 0
        for c in segments:
            n, length = len(c.tokens), c.start + len(c.tokens)
            table = c.blocks[: blocks_needed(length, S)]
            if n == 1:
                rows.append(offset)
                tables.append(table)
                lengths.append(length)
            else:
                blocks = torch.tensor(table, device=dev) if c.start else None
                self.prompts.append((offset, n, c.start, blocks))
            offset += n
        self.T = offset
        if states is not None and states.layers:  # the segments' state slots, for `state`
            self._state_args = (
                [
                    (o - len(c.tokens), len(c.tokens))
                    for c, o in zip(segments, accumulate(len(c.tokens) for c in segments), strict=True)
                ],
                torch.tensor([c.slot for c in segments], device=dev),
                torch.tensor([c.start == 0 for c in segments], device=dev),
            )
        self.decode_rows = None
        self.groups: list[tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]] = []
        if rows:
            block_bytes = cache.bytes_per_token // max(1, len(cache.k_LNSGK)) * S  # a layer's keys and values
            for group in width_groups([len(t) for t in tables], block_bytes):
                sel = None if len(group) == len(rows) else torch.tensor(group, device=dev)
                gt, gl = [tables[i] for i in group], [lengths[i] for i in group]
                self.groups.append((sel, *_padded(gt, gl, S, cache.k_LNSGK.dtype, dev)))
            contiguous = rows == list(range(len(rows)))
            self.decode_rows = slice(0, len(rows)) if contiguous else torch.tensor(rows, device=dev)

    @classmethod
    def decoding(cls, cache: PagedKVCache, slots_B, tables_BN, mask_B11L) -> PagedAttention:
        """A step of B decoding sequences given as tensors (`decode_graphs`' static buffers):
        their cache slots, their block tables padded to N blocks (flattened) and the length mask."""
        step = cls.__new__(cls)
        step.cache, step.slots_T, step.T, step.prompts, step.states = cache, slots_B, len(slots_B), [], None
        step.decode_rows, step.groups = slice(0, len(slots_B)), [(None, tables_BN, mask_B11L)]
        return step

    def attend(self, layer: int, q_1THK, k_1TGK, v_1TGK, scale=None, value_dim=None) -> torch.Tensor:
        """[1, T, H, E] attention output of the packed step at layer `layer` (E = K, the head dim).
        With `v_1TGK` None (MLA's latent cache: one key head [latent ; rope key], see
        `mlm.model.kinds.mla`) only the keys are stored and the values are the first `value_dim` columns
        of the keys (E = value_dim). `scale`: the softmax scale; None: K^-½."""
        assert (v_1TGK is None) == (value_dim is not None), "value_dim goes with values kept in the keys"
        layer = self.cache.layer_index[layer]
        q_THK, k_TGK = q_1THK[0], k_1TGK[0]
        v_TGE = None if v_1TGK is None else v_1TGK[0]
        self.cache.write(layer, self.slots_T, k_TGK, v_TGE)
        if v_TGE is None:
            v_TGE = k_TGK[..., :value_dim]
        if not self.prompts:  # decoding only (most steps): the batch is the step
            return self._decode(layer, q_THK, scale, value_dim)[None]
        out_THE = q_THK.new_empty(self.T, q_THK.shape[1], v_TGE.shape[-1])
        if self.decode_rows is not None:
            out_THE[self.decode_rows] = self._decode(layer, q_THK[self.decode_rows], scale, value_dim)

        def prompts(short: bool) -> None:
            for offset, n, start, blocks in self.prompts:
                if (n * (start + n) <= ONE_THREAD_SCORES) == short:
                    part = slice(offset, offset + n)
                    out_THE[part] = self._prompt(
                        layer, q_THK[part], k_TGK[part], v_TGE[part], start, blocks, scale, value_dim
                    )

        with _one_thread(q_THK.device):
            prompts(short=True)
        prompts(short=False)
        return out_THE[None]

    def state(self, layer: int) -> StateView:
        """Layer `layer`'s per-sequence states for this step (a recurrent mixer's, `state_cache`)."""
        return StateView(self.states.tensors[layer], *self._state_args)

    def _decode(self, layer: int, q_BHK, scale, value_dim) -> torch.Tensor:
        """One query per decoding sequence over its cached keys and values: [B, H, E]."""
        if len(self.groups) == 1:
            return self._attend_cached(layer, q_BHK, *self.groups[0][1:], scale, value_dim)
        B, H, K = q_BHK.shape
        out_BHE = q_BHK.new_empty(B, H, value_dim or K)
        for sel, tables_BN, mask_B11L in self.groups:
            out_BHE[sel] = self._attend_cached(layer, q_BHK[sel], tables_BN, mask_B11L, scale, value_dim)
        return out_BHE

    def _attend_cached(self, layer: int, q_BHK, tables_BN, mask_B11L, scale, value_dim) -> torch.Tensor:
        """Decoding sequences whose block tables (padded, flattened) are `tables_BN`: [B, H, E]."""
        B, H, K = q_BHK.shape
        pool_NSGK = self.cache.k_LNSGK[layer]
        G = pool_NSGK.shape[2]
        k_BLGK = pool_NSGK.index_select(0, tables_BN).view(B, -1, G, K)
        if value_dim is None:
            v_BLGE = self.cache.v_LNSGK[layer].index_select(0, tables_BN).view(B, -1, G, K)
        else:
            v_BLGE = k_BLGK[..., :value_dim]
        q_BGRK = q_BHK.view(B, G, H // G, K)
        o_BGRE = F.scaled_dot_product_attention(
            q_BGRK, k_BLGK.transpose(1, 2), v_BLGE.transpose(1, 2), attn_mask=mask_B11L, scale=scale
        )
        return o_BGRE.reshape(B, H, -1)

    def _prompt(self, layer, q_nHK, k_nGK, v_nGE, start, blocks, scale, value_dim) -> torch.Tensor:
        """Attention of one sequence's n new queries: [n, H, E]. From the start: causal over its own
        new keys and values; later: over its cached ones, query i seeing keys up to start + i."""
        n = q_nHK.shape[0]
        if start == 0:
            mask_nL = None
            k_LGK, v_LGE = k_nGK, v_nGE
        else:
            length = start + n
            k_LGK, v_LGE = self.cache.read(layer, blocks, length)
            if v_LGE is None:
                v_LGE = k_LGK[..., :value_dim]
            dev = q_nHK.device
            mask_nL = (
                torch.arange(length, device=dev)[None, :] <= start + torch.arange(n, device=dev)[:, None]
            )
        o_1HnE = F.scaled_dot_product_attention(
            q_nHK.transpose(0, 1)[None],
            k_LGK.transpose(0, 1)[None],
            v_LGE.transpose(0, 1)[None],
            attn_mask=mask_nL,
            is_causal=mask_nL is None,
            scale=scale,
            enable_gqa=q_nHK.shape[1] != k_LGK.shape[1],
        )
        return o_1HnE[0].transpose(0, 1)


GROUP_BYTES = 1 << 20
"""What one more group of decoding sequences costs per layer (its gather and attention calls, its
rows picked out and put back, its tables and mask made once per step), in bytes of keys and
values gathered: about 60 µs, as 1 MiB of gathering in a 16-sequence step of SmolLM2-135M's
shape (3 key heads of 64; 24 KiB per block of 16 tokens) on a 2-core Xeon."""


def width_groups(widths: list[int], block_bytes: int) -> list[list[int]]:
    """The decoding sequences (indices into `widths`, their block-table lengths) split into one or
    two groups by width, whichever gathers less, a second group counting as `GROUP_BYTES`
    (`block_bytes`: one block's keys and values in one layer). Each group is padded to its own
    longest, not the batch's: a 2,000-token sequence among short ones no longer pads every short
    one to 2,000."""
    B = len(widths)
    if (B * max(widths) - sum(widths)) * block_bytes <= GROUP_BYTES:  # less padding than a group costs
        return [list(range(B))]
    order = sorted(range(B), key=widths.__getitem__)
    w = [widths[i] for i in order]
    best, split = B * w[-1], B  # one group, in blocks
    for s in range(1, B):  # the s narrowest, then the rest
        cost = GROUP_BYTES / block_bytes + s * w[s - 1] + (B - s) * w[-1]
        if cost < best:
            best, split = cost, s
    if split == B:
        return [list(range(B))]
    return [sorted(order[:split]), sorted(order[split:])]


def _padded(tables: list[list[int]], lengths: list[int], S: int, dtype, dev):
    """Block tables padded to the longest (with a block each sequence owns) and flattened [B·N],
    and the additive length mask [B, 1, 1, N·S] (0 / -inf in the cache's dtype: SDPA would
    convert a boolean one at every layer)."""
    width = max(len(t) for t in tables)
    tables_BN = torch.tensor([t + [t[0]] * (width - len(t)) for t in tables], device=dev).flatten()
    past_BL = torch.arange(width * S, device=dev)[None, :] >= torch.tensor(lengths, device=dev)[:, None]
    mask_BL = torch.zeros(past_BL.shape, dtype=dtype, device=dev)
    return tables_BN, mask_BL.masked_fill_(past_BL, float("-inf"))[:, None, None]


ONE_THREAD_SCORES = 128 * 128
"""On the CPU, a prompt with at most this many attention scores per head (new queries × keys)
runs its attention on one intra-op thread (`_one_thread`); a longer one keeps all threads."""


@contextlib.contextmanager
def _one_thread(device: torch.device):
    """On the CPU, short prompts' attention runs on one intra-op thread: their ops are too small
    to split (SDPA of 1 query over 40 keys, measured on 2 loaded cores: 15 µs on one thread,
    800 µs on two). Long prompts keep every thread: causal SDPA over 2,000 tokens (9 query heads,
    3 key heads, head dim 64) took 75 ms on one thread and 45 ms on two on the same machine
    unloaded. Splitting runs over heads and queries, never a reduction, so the numbers are the
    same."""
    if device.type != "cpu":
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
