"""The cached forward: the plain GPT's own modules and weights, run over a packed batch of
sequence chunks whose keys and values go to and come from the paged cache.

A step packs every scheduled chunk (a prompt or part of one, or the one new token of a decoding
sequence) into one run of T tokens: embeddings, norms, projections and MLPs run once over all T
(one forward per step, the point of batching), and attention runs per sequence over that
sequence's own cached keys and values, with no padding. So a sequence's numbers do not depend on
what shares its batch (up to the matmul kernel, which on the CPU in fp32 computes each row alike).
Only the chunks that end a sequence's pending tokens (`sample`) go through the output layer.

Under tensor parallelism (a model from `parallelize`) the same code runs on every tp rank over
its shards: its query and key/value heads, its cache, its slice of the vocabulary, whose logits
are gathered; rank 0 calls `forward`, which first broadcasts the step, and the other ranks run
`follow` until rank 0's `close` (see `lockstep`).

Shape legend: T packed tokens, n a chunk's tokens, L a sequence's cached length, D hidden,
H heads, G key/value heads, K head dim, B sequences, V vocabulary.
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
from mlm.model.rope import apply_rope, rope_tables
from mlm.parallel.mesh import Mesh
from mlm.parallel.tensor import gather_from_tp


@dataclass
class Chunk:
    """`tokens` of one sequence, at positions start .., whose cache blocks are `blocks`; `sample`:
    its logits are wanted (the chunk ends the sequence's pending tokens)."""

    tokens: list[int]
    start: int
    blocks: list[int]
    sample: bool = True


class ModelRunner:
    def __init__(self, model: GPT, cache: PagedKVCache, mesh: Mesh | None = None):
        self.model = model.eval()
        self.cache = cache
        self.mesh = mesh or Mesh.single()
        self._closed = False
        cfg = model.cfg
        self.device = next(model.parameters()).device
        self.vocab = cfg.vocab_size
        self.rope = None
        if model.pos_embed is None:
            self.rope = rope_tables(cfg, cfg.max_position_embeddings, self.device)

    def forward(self, chunks: list[Chunk]) -> torch.Tensor:
        """Logits [B, V] (unpadded vocabulary) after the last token of each chunk that samples (on
        tp rank 0, which sends the step to the other tp ranks first)."""
        assert not self._closed, "the other tp ranks have left: close() released them"
        if self.mesh.tp > 1:
            broadcast_step(chunks, self.mesh, self.device)
        return self._run(chunks)

    def follow(self) -> int:
        """On the tp ranks other than 0: run the steps rank 0 sends until it stops; the steps run.
        Meanwhile SIGINT is ignored: a Ctrl-C reaches every rank of a torchrun job, and rank 0,
        stopping, sends the stop message that ends this loop."""
        main = threading.current_thread() is threading.main_thread()
        handler = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
        steps = 0
        try:
            while received := receive_step(self.mesh, self.device):
                self._run([Chunk(*c) for c in received])
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
    def _run(self, chunks: list[Chunk]) -> torch.Tensor:
        m, cache, dev = self.model, self.cache, self.device
        tokens_T = torch.tensor([t for c in chunks for t in c.tokens], device=dev)
        positions = [c.start + i for c in chunks for i in range(len(c.tokens))]
        pos_T = torch.tensor(positions, device=dev)
        slots_T = torch.tensor(
            [s for c in chunks for s in cache.slots(c.blocks, c.start, len(c.tokens))], device=dev
        )
        tables = [
            torch.tensor(c.blocks[: blocks_needed(c.start + len(c.tokens), cache.block_size)], device=dev)
            for c in chunks
        ]
        x_TD = m.embed(tokens_T)
        if m.pos_embed is not None:
            x_TD = x_TD + m.pos_embed(pos_T)
        rope = None if self.rope is None else (self.rope[0][pos_T], self.rope[1][pos_T])
        for i, layer in enumerate(m.layers.values()):
            x_TD = x_TD + self._attention(i, layer.attn, layer.attn_norm(x_TD), rope, slots_T, chunks, tables)
            x_TD = x_TD + layer.mlp(layer.mlp_norm(x_TD))
        lengths = accumulate(len(c.tokens) for c in chunks)
        ends = [end - 1 for c, end in zip(chunks, lengths, strict=True) if c.sample]
        if not ends:  # only parts of longer prompts (so on every rank): no output layer, no gather
            return x_TD.new_empty(0, self.vocab)
        x_BD = m.final_norm(x_TD[torch.tensor(ends, device=dev)])
        weight = m.embed.weight if m.output is None else m.output.weight
        return gather_from_tp(F.linear(x_BD, weight), self.mesh)[:, : self.vocab]

    def _attention(self, layer_idx, attn, h_TD, rope, slots_T, chunks, tables) -> torch.Tensor:
        T, K = h_TD.shape[0], attn.cfg.head_dim
        q_THK = attn.q(h_TD).view(T, -1, K)
        k_TGK = attn.k(h_TD).view(T, -1, K)
        v_TGK = attn.v(h_TD).view(T, -1, K)
        if rope is not None:  # apply_rope takes [B, T, heads, K]: one "batch" of T tokens
            q_THK = apply_rope(q_THK[None], *rope)[0]
            k_TGK = apply_rope(k_TGK[None], *rope)[0]
        self.cache.write(layer_idx, slots_T, k_TGK, v_TGK)
        gqa = q_THK.shape[1] != k_TGK.shape[1]
        out: list[torch.Tensor] = []
        offset = 0
        with self._few_threads():
            for c, blocks in zip(chunks, tables, strict=True):
                n = len(c.tokens)
                out.append(
                    self._sequence_attention(layer_idx, q_THK[offset : offset + n], c.start, blocks, gqa)
                )
                offset += n
        return attn.out(torch.cat(out).reshape(T, -1))

    def _sequence_attention(self, layer_idx, q_nHK, start, blocks, gqa) -> torch.Tensor:
        """Attention of one sequence's n new queries over its cached keys and values, [n, H, K]."""
        n, length = q_nHK.shape[0], start + q_nHK.shape[0]
        k_LGK, v_LGK = self.cache.read(layer_idx, blocks, length)
        q_1HnK = q_nHK.transpose(0, 1)[None]
        k_1GLK, v_1GLK = k_LGK.transpose(0, 1)[None], v_LGK.transpose(0, 1)[None]
        if n == 1 or start == 0:  # one query sees everything; a whole prompt is plain causal
            o = F.scaled_dot_product_attention(q_1HnK, k_1GLK, v_1GLK, is_causal=n > 1, enable_gqa=gqa)
        else:  # a later chunk of a prompt: query i sees keys up to start + i
            dev = q_nHK.device
            mask_nL = (
                torch.arange(length, device=dev)[None, :] <= start + torch.arange(n, device=dev)[:, None]
            )
            o = F.scaled_dot_product_attention(q_1HnK, k_1GLK, v_1GLK, attn_mask=mask_nL, enable_gqa=gqa)
        return o[0].transpose(0, 1)

    @contextlib.contextmanager
    def _few_threads(self):
        """On the CPU, the per-sequence attention runs on one intra-op thread: its ops are too small
        to split (SDPA of 1 query over 40 keys, measured on 2 loaded cores: 15 µs on one thread,
        800 µs on two). Splitting runs over heads and queries, never a reduction, so the numbers
        are the same."""
        if self.device.type != "cpu":
            yield
            return
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)
