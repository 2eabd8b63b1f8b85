"""The HTTP app: OpenAI's `/v1/completions`, `/v1/chat/completions` (both with `stream: true` as
server-sent events) and `/v1/models`; Megatron's `PUT /api`; vLLM's `/tokenize`, `/detokenize` and `/tokenizer_info`;
`/health` and `/metrics`.

Every request is checked in this order, each failure an OpenAI-shaped error: API key (401), model
loaded (503 + Retry-After), body size (413), JSON object (422), valid Unicode and fields (400),
model name (404), prompt and max_tokens against the context (400), room in the queue (429 +
Retry-After). Anything else that goes wrong is a 500 in the same shape (`CatchFaults`), and every
error leaves the keep-alive connection usable. A request's choices (`n`, `best_of`) live in the
engine as one `EngineStream`; a client that disconnects cancels them, which frees their cache
blocks at the next engine step.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import logging
import time
import uuid
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from mlm.chat import ChatTemplate
from mlm.errors import MlmError
from mlm.inference.engine import Completion, Engine, QueueFull, RequestOutput
from mlm.inference.sampling import SamplingParams, TokenLogprob
from mlm.serve import megatron
from mlm.serve.errors import ApiError
from mlm.serve.metrics import Metrics
from mlm.serve.schemas import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    check_text,
    parse,
)
from mlm.tokenizer import Tokenizer

log = logging.getLogger("mlm.serve")

ENDPOINTS = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/api",
    "/tokenize",
    "/detokenize",
    "/tokenizer_info",
    "/health",
    "/metrics",
)
"""The paths `/metrics` counts by name; any other path is counted as `other`."""


@dataclass
class Limits:
    """What one request may ask for."""

    max_body_bytes: int = 1 << 20
    """Largest request body (HTTP 413 beyond)."""
    max_tokens: int | None = None
    """Largest max_tokens a request may ask for; unset means the model's context."""
    retry_after_s: int = 1
    """Retry-After of a 429 (queue full) or 503 (loading)."""


class ServerState:
    """What the app serves: set up empty (the app answers 503 while loading), then `ready`."""

    def __init__(self, model_name: str, api_key: str | None = None, limits: Limits | None = None):
        self.model_name = model_name
        self.api_key = api_key
        self.limits = limits or Limits()
        self.metrics = Metrics()
        self.engine: Engine | None = None
        self.tokenizer: Tokenizer | None = None
        self.chat: ChatTemplate | None = None
        self.created = int(time.time())

    def ready(self, engine: Engine, tokenizer: Tokenizer, chat: ChatTemplate) -> None:
        self.tokenizer, self.chat = tokenizer, chat
        self.metrics.attach(engine)
        self.engine = engine  # last: requests are served from here on

    @property
    def context(self) -> int:
        assert self.engine is not None
        return self.engine.context


class EngineStream:
    """One prompt's requests in the engine (choices 0..n-1, one `SamplingParams` each), their
    outputs arriving on this event loop as (choice, output)."""

    def __init__(self, state: ServerState, prompt_ids: list[int], params: list[SamplingParams]):
        loop = asyncio.get_running_loop()
        self.state, self.engine = state, state.engine
        self.queue: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()
        self.ids: list[str] = []
        self.live: set[int] = set()
        """Choices not finished yet."""
        self.start, self.first = time.perf_counter(), None
        try:
            for i, p in enumerate(params):

                def put(out: RequestOutput, i: int = i) -> None:
                    loop.call_soon_threadsafe(self.queue.put_nowait, (i, out))

                self.ids.append(self.engine.submit(prompt_ids, p, put))
                self.live.add(i)
        except QueueFull as e:
            self.cancel()
            retry = str(state.limits.retry_after_s)
            raise ApiError(
                429, f"the server is busy ({e}); retry later", headers={"Retry-After": retry}
            ) from None
        except MlmError as e:
            self.cancel()
            raise ApiError(400, str(e), param="prompt") from None

    @property
    def n(self) -> int:
        return len(self.ids)

    async def __aiter__(self):
        while self.live:
            i, out = await self.queue.get()
            now = time.perf_counter()
            if self.first is None and (out.token_ids or out.finished):
                self.first = now
                self.state.metrics.ttft.observe(now - self.start)
            if out.finished:
                self.live.discard(i)
                if not self.live:
                    self.state.metrics.latency.observe(now - self.start)
            yield i, out

    def cancel(self) -> None:
        """Abort the choices not finished yet."""
        for i in sorted(self.live):
            self.engine.abort(self.ids[i])
        self.live.clear()

    async def gather(self) -> list[Completion]:
        results = [Completion() for _ in self.ids]
        async for i, out in self:
            results[i].add(out)
        return results


