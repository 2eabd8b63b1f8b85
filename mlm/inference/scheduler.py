"""Which sequences run in the next step, and how many of their tokens.

Continuous batching: the batch is rebuilt every step. Decoding sequences (one pending token each)
go first, then the next chunk of prompts being prefilled, then waiting requests in arrival order
while the step's token budget, the sequence limit and the free cache blocks allow. A request is
admitted only when blocks for its whole length (prompt + max_tokens, capped at the context) are
free, so a running sequence never waits for memory and nothing is ever preempted; a prompt is
split over steps only when it is longer than the step's token budget.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from mlm.inference.kv_cache import BlockAllocator, blocks_needed


class Schedulable(Protocol):
    blocks: list[int]
    num_computed: int  # tokens whose keys and values are in the cache

    @property
    def num_tokens(self) -> int: ...  # prompt + generated so far

    @property
    def max_length(self) -> int: ...  # the most tokens it can reach


class Scheduler:
    def __init__(self, allocator: BlockAllocator, block_size: int, max_seqs: int, max_tokens_per_step: int):
        assert max_tokens_per_step >= max_seqs, "every running sequence must fit in one step"
        self.allocator = allocator
        self.block_size = block_size
        self.max_seqs = max_seqs
        self.max_tokens_per_step = max_tokens_per_step
        self.waiting: deque[Schedulable] = deque()
        self.running: list[Schedulable] = []

    def add(self, seq: Schedulable) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Schedulable) -> None:
        """Take `seq` out (finished, cancelled or failed) and give its blocks back."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.allocator.free(seq.blocks)
        seq.blocks = []

    def blocks_for(self, seq: Schedulable) -> int:
        return blocks_needed(seq.max_length, self.block_size)

    def schedule(self) -> list[tuple[Schedulable, int]]:
        """(sequence, tokens to run) for the next step; empty when there is nothing to run."""
        budget = self.max_tokens_per_step
        batch: list[tuple[Schedulable, int]] = []
        decoding = [s for s in self.running if s.num_tokens - s.num_computed == 1]
        prefilling = [s for s in self.running if s.num_tokens - s.num_computed > 1]
        for seq in decoding + prefilling:
            n = min(seq.num_tokens - seq.num_computed, budget)
            if n > 0:
                batch.append((seq, n))
                budget -= n
        while self.waiting and len(self.running) < self.max_seqs:
            seq = self.waiting[0]
            need = self.blocks_for(seq)
            # a prompt that fits one step is never split (its numbers then match a run alone)
            if need > self.allocator.num_free or min(seq.num_tokens, self.max_tokens_per_step) > budget:
                break
            self.waiting.popleft()
            seq.blocks = self.allocator.allocate(need)
            self.running.append(seq)
            n = min(seq.num_tokens, budget)
            batch.append((seq, n))
            budget -= n
        return batch
