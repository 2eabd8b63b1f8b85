"""Per-request sampling: logit bias and penalties, greedy or temperature / top-k / top-p draws,
log-probs.

Each request draws from its own `torch.Generator` (seeded by `seed`, or at random), one draw per
token, so a seeded request gives the same tokens whichever requests share its batch. Log-probs
are those of the model's own distribution (log-softmax of the raw logits), before bias,
penalties, temperature and truncation, as OpenAI reports them.

Any valid `SamplingParams` gives finite probabilities on finite logits, however extreme: biased
and penalised logits are clamped to fp32's finite range, temperature divides logits minus their
maximum in fp64 (so 5e-324 is the greedy limit, not 0/0), and top-p always keeps the most
likely token. A row that fails all the same (NaN logits from the model, a bad token id) fails
alone: `sample` returns its error and the other rows their tokens.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

import torch

from mlm.errors import MlmError

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 300
"""Most entries of `logit_bias` (OpenAI's limit)."""
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
"""The seeds `torch.Generator.manual_seed` takes (a negative seed counts modulo 2**64)."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request's tokens are chosen and when it stops."""

    max_tokens: int = 16
    """Most new tokens to generate."""
    temperature: float = 0.0
    """0 picks the most likely token (greedy); above 0 samples from softmax(logits / temperature)."""
    top_k: int = 0
    """Sample among the k most likely tokens only; 0 means all."""
    top_p: float = 1.0
    """Sample among the most likely tokens whose probabilities sum to top_p (nucleus)."""
    repetition_penalty: float = 1.0
    """Divide positive (multiply negative) logits of tokens already in prompt or output (CTRL; 1 = off)."""
    presence_penalty: float = 0.0
    """Subtract from the logits of tokens already generated (OpenAI's presence_penalty)."""
    frequency_penalty: float = 0.0
    """Subtract this times the count of each token already generated (OpenAI's frequency_penalty)."""
    seed: int | None = None
    """Seed of this request's random draws; unset means a random seed."""
    stop: tuple[str, ...] = ()
    """Stop when the text contains one of these strings (not included in the output)."""
    stop_token_ids: tuple[int, ...] = ()
    """Stop at these token ids (not included), besides the tokenizer's end-of-text."""
    ignore_eos: bool = False
    """Do not stop at the tokenizer's end-of-text token."""
    logprobs: int | None = None
    """Return each chosen token's log-prob and this many most likely alternatives; unset means none."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias in [-100, 100]) added to the logits before anything else (OpenAI's logit_bias)."""

    def __post_init__(self):
        def check(ok: bool, msg: str) -> None:
            if not ok:
                raise MlmError(msg)

        check(self.max_tokens >= 1, f"max_tokens={self.max_tokens}: must be at least 1")
        check(self.temperature >= 0, f"temperature={self.temperature}: must be >= 0")
        check(self.top_k >= 0, f"top_k={self.top_k}: must be >= 0 (0 = off)")
        check(0 < self.top_p <= 1, f"top_p={self.top_p}: must be in (0, 1]")
        check(self.repetition_penalty > 0, f"repetition_penalty={self.repetition_penalty}: must be > 0")
        check(
            self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
            f"logprobs={self.logprobs}: must be in [0, {MAX_LOGPROBS}]",
        )
        check(all(s for s in self.stop), "stop: strings must not be empty")
        check(
            self.seed is None or SEED_MIN <= self.seed <= SEED_MAX,
            f"seed={self.seed}: must be in [{SEED_MIN}, {SEED_MAX}]",
        )
        check(
            len(self.logit_bias) <= MAX_LOGIT_BIAS,
            f"logit_bias: {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS}",
        )
        for token, bias in self.logit_bias:
            check(token >= 0, f"logit_bias: token id {token} is negative")
            check(-100 <= bias <= 100, f"logit_bias[{token}]={bias}: must be in [-100, 100]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing to apply first: the argmax of the raw logits."""
        return (
            self.greedy
            and not self.logit_bias
            and self.repetition_penalty == 1.0
            and self.presence_penalty == 0.0
            and self.frequency_penalty == 0.0
        )


def choice_seed(seed: int | None, choice: int) -> int | None:
    """The seed of choice `choice` (0, 1, ...) of a request asking for several (OpenAI's `n`):
    seed + choice modulo 2**64 (as vLLM derives them), so choice 0 keeps the request's seed; no
    seed stays no seed (each choice draws at random)."""
    return seed if seed is None or choice == 0 else (seed + choice) % 2**64


def generator(seed: int | None) -> torch.Generator:
    return torch.Generator().manual_seed(seed if seed is not None else random.getrandbits(63))


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    """The `logprobs` most likely tokens and their log-probs, most likely first."""


def apply_penalties(
    logits_V: torch.Tensor, p: SamplingParams, prompt_ids: list[int], output_ids: list[int]
) -> torch.Tensor:
    """`logits_V` (fp32, changed in place) with the logit bias and the penalties applied, clamped
    to fp32's finite range (a repetition penalty of 1e-40 divides a logit of 1 into inf)."""
    if p.logit_bias:
        ids, bias = zip(*p.logit_bias, strict=True)
        logits_V.index_add_(0, torch.tensor(ids), torch.tensor(bias, dtype=logits_V.dtype))
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long)
        if len(seen):
            vals = logits_V[seen]
            logits_V[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and output_ids:
        counts = Counter(output_ids)
        ids = torch.tensor(list(counts), dtype=torch.long)
        n = torch.tensor(list(counts.values()), dtype=logits_V.dtype)
        logits_V[ids] -= p.presence_penalty + p.frequency_penalty * n
    finite = torch.finfo(logits_V.dtype)
    return logits_V.clamp_(finite.min, finite.max)


def truncate(logits_V: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """-inf outside the top-k tokens and outside the top-p nucleus (the most likely token always
    stays, even when top_p rounds to 0 in the logits' dtype)."""
    if 0 < top_k < logits_V.numel():
        kth = torch.topk(logits_V, top_k).values[-1]
        logits_V = logits_V.masked_fill(logits_V < kth, float("-inf"))
    if top_p < 1.0:
        sorted_V, order = torch.sort(logits_V, descending=True)
        cum = torch.softmax(sorted_V, -1).cumsum(-1)
        drop = cum - torch.softmax(sorted_V, -1) >= top_p  # mass before this token already ≥ top_p
        drop[0] = False
        logits_V = logits_V.clone()
        logits_V[order[drop]] = float("-inf")
    return logits_V


def choose(
    logits_V: torch.Tensor,
    p: SamplingParams,
    gen: torch.Generator,
    prompt_ids: list[int],
    output_ids: list[int],
) -> int:
    """The next token of one sequence from its fp32 CPU logits [V]. Temperature divides the logits
    minus their maximum, in fp64: the most likely token stays at 0 and the others go to -inf as
    the temperature goes to 0, so any temperature > 0 (5e-324 too) gives finite probabilities,
    near 0 those of greedy (ties share the draw). Raises MlmError on NaN logits or probabilities."""
    logits_V = apply_penalties(logits_V.clone(), p, prompt_ids, output_ids)
    if torch.isnan(logits_V).any():
        raise MlmError("the model's logits contain NaN")
    if p.greedy:
        return int(logits_V.argmax())
    scaled_V = (logits_V.double() - logits_V.max()) / p.temperature
    probs_V = torch.softmax(truncate(scaled_V, p.top_k, p.top_p), -1)
    if not torch.isfinite(probs_V).all():
        raise MlmError(f"the probabilities are not finite (temperature={p.temperature}, top_p={p.top_p})")
    return int(torch.multinomial(probs_V, 1, generator=gen))


def token_logprob(logits_V: torch.Tensor, token: int, n_top: int) -> TokenLogprob:
    logp_V = torch.log_softmax(logits_V, -1)
    top = torch.topk(logp_V, n_top) if n_top else None
    pairs = list(zip(top.indices.tolist(), top.values.tolist(), strict=True)) if top is not None else []
    return TokenLogprob(token, float(logp_V[token]), pairs)


def sample(
    logits_BV: torch.Tensor,
    params: list[SamplingParams],
    gens: list[torch.Generator],
    prompts: list[list[int]],
    outputs: list[list[int]],
) -> tuple[list[int], list[TokenLogprob | None], list[str | None]]:
    """Next token (and log-probs when asked) of each row, and each row's error (None when it
    sampled): a row that fails (NaN logits, an exception) gets its message and token -1, and the
    other rows are unaffected. Plain greedy rows take one batched argmax on the logits' device;
    the others are processed one by one on the CPU in fp32 (fp64 from the temperature on)."""
    tokens_B = logits_BV.argmax(-1)
    nan = logits_BV.gather(-1, tokens_B[:, None]).isnan()[:, 0].tolist()  # argmax picks a NaN first
    tokens = tokens_B.tolist()
    errors: list[str | None] = [None] * len(params)
    special = [i for i, p in enumerate(params) if not p.plain_greedy or p.logprobs is not None]
    logprobs: list[TokenLogprob | None] = [None] * len(params)
    for i, p in enumerate(params):
        if p.plain_greedy and nan[i]:
            errors[i] = "MlmError: the model's logits contain NaN"
    if special:
        rows = logits_BV[special].float().cpu()
        for row, i in zip(rows, special, strict=True):
            p = params[i]
            try:
                if not p.plain_greedy:
                    tokens[i] = choose(row, p, gens[i], prompts[i], outputs[i])
                if p.logprobs is not None and errors[i] is None:
                    logprobs[i] = token_logprob(row, tokens[i], p.logprobs)
            except Exception as e:  # this row fails alone
                errors[i] = f"{type(e).__name__}: {e}"
    for i, e in enumerate(errors):
        if e is not None:
            tokens[i], logprobs[i] = -1, None
    return tokens, logprobs, errors
