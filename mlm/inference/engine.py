"""The inference engine: request lifecycle, the step loop and cancellation.

`submit` (any thread) queues a request; each `step` admits what fits, gives running sequences the
cache blocks their next tokens need or preempts one when none is free, reuses cached prompt
prefixes (see `scheduler`), runs one forward over the whole batch (see `model_runner`), samples a
token for every sequence that has consumed all its tokens, and reports each sequence's new tokens
and text to its `on_output` callback. A sequence leaves at once when it stops (stop token or
string), reaches max_tokens, is aborted (`abort`, any thread) or fails, and its cache blocks go
back to the pool (its full blocks stay cached for later requests until memory is needed). A
failed forward fails the step's batch; a failed sampling fails only its own sequence. `start`
runs the loop on a background thread (the server's way); `generate` drives it in the caller's
thread (the CLI's way). Under tensor parallelism the engine lives on tp rank 0 and the other
ranks only run `build_runner(...).follow()` (see `lockstep`).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from mlm.errors import MlmError
from mlm.inference.decode_graphs import DecodeGraphs
from mlm.inference.kv_cache import PagedKVCache, blocks_needed
from mlm.inference.model_runner import ModelRunner, Segment
from mlm.inference.packed_weights import pack_weights, packing_applies, unpack_weights
from mlm.inference.sampling import SamplingParams, TokenLogprob, generator, sample
from mlm.inference.scheduler import Scheduler
from mlm.inference.state_cache import StatePool
from mlm.inference.text import TextStream
from mlm.model.gpt import GPT
from mlm.parallel.mesh import Mesh
from mlm.tokenizer import Tokenizer

log = logging.getLogger("mlm.inference")


class QueueFull(Exception):
    """The engine holds its maximum of waiting requests; try again later."""


@dataclass
class EngineConfig:
    """Capacity of the engine."""

    max_seqs: int = 16
    """Sequences in one batch."""
    max_tokens_per_step: int = 512
    """Tokens one step runs (prompt chunks plus one per decoding sequence); at least max_seqs."""
    block_size: int = 16
    """Tokens per KV-cache block."""
    num_blocks: int | None = None
    """KV-cache blocks; unset means enough for max_seqs sequences of the full context."""
    max_waiting: int = 256
    """Requests that may wait for a place in the batch; more are refused (HTTP 429)."""
    prefix_caching: bool = True
    """Share the cache blocks of common prompt prefixes between requests (see `scheduler`)."""
    cuda_graphs: bool = False
    """Replay decode steps as CUDA graphs (CUDA, tp = 1; see `decode_graphs`: never run on a GPU yet)."""
    packed_weights: bool = True
    """On the CPU in fp32 (torch with MKL): multiply full decode batches (max_seqs rows) by
    MKL-packed copies of the weights, one more copy of them in memory (see `packed_weights`)."""

    def __post_init__(self):
        for name in ("max_seqs", "max_tokens_per_step", "block_size", "max_waiting"):
            if getattr(self, name) < 1:
                raise MlmError(f"{name}={getattr(self, name)}: must be at least 1")
        if self.max_tokens_per_step < self.max_seqs:
            raise MlmError(
                f"max_tokens_per_step={self.max_tokens_per_step} is less than max_seqs={self.max_seqs}: "
                "every running sequence needs a token in each step"
            )
        if self.num_blocks is not None and self.num_blocks < 1:
            raise MlmError(f"num_blocks={self.num_blocks}: must be at least 1")


@dataclass
class RequestOutput:
    """What one step produced for one request (deltas), and whether it is done."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    """stop (stop token or string), length (max_tokens or the context), abort, error."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None


