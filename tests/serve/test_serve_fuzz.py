"""`mlm serve` against the fuzz findings of issue 19, and the features they exposed (`n`,
`logit_bias`, `best_of`).

Each fuzz case sends its bad requests on ONE keep-alive connection shared by all cases, expects a
4xx in OpenAI's shape (or a correct 200), then sends the normal greedy request, whose text must
equal the reference, on the same connection (the client's local port never changes).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from dataclasses import dataclass, field

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("transformers")

from mlm.inference import engine as engine_module  # noqa: E402
from mlm.inference import sampling  # noqa: E402
from mlm.inference.engine import Engine, EngineConfig  # noqa: E402
from mlm.inference.sampling import SamplingParams  # noqa: E402
from mlm.serve import app as app_module  # noqa: E402
from mlm.serve.app import Limits, ServerState, create_app  # noqa: E402
from mlm.serve.server import ServerThread  # noqa: E402
from tests.helpers.serve import AUTH, KEY, assert_api_error, serving, wait_idle  # noqa: E402

PROMPT = "def main(argv):"
GREEDY = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}
FAIL_SEED = 424242
"""Requests with this seed fail in sampling when a case makes them (`failing_choose`)."""


@dataclass
class Fuzz:
    server: object
    state: object
    http: httpx.Client
    reference: str
    """The greedy text of GREEDY, from an engine in this thread."""
    ports: set[int] = field(default_factory=set)
    """The client's local port of every response: one connection."""

    def send(self, method: str, path: str, body: dict | None = None, content: bytes | None = None, **kw):
        """`body` as ASCII JSON (a lone surrogate goes out as its "\\ud800" escape)."""
        if body is not None:
            content = json.dumps(body).encode()
        return self.http.request(method, path, content=content, **kw)

    def record(self, r: httpx.Response) -> None:
        """An event hook: runs on the response's headers, while its connection is surely open."""
        self.ports.add(r.extensions["network_stream"].get_extra_info("client_addr")[1])

    def post(self, path: str, body: dict, **kw):
        return self.send("POST", path, body, **kw)

    def greedy(self, **kw) -> None:
        """The normal request: the reference text, on the one connection."""
        r = self.post("/v1/completions", GREEDY, **kw)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == self.reference
        assert len(self.ports) == 1, f"the connection was not kept alive: local ports {self.ports}"


def engine_run(state, prompt_ids: list[int], params: SamplingParams):
    (r,) = Engine(state.engine.model, state.tokenizer).generate([prompt_ids], params)
    return r


@pytest.fixture(scope="module")
def fuzz(tmp_path_factory, hf_tokenizer_json):
    limits = Limits(max_tokens=100)  # the default body limit of 1 MiB: a 100k-deep array fits
    with serving(tmp_path_factory.mktemp("fuzz"), hf_tokenizer_json, limits) as (server, state):
        reference = engine_run(state, state.tokenizer.encode(PROMPT), SamplingParams(max_tokens=8)).text
        with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as http:
            f = Fuzz(server, state, http, reference)
            http.event_hooks["response"] = [f.record]
            f.greedy()
            yield f


def slow_steps(monkeypatch, engine: Engine, seconds: float = 0.02) -> None:
    """Every engine step takes at least `seconds`, so that a request of 90 tokens is surely still
    running when its client goes away."""
    forward = engine.runner.forward

    def slow(segments):
        time.sleep(seconds)
        return forward(segments)

    monkeypatch.setattr(engine.runner, "forward", slow)


def failing_choose(monkeypatch) -> None:
    """Sampling raises for the requests seeded FAIL_SEED (choose is called per sampled row)."""
    real = sampling.choose

    def choose(logits_V, p, gen, prompt_ids, output_ids):
        if p.seed == FAIL_SEED:
            raise RuntimeError("a sampling fault")
        return real(logits_V, p, gen, prompt_ids, output_ids)

    monkeypatch.setattr(sampling, "choose", choose)


# ---------------------------------------------------------------------- the fuzz cases


