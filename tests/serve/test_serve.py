"""`mlm serve` over real HTTP: a uvicorn server on a free loopback port, driven by the official
`openai` client (completions, chat, streaming) and by plain HTTP for every error case, Megatron's
`PUT /api`, `/metrics`; a client that disconnects must free its cache blocks; a bounded load test
(64 concurrent streaming clients) must finish with no errors and no leaked blocks.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("transformers")


from mlm.inference.engine import Engine, EngineConfig  # noqa: E402
from mlm.inference.sampling import SamplingParams  # noqa: E402
from mlm.serve.app import Limits, ServerState, create_app  # noqa: E402
from mlm.serve.server import ServerThread  # noqa: E402
from tests.helpers.serve import AUTH, KEY, NAME, assert_api_error, serving, wait_idle  # noqa: E402


@pytest.fixture(scope="module")
def served(tmp_path_factory, hf_tokenizer_json):
    limits = Limits(max_body_bytes=4096, max_tokens=100)
    with serving(tmp_path_factory.mktemp("serve"), hf_tokenizer_json, limits) as served:
        yield served


def expected(state: ServerState, ids: list[int], max_tokens: int) -> str:
    """Greedy text of a separate engine on the same model, run in this thread."""
    (r,) = Engine(state.engine.model, state.tokenizer).generate([ids], SamplingParams(max_tokens=max_tokens))
    return r.text


def test_openai_client_completions_chat_and_streaming(served):
    server, state = served
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == [NAME]

    prompt = "def main(argv):"
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0, logprobs=2)
    (choice,) = r.choices
    assert choice.text == expected(state, state.tokenizer.encode(prompt), 12)
    assert r.usage.prompt_tokens == len(state.tokenizer.encode(prompt))
    assert r.usage.completion_tokens == len(choice.logprobs.tokens) <= 12
    # keyed by token text, so two tokens that decode alike (say, to U+FFFD) share an entry
    assert all(1 <= len(top) <= 2 for top in choice.logprobs.top_logprobs)
    assert "".join(choice.logprobs.tokens).startswith(choice.text.rstrip("\ufffd"))

    chunks = list(
        client.completions.create(
            model=NAME,
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    ids = state.tokenizer.encode_plain(state.chat.render(messages))
    chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0)
    assert chat.choices[0].message.content == expected(state, ids, 10)
    assert chat.choices[0].message.role == "assistant" and chat.usage.prompt_tokens == len(ids)
    stream = list(
        client.chat.completions.create(
            model=NAME, messages=messages, max_tokens=10, temperature=0, stream=True
        )
    )
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == chat.choices[0].message.content
    assert stream[-1].choices[0].finish_reason == chat.choices[0].finish_reason

    seeded = [
        client.completions.create(model=NAME, prompt="x = ", max_tokens=16, temperature=1.0, seed=5)
        .choices[0]
        .text
        for _ in range(2)
    ]
    assert seeded[0] == seeded[1]
    lp = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    assert all(len(t.top_logprobs) == 3 for t in lp.choices[0].logprobs.content)


def test_error_cases_over_plain_http(served):
    server, state = served
    url = f"{server.url}/v1/completions"
    ok = {"model": NAME, "prompt": "hi", "max_tokens": 2}
    with httpx.Client(timeout=30) as http:
        assert_api_error(http.post(url, json=ok), 401, code="invalid_api_key")
        assert_api_error(
            http.post(url, json=ok, headers={"Authorization": "Bearer nope"}), 401, code="invalid_api_key"
        )
        assert_api_error(
            http.post(url, json={**ok, "model": "gpt-5"}, headers=AUTH),
            404,
            param="model",
            code="model_not_found",
        )
        assert_api_error(http.get(f"{server.url}/v1/nothing", headers=AUTH), 404)
        assert_api_error(
            http.post(url, json={**ok, "temperature": 5}, headers=AUTH), 400, param="temperature"
        )
        assert_api_error(http.post(url, json={"model": NAME}, headers=AUTH), 400, param="prompt")
        assert_api_error(
            http.post(url, json={**ok, "max_tokens": "many"}, headers=AUTH), 400, param="max_tokens"
        )
        assert_api_error(
            http.post(url, json={**ok, "max_tokens": 101}, headers=AUTH), 400, param="max_tokens"
        )
        too_long = {**ok, "prompt": [5] * 120, "max_tokens": 20}  # context 128
        assert_api_error(
            http.post(url, json=too_long, headers=AUTH),
            400,
            param="max_tokens",
            code="context_length_exceeded",
        )
        full = {**ok, "prompt": [5] * 128}
        assert_api_error(
            http.post(url, json=full, headers=AUTH), 400, param="prompt", code="context_length_exceeded"
        )
        bad_token = {**ok, "prompt": [10**6]}
        assert_api_error(http.post(url, json=bad_token, headers=AUTH), 400, param="prompt")
        chat = f"{server.url}/v1/chat/completions"
        assert_api_error(
            http.post(chat, json={"model": NAME, "messages": []}, headers=AUTH), 400, param="messages"
        )
        big = {**ok, "prompt": "x" * 5000}
        assert_api_error(http.post(url, json=big, headers=AUTH), 413)
        assert_api_error(http.post(url, content=b'{"prompt": "hi",', headers=AUTH), 422)
        assert_api_error(http.post(url, content=b"[1, 2]", headers=AUTH), 422)
        # none of it disturbed the server
        r = http.post(url, json=ok, headers=AUTH)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    wait_idle(state.engine)
    assert state.engine.cache.allocator.num_used == 0


def test_tokenizer_endpoints_echo_and_several_prompts(served):
    """What lm-evaluation-harness's `local-completions` sends besides the plain completion: vLLM's
    tokenizer endpoints (its remote tokenizer), token-id prompts in a list, and `echo`."""
    server, state = served
    tok = state.tokenizer
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as http:
        info = http.get("/tokenizer_info").json()
        assert (
            info["eos_token"] == tok.token_text(tok.eod_id)
            and tok.token_to_id(info["eos_token"]) == tok.eod_id
        )
        assert info["chat_template"] == state.chat.source and info["model_max_length"] == state.context
        text = "def main(argv):\n    return 0"
        r = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
        assert r["tokens"] == tok.encode_plain(text) and r["count"] == len(r["tokens"])
        assert http.post("/tokenize", json={"prompt": text}).json()["tokens"] == tok.encode(text)
        assert http.post("/detokenize", json={"tokens": r["tokens"]}).json() == {
            "prompt": tok.decode(r["tokens"])
        }
        assert_api_error(http.post("/detokenize", json={"tokens": [1, 10**6]}), 400, param="tokens")
        assert_api_error(httpx.get(f"{server.url}/tokenizer_info"), 401, code="invalid_api_key")

        prompts = [tok.encode("x = "), tok.encode("class A:")]
        body = {"model": NAME, "prompt": prompts, "max_tokens": 5, "temperature": 0, "n": 2, "echo": True}
        r = http.post("/v1/completions", json=body).json()
        assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]  # prompt by prompt, n each
        for c in r["choices"]:
            ids = prompts[c["index"] // 2]
            assert c["text"] == tok.decode(ids) + expected(state, ids, 5)
        assert r["usage"]["prompt_tokens"] == len(prompts[0]) + len(prompts[1])
        texts = http.post(
            "/v1/completions", json={**body, "prompt": ["x = ", "y"], "n": 1, "echo": False}
        ).json()
        assert [c["text"] for c in texts["choices"]] == [
            expected(state, tok.encode(p), 5) for p in ("x = ", "y")
        ]
        stream = {**body, "stream": True, "echo": False}
        assert_api_error(http.post("/v1/completions", json=stream), 400, param="stream")
        assert_api_error(
            http.post("/v1/completions", json={**body, "prompt": "x", "stream": True}), 400, param="echo"
        )
    wait_idle(state.engine)
    assert state.engine.cache.allocator.num_used == 0


def test_prompt_logprobs_equal_transformers(served):
    """A loglikelihood request as lm-evaluation-harness's `local-completions` sends it (token-id
    prompts, echo, logprobs 1, max_tokens 1): every prompt token's log-prob after the first equals
    transformers' log-softmax on the same weights (1e-4 absolute; the served model is the one
    `tiny_llama_checkpoint` imported, rebuilt here from its seed), the first is null, and the top
    entry is the most likely token (how lm-eval decides `is_greedy`)."""
    import torch

    from tests.helpers.hf_models import llama as hf_llama

    server, state = served
    tok = state.tokenizer
    hf = hf_llama(
        tie=False, seed=3, vocab_size=state.engine.model.cfg.vocab_size, rms_norm_eps=1e-6, rope_scaling=None
    )
    prompts = [tok.encode("def main(argv):\n    return 0"), tok.encode("x = [1, 2, 3]")]
    body = {
        "model": NAME,
        "prompt": prompts,
        "max_tokens": 1,
        "temperature": 0,
        "logprobs": 1,
        "echo": True,
        "seed": 1234,
    }
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as http:
        r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    for ids, c in zip(prompts, sorted(r.json()["choices"], key=lambda c: c["index"]), strict=True):
        lp = c["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids) + 1 and lp["token_logprobs"][0] is None
        assert lp["tokens"][: len(ids)] == [tok.decode([i]) for i in ids]
        with torch.no_grad():
            theirs = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1)
        want = [float(theirs[j, ids[j + 1]]) for j in range(len(ids) - 1)]
        assert lp["token_logprobs"][1 : len(ids)] == pytest.approx(want, abs=1e-4)
        for j, top in enumerate(lp["top_logprobs"][1 : len(ids)]):
            (value,) = top.values()
            assert value == pytest.approx(float(theirs[j].max()), abs=1e-4)
    wait_idle(state.engine)
    assert state.engine.cache.allocator.num_used == 0


def test_busy_429_and_loading_503(served):
    _, state = served
    loading = ServerState(NAME)
    with ServerThread(create_app(loading)) as server, httpx.Client(timeout=30) as http:
        body = {"model": NAME, "prompt": "hi", "max_tokens": 2}
        assert http.get(f"{server.url}/health").status_code == 503
        r = http.post(f"{server.url}/v1/completions", json=body)
        assert_api_error(r, 503)
        assert r.headers["Retry-After"] == "1"
        # loaded, but the engine's loop is not running and one request already waits: full
        engine = Engine(state.engine.model, state.tokenizer, EngineConfig(max_waiting=1))
        loading.ready(engine, state.tokenizer, state.chat)
        engine.submit([1, 2], SamplingParams(), lambda out: None)
        assert http.get(f"{server.url}/health").json()["status"] == "ok"
        r = http.post(f"{server.url}/v1/completions", json=body)
        assert_api_error(r, 429)
        assert r.headers["Retry-After"] == "1"


def test_megatron_put_api(served):
    server, state = served
    body = {"prompts": ["def f(x):", "import os"], "tokens_to_generate": 6, "top_k": 1, "logprobs": True}
    r = httpx.put(f"{server.url}/api", json=body, headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    out = r.json()
    for prompt, text, segments, lps in zip(
        body["prompts"], out["text"], out["segments"], out["logprobs"], strict=True
    ):
        ids = state.tokenizer.encode_plain(prompt)
        assert text == prompt + expected(state, ids, 6)
        assert len(segments) == len(ids) + len(lps) and 1 <= len(lps) <= 6
    r = httpx.put(f"{server.url}/api", json={"prompts": "hi"}, headers=AUTH)
    assert_api_error(r, 400, param="prompts")
    r = httpx.put(f"{server.url}/api", json={"prompts": ["hi"], "top_k": 2, "top_p": 0.5}, headers=AUTH)
    assert_api_error(r, 400, param="top_p")


def test_metrics(served):
    server, _ = served
    r = httpx.post(
        f"{server.url}/v1/completions", json={"prompt": "a", "max_tokens": 3}, headers=AUTH, timeout=30
    )
    assert r.status_code == 200
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": "a"}, headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    text = httpx.get(f"{server.url}/metrics").text
    lines = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert float(lines['mlm_http_requests_total{endpoint="/v1/completions",status="200"}']) >= 1
    assert float(lines['mlm_http_requests_total{endpoint="/tokenize",status="200"}']) >= 1  # not "other"
    assert float(lines["mlm_time_to_first_token_seconds_count"]) >= 1
    assert float(lines["mlm_request_latency_seconds_count"]) >= 1
    assert float(lines["mlm_generation_tokens_total"]) >= 3
    assert float(lines["mlm_step_batch_size_count"]) >= 1
    assert lines["mlm_queue_length"] == "0.0" and float(lines["mlm_kv_blocks_total"]) > 0
    assert "mlm_running_sequences" in lines and 'mlm_finished_requests_total{reason="length"}' in lines


def test_client_disconnect_frees_cache_blocks(served, monkeypatch):
    server, state = served
    engine = state.engine
    forward = engine.runner.forward

    def slow(chunks):  # so that the request is surely still running when the client leaves
        time.sleep(0.005)
        return forward(chunks)

    monkeypatch.setattr(engine.runner, "forward", slow)
    wait_idle(engine)
    aborted = engine.finished["abort"]
    body = {"prompt": "hello", "max_tokens": 100, "ignore_eos": True, "logprobs": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=30) as r:
        first = next(line for line in r.iter_lines() if line.startswith("data:"))
        assert json.loads(first[5:])["choices"][0]["logprobs"]["tokens"]
        assert engine.cache.allocator.num_used > 0
    wait_idle(engine)
    assert engine.finished["abort"] == aborted + 1 and engine.cache.allocator.num_used == 0

    with pytest.raises(httpx.ReadTimeout):  # not streaming: the client gives up waiting
        httpx.post(f"{server.url}/v1/completions", json={**body, "stream": False}, headers=AUTH, timeout=0.2)
    wait_idle(engine)
    assert engine.finished["abort"] == aborted + 2 and engine.cache.allocator.num_used == 0


def test_load_64_streaming_clients(served):
    """64 concurrent streaming clients, 128 requests of mixed lengths: no errors, no leaked blocks;
    prints p50/p99 time to first token and tokens/s."""
    server, state = served
    requests = [
        {"prompt": [(13 * i + j) % 500 + 1 for j in range(4 + (i * 7) % 57)], "max_tokens": 4 + (i * 5) % 21}
        for i in range(128)
    ]

    async def one(http: httpx.AsyncClient, body: dict, gate: asyncio.Semaphore) -> tuple[float, int]:
        async with gate:
            start = time.perf_counter()
            ttft, tokens = None, 0
            payload = {**body, "stream": True, "logprobs": 0, "ignore_eos": True, "temperature": 0}
            async with http.stream("POST", "/v1/completions", json=payload) as r:
                assert r.status_code == 200, await r.aread()
                async for line in r.aiter_lines():
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[5:])
                    assert "error" not in chunk, chunk
                    n = len((chunk["choices"][0]["logprobs"] or {}).get("tokens", []))
                    if n and ttft is None:
                        ttft = time.perf_counter() - start
                    tokens += n
            assert tokens == body["max_tokens"]
            return ttft, tokens

    async def main() -> tuple[list, float]:
        gate = asyncio.Semaphore(64)
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=120, limits=limits) as http:
            start = time.perf_counter()
            results = await asyncio.gather(*(one(http, b, gate) for b in requests))
            return results, time.perf_counter() - start

    results, seconds = asyncio.run(main())
    wait_idle(state.engine)
    assert state.engine.cache.allocator.num_used == 0 and state.engine.num_waiting == 0
    ttfts = sorted(t for t, _ in results)
    tokens = sum(n for _, n in results)
    p99 = ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))]
    print(
        f"\nload: {len(requests)} requests, 64 concurrent streaming clients, {tokens} tokens in {seconds:.2f} s: "
        f"{tokens / seconds:.0f} tokens/s; time to first token p50 {statistics.median(ttfts) * 1e3:.0f} ms, "
        f"p99 {p99 * 1e3:.0f} ms"
    )
