"""Which sequences run in the next step, and how many of their tokens; the cache blocks they hold.

Continuous batching: the batch is rebuilt every step. Decoding sequences (one pending token each)
go first, then the next chunk of prompts being prefilled, then waiting requests in arrival order
while the step's token budget, the sequence limit and the free cache blocks allow; a prompt is
split over steps only when it is longer than the step's token budget.

Blocks are taken on demand: a request is admitted when blocks for the tokens it computes now are
free, and a running sequence takes a block when its next tokens need one. When none is free, the
most recently admitted running sequence is preempted (vLLM's rule): its blocks go back, and it
returns to the front of the waiting queue to recompute its prompt and output so far when it is
admitted again (its sampling generator goes on where it was, so a seeded request draws the same
tokens). A request whose whole length needs more blocks than the cache holds is refused at
submit, so a sequence alone always fits.

Prefix caching (vLLM v1's design; `BlockAllocator`): each full block a sequence computes is
registered under (its parent's prefix id, its token ids); at admission a request takes the cached
blocks of its longest cached prefix, over all its tokens but the last (whose logits it needs), and
computes from there. A waiting request whose next block past its cached prefix is being computed
right now by a running sequence waits for it, so that simultaneous requests with a common prefix
(and the n choices of one prompt) compute it once; requests behind it may be admitted meanwhile.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol

from mlm.inference.kv_cache import BlockAllocator, blocks_needed
from mlm.inference.state_cache import StatePool


class Schedulable(Protocol):
    blocks: list[int]  # its block table
    num_computed: int  # tokens whose keys and values are in the cache
    prefix_ids: list[int]  # the prefix id of each of its leading full blocks that are cached
    num_prompt_tokens: int
    preemptions: int  # times it was preempted
    slot: int | None  # its state slot while it runs (models with recurrent layers)

    @property
    def num_tokens(self) -> int: ...  # prompt + generated so far

    @property
    def max_length(self) -> int: ...  # the most tokens it can reach

    def tokens(self, start: int, end: int) -> list[int]: ...  # token ids start .. end - 1


@dataclass
class SchedulerStats:
    """Counters since the engine started."""

    prefill_tokens: int = 0
    """Tokens run through the model as prompts (and as recomputation after a preemption)."""
    decode_tokens: int = 0
    """Tokens run through the model one at a time after being sampled."""
    prefix_queries: int = 0
    """Tokens of requests looked up in the prefix cache at their first admission (all of each
    request's tokens; a preempted sequence admitted again is recomputation, not counted here)."""
    prefix_hits: int = 0
    """Of those, tokens found cached (so not computed)."""
    preemptions: int = 0
    """Running sequences preempted for want of a cache block."""


class Scheduler:
    def __init__(
        self,
        allocator: BlockAllocator,
        block_size: int,
        max_seqs: int,
        max_tokens_per_step: int,
        prefix_caching: bool = True,
        slots: StatePool | None = None,
    ):
        """`slots`: the recurrent layers' state slots (one per running sequence), if any."""
        assert max_tokens_per_step >= max_seqs, "every running sequence must fit in one step"
        assert slots is None or (slots.num_slots >= max_seqs and not prefix_caching), (
            "a slot each, no prefix cache"
        )
        self.allocator = allocator
        self.slots = slots
        self.block_size = block_size
        self.max_seqs = max_seqs
        self.max_tokens_per_step = max_tokens_per_step
        self.prefix_caching = prefix_caching
        self.waiting: deque[Schedulable] = deque()
        self.running: list[Schedulable] = []  # in order of admission
        self.stats = SchedulerStats()

    def add(self, seq: Schedulable) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Schedulable) -> None:
        """Take `seq` out (finished, cancelled or failed) and drop its blocks' references."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)

    def blocks_for(self, seq: Schedulable) -> int:
        """Blocks `seq` holds at its longest."""
        return blocks_needed(seq.max_length, self.block_size)

    def schedule(self) -> list[tuple[Schedulable, int]]:
        """(sequence, tokens to run) for the next step; empty when there is nothing to run."""
        budget = self.max_tokens_per_step
        batch: list[tuple[Schedulable, int]] = []
        preempted = False
        decoding = [s for s in self.running if s.num_tokens - s.num_computed == 1]
        prefilling = [s for s in self.running if s.num_tokens - s.num_computed > 1]
        for seq in decoding + prefilling:
            if seq not in self.running:  # preempted for an earlier one
                continue
            n = min(seq.num_tokens - seq.num_computed, budget)
            if n == 0:
                continue
            while not self._grow(seq, seq.num_computed + n):
                victim = self.running[-1]  # the most recently admitted
                self._preempt(victim)
                preempted = True
                for i, (s, m) in enumerate(batch):
                    if s is victim:
                        del batch[i]
                        budget += m
                        break
                if victim is seq:
                    break
            else:
                batch.append((seq, n))
                budget -= n
        if preempted:  # memory is short: admit nothing now
            return batch
        computing = {key for seq in self.running if (key := self._next_key(seq)) is not None}
        for seq in list(self.waiting):
            if len(self.running) >= self.max_seqs:
                break
            cached = self._match(seq)
            parent = self.allocator.prefix_id(cached[-1]) if cached else BlockAllocator.ROOT
            nxt = self._key_at(seq, len(cached), parent)
            if nxt is not None and nxt in computing:  # computed now by another: wait for it
                continue
            start = len(cached) * self.block_size
            # a prompt that fits one step is never split (its numbers then match a run alone)
            if min(seq.num_tokens - start, self.max_tokens_per_step) > budget:
                break
            n = min(seq.num_tokens - start, budget)
            need = blocks_needed(start + n, self.block_size) - len(cached)
            if need > self.allocator.num_free - self.allocator.num_reviving(cached):
                break
            self.waiting.remove(seq)
            self.allocator.take(cached)
            seq.blocks = cached + self.allocator.allocate(need)
            seq.prefix_ids = [self.allocator.prefix_id(b) for b in cached]
            seq.num_computed = start
            if self.slots is not None:
                seq.slot = self.slots.allocate()
            if self.prefix_caching and not seq.preemptions:
                self.stats.prefix_queries += seq.num_tokens
                self.stats.prefix_hits += start
            self.running.append(seq)
            if nxt is not None:
                computing.add(nxt)
            batch.append((seq, n))
            budget -= n
        return batch

    def computed(self, batch: list[tuple[Schedulable, int]]) -> None:
        """After the step's forward: count its tokens, advance each sequence and cache the full
        blocks it completed."""
        S = self.block_size
        for seq, n in batch:
            sampled_never_run = seq.num_prompt_tokens <= seq.num_computed == seq.num_tokens - 1
            if n == 1 and sampled_never_run:
                self.stats.decode_tokens += 1
            else:
                self.stats.prefill_tokens += n
            seq.num_computed += n
            if not self.prefix_caching:
                continue
            for i in range(len(seq.prefix_ids), seq.num_computed // S):
                parent = seq.prefix_ids[-1] if seq.prefix_ids else BlockAllocator.ROOT
                tokens = seq.tokens(i * S, i * S + S)
                seq.prefix_ids.append(self.allocator.register(seq.blocks[i], parent, tokens))

    def _match(self, seq: Schedulable) -> list[int]:
        """The cached blocks of `seq`'s longest cached prefix of full blocks, its last token left out."""
        if not self.prefix_caching:
            return []
        S = self.block_size
        chunks = (seq.tokens(i * S, i * S + S) for i in range((seq.num_tokens - 1) // S))
        return self.allocator.match(BlockAllocator.ROOT, chunks)

    def _key_at(self, seq: Schedulable, i: int, parent: int) -> tuple | None:
        """The cache key of `seq`'s block i after prefix id `parent`; None unless caching is on and
        the block is full without `seq`'s last token (so it could be shared)."""
        S = self.block_size
        if not self.prefix_caching or (i + 1) * S > seq.num_tokens - 1:
            return None
        return (parent, tuple(seq.tokens(i * S, i * S + S)))

    def _next_key(self, seq: Schedulable) -> tuple | None:
        """The key of the first block a running `seq` has still to compute, if it is full."""
        parent = seq.prefix_ids[-1] if seq.prefix_ids else BlockAllocator.ROOT
        return self._key_at(seq, len(seq.prefix_ids), parent)

    def _grow(self, seq: Schedulable, length: int) -> bool:
        """Give `seq` the blocks for its first `length` tokens; False when too few are free."""
        need = blocks_needed(length, self.block_size) - len(seq.blocks)
        if need > self.allocator.num_free:
            return False
        if need > 0:
            seq.blocks += self.allocator.allocate(need)
        return True

    def _preempt(self, seq: Schedulable) -> None:
        """Free a running sequence's blocks and put it first in line, to recompute from scratch."""
        self.running.remove(seq)
        self._release(seq)
        self.waiting.appendleft(seq)
        seq.preemptions += 1
        self.stats.preemptions += 1

    def _release(self, seq: Schedulable) -> None:
        self.allocator.free(seq.blocks)
        seq.blocks, seq.prefix_ids, seq.num_computed = [], [], 0
        if self.slots is not None and seq.slot is not None:
            self.slots.free(seq.slot)
            seq.slot = None
