"""Per-sequence state slots: what recurrent mixers keep between engine steps.

A mixer whose spec's `cache` is a `StateCache` (`mlm.model.kinds.spec`) keeps, per sequence and
layer, tensors of a fixed size whatever the sequence's length (a convolution's window, a
recurrence's state). `StatePool` allocates, for every such layer, one tensor per state name of
[slots, *shape]; a running sequence owns one slot, taken at admission and given back when it
finishes, is cancelled or is preempted (a preempted sequence recomputes from its first token,
so its state starts again from zeros). All tp ranks use the same slot ids (rank 0's scheduler
sends them with each step); each holds its own shard of the state (its channels or heads).

Prefix caching is off for a model with state layers: a cached block holds keys and values but
not the recurrent state at its end, so a request starting after a cached prefix would read a
state it never computed. (Megatron keeps state snapshots at block boundaries for this; mlm does
not, and says so in `mlm serve`'s log.)

During a step the mixers see `StateView`s (`PagedAttention.state`): the step's segments in the
packed row, each with its slot, and `load` / `store` of their states.

Shape legend: L state layers, N slots, S segments of the step, T packed tokens.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from mlm.config import ModelConfig
from mlm.model import kinds
from mlm.model.kinds.spec import StateCache


def state_layers(cfg: ModelConfig, tp: int = 1) -> dict[int, StateCache]:
    """Layer number → its mixer's `StateCache` on one of `tp` ranks, for the layers that keep one."""
    out = {}
    for i, spec in enumerate(cfg.layer_specs()):
        if spec.mixer is not None and isinstance(cache := kinds.mixer(spec.mixer).cache(cfg, tp), StateCache):
            out[i] = cache
    return out


class StatePool:
    """`num_slots` slots of every state layer's tensors, and their allocation."""

    def __init__(
        self, cfg: ModelConfig, num_slots: int, dtype: torch.dtype, device: torch.device, tp: int = 1
    ):
        self.layers = state_layers(cfg, tp)
        self.index = {layer: i for i, layer in enumerate(self.layers)}
        self.num_slots = num_slots
        self.tensors: dict[int, dict[str, torch.Tensor]] = {
            layer: {
                name: torch.zeros((num_slots, *shape), dtype=dtype, device=device)
                for name, shape in c.shapes.items()
            }
            for layer, c in self.layers.items()
        }
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_slots))
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.bytes_per_sequence = sum(c.per_sequence for c in self.layers.values()) * itemsize

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """A free slot (the scheduler admits at most `num_slots` sequences)."""
        assert self._free, "no free state slot"
        slot, _ = self._free.popitem(last=False)
        return slot

    def free(self, slot: int) -> None:
        assert slot not in self._free, f"state slot {slot} was freed twice"
        self._free[slot] = None

    def summary(self) -> str:
        """One line for `mlm serve`'s log."""
        kinds_used = sorted({c.description for c in self.layers.values() if c.description})
        what = f" ({'; '.join(kinds_used)})" if kinds_used else ""
        total = self.bytes_per_sequence * self.num_slots
        return (
            f"recurrent state: {len(self.layers)} layers, {self.num_slots} slots of "
            f"{self.bytes_per_sequence} bytes per sequence{what}, {total / 2**20:.2f} MiB per rank; "
            "prefix caching is off (a cached block does not hold the state at its end)"
        )


class StateView:
    """One state layer's slots during one step: `segments` ((offset, n) in the packed row),
    `load(name)` the states they start from (zeros for a segment at the start of its sequence),
    `store(name, values)` the states after them."""

    def __init__(
        self, tensors: dict[str, torch.Tensor], segments, slots_S: torch.Tensor, fresh_S: torch.Tensor
    ):
        self.tensors, self.segments, self.slots_S, self.fresh_S = tensors, segments, slots_S, fresh_S

    def load(self, name: str) -> torch.Tensor:
        """[S, *shape]: each segment's state before its tokens."""
        values = self.tensors[name].index_select(0, self.slots_S)
        return values.masked_fill(self.fresh_S.view(-1, *[1] * (values.ndim - 1)), 0)

    def store(self, name: str, values: torch.Tensor) -> None:
        """Keep `values` [S, *shape] as each segment's state after its tokens."""
        self.tensors[name].index_copy_(0, self.slots_S, values.to(self.tensors[name].dtype))
