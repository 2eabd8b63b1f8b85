"""The cached forward: the model's own forward (`GPT.hidden_states` and `GPT.logits`, the code
training runs) over a packed batch of sequence segments, given their positions and a view of
the paged cache (`PagedAttention`) that the model's attention layers write their keys and
values to and attend over.

A step packs every scheduled segment (a prompt or part of one, or the one new token of a
decoding sequence) into one run of T tokens: embeddings, norms, projections and MLPs run once
over all T (one forward per step, the point of batching), and attention runs once per layer
for all decoding sequences over their cached keys and values and once per prompt
(`paged_attention`). Only the segments that end a sequence's pending tokens (`sample`) go
through the output layer. Multi-latent attention caches one key head per token, [latent ; rope
key], whose latent columns are also the values; its queries come with the key up-projection
absorbed, so attention is one-key-head (MQA) attention over the cache (see `mlm.model.kinds.mla`).

Under tensor parallelism (a model from `parallelize`) the same code runs on every tp rank over
its shards: its query and key/value heads (MLA: its query heads, the whole latent), its cache,
its slice of the vocabulary, whose logits are gathered; rank 0 calls `forward`, which first
broadcasts the step, and the other ranks run `follow` until rank 0's `close` (see `lockstep`).

Shape legend: T packed tokens, D hidden, B sequences that sample, V vocabulary.
"""

from __future__ import annotations

import signal
import threading
from dataclasses import dataclass
from itertools import accumulate

import torch

from mlm.inference.decode_graphs import DecodeGraphs
from mlm.inference.kv_cache import PagedKVCache
from mlm.inference.lockstep import broadcast_step, receive_step, stop_followers
from mlm.inference.paged_attention import PagedAttention
from mlm.inference.sampling import TokenLogprob, token_logprob
from mlm.inference.state_cache import StatePool
from mlm.model.gpt import GPT
from mlm.parallel.mesh import Mesh
from mlm.parallel.tensor import gather_from_tp


@dataclass
class Segment:
    """`tokens` of one sequence, at positions start .., whose cache blocks are `blocks`; `sample`:
    its logits are wanted (the segment ends the sequence's pending tokens)."""

    tokens: list[int]
    start: int
    blocks: list[int]
    sample: bool = True
    slot: int | None = None
    """Its state slot (`state_cache`), for a model with recurrent layers."""


class ModelRunner:
    """Runs scheduled segments through the model over the paged cache: `forward` on tp rank 0
    (and at tp = 1), `follow` on the other tp ranks."""

    def __init__(
        self,
        model: GPT,
        cache: PagedKVCache,
        mesh: Mesh | None = None,
        graphs: DecodeGraphs | None = None,
        states: StatePool | None = None,
    ):
        """`graphs`: CUDA graphs that run the decode steps they take (tp = 1 only); `states`: the
        recurrent layers' state slots, if the model has any."""
        self.model = model.eval()
        self.cache = cache
        self.states = states
        self.mesh = mesh or Mesh.single()
        assert graphs is None or self.mesh.tp == 1, "decode graphs run at tp = 1 only"
        self.graphs = graphs
        self._closed = False
        self.device = next(model.parameters()).device
        self.vocab = model.cfg.vocab_size
        self.packed_bytes = 0
        """Bytes of the weights `packed_weights` packed for full decode batches (0: none)."""

    def forward(self, segments: list[Segment]) -> torch.Tensor:
        """Logits [B, V] (unpadded vocabulary) after the last token of each segment that samples (on
        tp rank 0, which sends the step to the other tp ranks first)."""
        assert not self._closed, "the other tp ranks have left: close() released them"
        self.model.check_position(max(c.start + len(c.tokens) for c in segments) - 1)
        if self.graphs is not None and self.graphs.takes(segments):
            return self.graphs.run(segments)[:, : self.vocab]
        if self.mesh.tp > 1:
            broadcast_step(segments, self.mesh, self.device)
        return self._run(segments)

    def follow(self) -> int:
        """On the tp ranks other than 0: run the steps rank 0 sends until it stops; the steps run.
        Meanwhile SIGINT is ignored: a Ctrl-C reaches every rank of a torchrun job, and rank 0,
        stopping, sends the stop message that ends this loop."""
        main = threading.current_thread() is threading.main_thread()
        handler = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
        steps = 0
        try:
            while received := receive_step(self.mesh, self.device):
                self._run([Segment(*c) for c in received])
                steps += 1
        finally:
            if handler is not None:
                signal.signal(signal.SIGINT, handler)
        return steps

    def close(self) -> None:
        """On tp rank 0: end the other ranks' `follow`, for good (nothing to do at tp = 1)."""
        if self.mesh.tp > 1 and not self._closed:
            stop_followers(self.mesh, self.device)
            self._closed = True

    @torch.inference_mode()
    def score(self, ids: list[int], top: int, rows: int = 256) -> list[TokenLogprob]:
        """The log-prob of each of `ids` after the first given those before it, with its `top` most
        likely alternatives: one forward over the whole sequence without the cache (tp = 1), the
        logits `rows` positions at a time."""
        assert self.mesh.tp == 1, "prompt log-probs run at tp = 1"
        h_1TD = self.model.hidden_states(torch.tensor([ids], device=self.device))
        out = []
        for s in range(0, len(ids) - 1, rows):
            logits_RV = self.model.logits(h_1TD[0, s : min(s + rows, len(ids) - 1)])[:, : self.vocab].float()
            out += [token_logprob(row, t, top) for row, t in zip(logits_RV, ids[s + 1 :], strict=False)]
        return out

    @torch.inference_mode()
    def _run(self, segments: list[Segment]) -> torch.Tensor:
        cache, dev = self.cache, self.device
        tokens_1T = torch.tensor([[t for c in segments for t in c.tokens]], device=dev)
        pos_1T = torch.tensor([[c.start + i for c in segments for i in range(len(c.tokens))]], device=dev)
        slots_T = torch.tensor(
            [s for c in segments for s in cache.slots(c.blocks, c.start, len(c.tokens))], device=dev
        )
        step = PagedAttention(cache, segments, slots_T, self.states)
        h_1TD = self.model.hidden_states(tokens_1T, pos_1T, step)
        lengths = accumulate(len(c.tokens) for c in segments)
        ends = [end - 1 for c, end in zip(segments, lengths, strict=True) if c.sample]
        if not ends:  # only parts of longer prompts (so on every rank): no output layer, no gather
            return h_1TD.new_empty(0, self.vocab)
        logits_Bv = self.model.logits(h_1TD[0, torch.tensor(ends, device=dev)])
        return gather_from_tp(logits_Bv, self.mesh)[:, : self.vocab]
