"""Prefix caching, on-demand cache blocks and preemption (mlm.inference.scheduler, kv_cache).

Requests sharing a prompt prefix compute its full blocks once (counted exactly) and give the same
greedy tokens as an engine without prefix caching; a cache too small for the running set preempts
and recomputes, and every request still gets the tokens of an unconstrained run (seeded sampling
included); a cached prefix is evicted when memory is needed and a later request is still right; a
hash collision cannot share a block; 1,000 mixed requests (shared prefixes, aborts, early stops,
preemptions) leave every block unreferenced; at tp = 2, where rank 0 alone allocates, prefix hits
and preemptions give the tokens of tp = 1. A tiny random Llama-style model (GQA) with a 512-token
context, so that a 200-token prefix fits.
"""

from __future__ import annotations

import random
from dataclasses import asdict

import pytest
import torch

from mlm.config import ModelConfig
from mlm.inference.engine import Completion, Engine, EngineConfig, Sequence, build_runner
from mlm.inference.kv_cache import BlockAllocator
from mlm.inference.loader import load_model
from mlm.inference.lockstep import serving_mesh
from mlm.inference.sampling import SamplingParams
from mlm.model.gpt import build_model
from tests.helpers.distributed import run_ranks
from tests.helpers.inference import model_checkpoint

VOCAB = 100
LLAMA = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=96,
    vocab_size=VOCAB,
    max_position_embeddings=512,
    init_std=0.2,  # logits spread out: no near-ties for greedy to break differently
)
ROOT = BlockAllocator.ROOT


@pytest.fixture(scope="module")
def model():
    return build_model(ModelConfig(**LLAMA), seed=3).eval()


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def metric_lines(engine: Engine) -> dict[str, float]:
    from mlm.serve.metrics import Metrics

    metrics = Metrics()
    metrics.attach(engine)
    lines = metrics.render().decode().splitlines()
    return {k: float(v) for k, v in (line.split(" ") for line in lines if not line.startswith("#"))}


def test_shared_prefix_is_computed_once(model):
    rng = random.Random(0)
    prefix = random_tokens(rng, 200)
    ps = [prefix + [(7 * i + j) % VOCAB for j in range(8)] for i in range(8)]  # 208 tokens each
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    engine = Engine(model, None, EngineConfig(max_seqs=8))  # blocks of 16 tokens
    off = Engine(model, None, EngineConfig(max_seqs=8, prefix_caching=False))
    got, want = engine.generate(ps, params), off.generate(ps, params)  # all 8 submitted at once
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert all(len(r.token_ids) == 6 for r in got)
    # the first request computes its 208 tokens; the 7 others wait for it, then find the 12 full
    # blocks of the prefix (192 tokens) cached and compute their last 16
    s = engine.stats
    assert s.prefill_tokens == 208 + 7 * (208 - 192)
    assert off.stats.prefill_tokens == 8 * 208
    assert s.decode_tokens == off.stats.decode_tokens == 8 * 5
    assert (s.prefix_queries, s.prefix_hits) == (8 * 208, 7 * 192)
    assert off.stats.prefix_queries == off.stats.prefix_hits == 0
    pool = engine.cache.allocator
    assert pool.num_used == 0 and pool.num_cached > 0  # cached blocks are not in use

    # n = 3 of one prompt (the app submits n > 1 as n requests): the prompt's 2 full blocks
    # before its last token are computed once; greedy choices are equal
    q = random_tokens(rng, 37)
    before = s.prefill_tokens
    choices = engine.generate([q] * 3, params)
    assert s.prefill_tokens - before == 37 + 2 * (37 - 32)
    assert [r.token_ids for r in choices] == [off.generate([q], params)[0].token_ids] * 3

    m = metric_lines(engine)
    assert m["mlm_prefix_cache_queries_total"] == 8 * 208 + 3 * 37
    assert m["mlm_prefix_cache_hits_total"] == 7 * 192 + 2 * 32
    assert m["mlm_prefix_cache_hit_rate"] == pytest.approx((7 * 192 + 2 * 32) / (8 * 208 + 3 * 37))
    assert m["mlm_prefill_tokens_total"] == s.prefill_tokens and m["mlm_decode_tokens_total"] == 8 * 5 + 3 * 5
    assert m["mlm_kv_blocks_used"] == 0 and m["mlm_kv_blocks_cached"] == pool.num_cached
    assert m["mlm_preemptions_total"] == 0


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_finishes_every_request_with_the_same_tokens(model, prefix_caching):
    rng = random.Random(2)
    ps = [random_tokens(rng, rng.randint(5, 20)) for _ in range(16)]
    ps[5] = ps[3][:12] + ps[5]  # and a shared prefix
    params = [
        SamplingParams(max_tokens=24, ignore_eos=True, temperature=1.0 if i % 4 == 1 else 0.0, seed=i)
        for i in range(16)
    ]
    free = Engine(model, None, EngineConfig(max_seqs=16, block_size=4))
    want = free.generate(ps, params)
    assert free.stats.preemptions == 0
    # 44 blocks of 4 tokens: 4 sequences of 44 tokens (the longest: 32 prompt + 24 new = 14 blocks)
    tight = Engine(
        model, None, EngineConfig(max_seqs=16, block_size=4, num_blocks=44, prefix_caching=prefix_caching)
    )
    got = tight.generate(ps, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]  # seeded sampling included
    assert all(r.finish_reason == "length" and len(r.token_ids) == 24 for r in got)
    assert tight.stats.preemptions > 0
    # preempted sequences recompute: more tokens run than the unconstrained engine ran
    assert tight.stats.prefill_tokens > free.stats.prefill_tokens
    assert tight.cache.allocator.num_used == 0 and set(tight.cache.allocator.refs) == {0}
    assert metric_lines(tight)["mlm_preemptions_total"] == tight.stats.preemptions


