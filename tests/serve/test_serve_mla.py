"""Serving multi-latent attention (MLA): the paged cache holds per token and layer one head
[normed latent ; roped rope key] and no values, and decoding runs the absorbed computation
(`mlm.model.kinds.mla`: W_UK folded into the query, W_UV applied to the attention output).

Through the engine `mlm serve` runs (continuous batching, a prompt prefilled over two steps),
greedy tokens must equal the training forward's (`greedy`: the full sequence re-run each step)
and every sampled row of logits must be within TOL of it; the cache must take exactly
(kv_lora_rank + qk_rope_head_dim) · dtype bytes · layers per token, which `mlm serve` reports;
at tp = 2 (every rank holds the whole latent) the greedy tokens must equal tp = 1's.
"""

from __future__ import annotations

import torch

from mlm.config import MLAConfig, ModelConfig
from mlm.inference.engine import Completion, Engine, EngineConfig, build_runner
from mlm.inference.kv_cache import (
    PagedKVCache,
    blocks_for_memory,
    bytes_per_block,
    bytes_per_token,
    cache_layout,
)
from mlm.inference.loader import load_model
from mlm.inference.lockstep import serving_mesh
from mlm.inference.sampling import SamplingParams
from mlm.model.generate import greedy
from mlm.model.gpt import build_model
from mlm.serve.metrics import Metrics
from tests.helpers.distributed import run_ranks
from tests.helpers.inference import ENGINE, LLAMA, drive_engine, model_checkpoint

TOL = 1e-5  # fp32 logits: max |served − reference| / max |reference|; measured 9.8e-7 (training forward), 7.3e-7 (tp 2 vs 1)
LATENT, ROPE, LAYERS = 12, 4, 2
MLA = dict(
    num_layers=LAYERS,
    hidden_size=32,
    num_attention_heads=4,
    vocab_size=100,
    max_position_embeddings=64,
    init_std=0.2,  # logits spread out: no near-ties for greedy to break differently
    attention_kind="mla",
    mla=MLAConfig(
        q_lora_rank=16, kv_lora_rank=LATENT, qk_nope_head_dim=8, qk_rope_head_dim=ROPE, v_head_dim=6
    ),
)
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def mla_model():
    return build_model(ModelConfig(**MLA), seed=3).eval()


def prompts(vocab: int, lengths) -> list[list[int]]:
    return [[(37 * i + 11 * j + 5) % vocab for j in range(n)] for i, n in enumerate(lengths)]


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def run_recording(engine: Engine, ps: list[list[int]], arrivals: list[int]):
    """Submit prompt i at step arrivals[i] and step to the end: (completions, the rows of logits
    the engine sampled from as (prompt index, position, logits))."""
    results = [Completion() for _ in ps]
    ids: dict[str, int] = {}
    rows: list[tuple[int, int, torch.Tensor]] = []
    schedule, forward = engine.scheduler.schedule, engine.runner.forward
    batches: list[list[str]] = []

    def scheduled():
        batch = schedule()
        batches.append([seq.id for seq, _ in batch])
        return batch

    def recorded(segments):
        logits = forward(segments)
        sampled = [(rid, c) for rid, c in zip(batches[-1], segments, strict=True) if c.sample]
        for (rid, c), row in zip(sampled, logits, strict=True):
            rows.append((ids[rid], c.start + len(c.tokens) - 1, row))
        return logits

    engine.scheduler.schedule, engine.runner.forward = scheduled, recorded
    step = 0
    while step <= max(arrivals) or engine.has_work():
        for i, at in enumerate(arrivals):
            if at == step:
                ids[engine.submit(ps[i], GREEDY, results[i].add)] = i
        engine.step()
        step += 1
    return results, rows


def check_against_training_forward(model, ps, results, rows) -> float:
    """Greedy tokens equal the training forward's; each sampled row of logits is within TOL of the
    training forward's at its position. The largest relative difference."""
    vocab = model.cfg.vocab_size
    with torch.no_grad():
        full = [
            model(torch.tensor([p + r.token_ids]))[0, :, :vocab] for p, r in zip(ps, results, strict=True)
        ]
    for p, r in zip(ps, results, strict=True):
        assert r.finish_reason == "length" and len(r.token_ids) == GREEDY.max_tokens
        assert r.token_ids == greedy(model, p, GREEDY.max_tokens)
    worst = max(relative(row, full[i][pos]) for i, pos, row in rows)
    assert worst <= TOL, f"served logits differ from the training forward by {worst:.2e} relative"
    assert len(rows) == sum(GREEDY.max_tokens for _ in ps)  # every sampled token was checked
    return worst


def test_absorbed_decode_equals_training_forward():
    """One sequence: its prompt prefilled at once, then decoded token by token over the latent cache."""
    model = mla_model()
    engine = Engine(model, None, EngineConfig(max_seqs=1, block_size=4))
    ps = prompts(model.cfg.vocab_size, [9])
    results, rows = run_recording(engine, ps, [0])
    check_against_training_forward(model, ps, results, rows)
    assert [pos for _, pos, _ in rows] == list(range(8, 8 + GREEDY.max_tokens))
    assert engine.cache.k_LNSGK.abs().sum() > 0 and engine.cache.allocator.num_used == 0


