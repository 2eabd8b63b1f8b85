"""Request bodies of the OpenAI endpoints (pydantic), and their translation to `SamplingParams`.

Unknown fields are accepted and ignored (clients send fields a server may not use); a field of the
wrong type or out of range is a 400 naming it (`parse`), and so is a string anywhere in the body
that is not valid Unicode (a lone UTF-16 surrogate such as "\\ud800", which JSON can escape but
no tokenizer can encode: `check_text`).
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from mlm.inference.sampling import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    SEED_MAX,
    SEED_MIN,
    SamplingParams,
    choice_seed,
)
from mlm.serve.errors import ApiError

MAX_N = 16
"""Most choices (`n`, and `best_of`) one request may ask for."""


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=0)] = 0
    """Extension (as in vLLM): sample among the k most likely tokens; 0 = off."""
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    """Choices to generate from the prompt, each with its own draws (see `sampling`)."""
    stream: bool = False
    stream_options: dict | None = None
    stop: str | list[str] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0)] = 1.0
    """Extension: CTRL's repetition penalty; 1 = off."""
    seed: int | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    """{token id (a string): bias in [-100, 100]} added to the logits; at most 300 entries."""
    stop_token_ids: list[int] | None = None
    """Extension: stop at these token ids."""
    ignore_eos: bool = False
    """Extension: do not stop at the end-of-text token."""

    @field_validator("seed")
    @classmethod
    def _seed_in_range(cls, v: int | None) -> int | None:
        if v is not None and not SEED_MIN <= v <= SEED_MAX:
            raise ValueError(f"must be an integer in [{SEED_MIN}, {SEED_MAX}]")
        return v

    def stops(self) -> tuple[str, ...]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > 4:
            raise ApiError(400, f"stop: at most 4 sequences, got {len(stop)}", param="stop")
        if any(not s for s in stop):
            raise ApiError(400, "stop: sequences must not be empty", param="stop")
        return tuple(stop)

    def biases(self, vocab: int) -> tuple[tuple[int, float], ...]:
        """`logit_bias` as (token id, bias) pairs, each id checked against the vocabulary."""
        bias = self.logit_bias or {}
        if len(bias) > MAX_LOGIT_BIAS:
            raise ApiError(
                400, f"logit_bias: at most {MAX_LOGIT_BIAS} entries, got {len(bias)}", param="logit_bias"
            )
        pairs = []
        for key, value in bias.items():
            if not re.fullmatch(r"[0-9]{1,19}", key):
                raise ApiError(400, f"logit_bias: key {key!r} is not a token id", param="logit_bias")
            if int(key) >= vocab:
                raise ApiError(
                    400,
                    f"logit_bias: token id {int(key)} is outside the vocabulary [0, {vocab})",
                    param="logit_bias",
                )
            pairs.append((int(key), value))
        return tuple(pairs)

    def sampling(self, max_tokens: int, logprobs: int | None, vocab: int, count: int) -> list[SamplingParams]:
        """The params of choices 0..count-1: choice i draws with seed + i (`choice_seed`), so choice
        0 draws as a request with n = 1 does."""
        first = SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed,
            stop=self.stops(),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            logit_bias=self.biases(vocab),
        )
        return [replace(first, seed=choice_seed(self.seed, i)) for i in range(count)]

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    """Text, token ids, or a list of prompts (texts, or lists of token ids), each its own choices."""
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    """Put the prompt's text before each choice's."""
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    """Generate this many candidates and return the n whose chosen tokens' log-probs sum highest."""


class TokenizeRequest(BaseModel):
    """`POST /tokenize` (vLLM's, which lm-evaluation-harness's remote tokenizer calls)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    """Let the tokenizer add its special tokens (a Llama tokenizer's BOS), as `tokenizer(text)` does."""


class DetokenizeRequest(BaseModel):
    """`POST /detokenize`."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[int]


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatRequest(_Request):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None


def parse(cls: type[BaseModel], body: dict):
    """`body` as a `cls`, or a 400 naming the first bad field."""
    try:
        return cls.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"] if not str(x).startswith(("list[", "str", "int")))
        raise ApiError(400, f"{loc or 'body'}: {err['msg']}", param=loc or None) from None


def check_text(body: dict) -> None:
    """A 400 naming a string (value or key) in `body` that UTF-8 cannot encode (a lone
    surrogate), its path as `param` (e.g. "messages.0.content")."""
    todo: list[tuple[str, object]] = [("", body)]
    while todo:  # not recursive: the JSON parser already bounds the depth, this need not
        path, v = todo.pop()
        if isinstance(v, str):
            try:
                v.encode()
            except UnicodeEncodeError:
                where = path or "body"
                raise ApiError(
                    400,
                    f"{where}: not valid Unicode (a lone UTF-16 surrogate at character {_bad_char(v)}); "
                    "send text that UTF-8 can encode",
                    param=where,
                ) from None
        elif isinstance(v, dict):
            for key, item in v.items():
                name = key.encode("utf-8", "backslashreplace").decode()
                todo.append((f"{path}.{name}" if path else name, item))
                todo.append((f"{path}.{name} (key)" if path else f"{name} (key)", key))
        elif isinstance(v, list):  # numbers (token ids) need no look
            todo += [(f"{path}.{i}", item) for i, item in enumerate(v) if isinstance(item, str | list | dict)]


def _bad_char(s: str) -> int:
    return next(i for i, c in enumerate(s) if 0xD800 <= ord(c) <= 0xDFFF)