async def collect(request: Request, streams: list[EngineStream]) -> list[list[Completion]]:
    """Each stream's choices put together; all are cancelled if the client goes away first."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work = asyncio.ensure_future(asyncio.gather(*(s.gather() for s in streams)))
    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        gone = not work.done()
        if gone:
            work.cancel()
            for s in streams:
                s.cancel()
    if gone:
        raise ApiError(400, "the client disconnected")  # nobody reads it
    results = work.result()
    for r in (c for choices in results for c in choices):
        if r.finish_reason == "error":
            raise ApiError(500, f"generation failed: {r.error}")
    return results


# ---------------------------------------------------------------------- checks


def _check_access(state: ServerState, request: Request) -> None:
    if state.api_key is not None:
        auth = request.headers.get("authorization", "")
        scheme, _, key = auth.partition(" ")  # the scheme is case-insensitive (RFC 7235)
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            key.strip().encode(), state.api_key.encode()
        ):
            what = "a wrong API key" if auth else "no API key"
            raise ApiError(
                401, f"{what}: send the header `Authorization: Bearer KEY`", code="invalid_api_key"
            )
    if state.engine is None:
        retry = {"Retry-After": str(state.limits.retry_after_s)}
        raise ApiError(503, "the model is loading; retry in a moment", headers=retry)


async def _read_json(state: ServerState, request: Request) -> dict:
    limit = state.limits.max_body_bytes
    declared = request.headers.get("content-length")
    too_big = ApiError(413, f"the request body is larger than the limit of {limit} bytes")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_big
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise too_big
    try:
        data = json.loads(body, parse_constant=_not_json)
    except RecursionError:
        raise ApiError(422, "the request body is not valid JSON (nested too deeply)") from None
    except ValueError as e:  # also JSONDecodeError, UnicodeDecodeError, integers of over 4300 digits
        raise ApiError(422, f"the request body is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ApiError(422, f"the request body must be a JSON object, not {type(data).__name__}")
    check_text(data)
    return data


def _not_json(name: str):
    raise ValueError(f"{name} is not a JSON value")


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise ApiError(
            404,
            f"the model {model!r} does not exist; this server serves {state.model_name!r}",
            param="model",
            code="model_not_found",
        )


def _max_tokens(state: ServerState, prompt_len: int, asked: int | None, default: int | None) -> int:
    room = state.context - prompt_len
    if room < 1:
        raise ApiError(
            400,
            f"the prompt has {prompt_len} tokens; the model's context is {state.context} tokens, "
            "which leaves no room to generate",
            param="prompt",
            code="context_length_exceeded",
        )
    cap = state.limits.max_tokens
    if asked is None:
        return min(x for x in (default, room, cap) if x is not None)
    if cap is not None and asked > cap:
        raise ApiError(400, f"max_tokens={asked}: this server allows at most {cap}", param="max_tokens")
    if asked > room:
        raise ApiError(
            400,
            f"max_tokens={asked} plus the prompt's {prompt_len} tokens exceed the model's context of "
            f"{state.context} tokens; ask for at most {room}",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return asked


def _prompts(prompt) -> list[str | list[int]]:
    """The prompts of a completion request: one text or token list, or a list of either."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def _check_queue(state: ServerState, count: int, what: str | None = None, req=None) -> None:
    """A 400 where `count` engine requests (choices) could never all wait in the queue: a 429
    would have the client retry in vain. `what` names the count (else n or best_of)."""
    limit = state.engine.config.max_waiting
    if count > limit:
        field = "best_of" if getattr(req, "best_of", None) else "n"
        raise ApiError(
            400,
            f"{what or field}={count}: more choices than may wait in the server's queue (--max-waiting "
            f"{limit}); ask for at most {limit}",
            param="prompt" if what else field,
        )