def test_batched_and_chunked_prefill_equal_training_forward():
    """Requests joining and leaving a running batch of 3, a 30-token prompt prefilled over two steps
    of 16 tokens (its first chunk samples nothing), blocks of 4 tokens."""
    model = mla_model()
    engine = Engine(model, None, EngineConfig(max_seqs=3, max_tokens_per_step=16, block_size=4))
    ps = prompts(model.cfg.vocab_size, [5, 30, 1, 12, 7])
    prefill_chunks = []
    forward = engine.runner.forward
    engine.runner.forward = lambda segs: (
        prefill_chunks.extend(c for c in segs if not c.sample) or forward(segs)
    )
    results, rows = run_recording(engine, ps, [0, 1, 3, 4, 4])
    check_against_training_forward(model, ps, results, rows)
    assert any(len(c.tokens) > 1 and c.start == 0 for c in prefill_chunks)  # the prompt split over steps
    assert engine.cache.allocator.num_used == 0


def test_bytes_per_token_is_the_latent_and_rope_key():
    cfg = ModelConfig(**MLA)
    for dtype, size in ((torch.float32, 4), (torch.bfloat16, 2)):
        want = (LATENT + ROPE) * size * LAYERS
        assert [bytes_per_token(cfg, dtype, tp) for tp in (1, 2)] == [want, want]  # not divided by tp
        assert bytes_per_block(cfg, 16, dtype) == 16 * want
        assert blocks_for_memory(cfg, 16, dtype, 10 * 16 * want + 5) == 10
        cache = PagedKVCache(cfg, num_blocks=3, block_size=16, dtype=dtype, device=torch.device("cpu"))
        assert tuple(cache.k_LNSGK.shape) == (LAYERS, 3, 16, 1, LATENT + ROPE)
        assert cache.v_LNSGK is None and cache.k_LNSGK.dtype == dtype
        assert cache.k_LNSGK.nbytes == 3 * 16 * want == 3 * bytes_per_block(cfg, 16, dtype)
    assert cache_layout(cfg, tp=2) == cache_layout(cfg)


def test_gqa_bytes_per_token_is_unchanged():
    """2 · (query groups / tp) · head dim · layers · dtype bytes, keys and values in two tensors."""
    cfg = ModelConfig(**LLAMA)  # 2 query groups of 16 dims, 2 layers
    assert bytes_per_token(cfg, torch.float32) == 2 * 2 * 16 * 2 * 4
    assert bytes_per_token(cfg, torch.bfloat16, tp=2) == 2 * 1 * 16 * 2 * 2
    cache = PagedKVCache(
        cfg, num_blocks=3, block_size=4, dtype=torch.float32, device=torch.device("cpu"), tp=2
    )
    assert tuple(cache.k_LNSGK.shape) == tuple(cache.v_LNSGK.shape) == (2, 3, 4, 1, 16)
    assert cache.k_LNSGK.nbytes + cache.v_LNSGK.nbytes == 3 * bytes_per_block(cfg, 4, torch.float32, tp=2)
    assert cache.summary().endswith(
        "256 bytes per token (keys and values: 2 × 1 heads × 16 dims × 2 layers × 4 bytes; "
        "1 of the 2 key/value heads on each of 2 tp ranks)"
    )


def test_serve_reports_bytes_per_token():
    """The startup log line (`PagedKVCache.summary`) and /metrics' mlm_kv_cache_bytes_per_token."""
    engine = Engine(mla_model(), None, EngineConfig(max_seqs=2, block_size=16))
    assert engine.cache.summary() == (
        "KV cache: 8 blocks of 16 tokens, 0.02 MiB per rank; "
        "128 bytes per token (MLA: (latent 12 + rope key 4) × 2 layers × 4 bytes)"
    )
    metrics = Metrics()
    metrics.attach(engine)
    text = metrics.render().decode()
    lines = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert float(lines["mlm_kv_cache_bytes_per_token"]) == (LATENT + ROPE) * 4 * LAYERS


def _mla_rank(rank: int, world_size: int, ckpt: str) -> dict:
    mesh = serving_mesh(ModelConfig(**MLA), None, torch.device("cpu"))  # tp = WORLD_SIZE
    model, _, _ = load_model(ckpt, device="cpu", mesh=mesh)
    if rank == 0:
        engine = Engine(model, None, ENGINE, mesh)
        tokens, logits = drive_engine(engine)
        engine.stop()  # the stop message
        out = dict(tokens=tokens, logits=[x.tolist() for x in logits], used=engine.cache.allocator.num_used)
        cache = engine.cache
    else:
        runner = build_runner(model, ENGINE, mesh)
        out, cache = dict(steps=runner.follow()), runner.cache
    heads = [m.up_weights()[0].shape[0] for m in model.modules() if hasattr(m, "up_weights")]
    return dict(out, cache=tuple(cache.k_LNSGK.shape), values=cache.v_LNSGK is None, heads=heads)


def test_tp2_equals_tp1(tmp_path):
    """At tp = 2 each rank runs 2 of the 4 heads over the whole latent, which both ranks cache."""
    ckpt = model_checkpoint(tmp_path / "mla", MLA)
    lead, follower = run_ranks(2, _mla_rank, ckpt)
    model, _, _ = load_model(ckpt, device="cpu")
    tokens, logits = drive_engine(Engine(model, None, ENGINE))
    assert lead["tokens"] == tokens
    assert len(lead["logits"]) == len(logits) == follower["steps"]
    for got, ref in zip(lead["logits"], logits, strict=True):
        assert len(got) == ref.shape[0]
        if got:
            assert relative(torch.tensor(got), ref) <= TOL
    assert lead["used"] == 0
    assert lead["heads"] == follower["heads"] == [2] * LAYERS  # each rank: its 2 heads' W_UK
    assert lead["cache"] == follower["cache"] and lead["cache"][3:] == (1, LATENT + ROPE)
    assert lead["values"] and follower["values"]
