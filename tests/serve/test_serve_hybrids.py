"""Serving the imported hybrids (Mamba-2, Nemotron-H, Qwen3-Next: recurrent mixers whose state lives
in slots): the engine and `mlm serve` give transformers' greedy tokens, and 1,000 mixed requests on a
Mamba hybrid leave no state slot or cache block taken. The mixer kinds themselves:
tests/unit/test_mamba.py, tests/unit/test_gdn.py, tests/distributed/test_recurrent_mixers.py.
"""

from __future__ import annotations

import pytest
import torch

from mlm.config import MambaConfig, ModelConfig
from mlm.model import build_model

SMALL = ModelConfig(
    num_layers=3,
    hidden_size=32,
    vocab_size=64,
    layer_pattern="MM-M",
    mamba=MambaConfig(head_dim=8, state_dim=16, num_groups=2, chunk_size=8),
)


@pytest.mark.parametrize("arch", ["mamba2", "nemotron_h", "nemotron_h-moe", "qwen3_next"])
def test_serving_an_imported_hybrid_generates_transformers_greedy_tokens(arch):
    """Three prompts batched through the engine (prefill in chunks, then decode) give, each,
    transformers' greedy 32 tokens: Mamba-2, and Nemotron-H (Mamba-2, attention without
    positions, squared-ReLU MLPs; and with its MoE blocks), Qwen3-Next (Gated DeltaNet, gated
    attention, MoE)."""
    pytest.importorskip("transformers")
    from mlm.convert.hf import config_from_hf, load_hf_into
    from mlm.inference.engine import Engine, EngineConfig
    from mlm.inference.sampling import SamplingParams
    from mlm.model.gpt import GPT
    from tests.helpers import hf_models

    hf = hf_models.ARCHS[arch].build()
    model = load_hf_into(GPT(config_from_hf(hf.config.to_dict())).eval(), hf)
    prompts = [[5, 17, 42, 7, 99, 3], [1, 2, 3], list(range(10, 40))]
    engine = Engine(model, config=EngineConfig(max_seqs=3, max_tokens_per_step=16, packed_weights=False))
    outs = engine.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0))
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            theirs = hf.generate(
                torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0
            )[0, len(prompt) :].tolist()
        assert out.token_ids == theirs


def test_mlm_serve_gives_a_nemotron_h_import_transformers_greedy_text(tmp_path, hf_tokenizer_json):
    """`mlm serve` (the HTTP server, in a thread) on an imported Nemotron-H with MoE blocks: a greedy
    completion's text is transformers' greedy tokens decoded, and every state slot comes back."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    from mlm.convert.hf.folder import import_hf
    from mlm.inference.engine import EngineConfig
    from mlm.serve.app import Limits, ServerState, create_app
    from mlm.serve.server import ServerThread, load_into
    from tests.helpers.hf_models import NEMOTRON_MOE, nemotron_h

    tokenizer = Tokenizer.from_file(str(hf_tokenizer_json))
    hf = nemotron_h(**NEMOTRON_MOE, vocab_size=tokenizer.get_vocab_size())
    hf.save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer.json").write_bytes(hf_tokenizer_json.read_bytes())
    import_hf(tmp_path / "hf", tmp_path / "ckpt")
    state = ServerState("nemotron", api_key="k", limits=Limits())
    engine = load_into(
        state, str(tmp_path / "ckpt"), EngineConfig(max_seqs=4, max_tokens_per_step=8), device="cpu"
    )
    prompt = "def main(argv):"
    ids = tokenizer.encode(prompt).ids
    with torch.no_grad():
        theirs = hf.generate(
            torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(ids) :].tolist()
    try:
        with ServerThread(create_app(state)) as server, httpx.Client(timeout=60) as http:
            body = {
                "model": "nemotron",
                "prompt": prompt,
                "max_tokens": 16,
                "temperature": 0,
                "ignore_eos": True,
            }
            r = http.post(f"{server.url}/v1/completions", json=body, headers={"Authorization": "Bearer k"})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == tokenizer.decode(theirs)
    finally:
        engine.stop()
    pool = engine.runner.states
    assert pool is not None and pool.num_free == pool.num_slots


def test_a_thousand_mixed_requests_leave_no_state_slot_taken():
    """1,000 requests (greedy and sampled, stop tokens, aborts while waiting, running or done) on a
    Mamba hybrid, with few slots and cache blocks (preemptions): each finishes, and afterwards
    every state slot and cache block is free."""
    import dataclasses
    import random

    from mlm.inference.engine import Engine, EngineConfig
    from mlm.inference.sampling import SamplingParams

    model = build_model(dataclasses.replace(SMALL, layer_pattern="M*-M-"), "cpu", seed=5).eval()
    rng = random.Random(1)
    config = EngineConfig(max_seqs=6, max_tokens_per_step=48, block_size=4, num_blocks=24, max_waiting=64)
    engine = Engine(model, None, config)
    finished: dict[str, str] = {}
    aborts: list[tuple[int, str]] = []
    submitted = step = 0
    while submitted < 1000 or engine.has_work():
        while submitted < 1000 and engine.num_waiting < 12:
            params = SamplingParams(
                max_tokens=rng.randint(1, 12),
                temperature=rng.choice([0.0, 0.8]),
                seed=submitted,
                stop_token_ids=tuple(rng.randrange(64) for _ in range(3)) if rng.random() < 0.3 else (),
                ignore_eos=True,
            )
            rid = f"r{submitted}"
            prompt = [rng.randrange(64) for _ in range(rng.randint(1, 20))]

            def done(out, rid=rid):
                if out.finish_reason:
                    finished[rid] = out.finish_reason

            engine.submit(prompt, params, done, rid)
            if rng.random() < 0.1:
                aborts.append((step + rng.randint(0, 6), rid))
            submitted += 1
        for rid in [rid for at, rid in aborts if at == step]:
            engine.abort(rid)
        engine.step()
        step += 1
    pool, blocks = engine.runner.states, engine.cache.allocator
    assert len(finished) == 1000 and engine.num_running == engine.num_waiting == 0
    assert pool.num_free == pool.num_slots and blocks.num_used == 0
    assert engine.stats.preemptions > 0 and {"abort", "stop", "length"} <= set(finished.values())