def case_1_lone_surrogates(f: Fuzz, monkeypatch) -> None:
    for method, path, body, param in [
        ("POST", "/v1/completions", {"prompt": "\ud800"}, "prompt"),
        ("POST", "/v1/completions", {"prompt": ["a\udc00b"]}, "prompt.0"),
        ("POST", "/v1/completions", {"prompt": "hi", "stop": ["ok", "\udfff"]}, "stop.1"),
        (
            "POST",
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "\ud800"}]},
            "messages.0.content",
        ),
        (
            "POST",
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "x\ud83d"}]}]},
            "messages.0.content.0.text",
        ),
        ("PUT", "/api", {"prompts": ["ok", "\ud800"], "tokens_to_generate": 2}, "prompts.1"),
    ]:
        err = assert_api_error(f.send(method, path, body), 400, param=param)
        assert "lone UTF-16 surrogate" in err["message"]
    # a surrogate pair (JSON's escape of U+1F600) is valid text
    r = f.post("/v1/completions", {"prompt": "\U0001f600", "max_tokens": 2})
    assert r.status_code == 200, r.text


def case_2_seeds_outside_64_bits(f: Fuzz, monkeypatch) -> None:
    for path, body in [
        ("/v1/completions", {"prompt": "hi", "seed": 2**64 + 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "seed": -(2**63) - 1}),
    ]:
        err = assert_api_error(f.post(path, body), 400, param="seed")
        assert f"[{-(2**63)}, {2**64 - 1}]" in err["message"]
    err = assert_api_error(
        f.send("PUT", "/api", {"prompts": ["hi"], "random_seed": 2**70}), 400, param="random_seed"
    )
    assert str(2**64 - 1) in err["message"]
    for seed in (2**64 - 1, -(2**63)):  # the ends of the range are seeds
        r = f.post("/v1/completions", {"prompt": "hi", "max_tokens": 3, "temperature": 1, "seed": seed})
        assert r.status_code == 200, r.text
    r = f.send("PUT", "/api", {"prompts": ["hi"], "tokens_to_generate": 3, "random_seed": 2**64 - 1})
    assert r.status_code == 200, r.text


def case_3_sampling_that_went_nan(f: Fuzz, monkeypatch) -> None:
    # tiny temperatures and top_p (0 in fp32) keep only the most likely token: the greedy text
    for extra in ({"temperature": 1e-40}, {"temperature": 5e-324}, {"temperature": 1.0, "top_p": 1e-300}):
        r = f.post("/v1/completions", {**GREEDY, **extra, "seed": 1})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == f.reference, extra
    # a repetition penalty of 1e-40 makes seen tokens' logits huge (clamped to fp32's range)
    ids = f.state.tokenizer.encode(PROMPT)
    body = {"prompt": ids, "max_tokens": 8, "temperature": 1.0, "repetition_penalty": 1e-40, "seed": 3}
    r = f.post("/v1/completions", {**body, "ignore_eos": True})
    assert r.status_code == 200, r.text
    params = SamplingParams(max_tokens=8, temperature=1.0, repetition_penalty=1e-40, seed=3, ignore_eos=True)
    run = engine_run(f.state, ids, params)
    assert r.json()["choices"][0]["text"] == run.text and len(run.token_ids) == 8
    assert set(run.token_ids) <= set(ids)  # only the prompt's tokens (all have positive logits here)


