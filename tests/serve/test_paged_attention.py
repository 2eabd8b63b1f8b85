"""Attention over the paged KV cache (mlm.inference.paged_attention) against plain causal attention
over each sequence's whole keys and values, computed here without the cache: decoding sequences
batched in one call (block tables of different lengths, padded and masked), whole prompts, later
chunks of prompts, steps that mix them in any order, grouped-query heads and MLA's latent cache
(values = the keys' first columns). fp32; tolerance 1e-5 absolute on outputs of size ~1 (the
padded reduction only changes rounding). And the fixed-shape decode step of CUDA graphs
(mlm.inference.decode_graphs) against the eager runner, on the CPU without capture.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from mlm.config import MLAConfig, ModelConfig
from mlm.errors import MlmError
from mlm.inference import paged_attention
from mlm.inference.decode_graphs import DecodeGraphs
from mlm.inference.engine import EngineConfig, build_runner
from mlm.inference.kv_cache import PagedKVCache, blocks_needed
from mlm.inference.model_runner import ModelRunner, Segment
from mlm.inference.paged_attention import PagedAttention, width_groups
from mlm.model.gpt import GPT

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
@pytest.mark.parametrize("long", [False, True])
def test_batched_paged_attention_equals_each_sequence_alone(kind, order, long, monkeypatch):
    """long: one decoding sequence of 151 tokens among short ones, so that the decoding sequences
    run as two groups, each padded to its own longest (`width_groups`; a group costs as much as
    gathering 4 KiB here, where a block is a few hundred bytes)."""
    monkeypatch.setattr(paged_attention, "GROUP_BYTES", 4096)
    torch.manual_seed(0)
    rng = random.Random(0)
    if kind == "gqa":  # 6 query heads over 2 key heads, head dim 8
        cfg = ModelConfig(num_layers=2, hidden_size=48, num_attention_heads=6, num_query_groups=2)
        H, G, K, E, value_dim = 6, 2, 8, 8, None
    else:  # MLA: one key head [latent 12 ; rope key 4], values the latent's 12 columns
        mla = MLAConfig(kv_lora_rank=12, qk_rope_head_dim=4)
        cfg = ModelConfig(num_layers=2, hidden_size=48, num_attention_heads=6, attention_kind="mla", mla=mla)
        H, G, K, E, value_dim = 6, 1, 16, 12, 12
    num_blocks = 128
    cache = PagedKVCache(cfg, num_blocks, block_size=S, dtype=torch.float32, device=torch.device("cpu"))
    # (cached length before the step, new tokens): decodes of several lengths, a whole prompt,
    # a later chunk of a prompt, and a one-token prompt (which decodes from an empty cache)
    work = [(9, 1), (0, 7), (2, 1), (13, 1), (6, 5), (0, 1), (4, 1)] + [(150, 1)] * long
    if order == "prompts_first":
        work.sort(key=lambda w: -w[1])
    elif order == "decode_first":
        work.sort(key=lambda w: w[1])
    free = list(range(num_blocks))
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
    assert len(step.groups) == 1 + long
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


def test_decode_graphs_static_path_equals_the_eager_runner():
    """The fixed-shape decode step that CUDA graphs capture (`decode_graphs`), run on the CPU
    without capture: 5 sequences padded to a bucket of 8 and to power-of-two table widths give the
    eager runner's logits (1e-5) and leave the same keys and values in every real block; the
    padding rows write only the scratch block. Capture and replay themselves need CUDA."""
    torch.manual_seed(0)
    cfg = ModelConfig(
        num_layers=2, hidden_size=48, num_attention_heads=6, num_query_groups=2, vocab_size=97,
        max_position_embeddings=64, ffn_hidden_size=96, normalization="rmsnorm", activation="swiglu",
    )  # fmt: skip
    model = GPT(cfg).eval()
    cpu = torch.device("cpu")
    eager = ModelRunner(model, PagedKVCache(cfg, 40, S, torch.float32, cpu))
    cache = PagedKVCache(cfg, 40, S, torch.float32, cpu, scratch=True)
    graphs = DecodeGraphs(model, cache, max_seqs=8, capture=False)
    static = ModelRunner(model, cache, graphs=graphs)
    lengths = [3, 9, 4, 13, 6]
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(5)]
    prompts = [
        Segment([(7 * i + j) % 97 for j in range(n)], 0, t)
        for i, (n, t) in enumerate(zip(lengths, tables, strict=True))
    ]
    assert not graphs.takes(prompts)
    for runner in (eager, static):
        runner.forward(prompts)
    for k in range(8):  # crosses block boundaries: tables of 1 to 6 blocks, widths 2, 4 and 8
        step = [
            Segment([(5 * i + k) % 97], n + k, t)
            for i, (n, t) in enumerate(zip(lengths, tables, strict=True))
        ]
        assert graphs.takes(step)
        torch.testing.assert_close(static.forward(step), eager.forward(step), rtol=0, atol=1e-5)
    assert {key[0] for key in graphs.buckets} == {8} and {key[1] for key in graphs.buckets} == {4, 8}
    torch.testing.assert_close(cache.k_LNSGK[:, :40], eager.cache.k_LNSGK, rtol=0, atol=1e-6)
    torch.testing.assert_close(cache.v_LNSGK[:, :40], eager.cache.v_LNSGK, rtol=0, atol=1e-6)
    assert cache.k_LNSGK[:, 40].abs().sum() > 0  # the padding rows wrote there


def test_cuda_graphs_are_refused_off_cuda():
    cfg = ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=31)
    with pytest.raises(MlmError, match="--cuda-graphs on cpu: CUDA graphs run on a CUDA device at tp 1 only"):
        build_runner(GPT(cfg), EngineConfig(cuda_graphs=True))


def test_only_short_prompts_attend_on_one_cpu_thread(monkeypatch):
    """On the CPU a short prompt's attention runs on one intra-op thread (too small to split) and
    a long one's on all of them (one thread made a 2,000-token prompt's attention 1.7x slower on
    two cores). The numbers are those of test_batched_paged_attention_equals_each_sequence_alone."""
    cfg = ModelConfig(num_layers=1, hidden_size=48, num_attention_heads=6, num_query_groups=2)
    cache = PagedKVCache(cfg, num_blocks=80, block_size=S, dtype=torch.float32, device=torch.device("cpu"))
    short, long = 8, 200  # 64 and 40,000 scores per head
    segments = [Segment([1] * short, 0, list(range(2))), Segment([1] * long, 0, list(range(2, 52)))]
    slots_T = torch.tensor([s for c in segments for s in cache.slots(c.blocks, c.start, len(c.tokens))])
    step = PagedAttention(cache, segments, slots_T)
    threads = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, *args, **kw):
        threads.append((q.shape[2], torch.get_num_threads()))
        return sdpa(q, *args, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        T = short + long
        step.attend(0, torch.randn(1, T, 6, 8), torch.randn(1, T, 2, 8), torch.randn(1, T, 2, 8))
    finally:
        torch.set_num_threads(before)
    assert sorted(threads) == [(short, 1), (long, 2)]


def test_decode_graphs_go_eager_after_a_failed_capture(monkeypatch, caplog):
    """A model whose decode step cannot be captured (a host sync inside, as MoE routing has) is
    served eagerly: the step whose capture failed still gives the eager runner's logits, one
    warning says why, and no later step tries again. The capture is made to fail here (no CUDA)."""
    cfg = ModelConfig(num_layers=1, hidden_size=48, num_attention_heads=6, num_query_groups=2, vocab_size=97)
    model = GPT(cfg).eval()
    cpu = torch.device("cpu")
    eager = ModelRunner(model, PagedKVCache(cfg, 8, S, torch.float32, cpu))
    cache = PagedKVCache(cfg, 8, S, torch.float32, cpu, scratch=True)
    graphs = DecodeGraphs(model, cache, max_seqs=4, capture=False)
    graphs.capture = True  # as on CUDA, with a capture that fails
    tries = []

    def capture(bucket):
        tries.append(bucket)
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs, "_capture", capture)
    static = ModelRunner(model, cache, graphs=graphs)
    prompts = [Segment([3, 5, 7], 0, [0, 1]), Segment([2, 4], 0, [2, 3])]
    for runner in (eager, static):
        runner.forward(prompts)
    with caplog.at_level("WARNING", logger="mlm.inference"):
        for k in range(3):
            step = [Segment([11 + k], 3 + k, [0, 1]), Segment([13 + k], 2 + k, [2, 3])]
            assert graphs.takes(step) == (k == 0)
            torch.testing.assert_close(static.forward(step), eager.forward(step), rtol=0, atol=1e-5)
    assert len(tries) == 1 and "stream is capturing" in graphs.failed
    assert [r.message for r in caplog.records].count(
        f"CUDA graphs off: the decode step could not be captured ({graphs.failed})"
    ) == 1


def test_width_groups_split_only_where_padding_costs_more_than_a_group():
    big = 24 << 10  # bytes of a block's keys and values per layer: SmolLM2-135M's shape
    assert width_groups([3, 4, 2, 4], big) == [[0, 1, 2, 3]]  # alike: one group
    assert width_groups([5], big) == [[0]]
    # one 2,000-token sequence (125 blocks of 16) among 15 of ~100 tokens: 2 groups, each padded
    # to its own longest (gathering 125 + 15 · 7 blocks instead of 16 · 125)
    widths = [7] * 7 + [125] + [6] * 8
    assert width_groups(widths, big) == [[i for i in range(16) if i != 7], [7]]
    # the split goes where it saves the most: the 3 narrow ones, then the rest
    assert width_groups([40, 2, 40, 1, 38, 2], big) == [[1, 3, 5], [0, 2, 4]]
    # where blocks are small a second group costs more than the padding it saves
    assert width_groups([40, 2, 40, 1, 38, 2], 512) == [list(range(6))]