@dataclass
class Completion:
    """A request's outputs put together (`add` each `RequestOutput` in order)."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None

    def add(self, out: RequestOutput) -> None:
        self.token_ids += out.token_ids
        self.text += out.text
        self.logprobs += out.logprobs
        self.prompt_tokens, self.completion_tokens = out.prompt_tokens, out.completion_tokens
        if out.finished:
            self.finish_reason, self.error = out.finish_reason, out.error


def build_runner(model: GPT, config: EngineConfig, mesh: Mesh | None = None) -> ModelRunner:
    """The paged cache (this rank's key/value heads, the same blocks on every tp rank) and the
    runner over it, for this rank's shard of the model."""
    mesh = mesh or Mesh.single()
    p = next(model.parameters())
    context = model.cfg.max_position_embeddings
    num_blocks = config.num_blocks or config.max_seqs * blocks_needed(context, config.block_size)
    if config.cuda_graphs and (p.device.type != "cuda" or mesh.tp > 1):
        where = f"on {p.device.type}" if p.device.type != "cuda" else f"at tp {mesh.tp}"
        raise MlmError(f"--cuda-graphs {where}: CUDA graphs run on a CUDA device at tp 1 only; leave it off")
    states = StatePool(model.cfg, config.max_seqs, p.dtype, p.device, mesh.tp)
    if config.cuda_graphs and states.layers:
        raise MlmError(
            "--cuda-graphs with recurrent layers: decode graphs of state slots are not built; leave it off"
        )
    cache = PagedKVCache(
        model.cfg, num_blocks, config.block_size, p.dtype, p.device, mesh.tp, scratch=config.cuda_graphs
    )
    graphs = DecodeGraphs(model, cache, config.max_seqs, capture=True) if config.cuda_graphs else None
    runner = ModelRunner(model, cache, mesh, graphs, states if states.layers else None)
    if config.packed_weights and packing_applies(p.device, p.dtype):
        runner.packed_bytes = pack_weights(model, config.max_seqs)
    else:
        unpack_weights(model)
    return runner


class Sequence:
    """One request inside the engine."""

    def __init__(self, request_id, prompt_ids, params, on_output, tokenizer, context):
        self.id = request_id
        self.prompt_ids: list[int] = prompt_ids
        self.output_ids: list[int] = []
        self.params: SamplingParams = params
        self.on_output: Callable[[RequestOutput], None] = on_output
        self.blocks: list[int] = []
        self.num_computed = 0
        self.prefix_ids: list[int] = []
        self.num_prompt_tokens = len(prompt_ids)
        self.preemptions = 0
        self.slot: int | None = None  # its state slot while it runs (recurrent layers)
        self.completion_tokens = 0  # output_ids plus a stop token, which is not output
        self.max_length = min(len(prompt_ids) + params.max_tokens, context)
        self.gen = None if params.greedy else generator(params.seed)
        self.text = TextStream(tokenizer, params.stop)
        eod = tokenizer.eod_id if tokenizer is not None else None
        self.stop_ids = set(params.stop_token_ids) | (
            {eod} if eod is not None and not params.ignore_eos else set()
        )
        self.arrival = time.perf_counter()

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def tokens(self, start: int, end: int) -> list[int]:
        """Token ids start .. end - 1 of prompt + output."""
        P = len(self.prompt_ids)
        if end <= P:
            return self.prompt_ids[start:end]
        if start >= P:
            return self.output_ids[start - P : end - P]
        return self.prompt_ids[start:] + self.output_ids[: end - P]

    def pending(self, n: int) -> list[int]:
        return self.tokens(self.num_computed, self.num_computed + n)


class Engine:
    """Continuous batching over the paged KV cache: `submit` queues a request, each `step` admits
    what fits, runs one model forward over every scheduled segment and samples the next token of
    every sequence that finished its pending tokens; `has_work` says whether steps remain."""

    def __init__(
        self,
        model: GPT,
        tokenizer: Tokenizer | None = None,
        config: EngineConfig | None = None,
        mesh: Mesh | None = None,
    ):
        """`model`: the plain GPT, or this rank's tp shard of it on tp rank 0 of `mesh`."""
        self.model = model
        self.tokenizer = tokenizer
        self.config = cfg = config or EngineConfig()
        self.context = model.cfg.max_position_embeddings
        self.runner = build_runner(model, cfg, mesh)
        self.cache = self.runner.cache
        states = self.runner.states
        if states is not None:
            log.info("%s", states.summary())
        self.scheduler = Scheduler(
            self.cache.allocator,
            cfg.block_size,
            cfg.max_seqs,
            cfg.max_tokens_per_step,
            cfg.prefix_caching and states is None,
            states,
        )
        self.stats = self.scheduler.stats
        """Tokens run (prefill, decode), prefix-cache tokens queried and hit, preemptions."""
        self.on_step: Callable[[int, int], None] | None = None
        """Called after each step with (sequences run, tokens run), e.g. by the server's metrics."""
        self._live: dict[str, Sequence] = {}
        self._inbox: list[Sequence] = []
        self._aborts: set[str] = set()
        self._scores: list[tuple[list[int], int, Callable]] = []
        """Prompts whose log-probs are asked for (`score`), run before the next step."""
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._ids = itertools.count()
        self.finished: Counter[str] = Counter()
        """Requests finished, by finish_reason."""
        self.prompt_tokens = 0
        """Prompt tokens of the finished requests."""
        self.generated_tokens = 0
        """Tokens sampled (stop tokens included)."""

    # ------------------------------------------------------------------ any thread

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        on_output: Callable[[RequestOutput], None],
        request_id: str | None = None,
    ) -> str:
        """Queue a request; its outputs go to `on_output` (on the engine's thread). Raises MlmError
        for a request that can never run and QueueFull when max_waiting requests already wait."""
        self._check_prompt(prompt_ids)
        request_id = request_id or f"req-{next(self._ids)}"
        seq = Sequence(request_id, list(prompt_ids), params, on_output, self.tokenizer, self.context)
        need, total = self.scheduler.blocks_for(seq), self.cache.allocator.num_blocks
        if need > total:
            raise MlmError(
                f"the request needs {need} KV-cache blocks (prompt + max_tokens = {seq.max_length} tokens) "
                f"but the cache has {total}; lower max_tokens or give the engine more blocks"
            )
        with self._lock:
            if len(self._inbox) + len(self.scheduler.waiting) >= self.config.max_waiting:
                raise QueueFull(f"{self.config.max_waiting} requests are already waiting")
            self._inbox.append(seq)
        self._wake.set()
        return request_id

    def score(
        self, prompt_ids: list[int], top: int, on_done: Callable[[list[TokenLogprob] | Exception], None]
    ) -> None:
        """Queue the log-prob of every prompt token after the first, given the tokens before it,
        with its `top` most likely alternatives (the model's own distribution: no temperature or
        penalty); `on_done` gets them, or the exception that failed them (on the engine's thread).
        One forward over the whole prompt, without the cache. MlmError for a prompt that can never
        run, or under tensor parallelism (not built)."""
        self._check_prompt(prompt_ids)
        if self.runner.mesh.tp > 1:
            raise MlmError("prompt log-probs are not built under tensor parallelism; serve at tp 1")
        with self._lock:
            self._scores.append((list(prompt_ids), top, on_done))
        self._wake.set()

    def _check_prompt(self, prompt_ids: list[int]) -> None:
        vocab = self.model.cfg.vocab_size
        if not prompt_ids:
            raise MlmError("the prompt is empty: give at least one token")
        if any(not 0 <= t < vocab for t in prompt_ids):
            bad = next(t for t in prompt_ids if not 0 <= t < vocab)
            raise MlmError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        if len(prompt_ids) >= self.context:
            raise MlmError(
                f"the prompt has {len(prompt_ids)} tokens; the model's context is {self.context}, "
                "which leaves no room to generate"
            )

    def abort(self, request_id: str) -> None:
        """Cancel a request; it leaves at the next step with finish_reason "abort"."""
        with self._lock:
            self._aborts.add(request_id)
        self._wake.set()

    @property
    def num_waiting(self) -> int:
        return len(self._inbox) + len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    # ------------------------------------------------------------------ the engine's thread

    def has_work(self) -> bool:
        return bool(self._live or self._inbox or self._aborts or self._scores)

    def step(self) -> int:
        """Score the prompts asked for, then admit, run and sample one step; the number of
        sequences it ran."""
        self._run_scores()
        self._take_inbox()
        batch = self.scheduler.schedule()
        if not batch:
            return 0
        try:
            segments = [
                Segment(
                    seq.pending(n),
                    seq.num_computed,
                    seq.blocks,
                    seq.num_computed + n == seq.num_tokens,
                    seq.slot,
                )
                for seq, n in batch
            ]
            logits_BV = self.runner.forward(segments)  # rows: the segments that sample
            self.scheduler.computed(batch)
            seqs = [seq for (seq, _), c in zip(batch, segments, strict=True) if c.sample]
            tokens, logprobs, errors = sample(
                logits_BV,
                [s.params for s in seqs],
                [s.gen for s in seqs],
                [s.prompt_ids for s in seqs],
                [s.output_ids for s in seqs],
            )
        except Exception as e:  # a failed forward fails its batch, never the engine
            log.exception("inference step failed")
            for seq, _ in batch:
                self._finish(seq, RequestOutput(seq.id), "error", error=f"{type(e).__name__}: {e}")
            return len(batch)
        for seq, token, lp, error in zip(seqs, tokens, logprobs, errors, strict=True):
            if error is None:
                self._append(seq, token, lp)
            else:  # its sampling failed: it alone finishes
                log.warning("sampling %s failed: %s", seq.id, error)
                self._finish(seq, RequestOutput(seq.id), "error", error=f"sampling failed: {error}")
        if self.on_step is not None:
            self.on_step(len(batch), sum(len(c.tokens) for c in segments))
        return len(batch)

    def _run_scores(self) -> None:
        with self._lock:
            scores, self._scores = self._scores, []
        for ids, top, on_done in scores:
            try:
                result = self.runner.score(ids, top)
            except Exception as e:  # a failed forward fails its request, never the engine
                log.exception("scoring a prompt failed")
                result = e
            on_done(result)

    def _take_inbox(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, set()
        for seq in inbox:
            self._live[seq.id] = seq
            self.scheduler.add(seq)
        for rid in aborts:
            if rid in self._live:
                self._finish(self._live[rid], RequestOutput(rid), "abort")

    def _append(self, seq: Sequence, token: int, lp: TokenLogprob | None) -> None:
        seq.completion_tokens += 1
        self.generated_tokens += 1
        out = RequestOutput(seq.id)
        if token in seq.stop_ids:
            out.text = seq.text.flush()
            self._finish(seq, out, "stop")
            return
        seq.output_ids.append(token)
        out.token_ids = [token]
        out.logprobs = [lp] if lp is not None else []
        out.text, hit_stop = seq.text.add(token)
        if hit_stop:
            self._finish(seq, out, "stop")
        elif seq.num_tokens >= seq.max_length:
            out.text += seq.text.flush()
            self._finish(seq, out, "length")
        else:
            self._emit(seq, out)

    def _finish(self, seq: Sequence, out: RequestOutput, reason: str, error: str | None = None) -> None:
        self.scheduler.remove(seq)
        self._live.pop(seq.id, None)
        self.finished[reason] += 1
        self.prompt_tokens += len(seq.prompt_ids)
        out.finished, out.finish_reason, out.error = True, reason, error
        self._emit(seq, out)

    def _emit(self, seq: Sequence, out: RequestOutput) -> None:
        out.prompt_tokens, out.completion_tokens = len(seq.prompt_ids), seq.completion_tokens
        try:
            seq.on_output(out)
        except Exception:  # a consumer that went away must not stop the others
            log.exception("output callback of %s failed", seq.id)

    def start(self) -> None:
        """Run the step loop on a background thread until `stop`."""
        assert self._thread is None
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="mlm-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the loop's thread (if started); under tp, also release the other ranks, for good."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.runner.close()

    def _loop(self) -> None:
        while not self._stopping:
            self._wake.clear()  # before looking for work: a submit from now on wakes the wait
            try:
                ran = self.step()
            except Exception as e:  # a bug outside the model step: fail what is live, keep serving
                log.exception("engine step failed")
                for seq in list(self._live.values()):
                    self._finish(seq, RequestOutput(seq.id), "error", error=f"{type(e).__name__}: {e}")
                ran = 0
            if ran == 0 and not self._inbox and not self._aborts and not self._scores:
                self._wake.wait(timeout=1.0)

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[Completion]:
        """Run `prompts` together to the end in this thread (the engine must not be started)."""
        assert self._thread is None, "generate() drives the engine itself; it is running on a thread"
        plist = params if isinstance(params, list) else [params] * len(prompts)
        results = [Completion() for _ in prompts]
        for prompt, p, result in zip(prompts, plist, results, strict=True):
            self.submit(prompt, p, result.add)
        while self.has_work():
            self.step()
        return results
