"""The inference engine (mlm.inference): paged KV cache, continuous batching, sampling.

Greedy output with continuous batching (requests of different lengths arriving at different
steps) must equal each request run alone and the cache-less training forward, token for token,
and transformers' `generate` on a tiny random Llama imported with `mlm convert from-hf`; every
sampling option must do what it says; no cache block may leak after a finish, a cancel or a failed
step.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mlm.config import ModelConfig  # noqa: E402
from mlm.errors import MlmError  # noqa: E402
from mlm.inference.engine import Completion, Engine, EngineConfig, QueueFull  # noqa: E402
from mlm.inference.loader import load_checkpoint_tokenizer, load_model  # noqa: E402
from mlm.inference.sampling import SamplingParams, apply_penalties, sample, truncate  # noqa: E402
from mlm.inference.text import TextStream  # noqa: E402
from mlm.model.generate import greedy  # noqa: E402
from mlm.model.gpt import GPT  # noqa: E402
from tests.helpers.common import ROOT  # noqa: E402
from tests.helpers.inference import tiny_llama_checkpoint  # noqa: E402

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llama(tmp_path_factory, hf_tokenizer_json):
    """(HF model, mlm model loaded from the imported checkpoint, its tokenizer, checkpoint dir)."""
    hf, ckpt = tiny_llama_checkpoint(tmp_path_factory.mktemp("inference"), hf_tokenizer_json)
    model, manifest, it_dir = load_model(ckpt, device="cpu")
    return hf, model, load_checkpoint_tokenizer(manifest, it_dir), ckpt


def prompts(vocab: int, lengths) -> list[list[int]]:
    return [[(37 * i + 11 * j + 5) % vocab for j in range(n)] for i, n in enumerate(lengths)]


def staggered(
    engine: Engine, items: list[tuple[list[int], SamplingParams]], every: int = 2
) -> list[Completion]:
    """Submit one request every `every` steps while the batch runs; step until all are done."""
    results = [Completion() for _ in items]
    k = step = 0
    max_running = 0
    while k < len(items) or engine.has_work():
        if k < len(items) and step % every == 0:
            engine.submit(items[k][0], items[k][1], results[k].add)
            k += 1
        engine.step()
        max_running = max(max_running, engine.num_running)
        step += 1
    assert max_running <= engine.config.max_seqs
    return results


def test_continuous_batching_equals_alone_and_no_cache(llama):
    _, model, _, _ = llama
    ps = prompts(model.cfg.vocab_size, [5, 40, 1, 23, 70, 9])
    # 3 sequences at most, 48 tokens a step: requests queue, join and leave mid-run, and the
    # 70-token prompt is prefilled in two chunks
    engine = Engine(model, None, EngineConfig(max_seqs=3, max_tokens_per_step=48, block_size=8))
    batched = staggered(engine, [(p, GREEDY) for p in ps])
    alone = [Engine(model, None, EngineConfig(block_size=8)).generate([p], GREEDY)[0] for p in ps]
    for i, (p, b, a) in enumerate(zip(ps, batched, alone, strict=True)):
        assert b.token_ids == a.token_ids
        assert len(b.token_ids) == GREEDY.max_tokens and b.finish_reason == "length"
        if i % 2 == 0:  # and the training forward without a cache (half of them: it is slow)
            assert b.token_ids == greedy(model, p, GREEDY.max_tokens)
    assert engine.cache.allocator.num_used == 0


def test_equals_transformers_generate(llama):
    hf, model, _, _ = llama
    hf.generation_config.eos_token_id = None  # run the full 32 tokens, as the engine does here
    ps = prompts(model.cfg.vocab_size, [3, 17])
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    engine = Engine(model, None, EngineConfig(max_seqs=4))
    ours = engine.generate(ps, params)
    for p, r in zip(ps, ours, strict=True):
        ids = torch.tensor([p])
        theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=32)
        assert r.token_ids == theirs[0, len(p) :].tolist()


def test_learned_positions_gpt2_style():
    cfg = ModelConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        vocab_size=200,
        max_position_embeddings=64,
        normalization="layernorm",
        position_embedding="learned",
        activation="gelu_tanh",
        add_bias=True,
        tie_embeddings=True,
    )
    model = GPT(cfg).eval()  # torch's default init: an N(0, 1) embedding spreads the logits
    ps = prompts(cfg.vocab_size, [4, 19, 7])
    engine = Engine(model, None, EngineConfig(max_seqs=2, max_tokens_per_step=16, block_size=4))
    for p, r in zip(ps, staggered(engine, [(p, GREEDY) for p in ps]), strict=True):
        assert r.token_ids == greedy(model, p, GREEDY.max_tokens)


def test_seeded_sampling_is_reproducible_in_any_batch(llama):
    _, model, _, _ = llama
    ps = prompts(model.cfg.vocab_size, [6, 12, 3])
    sampled = SamplingParams(max_tokens=20, temperature=1.0, seed=7, ignore_eos=True)
    alone = Engine(model).generate([ps[0]], sampled)[0].token_ids
    engine = Engine(model, None, EngineConfig(max_seqs=3))
    mixed = staggered(engine, [(ps[1], GREEDY), (ps[0], sampled), (ps[2], GREEDY)], every=1)
    assert mixed[1].token_ids == alone
    other_seed = SamplingParams(max_tokens=20, temperature=1.0, seed=8, ignore_eos=True)
    assert Engine(model).generate([ps[0]], other_seed)[0].token_ids != alone


def test_top_k_samples_among_the_k_best_and_logprobs(llama):
    _, model, _, _ = llama
    p = prompts(model.cfg.vocab_size, [9])[0]
    params = SamplingParams(max_tokens=20, temperature=1.5, top_k=3, seed=1, logprobs=3, ignore_eos=True)
    (r,) = Engine(model).generate([p], params)
    assert len(r.logprobs) == 20
    for token, lp in zip(r.token_ids, r.logprobs, strict=True):
        assert lp.token_id == token and token in [i for i, _ in lp.top]
    # greedy log-probs are the no-cache model's log-softmax at each position
    (g,) = Engine(model).generate([p], SamplingParams(max_tokens=5, logprobs=2, ignore_eos=True))
    with torch.no_grad():
        logits = model(torch.tensor([p + g.token_ids]))[0, len(p) - 1 : -1, : model.cfg.vocab_size]
    expected = torch.log_softmax(logits, -1)
    for i, lp in enumerate(g.logprobs):
        assert lp.token_id == int(expected[i].argmax()) == lp.top[0][0]
        assert abs(lp.logprob - float(expected[i, lp.token_id])) < 1e-5
        assert lp.top[0][1] >= lp.top[1][1]


def test_truncation_and_penalties_do_what_they_say():
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    assert torch.isfinite(truncate(logits, 2, 1.0)).tolist() == [True, True, False, False]
    # mass before the 3rd token is 0.7 ≥ 0.5: the nucleus is the first two
    assert torch.isfinite(truncate(logits, 0, 0.5)).tolist() == [True, True, False, False]
    assert torch.isfinite(truncate(logits, 0, 0.3)).tolist() == [True, False, False, False]
    x = torch.tensor([2.0, -2.0, 1.0, 0.5])
    rep = apply_penalties(x.clone(), SamplingParams(repetition_penalty=2.0), [0], [1])
    assert rep.tolist() == [1.0, -4.0, 1.0, 0.5]
    pen = apply_penalties(
        x.clone(), SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), [3], [2, 2, 0]
    )
    assert pen.tolist() == [2.0 - 0.75, -2.0, 1.0 - 1.0, 0.5]


def test_penalties_stop_repeats(llama):
    _, model, _, _ = llama
    p = prompts(model.cfg.vocab_size, [4])[0]
    (plain,) = Engine(model).generate([p], SamplingParams(max_tokens=40, ignore_eos=True))
    assert len(set(plain.token_ids)) < 40  # a tiny random model loops
    for params in (
        SamplingParams(max_tokens=40, presence_penalty=100.0, ignore_eos=True),
        SamplingParams(max_tokens=40, repetition_penalty=1e6, ignore_eos=True),
    ):
        (r,) = Engine(model).generate([p], params)
        assert len(set(r.token_ids)) == 40
    (r,) = Engine(model).generate([p], SamplingParams(max_tokens=40, repetition_penalty=1e6, ignore_eos=True))
    assert not set(r.token_ids) & set(p)


def test_stop_tokens_strings_and_max_tokens(llama):
    _, model, tok, _ = llama
    engine = Engine(model, tok)
    p = tok.encode("def main(argv):\n    return")
    (full,) = engine.generate([p], SamplingParams(max_tokens=30, ignore_eos=True))
    assert full.finish_reason == "length" and len(full.token_ids) == 30 and full.completion_tokens == 30
    third = full.token_ids[2]
    first = full.token_ids.index(third)
    (r,) = engine.generate([p], SamplingParams(max_tokens=30, stop_token_ids=(third,), ignore_eos=True))
    assert r.token_ids == full.token_ids[:first] and r.finish_reason == "stop"
    assert r.completion_tokens == first + 1  # the stop token counts, but is not output
    stop = next(
        full.text[i : i + 3] for i in range(4, len(full.text)) if "\ufffd" not in full.text[i : i + 3]
    )
    (s,) = engine.generate([p], SamplingParams(max_tokens=30, stop=(stop,), ignore_eos=True))
    assert s.finish_reason == "stop" and s.text == full.text[: full.text.index(stop)]
    (m,) = engine.generate([p], SamplingParams(max_tokens=5, ignore_eos=True))
    assert m.token_ids == full.token_ids[:5] and m.finish_reason == "length"
    # the tokenizer's end-of-text stops a request that does not ignore it
    engine_eod = Engine(model, tok)
    engine_eod.tokenizer.eod_id, saved = third, tok.eod_id
    try:
        (e,) = engine_eod.generate([p], SamplingParams(max_tokens=30))
    finally:
        tok.eod_id = saved
    assert e.finish_reason == "stop" and e.token_ids == full.token_ids[:first]


class _Chars:
    """A tokenizer whose token i is the letter chr(97 + i)."""

    eod_id = None

    def decode(self, ids):
        return "".join(chr(97 + i) for i in ids)


def test_text_stream_holds_back_a_possible_stop_string():
    s = TextStream(_Chars(), ("cd",))
    assert [s.add(i) for i in (0, 1, 2)] == [("a", False), ("b", False), ("", False)]  # "c" may start "cd"
    assert s.add(4) == ("ce", False)  # it did not
    assert s.add(2) == ("", False) and s.add(3) == ("", True) and s.text == "abce"


def test_blocks_are_freed_after_finish_cancel_and_error(llama):
    _, model, _, _ = llama
    engine = Engine(model, None, EngineConfig(max_seqs=2, block_size=4))
    pool = engine.cache.allocator
    ps = prompts(model.cfg.vocab_size, [5, 9, 13])
    long = SamplingParams(max_tokens=50, ignore_eos=True)
    done = [Completion() for _ in ps]
    ids = [engine.submit(p, long, d.add) for p, d in zip(ps, done, strict=True)]
    for _ in range(3):
        engine.step()
    assert engine.num_running == 2 and engine.num_waiting == 1
    # blocks are taken as tokens need them: ⌈(prompt + 2 decoded) / 4⌉ for each of the two running
    assert pool.num_used == 2 + 3
    engine.abort(ids[0])
    engine.abort(ids[2])  # still waiting: it leaves without ever holding blocks
    engine.step()
    assert done[0].finish_reason == "abort" and done[2].finish_reason == "abort"
    assert pool.num_used == 3 and engine.num_running == 1
    while engine.has_work():
        engine.step()
    assert done[1].finish_reason == "length" and pool.num_used == 0

    def broken(chunks):
        raise RuntimeError("device lost")

    engine.runner.forward, working = broken, engine.runner.forward
    (failed,) = engine.generate([ps[0]], long)
    assert failed.finish_reason == "error" and "device lost" in failed.error and pool.num_used == 0
    engine.runner.forward = working
    assert engine.generate([ps[0]], GREEDY)[0].finish_reason == "length"
    assert engine.finished == {"abort": 2, "length": 2, "error": 1}


def test_a_failed_sampling_fails_only_its_request(llama):
    """A row whose sampling raises (here a logit_bias id outside the vocabulary, which only the
    HTTP layer checks) or whose logits are NaN finishes alone with "error"; the others go on."""
    _, model, _, _ = llama
    ps = prompts(model.cfg.vocab_size, [6, 11, 4])
    engine = Engine(model, None, EngineConfig(max_seqs=3, block_size=4))
    bad = SamplingParams(max_tokens=24, temperature=1.0, logit_bias=((model.cfg.vocab_size + 5, 1.0),))
    seeded = SamplingParams(max_tokens=24, temperature=1.0, seed=3, ignore_eos=True)
    results = engine.generate(ps, [GREEDY, bad, seeded])
    assert results[1].finish_reason == "error" and results[1].token_ids == []
    assert results[1].error.startswith("sampling failed: IndexError")
    assert results[0].token_ids == Engine(model).generate([ps[0]], GREEDY)[0].token_ids
    assert results[2].token_ids == Engine(model).generate([ps[2]], seeded)[0].token_ids
    assert engine.finished == {"error": 1, "length": 2} and engine.cache.allocator.num_used == 0

    logits = torch.randn(3, 50)
    logits[1, 7] = float("nan")
    gens = [torch.Generator().manual_seed(0) for _ in range(3)]
    plain, sampled = SamplingParams(), SamplingParams(temperature=1.0)
    for params in ([plain, plain, plain], [plain, sampled, plain]):
        tokens, _, errors = sample(logits, params, gens, [[1]] * 3, [[]] * 3)
        assert errors[0] is None and errors[2] is None and "NaN" in errors[1]
        assert tokens[0] == int(logits[0].argmax()) and tokens[2] == int(logits[2].argmax())


def test_extreme_sampling_values_give_finite_probabilities(llama):
    """Values that made NaN probabilities (issue 19, fuzz case 3): a tiny temperature is greedy, a
    top_p that is 0 in fp32 keeps the most likely token, a repetition penalty of 1e-40 (or 1e40)
    gives finite logits; logit_bias forces or forbids tokens."""
    _, model, _, _ = llama
    p = prompts(model.cfg.vocab_size, [5])[0]
    (greedy_run,) = Engine(model).generate([p], GREEDY)
    for extreme in (
        SamplingParams(max_tokens=24, temperature=5e-324, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=1e-40, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=1.0, top_p=1e-300, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=2.0, top_k=1, top_p=1e-300, ignore_eos=True),
    ):
        (r,) = Engine(model).generate([p], extreme)
        assert r.token_ids == greedy_run.token_ids, extreme
    for penalty in (1e-40, 1e40):
        params = SamplingParams(
            max_tokens=24, temperature=1.0, repetition_penalty=penalty, seed=0, ignore_eos=True
        )
        (r,) = Engine(model).generate([p], params)
        assert r.finish_reason == "length" and len(r.token_ids) == 24
        if penalty < 1:  # the seen tokens' positive logits become fp32's largest: only they are drawn
            assert set(r.token_ids) <= set(p)
    logits = torch.tensor([1.0, 3.0, -2.0])
    rep = apply_penalties(logits.clone(), SamplingParams(repetition_penalty=1e-40), [0, 2], [])
    assert torch.isfinite(rep).all() and rep[0] == torch.finfo(torch.float32).max and rep[1] == 3.0
    assert torch.isfinite(truncate(logits, 0, 1e-300)).tolist() == [False, True, False]

    forced = (p[0] + 1) % model.cfg.vocab_size
    (r,) = Engine(model).generate([p], SamplingParams(max_tokens=8, logit_bias=((forced, 100.0),)))
    assert r.token_ids == [forced] * 8
    first = greedy_run.token_ids[0]
    (r,) = Engine(model).generate([p], SamplingParams(max_tokens=8, logit_bias=((first, -100.0),)))
    assert r.token_ids[0] != first
    with pytest.raises(MlmError, match="logit_bias"):
        SamplingParams(logit_bias=((1, 100.5),))
    with pytest.raises(MlmError, match=r"seed=18446744073709551616: must be in \[-9223372036854775808"):
        SamplingParams(seed=2**64)


def test_admission_limits(llama):
    _, model, _, _ = llama
    # 8 blocks of 4: a request is admitted when blocks for its prompt are free (3 for 9 tokens), so
    # two of three start; at their 17th token the two need 10 blocks, and the later one is
    # preempted, to be recomputed when blocks are free again (tests/serve/test_prefix_cache.py)
    engine = Engine(model, None, EngineConfig(max_seqs=4, block_size=4, num_blocks=8, max_waiting=3))
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    ps = prompts(model.cfg.vocab_size, [9, 9, 9])
    results = [Completion() for _ in ps]
    for q, r in zip(ps, results, strict=True):
        engine.submit(q, params, r.add)
    with pytest.raises(QueueFull):
        engine.submit(ps[0], params, Completion().add)
    engine.step()
    assert engine.num_running == 2 and engine.num_waiting == 1
    while engine.has_work():
        engine.step()
    assert engine.stats.preemptions > 0 and engine.cache.allocator.num_used == 0
    for q, r in zip(ps, results, strict=True):
        assert r.token_ids == Engine(model).generate([q], params)[0].token_ids
    p = ps[0][:5]
    # a request that alone needs more blocks than the cache holds is refused at once
    with pytest.raises(MlmError, match="needs 9 KV-cache blocks"):
        engine.submit(p, SamplingParams(max_tokens=30), Completion().add)
    with pytest.raises(MlmError, match="context is 128"):
        engine.submit([1] * 128, params, Completion().add)
    with pytest.raises(MlmError, match="outside the vocabulary"):
        engine.submit([model.cfg.vocab_size], params, Completion().add)
    with pytest.raises(MlmError, match="max_tokens_per_step=2 is less than max_seqs=4"):
        EngineConfig(max_seqs=4, max_tokens_per_step=2)


def test_missing_tokenizer_names_the_option(llama, tmp_path):
    _, _, _, ckpt = llama
    _, manifest, it_dir = load_model(ckpt, device="cpu")
    manifest = {**manifest, "tokenizer": None, "config": {**manifest["config"], "data": {}}}
    with pytest.raises(MlmError, match="pass --tokenizer PATH"):
        load_checkpoint_tokenizer(manifest, it_dir)


def test_generate_cli(llama):
    _, model, tok, ckpt = llama
    r = subprocess.run(
        [sys.executable, "-m", "cli.main", "generate", str(ckpt), "-p", "def main(", "--max-tokens", "8"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    (expected,) = Engine(model, tok).generate([tok.encode("def main(")], SamplingParams(max_tokens=8))
    assert r.stdout == f"def main({expected.text}\n"
    assert f"{expected.completion_tokens} tokens in" in r.stderr


def test_serving_runner_runs_the_training_forward(tmp_path, tiny_data, monkeypatch):
    """On a checkpoint trained by `mlm train`: the serving runner (paged cache, a prompt prefilled
    in two parts packed with another sequence, then one decode step) gives the training forward's
    logits at every sampled position, and it gets them by calling the model's own forward."""
    from mlm.config import load_config
    from mlm.inference.kv_cache import PagedKVCache
    from mlm.inference.model_runner import ModelRunner, Segment
    from mlm.train.trainer import Trainer
    from tests.helpers.common import tiny_sets

    sets = tiny_sets(
        tmp_path / "run", tiny_data, **{"train.train_iters": 2, "checkpoint.save": f"'{tmp_path}/ckpt'"}
    )
    trainer = Trainer(load_config(None, sets))
    trainer.train()
    a, b = [int(t) for t in torch.arange(30) * 13 % 500], [int(t) for t in torch.arange(9) * 7 % 500]
    with torch.no_grad():
        want_a = trainer.pipeline.logits(torch.tensor([a]))[0, :, :512]
        want_b = trainer.pipeline.logits(torch.tensor([b]))[0, :, :512]

    model, _, _ = load_model(tmp_path / "ckpt", device="cpu")
    calls = []
    real = type(model).hidden_states
    monkeypatch.setattr(type(model), "hidden_states", lambda m, *args: calls.append(1) or real(m, *args))
    cache = PagedKVCache(
        model.cfg, num_blocks=16, block_size=4, dtype=torch.float32, device=torch.device("cpu")
    )
    runner = ModelRunner(model, cache)
    blocks_a, blocks_b = cache.allocator.allocate(8), cache.allocator.allocate(3)
    runner.forward([Segment(a[:17], 0, blocks_a, sample=False)])  # the first part of a's prompt
    got = runner.forward([Segment(a[17:29], 17, blocks_a), Segment(b, 0, blocks_b)])  # its rest, and b
    step = runner.forward([Segment(a[29:], 29, blocks_a)])  # decoding a's next token
    assert len(calls) == 3  # one model forward per step
    torch.testing.assert_close(got[0], want_a[28], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want_b[8], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(step[0], want_a[29], rtol=1e-5, atol=1e-5)


def test_moe_checkpoint_generates_as_the_plain_model(tmp_path):
    """A mixture-of-experts checkpoint (trained with a capacity factor) served with continuous
    batching: greedy tokens equal the cache-less forward of the plain model, which is dropless."""
    from mlm.model.kinds.moe.module import MoE
    from tests.helpers.inference import MOE, model_checkpoint

    model, _, _ = load_model(model_checkpoint(tmp_path, MOE), device="cpu")
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    assert len(moes) == 2 and all(m.options.capacity_factor is None for m in moes)  # served dropless
    ps = prompts(model.cfg.vocab_size, [5, 30, 1, 12])
    engine = Engine(model, None, EngineConfig(max_seqs=3, max_tokens_per_step=16, block_size=4))
    for p, r in zip(ps, staggered(engine, [(p, GREEDY) for p in ps]), strict=True):
        assert r.token_ids == greedy(model, p, GREEDY.max_tokens)
    assert engine.cache.allocator.num_used == 0
