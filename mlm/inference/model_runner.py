"""The cached forward: the model's own forward (`GPT.hidden_states` and `GPT.logits`, the code
training runs) over a packed batch of sequence segments, given their positions and a view of
the paged cache (`PagedAttention`) that the model's attention layers write their keys and
values to and attend over.

A step packs every scheduled segment (a prompt or part of one, or the one new token of a
decoding sequence) into one run of T tokens: embeddings, norms, projections and MLPs run once
over all T (one forward per step, the point of batching), and attention runs per sequence over
that sequence's own cached keys and values, with no padding. So a sequence's numbers do not depend
on what shares its batch (up to the matmul kernel, which on the CPU in fp32 computes each row
alike). Only the segments that end a sequence's pending tokens (`sample`) go through the output
layer. Multi-latent attention caches one key head per token, [latent ; rope key], whose latent
columns are also the values; its queries come with the key up-projection absorbed, so attention
is one-key-head (MQA) attention over the cache (see `mlm.model.mla`).

Under tensor parallelism (a model from `parallelize`) the same code runs on every tp rank over
its shards: its query and key/value heads (MLA: its query heads, the whole latent), its cache,
its slice of the vocabulary, whose logits are gathered; rank 0 calls `forward`, which first
broadcasts the step, and the other ranks run `follow` until rank 0's `close` (see `lockstep`).

Shape legend: T packed tokens, n a segment's tokens, L a sequence's cached length, D hidden,
H heads, G key/value heads, K key dims, E value dims, B sequences, V vocabulary.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F

from mlm.inference.kv_cache import PagedKVCache, blocks_needed
from mlm.inference.lockstep import broadcast_step, receive_step, stop_followers
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


class ModelRunner:
    """Runs scheduled segments through the model over the paged cache: `forward` on tp rank 0
    (and at tp = 1), `follow` on the other tp ranks."""

    def __init__(self, model: GPT, cache: PagedKVCache, mesh: Mesh | None = None):
        self.model = model.eval()
        self.cache = cache
        self.mesh = mesh or Mesh.single()
        self._closed = False
        self.device = next(model.parameters()).device
        self.vocab = model.cfg.vocab_size

    def forward(self, segments: list[Segment]) -> torch.Tensor:
        """Logits [B, V] (unpadded vocabulary) after the last token of each segment that samples (on
        tp rank 0, which sends the step to the other tp ranks first)."""
        assert not self._closed, "the other tp ranks have left: close() released them"
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
    def _run(self, segments: list[Segment]) -> torch.Tensor:
        cache, dev = self.cache, self.device
        tokens_1T = torch.tensor([[t for c in segments for t in c.tokens]], device=dev)
        pos_1T = torch.tensor([[c.start + i for c in segments for i in range(len(c.tokens))]], device=dev)
        slots_T = torch.tensor(
            [s for c in segments for s in cache.slots(c.blocks, c.start, len(c.tokens))], device=dev
        )
        step = PagedAttention(cache, segments, slots_T)
        h_1TD = self.model.hidden_states(tokens_1T, pos_1T, step)
        lengths = accumulate(len(c.tokens) for c in segments)
        ends = [end - 1 for c, end in zip(segments, lengths, strict=True) if c.sample]
        if not ends:  # only parts of longer prompts (so on every rank): no output layer, no gather
            return h_1TD.new_empty(0, self.vocab)
        logits_Bv = self.model.logits(h_1TD[0, torch.tensor(ends, device=dev)])
        return gather_from_tp(logits_Bv, self.mesh)[:, : self.vocab]


class PagedAttention:
    """The KV cache as the model's attention layers see it during one step: `attend` writes the
    step's keys and values to their slots, then runs each sequence's queries over that sequence's
    cached keys and values."""

    def __init__(self, cache: PagedKVCache, segments: list[Segment], slots_T: torch.Tensor):
        self.cache, self.segments, self.slots_T = cache, segments, slots_T
        dev = slots_T.device
        self.tables = [
            torch.tensor(c.blocks[: blocks_needed(c.start + len(c.tokens), cache.block_size)], device=dev)
            for c in segments
        ]

    def attend(self, layer: int, q_1THK, k_1TGK, v_1TGK, scale=None, value_dim=None) -> torch.Tensor:
        """[1, T, H, E] attention output of the packed step at layer `layer` (E = K, the head dim).
        With `v_1TGK` None (MLA's latent cache: one key head [latent ; rope key], see
        `mlm.model.mla`) only the keys are stored and the values are the first `value_dim` columns
        of the cached keys (E = value_dim). `scale`: the softmax scale; None: K^-½."""
        assert (v_1TGK is None) == (value_dim is not None), "value_dim goes with values kept in the keys"
        q_THK = q_1THK[0]
        self.cache.write(layer, self.slots_T, k_1TGK[0], None if v_1TGK is None else v_1TGK[0])
        gqa = q_THK.shape[1] != k_1TGK.shape[2]
        out: list[torch.Tensor] = []
        offset = 0
        with _few_threads(q_THK.device):
            for c, blocks in zip(self.segments, self.tables, strict=True):
                n = len(c.tokens)
                q_nHK = q_THK[offset : offset + n]
                out.append(self._sequence(layer, q_nHK, c.start, blocks, gqa, scale, value_dim))
                offset += n
        return torch.cat(out)[None]

    def _sequence(self, layer, q_nHK, start, blocks, gqa, scale, value_dim) -> torch.Tensor:
        """Attention of one sequence's n new queries over its cached keys and values, [n, H, E]."""
        n, length = q_nHK.shape[0], start + q_nHK.shape[0]
        k_LGK, v_LGE = self.cache.read(layer, blocks, length)
        if v_LGE is None:
            v_LGE = k_LGK[..., :value_dim]
        q_1HnK = q_nHK.transpose(0, 1)[None]
        k_1GLK, v_1GLE = k_LGK.transpose(0, 1)[None], v_LGE.transpose(0, 1)[None]
        if n == 1 or start == 0:  # one query sees everything; a whole prompt is plain causal
            mask_nL = None
        else:  # a later part of a prompt: query i sees keys up to start + i
            dev = q_nHK.device
            mask_nL = (
                torch.arange(length, device=dev)[None, :] <= start + torch.arange(n, device=dev)[:, None]
            )
        o = F.scaled_dot_product_attention(
            q_1HnK,
            k_1GLK,
            v_1GLE,
            attn_mask=mask_nL,
            is_causal=mask_nL is None and n > 1,
            scale=scale,
            enable_gqa=gqa,
        )
        return o[0].transpose(0, 1)


@contextlib.contextmanager
def _few_threads(device: torch.device):
    """On the CPU, the per-sequence attention runs on one intra-op thread: its ops are too small
    to split (SDPA of 1 query over 40 keys, measured on 2 loaded cores: 15 µs on one thread,
    800 µs on two). Splitting runs over heads and queries, never a reduction, so the numbers
    are the same."""
    if device.type != "cpu":
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