def _params(
    state: ServerState, req, max_tokens: int, logprobs: int | None, count: int
) -> list[SamplingParams]:
    """The params of `count` choices (n, or best_of candidates), each an engine request."""
    _check_queue(state, count, req=req)
    try:
        return req.sampling(max_tokens, logprobs, state.engine.model.cfg.vocab_size, count)
    except MlmError as e:
        raise ApiError(400, str(e)) from None


# ---------------------------------------------------------------------- response bodies


def _completion_logprobs(tok: Tokenizer, lps: list[TokenLogprob], offset: int) -> dict | None:
    if not lps:
        return None
    tokens = [tok.decode([lp.token_id]) for lp in lps]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{tok.decode([i]): v for i, v in lp.top} for lp in lps],
        "text_offset": offsets,
    }


def _score(state: ServerState, ids: list[int], top: int) -> asyncio.Future:
    """The engine's log-probs of `ids`' tokens after the first (`Engine.score`), as a future."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    try:
        state.engine.score(ids, top, lambda r: loop.call_soon_threadsafe(done.set_result, r))
    except MlmError as e:
        raise ApiError(400, str(e), param="prompt") from None

    async def result() -> list[TokenLogprob]:
        r = await done
        if isinstance(r, Exception):
            raise ApiError(500, f"scoring the prompt failed: {type(r).__name__}: {r}")
        return r

    return asyncio.ensure_future(result())


def _prompt_logprobs(tok: Tokenizer, ids: list[int], lps: list[TokenLogprob]) -> dict:
    """The echoed prompt's part of a choice's `logprobs`: its first token has none (null)."""
    tokens = [tok.decode([i]) for i in ids]
    return {
        "tokens": tokens,
        "token_logprobs": [None] + [lp.logprob for lp in lps],
        "top_logprobs": [None] + [{tok.decode([i]): v for i, v in lp.top} for lp in lps],
        "text_offset": list(itertools.accumulate([0] + [len(t) for t in tokens[:-1]])),
    }


def _chat_logprobs(tok: Tokenizer, lps: list[TokenLogprob]) -> dict | None:
    if not lps:
        return None

    def entry(token_id: int, logprob: float) -> dict:
        text = tok.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]} for lp in lps
        ]
    }


def _usage(choices: list[Completion] | list[RequestOutput]) -> dict:
    """The prompt counted once, the completion tokens of every choice."""
    prompt, completion = choices[0].prompt_tokens, sum(c.completion_tokens for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


async def _event_stream(stream: EngineStream, head: dict, choice, include_usage: bool, first):
    """SSE chunks: `choice(i, out)` makes each chunk's choice (of index i); `first(i)`, when given,
    a choice sent for each index before any token. A failure ends the stream with an error event.
    The choices left are cancelled by the response (`EventStreamResponse`), however it ends."""
    try:
        if first is not None:
            for i in range(stream.n):
                yield _sse({**head, "choices": [first(i)]})
        finals: list[RequestOutput] = []
        async for i, out in stream:
            if out.finish_reason == "error":
                yield _sse(ApiError(500, f"generation failed: {out.error}").body())
                break
            if out.text or out.logprobs or out.finished:
                yield _sse({**head, "choices": [choice(i, out)]})
            if out.finished:
                finals.append(out)
        else:
            if include_usage:
                yield _sse({**head, "choices": [], "usage": _usage(finals)})
        yield _sse("[DONE]")
    except Exception as e:  # a fault of ours mid-stream: the client still gets a complete response
        log.exception("streaming %s failed", head["id"])
        yield _sse(ApiError(500, f"internal error: {type(e).__name__}: {e}").body())
        yield _sse("[DONE]")


class EventStreamResponse(StreamingResponse):
    """Server-sent events of one engine stream, whose choices are cancelled however the response
    ends: also when the client has gone before the first byte, where `_event_stream` never starts
    (so its own `finally` never runs) and the choices would otherwise generate to max_tokens."""

    def __init__(self, events, stream: EngineStream):
        super().__init__(events, media_type="text/event-stream")
        self.stream = stream

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.stream.cancel()


# ---------------------------------------------------------------------- the app


class CountRequests:
    """ASGI middleware: counts every HTTP response by endpoint and status for /metrics."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = {"code": 500}

        async def record(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, record)
        finally:
            endpoint = scope["path"] if scope["path"] in ENDPOINTS else "other"
            self.metrics.requests.labels(endpoint, str(status["code"])).inc()


