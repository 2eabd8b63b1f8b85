"""Attention over the paged KV cache (mlm.inference.paged_attention) against plain causal attention
over each sequence's whole keys and values, computed here without the cache: decoding sequences
batched in one call (block tables of different lengths, padded and masked), whole prompts, later
chunks of prompts, steps that mix them in any order, grouped-query heads and MLA's latent cache
(values = the keys' first columns). fp32; tolerance 1e-5 absolute on outputs of size ~1 (the
padded reduction only changes rounding).
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from mlm.config import MLAConfig, ModelConfig
from mlm.inference.kv_cache import PagedKVCache, blocks_needed
from mlm.inference.model_runner import Segment
from mlm.inference.paged_attention import PagedAttention

S = 4  # block size: small, so that tables have many blocks and partial last blocks


def reference(q_nHK, k_LGK, v_LGE, start: int, scale: float) -> torch.Tensor:
    """Query i (at position start + i) over keys 0 .. start + i, heads repeated per group."""
    n, H, _ = q_nHK.shape
    L, G, _ = k_LGK.shape
    k_HLK = k_LGK.repeat_interleave(H // G, dim=1).transpose(0, 1)
    v_HLE = v_LGE.repeat_interleave(H // G, dim=1).transpose(0, 1)
    mask_nL = torch.arange(L)[None, :] <= start + torch.arange(n)[:, None]
    o_HnE = F.scaled_dot_product_attention(
        q_nHK.transpose(0, 1), k_HLK, v_HLE, attn_mask=mask_nL, scale=scale
    )
    return o_HnE.transpose(0, 1)


@pytest.mark.parametrize("kind", ["gqa", "mla"])
@pytest.mark.parametrize("order", ["decode_first", "prompts_first", "interleaved"])
def test_batched_paged_attention_equals_each_sequence_alone(kind, order):
    torch.manual_seed(0)
    rng = random.Random(0)
    if kind == "gqa":  # 6 query heads over 2 key heads, head dim 8
        cfg = ModelConfig(num_layers=2, hidden_size=48, num_attention_heads=6, num_query_groups=2)
        H, G, K, E, value_dim = 6, 2, 8, 8, None
    else:  # MLA: one key head [latent 12 ; rope key 4], values the latent's 12 columns
        mla = MLAConfig(kv_lora_rank=12, qk_rope_head_dim=4)
        cfg = ModelConfig(num_layers=2, hidden_size=48, num_attention_heads=6, attention_kind="mla", mla=mla)
        H, G, K, E, value_dim = 6, 1, 16, 12, 12
    cache = PagedKVCache(cfg, num_blocks=64, block_size=S, dtype=torch.float32, device=torch.device("cpu"))
    # (cached length before the step, new tokens): decodes of several lengths, a whole prompt,
    # a later chunk of a prompt, and a one-token prompt (which decodes from an empty cache)
    work = [(9, 1), (0, 7), (2, 1), (13, 1), (6, 5), (0, 1), (4, 1)]
    if order == "prompts_first":
        work.sort(key=lambda w: -w[1])
    elif order == "decode_first":
        work.sort(key=lambda w: w[1])
    free = list(range(64))
    rng.shuffle(free)  # blocks scattered over the pool
    scale = 0.3
    seqs = []
    for start, n in work:
        length = start + n
        blocks = [free.pop() for _ in range(blocks_needed(length, S) + 1)]  # one spare, unused
        k_LGK, v_LGE = torch.randn(length, G, K), torch.randn(length, G, K)
        seqs.append((start, n, blocks, k_LGK, v_LGE, torch.randn(n, H, K)))
    for layer in range(2):
        for start, _, blocks, k_LGK, v_LGE, _ in seqs:  # what earlier steps cached
            if start:
                slots = torch.tensor(cache.slots(blocks, 0, start))
                cache.write(layer, slots, k_LGK[:start], None if value_dim else v_LGE[:start])
    segments = [Segment([1] * n, start, blocks) for start, n, blocks, *_ in seqs]
    slots_T = torch.tensor([s for c in segments for s in cache.slots(c.blocks, c.start, len(c.tokens))])
    step = PagedAttention(cache, segments, slots_T)
    q_1THK = torch.cat([q for *_, q in seqs])[None]
    k_1TGK = torch.cat([k[start:] for start, _, _, k, _, _ in seqs])[None]
    v_1TGK = None if value_dim else torch.cat([v[start:] for start, _, _, _, v, _ in seqs])[None]
    for layer in range(2):
        got = step.attend(layer, q_1THK, k_1TGK, v_1TGK, scale=scale, value_dim=value_dim)[0]
        assert got.shape == (len(slots_T), H, E)
        offset = 0
        for start, n, _, k_LGK, v_LGE, q_nHK in seqs:
            v = k_LGK[..., :value_dim] if value_dim else v_LGE
            want = reference(q_nHK, k_LGK, v, start, scale)
            torch.testing.assert_close(got[offset : offset + n], want, rtol=0, atol=1e-5)
            offset += n