def case_4_failure_alongside_a_stream(f: Fuzz, monkeypatch) -> None:
    """A request whose sampling fails (and the requests of case 3, which used to) while a greedy
    stream runs in the same batches: they get their answers, the stream its full greedy text."""
    state = f.state
    failing_choose(monkeypatch)
    forward = state.engine.runner.forward

    def slow(segments):  # the stream alone is slow: it surely outlasts the other requests
        if len(segments) == 1:
            time.sleep(0.03)
        return forward(segments)

    monkeypatch.setattr(state.engine.runner, "forward", slow)
    batches = []
    real_sample = engine_module.sample

    def sample(logits_BV, params, *args):
        if any(p.seed == FAIL_SEED for p in params):
            batches.append(len(params))
        return real_sample(logits_BV, params, *args)

    monkeypatch.setattr(engine_module, "sample", sample)
    ids = state.tokenizer.encode(PROMPT)
    want = engine_run(state, ids, SamplingParams(max_tokens=100, ignore_eos=True)).text
    body = {"prompt": PROMPT, "max_tokens": 100, "ignore_eos": True, "temperature": 0, "stream": True}
    events: list[dict] = []
    first = threading.Event()

    def read_stream() -> None:
        with httpx.stream("POST", f"{f.server.url}/v1/completions", json=body, headers=AUTH, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
                    first.set()

    reader = threading.Thread(target=read_stream)
    reader.start()
    assert first.wait(30)
    err = assert_api_error(f.post("/v1/completions", {**GREEDY, "temperature": 1.0, "seed": FAIL_SEED}), 500)
    assert "sampling failed: RuntimeError: a sampling fault" in err["message"]
    for extra in (
        {"temperature": 5e-324},
        {"temperature": 1.0, "top_p": 1e-300},
        {"repetition_penalty": 1e-40},
    ):
        r = f.post("/v1/completions", {**GREEDY, **extra})
        assert r.status_code == 200, r.text
    running = state.engine.num_running
    reader.join(60)
    assert running == 1, "the stream ended before the other requests were done"
    assert batches and max(batches) >= 2, "the failing request never shared a batch"
    assert not [e for e in events if "error" in e]
    assert "".join(e["choices"][0]["text"] for e in events) == want
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert state.engine.finished["error"] >= 1


def case_5_json_the_parser_rejects(f: Fuzz, monkeypatch) -> None:
    deep = b"[" * 100_000 + b"]" * 100_000
    for method, path, key in [
        ("POST", "/v1/completions", b"prompt"),
        ("POST", "/v1/chat/completions", b"messages"),
        ("PUT", "/api", b"prompts"),
    ]:
        for content in (
            b'{"%s": %s}' % (key, deep),
            b'{"%s": ["hi"], "seed": %s}' % (key, b"9" * 5000),
            b'{"%s": ["hi"], "temperature": NaN}' % key,
        ):
            err = assert_api_error(f.send(method, path, content=content), 422)
            assert "not valid JSON" in err["message"]
    # 1e400 is valid JSON but inf as a float: out of range
    r = f.send("POST", "/v1/completions", content=b'{"prompt": "hi", "temperature": 1e400}')
    assert_api_error(r, 400, param="temperature")
    assert_api_error(
        f.send("PUT", "/api", content=b'{"prompts": ["hi"], "temperature": 1e400}'), 400, param="temperature"
    )


def case_6_a_real_server_fault(f: Fuzz, monkeypatch) -> None:
    """Faults of the server itself: a 500 before the response, an error event inside a stream;
    the connection stays usable after both."""
    tok = f.state.tokenizer

    def broken(text):
        raise RuntimeError("the tokenizer broke")

    with monkeypatch.context() as m:
        m.setattr(tok, "encode", broken)
        err = assert_api_error(f.post("/v1/completions", {"prompt": "hi"}), 500)
        assert err["type"] == "server_error" and "RuntimeError: the tokenizer broke" in err["message"]
    with monkeypatch.context() as m:
        m.setattr(app_module, "_completion_logprobs", lambda *a: 1 / 0)
        r = f.post("/v1/completions", {**GREEDY, "logprobs": 1, "stream": True})
        assert r.status_code == 200
        lines = [line for line in r.text.splitlines() if line.startswith("data: ")]
        assert "ZeroDivisionError" in json.loads(lines[-2][6:])["error"]["message"]
        assert lines[-1] == "data: [DONE]"
    metrics = httpx.get(f"{f.server.url}/metrics").text
    assert 'mlm_http_requests_total{endpoint="/v1/completions",status="500"}' in metrics


def case_7_ignored_fields_and_lower_case_bearer(f: Fuzz, monkeypatch) -> None:
    state, tok = f.state, f.state.tokenizer
    for scheme in ("bearer", "BEARER"):
        r = f.post("/v1/completions", GREEDY, headers={"Authorization": f"{scheme} {KEY}"})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == f.reference
    assert_api_error(
        f.post("/v1/completions", GREEDY, headers={"Authorization": f"Basic {KEY}"}),
        401,
        code="invalid_api_key",
    )

    # logit_bias: +100 forces a token, -100 forbids the greedy one
    ids = tok.encode(PROMPT)
    forced = tok.encode(" return")[0]
    r = f.post("/v1/completions", {**GREEDY, "logit_bias": {str(forced): 100}, "ignore_eos": True})
    assert r.json()["choices"][0]["text"] == tok.decode([forced] * 8)
    t0 = engine_run(state, ids, SamplingParams(max_tokens=8)).token_ids[0]
    banned = engine_run(state, ids, SamplingParams(max_tokens=8, logit_bias=((t0, -100.0),)))
    assert banned.token_ids[0] != t0
    r = f.post("/v1/completions", {**GREEDY, "logit_bias": {str(t0): -100}})
    assert r.json()["choices"][0]["text"] == banned.text != f.reference
    vocab = state.engine.model.cfg.vocab_size
    err = assert_api_error(
        f.post("/v1/completions", {**GREEDY, "logit_bias": {str(vocab): 1}}), 400, param="logit_bias"
    )
    assert f"token id {vocab} is outside the vocabulary" in err["message"]
    assert_api_error(f.post("/v1/completions", {**GREEDY, "logit_bias": {"x": 1}}), 400, param="logit_bias")
    assert_api_error(
        f.post("/v1/completions", {**GREEDY, "logit_bias": {"5": 101}}), 400, param="logit_bias.5"
    )
    many = {str(i): 1 for i in range(301)}
    assert_api_error(f.post("/v1/completions", {**GREEDY, "logit_bias": many}), 400, param="logit_bias")

    # best_of: the candidates are those of n = best_of with the same seed; the best by summed log-prob
    sampled = {"prompt": PROMPT, "max_tokens": 6, "temperature": 1.0, "seed": 11}
    r = f.post("/v1/completions", {**sampled, "n": 4, "logprobs": 0}).json()
    score = {c["text"]: sum(c["logprobs"]["token_logprobs"]) for c in r["choices"]}
    assert len(score) > 1
    r = f.post("/v1/completions", {**sampled, "best_of": 4, "n": 2}).json()
    assert [c["text"] for c in r["choices"]] == sorted(score, key=score.get, reverse=True)[:2]
    assert [c["index"] for c in r["choices"]] == [0, 1] and r["choices"][0]["logprobs"] is None
    assert_api_error(f.post("/v1/completions", {**sampled, "best_of": 2, "n": 3}), 400, param="best_of")
    assert_api_error(
        f.post("/v1/completions", {**sampled, "best_of": 2, "stream": True}), 400, param="best_of"
    )


CASES = [
    case_1_lone_surrogates,
    case_2_seeds_outside_64_bits,
    case_3_sampling_that_went_nan,
    case_4_failure_alongside_a_stream,
    case_5_json_the_parser_rejects,
    case_6_a_real_server_fault,
    case_7_ignored_fields_and_lower_case_bearer,
]


@pytest.mark.parametrize("case", CASES, ids=[c.__name__ for c in CASES])
def test_fuzz_case_then_the_same_greedy_text_on_the_same_connection(fuzz, case, monkeypatch):
    case(fuzz, monkeypatch)
    monkeypatch.undo()
    fuzz.greedy()
    wait_idle(fuzz.state.engine)
    assert fuzz.state.engine.cache.allocator.num_used == 0


# ---------------------------------------------------------------------- n > 1


def test_n_choices(fuzz):
    f = fuzz
    n3 = f.post("/v1/completions", {**GREEDY, "n": 3}).json()
    assert [c["index"] for c in n3["choices"]] == [0, 1, 2]
    assert [c["text"] for c in n3["choices"]] == [f.reference] * 3
    one = f.post("/v1/completions", GREEDY).json()
    assert n3["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]  # the prompt counted once
    assert n3["usage"]["completion_tokens"] == 3 * one["usage"]["completion_tokens"]

    sampled = {"prompt": PROMPT, "max_tokens": 12, "temperature": 1.0, "seed": 5, "ignore_eos": True}
    texts = [c["text"] for c in f.post("/v1/completions", {**sampled, "n": 3}).json()["choices"]]
    assert len(set(texts)) == 3
    assert texts[0] == f.post("/v1/completions", sampled).json()["choices"][0]["text"]  # choice 0: the seed
    assert texts[1] == f.post("/v1/completions", {**sampled, "seed": 6}).json()["choices"][0]["text"]

    messages = [{"role": "user", "content": "Hello!"}]
    chat = f.post(
        "/v1/chat/completions", {"messages": messages, "max_tokens": 6, "temperature": 0, "n": 3}
    ).json()
    assert len({c["message"]["content"] for c in chat["choices"]}) == 1 and len(chat["choices"]) == 3

    for path, body, text_of in [
        ("/v1/completions", {**sampled, "n": 3}, lambda c: c["text"]),
        (
            "/v1/chat/completions",
            {"messages": messages, "max_tokens": 6, "temperature": 0, "n": 3},
            lambda c: c["delta"].get("content", ""),
        ),
    ]:
        r = f.post(path, {**body, "stream": True, "stream_options": {"include_usage": True}})
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        got = ["", "", ""]
        for c in chunks[:-1]:
            (choice,) = c["choices"]
            got[choice["index"]] += text_of(choice)
        finished = [c["choices"][0]["index"] for c in chunks[:-1] if c["choices"][0]["finish_reason"]]
        assert sorted(finished) == [0, 1, 2]
        if "messages" in body:
            assert got == [chat["choices"][0]["message"]["content"]] * 3
            roles = [
                c["choices"][0]["index"]
                for c in chunks
                if c["choices"] and "role" in c["choices"][0]["delta"]
            ]
            assert roles == [0, 1, 2]
        else:
            assert got == texts
        usage = chunks[-1]["usage"]
        assert chunks[-1]["choices"] == [] and usage["prompt_tokens"] > 0
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert_api_error(f.post("/v1/completions", {**GREEDY, "n": 17}), 400, param="n")
    f.greedy()


@pytest.mark.parametrize("stream", [True, False])
def test_n_choices_are_all_cancelled_when_the_client_disconnects(fuzz, monkeypatch, stream):
    """n = 3 choices, streamed or not: a client that goes away aborts all three, and their cache
    blocks (shared prompt blocks included) go back."""
    engine = fuzz.state.engine
    slow_steps(monkeypatch, engine)  # 90 steps: surely running when the client leaves at 0.5 s
    wait_idle(engine)
    aborted = engine.finished["abort"]
    body = {"prompt": PROMPT, "max_tokens": 90, "ignore_eos": True, "temperature": 1.0, "n": 3}
    url = f"{fuzz.server.url}/v1/completions"
    if stream:
        with httpx.stream("POST", url, json={**body, "stream": True}, headers=AUTH, timeout=30) as r:
            assert next(line for line in r.iter_lines() if line.startswith("data: {"))
            assert engine.cache.allocator.num_used > 0
    else:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up waiting
            httpx.post(url, json=body, headers=AUTH, timeout=0.5)
    wait_idle(engine)
    assert engine.finished["abort"] == aborted + 3 and engine.cache.allocator.num_used == 0


def test_more_choices_than_may_wait_is_a_400_not_a_429(fuzz):
    """n (or best_of) above --max-waiting can never be queued: a 400 naming the field, not a 429
    that tells the client to retry; n = max_waiting is queued."""
    state = fuzz.state
    small = ServerState("small")
    engine = Engine(state.engine.model, state.tokenizer, EngineConfig(max_waiting=2))  # not started
    small.ready(engine, state.tokenizer, state.chat)
    with ServerThread(create_app(small)) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        for field, body in [("n", {"n": 3}), ("best_of", {"n": 1, "best_of": 3})]:
            err = assert_api_error(http.post("/v1/completions", json={**GREEDY, **body}), 400, param=field)
            assert "--max-waiting 2" in err["message"]
        messages = [{"role": "user", "content": "hi"}]
        assert_api_error(
            http.post("/v1/chat/completions", json={"messages": messages, "n": 3}), 400, param="n"
        )
        assert engine.num_waiting == 0
        with http.stream("POST", "/v1/completions", json={**GREEDY, "n": 2, "stream": True}) as r:
            assert r.status_code == 200  # queued (nobody runs this engine): the client leaves
            deadline = time.monotonic() + 10
            while engine.num_waiting < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert engine.num_waiting == 2


def test_a_stream_whose_client_left_before_its_first_byte_is_cancelled(fuzz, monkeypatch):
    """A streaming request whose client is gone before the response starts (the server's first
    send fails, as uvicorn's does under ASGI 2.4 for a closed connection, so the event generator
    never starts): its n = 3 choices are aborted, not generated to max_tokens."""
    engine = fuzz.state.engine
    slow_steps(monkeypatch, engine)  # 90 steps: still running when the request has ended
    wait_idle(engine)
    aborted = engine.finished["abort"]
    body = json.dumps({**GREEDY, "max_tokens": 90, "ignore_eos": True, "n": 3, "stream": True}).encode()
    headers = [(b"authorization", f"Bearer {KEY}".encode()), (b"content-length", str(len(body)).encode())]
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
        "query_string": b"", "root_path": "", "headers": headers, "client": ("127.0.0.1", 1),
    }  # fmt: skip

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        if message["type"] == "http.response.start":
            raise OSError("the client has gone")

    async def request():
        with contextlib.suppress(Exception):  # whatever the app makes of the failed send
            await create_app(fuzz.state)(scope, receive, send)

    asyncio.run(request())
    wait_idle(engine)
    assert engine.finished["abort"] == aborted + 3 and engine.cache.allocator.num_used == 0
