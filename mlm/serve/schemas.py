"""Request bodies of the OpenAI endpoints (pydantic), and their translation to `SamplingParams`.

Unknown fields are accepted and ignored (clients send fields a server may not use); a field of the
wrong type or out of range is a 400 naming it (`parse`).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mlm.inference.sampling import MAX_LOGPROBS, SamplingParams
from mlm.serve.errors import ApiError


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=0)] = 0
    """Extension (as in vLLM): sample among the k most likely tokens; 0 = off."""
    n: Literal[1] = 1
    stream: bool = False
    stream_options: dict | None = None
    stop: str | list[str] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0)] = 1.0
    """Extension: CTRL's repetition penalty; 1 = off."""
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    """Extension: stop at these token ids."""
    ignore_eos: bool = False
    """Extension: do not stop at the end-of-text token."""

    def stops(self) -> tuple[str, ...]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > 4:
            raise ApiError(400, f"stop: at most 4 sequences, got {len(stop)}", param="stop")
        if any(not s for s in stop):
            raise ApiError(400, "stop: sequences must not be empty", param="stop")
        return tuple(stop)

    def sampling(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
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
        )

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str]
    """Text, token ids, or a list of one text."""
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: Literal[False] = False


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