class CatchFaults:
    """ASGI middleware: an unexpected exception becomes a logged 500 in OpenAI's shape and goes no
    further. Starlette's own handler (an `exception_handler(Exception)`) re-raises after sending
    its response, and uvicorn then closes the connection, so the client's next request on that
    keep-alive connection failed too."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watch(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception as e:
            log.exception("%s %s failed", scope["method"], scope["path"])
            if started:  # nothing to answer with: uvicorn closes the unfinished response
                return
            await ApiError(500, f"internal error: {type(e).__name__}: {e}").response()(scope, receive, send)


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="mlm serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(CatchFaults)
    app.add_middleware(CountRequests, metrics=state.metrics)  # outside CatchFaults: counts its 500s

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return e.response()

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException):
        return ApiError(e.status_code, str(e.detail), headers=e.headers).response()

    @app.get("/health")
    async def health():
        if state.engine is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        return {"status": "ok", "model": state.model_name}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: Request):
        _check_access(state, request)
        card = {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "mlm"}
        return {"object": "list", "data": [{**card, "max_model_len": state.context}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        _check_access(state, request)
        req = parse(CompletionRequest, await _read_json(state, request))
        _check_model(state, req.model)
        prompts = _prompts(req.prompt)
        best_of = req.best_of or req.n
        if best_of < req.n:
            raise ApiError(400, f"best_of={best_of} is less than n={req.n}", param="best_of")
        if req.stream and best_of > req.n:
            raise ApiError(400, "best_of > n cannot be streamed: set stream to false", param="best_of")
        if req.stream and len(prompts) > 1:
            raise ApiError(
                400,
                f"{len(prompts)} prompts cannot be streamed: send one, or set stream to false",
                param="stream",
            )
        if req.echo and req.stream:
            raise ApiError(400, "echo cannot be streamed: set stream to false", param="echo")
        ids = [state.tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]
        scored = req.echo and req.logprobs is not None  # the prompt's own log-probs, as lm-eval reads them
        if len(prompts) > 1:
            _check_queue(state, len(prompts) * best_of, f"{len(prompts)} prompts × {best_of} choices")
        # best_of ranks the candidates by their tokens' log-probs: they are computed, shown if asked
        logprobs = req.logprobs if req.logprobs is not None or best_of == req.n else 0
        streams: list[EngineStream] = []
        try:
            for p in ids:
                max_tokens = _max_tokens(state, len(p), req.max_tokens, 16)
                streams.append(EngineStream(state, p, _params(state, req, max_tokens, logprobs, best_of)))
            scores = [_score(state, p, req.logprobs) for p in ids] if scored else []
        except ApiError:
            for st in streams:
                st.cancel()
            raise
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time())}
        head["model"] = state.model_name
        offsets = [0] * best_of  # of each choice's text so far (one prompt when streamed)

        def choice(
            i: int, out: RequestOutput | Completion, echoed: str = "", prompt_lp: dict | None = None
        ) -> dict:
            lp = (
                _completion_logprobs(state.tokenizer, out.logprobs, offsets[i])
                if req.logprobs is not None
                else None
            )
            if prompt_lp is not None:  # the echoed prompt's tokens first
                lp = {k: v + (lp[k] if lp else []) for k, v in prompt_lp.items()}
            offsets[i] += len(out.text)
            return {"index": i, "text": echoed + out.text, "logprobs": lp, "finish_reason": _reason(out)}

        if req.stream:
            events = _event_stream(streams[0], head, choice, req.include_usage, None)
            return EventStreamResponse(events, streams[0])
        choices, usage = [], {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        for k, results in enumerate(await collect(request, streams)):
            best = results
            if best_of > req.n:  # the n of highest summed log-prob, best first (ties keep their order)
                best = sorted(results, key=lambda c: -sum(lp.logprob for lp in c.logprobs))[: req.n]
            echoed = (
                ""
                if not req.echo
                else prompts[k]
                if isinstance(prompts[k], str)
                else state.tokenizer.decode(ids[k])
            )
            offsets[:] = [len(echoed)] * best_of
            prompt_lp = _prompt_logprobs(state.tokenizer, ids[k], await scores[k]) if scored else None
            choices += [
                choice(i, c, echoed, prompt_lp) | {"index": k * req.n + i} for i, c in enumerate(best)
            ]
            for key, v in _usage(results).items():  # every candidate generated counts
                usage[key] += v
        return {**head, "choices": choices, "usage": usage}

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request):
        """The tokenizer's special tokens, chat template and context (vLLM's endpoint, which
        lm-evaluation-harness's remote tokenizer reads)."""
        _check_access(state, request)
        tok = state.tokenizer
        special = {"eos_token": tok.eod_id, "bos_token": tok.bos_id, "pad_token": tok.pad_id}
        return {
            **{k: None if i is None else tok.token_text(i) for k, i in special.items()},
            "chat_template": state.chat.source,
            "model_max_length": state.context,
            "tokenizer_class": tok.kind,
        }

    @app.post("/tokenize")
    async def tokenize(request: Request):
        _check_access(state, request)
        req = parse(TokenizeRequest, await _read_json(state, request))
        _check_model(state, req.model)
        tok = state.tokenizer
        tokens = tok.encode(req.prompt) if req.add_special_tokens else tok.encode_plain(req.prompt)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": state.context}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        _check_access(state, request)
        req = parse(DetokenizeRequest, await _read_json(state, request))
        _check_model(state, req.model)
        vocab = state.tokenizer.vocab_size
        if bad := [t for t in req.tokens if not 0 <= t < vocab]:
            raise ApiError(
                400, f"tokens: {bad[0]} is not a token id (the vocabulary has {vocab})", param="tokens"
            )
        return {"prompt": state.tokenizer.decode(req.tokens)}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        _check_access(state, request)
        req = parse(ChatRequest, await _read_json(state, request))
        _check_model(state, req.model)
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            ids = state.tokenizer.encode_plain(state.chat.render(messages))
        except MlmError as e:
            raise ApiError(400, str(e), param="messages") from None
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        asked = req.max_completion_tokens or req.max_tokens
        params = _params(state, req, _max_tokens(state, len(ids), asked, None), logprobs, req.n)
        stream = EngineStream(state, ids, params)
        head = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
        }
        head["model"] = state.model_name

        def logprobs_of(out) -> dict | None:
            return _chat_logprobs(state.tokenizer, out.logprobs) if logprobs is not None else None

        if req.stream:
            head["object"] = "chat.completion.chunk"

            def choice(i: int, out: RequestOutput) -> dict:
                delta = {"content": out.text} if out.text else {}
                return {
                    "index": i,
                    "delta": delta,
                    "logprobs": logprobs_of(out),
                    "finish_reason": _reason(out),
                }

            def first(i: int) -> dict:
                delta = {"role": "assistant", "content": ""}
                return {"index": i, "delta": delta, "logprobs": None, "finish_reason": None}

            events = _event_stream(stream, head, choice, req.include_usage, first)
            return EventStreamResponse(events, stream)
        (results,) = await collect(request, [stream])
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": r.text},
                "logprobs": logprobs_of(r),
                "finish_reason": _reason(r),
            }
            for i, r in enumerate(results)
        ]
        return {**head, "choices": choices, "usage": _usage(results)}

    @app.put("/api")
    async def megatron_api(request: Request):
        _check_access(state, request)
        req = megatron.parse(await _read_json(state, request))
        tok = state.tokenizer
        streams = []
        try:
            for prompt in req.prompts:
                ids = tok.encode_plain(prompt)
                if req.add_bos and tok.bos_id is not None:
                    ids = [tok.bos_id, *ids]
                params = megatron.sampling(req, _max_tokens(state, len(ids), req.tokens_to_generate, None))
                streams.append((ids, EngineStream(state, ids, [params])))
            results = await collect(request, [s for _, s in streams])
        finally:
            for _, s in streams:
                s.cancel()
        return megatron.response(tok, req, [ids for ids, _ in streams], [r for (r,) in results])

    return app


def _reason(out: RequestOutput | Completion) -> str | None:
    return out.finish_reason if out.finish_reason in ("stop", "length") else None