def test_cached_prefix_is_evicted_when_memory_is_needed(model):
    engine = Engine(model, None, EngineConfig(max_seqs=2, block_size=4, num_blocks=12))
    pool, S = engine.cache.allocator, 4
    a = [(3 * j + 1) % VOCAB for j in range(17)]
    chunks = [a[i * S : i * S + S] for i in range(4)]  # a's full blocks before its last token
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    (first,) = engine.generate([a], params)
    # 17 prompt + 3 generated tokens computed: 5 full blocks cached, none referenced
    assert pool.num_cached == 5 and pool.num_used == 0 and len(pool.match(ROOT, chunks)) == 4
    (again,) = engine.generate([a], params)
    assert again.token_ids == first.token_ids and engine.stats.prefix_hits == 16
    b = [(5 * j + 2) % VOCAB for j in range(40)]  # 40 + 4 tokens: 11 of the 12 blocks
    engine.generate([b], params)
    # b took its 7 uncached blocks and evicted 4 of a's 5 cached ones, a's last blocks first: the
    # first of a's blocks is still found
    assert len(pool.match(ROOT, chunks)) == 1
    hits = engine.stats.prefix_hits
    (third,) = engine.generate([a], params)
    assert third.token_ids == first.token_ids
    assert engine.stats.prefix_hits - hits == 4
    off = Engine(model, None, EngineConfig(max_seqs=2, block_size=4, num_blocks=12, prefix_caching=False))
    assert off.generate([a], params)[0].token_ids == first.token_ids


def test_allocator_keys_are_exact_and_blocks_counted():
    pool = BlockAllocator(4)
    # CPython hashes -1 and -2 alike, so these keys collide; the cache compares keys in full
    assert hash((ROOT, (-1, 5))) == hash((ROOT, (-2, 5)))
    (b,) = pool.allocate(1)
    pid = pool.register(b, ROOT, [-1, 5])
    assert pool.match(ROOT, [[-2, 5]]) == [] and pool.match(ROOT, [[-1, 5]]) == [b]
    (c, d) = pool.allocate(2)
    pool.register(c, pid, [7, 7])
    other = pool.register(d, ROOT, [3, 3])
    assert pool.match(ROOT, [[-1, 5], [7, 7]]) == [b, c]
    assert pool.match(ROOT, [[3, 3], [7, 7]]) == [d]  # the same tokens after another prefix
    assert pool.match(other, [[7, 7]]) == []
    (e,) = pool.allocate(1)
    assert pool.register(e, ROOT, [3, 3]) == other  # a duplicate: d stays the cached one
    pool.take([b])
    assert pool.refs == [2 if x == b else 1 for x in range(4)] and pool.num_free == 0
    pool.free([b, c, d, e])
    pool.free([b])
    assert pool.num_used == 0 and pool.num_cached == 3 and set(pool.refs) == {0}
    assert pool.match(ROOT, [[-1, 5], [7, 7]]) == [b, c]  # freed, still cached
    pool.take([b])
    assert pool.num_free == 3 and pool.refs[b] == 1
    assert pool.allocate(1) == [e]  # the unregistered block goes first
    pool.allocate(2)  # evicts d and c (a sequence frees its last block first)
    assert pool.num_cached == 1 and pool.match(ROOT, [[3, 3]]) == []
    assert pool.match(ROOT, [[-1, 5], [7, 7]]) == [b]
    with pytest.raises(AssertionError, match="freed twice"):
        pool.free([c, c])


