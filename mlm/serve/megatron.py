"""Megatron-LM's `PUT /api` (tools/run_text_generation_server.py), for users migrating from it.

Request: {"prompts": [str, ...], "tokens_to_generate": 64, "temperature": 1.0, "top_k": 0,
"top_p": 0.0, "logprobs": false, "add_BOS": false, "random_seed": -1, "stop_on_eol": false,
"stop_on_double_eol": false}; top_k = 1 is greedy, as there. Response: {"text": [prompt +
generation, ...], "segments": [[token strings of prompt and generation], ...], and with logprobs
"logprobs": [[log-prob of each generated token], ...]}. Unlike Megatron, errors are JSON in the
OpenAI shape, and no log-probs are returned for prompt tokens (so tokens_to_generate ≥ 1).
"""

from __future__ import annotations

from dataclasses import dataclass

from mlm.inference.engine import Completion
from mlm.inference.sampling import SEED_MAX, SamplingParams
from mlm.serve.errors import ApiError
from mlm.tokenizer import Tokenizer

MAX_PROMPTS = 128


@dataclass
class MegatronRequest:
    prompts: list[str]
    tokens_to_generate: int = 64
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0
    logprobs: bool = False
    add_bos: bool = False
    random_seed: int | None = None
    stop_on_eol: bool = False
    stop_on_double_eol: bool = False


def _field(body: dict, name: str, kinds, default, rule=lambda v: True, must: str = ""):
    if name not in body:
        return default
    v = body[name]
    if not isinstance(v, kinds) or isinstance(v, bool) != (kinds is bool) or not rule(v):
        raise ApiError(400, f"{name}={v!r}: must be {must}", param=name)
    return v


def parse(body: dict) -> MegatronRequest:
    for old, new in (("max_len", "tokens_to_generate"), ("sentences", "prompts")):
        if old in body:
            raise ApiError(400, f"{old} is no longer used; use {new}", param=old)
    prompts = body.get("prompts")
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise ApiError(400, "prompts: must be a non-empty list of strings", param="prompts")
    if len(prompts) > MAX_PROMPTS:
        raise ApiError(400, f"prompts: at most {MAX_PROMPTS}, got {len(prompts)}", param="prompts")
    add_bos = _field(body, "add_BOS", bool, False, must="true or false")
    if any(not p for p in prompts) and not add_bos:
        raise ApiError(400, "prompts: an empty prompt needs add_BOS=true", param="prompts")
    seed = _field(
        body,
        "random_seed",
        int,
        -1,
        lambda v: -1 <= v <= SEED_MAX,
        f"an integer in [0, {SEED_MAX}] (-1: random)",
    )
    return MegatronRequest(
        prompts=prompts,
        tokens_to_generate=_field(body, "tokens_to_generate", int, 64, lambda v: v >= 1, "an integer >= 1"),
        temperature=_field(body, "temperature", (int, float), 1.0, lambda v: 0 < v <= 100, "in (0, 100]"),
        top_k=_field(body, "top_k", int, 0, lambda v: 0 <= v <= 1000, "an integer in [0, 1000]"),
        top_p=_field(body, "top_p", (int, float), 0.0, lambda v: 0 <= v <= 1, "in [0, 1]"),
        logprobs=_field(body, "logprobs", bool, False, must="true or false"),
        add_bos=add_bos,
        random_seed=None if seed == -1 else seed,
        stop_on_eol=_field(body, "stop_on_eol", bool, False, must="true or false"),
        stop_on_double_eol=_field(body, "stop_on_double_eol", bool, False, must="true or false"),
    )


def sampling(req: MegatronRequest, max_tokens: int) -> SamplingParams:
    if req.top_k and req.top_p:
        raise ApiError(400, "top_k and top_p: set one of them, not both", param="top_p")
    stop = ("\n",) if req.stop_on_eol else ("\n\n",) if req.stop_on_double_eol else ()
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0 if req.top_k == 1 else float(req.temperature),
        top_k=req.top_k,
        top_p=req.top_p or 1.0,
        seed=req.random_seed,
        stop=stop,
        logprobs=0 if req.logprobs else None,
    )


def response(
    tok: Tokenizer, req: MegatronRequest, prompts: list[list[int]], results: list[Completion]
) -> dict:
    body: dict = {
        "text": [p + r.text for p, r in zip(req.prompts, results, strict=True)],
        "segments": [
            [tok.decode([t]) for t in ids + r.token_ids] for ids, r in zip(prompts, results, strict=True)
        ],
    }
    if req.logprobs:
        body["logprobs"] = [[lp.logprob for lp in r.logprobs] for r in results]
    return body
