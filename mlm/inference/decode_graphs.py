"""CUDA graphs for decode steps (`mlm serve --cuda-graphs`).

A step in which every sequence decodes (one new token each: the steady state of serving) does the
same work for the same batch size and block-table width, and on a GPU its hundreds of small
kernels are launch-bound. `DecodeGraphs` pads such a step to a bucket, a power of two of
sequences (up to max_seqs) by a power of two of blocks per table (up to the context), keeps
static input buffers per bucket, captures the model's forward over them once with
`torch.cuda.graph` and then replays it: the step's inputs are copied into the buffers and the
whole forward is one launch. Padding rows decode token 0 at position 0 into the cache's scratch
block (never handed out by the allocator) and attend to that one slot; their logits are dropped,
and the padding of real rows' tables is masked. Steps with prompt tokens run eagerly.

Where it runs: CUDA at tp = 1 (NCCL collectives inside captured graphs are not tried). A model
whose forward cannot be captured (one that synchronises with the host, as MoE routing does) is
served eagerly after one warning. On the CPU the same padded static path runs without capture,
which is how tests check it against the eager runner; **capture and replay have never run on a
GPU** (no GPU was available to this project's sessions so far).

Shape legend: B sequences (padded to the bucket), N blocks per table (padded), S block size,
L = N · S keys, V vocabulary (this rank's padded share).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from mlm.inference.kv_cache import PagedKVCache, blocks_needed
from mlm.inference.paged_attention import PagedAttention
from mlm.model.gpt import GPT

log = logging.getLogger("mlm.inference")


def _bucket(n: int, cap: int) -> int:
    """The smallest power of two ≥ n, or `cap` if that is less (n ≤ cap)."""
    return min(1 << (n - 1).bit_length(), cap)


@dataclass
class _Bucket:
    """Static inputs of one (batch, width) bucket and, once captured, its graph and output."""

    tokens_1B: torch.Tensor
    positions_1B: torch.Tensor
    slots_B: torch.Tensor
    tables_BN: torch.Tensor
    lengths_B: torch.Tensor
    graph: torch.cuda.CUDAGraph | None = None
    logits_BV: torch.Tensor | None = None


class DecodeGraphs:
    """Decode steps of up to `max_seqs` sequences through `model` over `cache` (which must have a
    scratch block), captured as CUDA graphs when `capture`, else run on the same static buffers."""

    def __init__(self, model: GPT, cache: PagedKVCache, max_seqs: int, capture: bool):
        assert cache.scratch_block is not None, "decode graphs write padding rows to the scratch block"
        self.model, self.cache, self.capture = model, cache, capture
        self.device = cache.k_LNSGK.device
        self.max_seqs = max_seqs
        self.max_width = blocks_needed(model.cfg.max_position_embeddings, cache.block_size)
        self.keys_L = torch.arange(self.max_width * cache.block_size, device=self.device)
        self.buckets: dict[tuple[int, int], _Bucket] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.failed: str | None = None

    def takes(self, segments) -> bool:
        """Whether `segments` is a decode step these graphs run."""
        return (
            self.failed is None
            and len(segments) <= self.max_seqs
            and all(len(c.tokens) == 1 and c.sample for c in segments)
        )

    @torch.inference_mode()
    def run(self, segments) -> torch.Tensor:
        """Logits [len(segments), V] of a decode step (`takes(segments)`)."""
        S, scratch = self.cache.block_size, self.cache.scratch_block
        B = len(segments)
        width = max(blocks_needed(c.start + 1, S) for c in segments)
        key = (_bucket(B, self.max_seqs), _bucket(width, self.max_width))
        b = self.buckets.get(key) or self._new_bucket(*key)
        pad = key[0] - B
        tables = [c.blocks[: blocks_needed(c.start + 1, S)] for c in segments]
        tables = [t + [scratch] * (key[1] - len(t)) for t in tables] + [[scratch] * key[1]] * pad
        inputs = (
            (b.tokens_1B, [[c.tokens[0] for c in segments] + [0] * pad]),
            (b.positions_1B, [[c.start for c in segments] + [0] * pad]),
            (b.slots_B, [c.blocks[c.start // S] * S + c.start % S for c in segments] + [scratch * S] * pad),
            (b.tables_BN, [i for t in tables for i in t]),
            (b.lengths_B, [c.start + 1 for c in segments] + [1] * pad),
        )
        for buffer, values in inputs:
            buffer.copy_(torch.tensor(values), non_blocking=True)
        if not self.capture:
            return self._forward(b)[:B]
        if b.graph is None:
            try:
                self._capture(b)
            except Exception as e:  # noqa: BLE001 - served eagerly from here on, said once
                cause = e.__context__  # an error inside the capture, then capture_end's own
                self.failed = f"{type(e).__name__}: {e}" + (
                    f" (after {type(cause).__name__}: {cause})" if cause else ""
                )
                log.warning("CUDA graphs off: the decode step could not be captured (%s)", self.failed)
                return self._forward(b)[:B]
        b.graph.replay()
        # a view of the graph's output buffer: the next replay overwrites it (Engine.step samples
        # from it first; any other caller that keeps logits across steps clones them)
        return b.logits_BV[:B]

    def _new_bucket(self, batch: int, width: int) -> _Bucket:
        def zeros(*shape):
            return torch.zeros(shape, dtype=torch.long, device=self.device)

        b = _Bucket(zeros(1, batch), zeros(1, batch), zeros(batch), zeros(batch * width), zeros(batch))
        self.buckets[(batch, width)] = b
        return b

    def _forward(self, b: _Bucket) -> torch.Tensor:
        L = len(b.tables_BN) // len(b.slots_B) * self.cache.block_size
        mask_B11L = (self.keys_L[:L][None, :] < b.lengths_B[:, None])[:, None, None]
        step = PagedAttention.decoding(self.cache, b.slots_B, b.tables_BN, mask_B11L)
        return self.model.logits(self.model.hidden_states(b.tokens_1B, b.positions_1B, step)[0])

    def _capture(self, b: _Bucket) -> None:
        """Warm up on a side stream (lazy initialisation must not be captured), then capture. The
        buffers already hold this step's inputs, so the warm-up writes its keys and values. A failed
        capture can leave its capture stream current (`torch.cuda.graph` ends the capture before
        it restores the stream): the caller's stream is set back."""
        stream = torch.cuda.current_stream()
        try:
            side = torch.cuda.Stream()
            side.wait_stream(stream)
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._forward(b)
            stream.wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                b.logits_BV = self._forward(b)
        except Exception:
            torch.cuda.set_stream(stream)
            raise
        b.graph = graph