def test_thousand_mixed_requests_leave_no_block_referenced(model):
    rng = random.Random(1)
    prefixes = [random_tokens(rng, n) for n in (9, 23, 40)]
    # 48 blocks of 4 tokens for 8 sequences of up to 94 tokens: preemptions and evictions
    config = EngineConfig(max_seqs=8, max_tokens_per_step=64, block_size=4, num_blocks=48, max_waiting=64)
    engine = Engine(model, None, config)
    results: dict[str, Completion] = {}
    aborts: list[tuple[int, str]] = []
    submitted = step = 0
    while submitted < 1000 or engine.has_work():
        while submitted < 1000 and engine.num_waiting < 12:
            shared = rng.choice(prefixes) if rng.random() < 0.5 else []
            params = SamplingParams(
                max_tokens=rng.randint(1, 24),
                temperature=rng.choice([0.0, 0.8]),
                seed=submitted,
                stop_token_ids=tuple(random_tokens(rng, 3)) if rng.random() < 0.3 else (),
                ignore_eos=True,
            )
            results[rid := f"r{submitted}"] = c = Completion()
            engine.submit(shared + random_tokens(rng, rng.randint(1, 30)), params, c.add, rid)
            if rng.random() < 0.1:  # cancelled while waiting, running, or after it finished
                aborts.append((step + rng.randint(0, 8), rid))
            submitted += 1
        for rid in [rid for at, rid in aborts if at == step]:
            engine.abort(rid)
        engine.step()
        step += 1
    pool = engine.cache.allocator
    assert pool.num_used == 0 and pool.num_free == pool.num_blocks and set(pool.refs) == {0}
    assert engine.num_running == engine.num_waiting == 0
    assert sum(engine.finished.values()) == 1000 and all(c.finish_reason for c in results.values())
    assert min(engine.finished[r] for r in ("abort", "stop", "length")) > 0
    assert engine.stats.preemptions > 0 and engine.stats.prefix_hits > 0 and pool.num_cached > 0


# tp: 8 requests, 4 of them sharing a 20-token prefix, in 24 blocks of 4 tokens (12 for the longest)
TIGHT = EngineConfig(max_seqs=8, max_tokens_per_step=64, block_size=4, num_blocks=24)
TP_PARAMS = SamplingParams(max_tokens=16, ignore_eos=True)


def tp_prompts() -> list[list[int]]:
    rng = random.Random(4)
    shared = random_tokens(rng, 20)
    return [(shared if i < 4 else []) + random_tokens(rng, rng.randint(3, 12)) for i in range(8)]


def _tp_rank(rank: int, world_size: int, ckpt: str):
    mesh = serving_mesh(ModelConfig(**LLAMA), None, torch.device("cpu"))  # tp = WORLD_SIZE
    model, _, _ = load_model(ckpt, device="cpu", mesh=mesh)
    if rank != 0:
        return dict(steps=build_runner(model, TIGHT, mesh).follow())  # until the stop message
    engine = Engine(model, None, TIGHT, mesh)
    results = engine.generate(tp_prompts(), TP_PARAMS)
    engine.stop()
    used = engine.cache.allocator.num_used
    return dict(tokens=[r.token_ids for r in results], stats=asdict(engine.stats), used=used)


def test_tp2_prefix_hits_and_preemption_equal_tp1(tmp_path):
    ckpt = model_checkpoint(tmp_path, LLAMA)
    lead, follower = run_ranks(2, _tp_rank, ckpt)
    model, _, _ = load_model(ckpt, device="cpu")
    one = Engine(model, None, TIGHT)
    assert lead["tokens"] == [r.token_ids for r in one.generate(tp_prompts(), TP_PARAMS)]
    assert lead["stats"] == asdict(one.stats)  # the same schedule
    assert one.stats.preemptions > 0 and one.stats.prefix_hits > 0
    assert lead["used"] == 0 and follower["steps"] > 0


def test_recomputation_after_preemption_is_not_a_prefix_hit(model):
    """The prefix-cache counters (and /metrics' hit rate) count each request once, at its first
    admission: a preempted sequence that finds its own blocks still cached when it is admitted
    again is recomputation (prefill tokens, preemptions), not prompts sharing a prefix."""
    rng = random.Random(5)
    ps = [random_tokens(rng, rng.randint(10, 20)) for _ in range(12)]  # no common block of 4
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    tight = Engine(model, None, EngineConfig(max_seqs=12, block_size=4, num_blocks=30))
    tight.generate(ps, params)
    assert tight.stats.preemptions > 0
    assert tight.stats.prefix_queries == sum(len(p) for p in ps)
    assert tight.stats.prefix_hits == 0
    assert metric_lines(tight)["mlm_prefix_cache_hit_rate"] == 0.0


def test_one_token_chunks_of_recomputation_count_as_prefill(model):
    """A recomputing sequence can get a chunk of one token (the step's budget left over): tokens it
    had already run count as prefill; only its pending token, sampled and never run, is a decode."""
    engine = Engine(model, None, EngineConfig(block_size=4, prefix_caching=False))
    seq = Sequence("s", [1, 2, 3], SamplingParams(), lambda out: None, None, 512)
    seq.output_ids = [4, 5, 6]  # 6 pending after a preemption; 3 recomputed so far
    seq.num_computed = 3
    for _ in range(3):
        engine.scheduler.computed([(seq, 1)])
    assert (engine.stats.prefill_tokens, engine.stats.decode_tokens) == (2, 1)
