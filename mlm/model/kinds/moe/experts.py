"""The routed experts: E MLPs stored as stacked weights [E, out, in], run over tokens grouped by
expert (rows of expert 0 first, then expert 1, ...; `counts` rows each).

Three implementations of the same math, equal in tests:

    grouped_mm   torch._grouped_mm over the groups (one kernel; torchtitan's GroupedExperts)
    bmm          the groups padded to the largest, one batched matmul
    loop         one matmul per expert (Megatron's SequentialMLP): the reference

`auto` takes grouped_mm where the torch build has it and the shapes suit it (rows 16-byte
aligned), else bmm. Shape legend: M rows (token copies), D hidden, F expert ffn, E experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.lean import autocast_dtype
from mlm.model.ops import Ops

IMPLS = ("grouped_mm", "bmm", "loop")


class ExpertWeights(nn.Module):
    """One stacked weight [E, out, in] (named like a linear layer's, `...gate.weight`)."""

    def __init__(self, experts: int, out_features: int, in_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, out_features, in_features))


def _grouped_mm_ok(x_MD: torch.Tensor, *weights: torch.Tensor) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    align = 16 // x_MD.element_size()
    return all(w.shape[1] % align == 0 and w.shape[2] % align == 0 for w in weights)


class GroupedExperts(nn.Module):
    """E expert MLPs (SwiGLU: down(silu(gate x) · up x); else down(act(up x))) over grouped rows;
    the activation is the dense MLP's (`model.kernels` picks torch or Triton, saving its inputs only)."""

    def __init__(
        self, experts: int, hidden: int, ffn: int, activation: str, impl: str = "auto", ops: Ops | None = None
    ):
        super().__init__()
        self.ops = ops or Ops()
        self.gated = activation == "swiglu"
        self.activation = activation
        self.gate = ExpertWeights(experts, ffn, hidden) if self.gated else None
        self.up = ExpertWeights(experts, ffn, hidden)
        self.down = ExpertWeights(experts, hidden, ffn)
        self.impl = impl

    @property
    def num_local(self) -> int:
        return self.up.weight.shape[0]

    def _act(self, gate, up):
        return self.ops.swiglu(gate, up) if self.gated else self.ops.activation(up, self.activation)

    def forward(self, x_MD: torch.Tensor, counts: list[int]) -> torch.Tensor:
        assert len(counts) == self.num_local and sum(counts) == x_MD.shape[0], (counts, x_MD.shape)
        weights = [w.weight for w in (self.gate, self.up, self.down) if w is not None]
        dtype = autocast_dtype(x_MD)
        if dtype is not None:  # autocast does not cover _grouped_mm / index ops: cast by hand
            x_MD, weights = x_MD.to(dtype), [w.to(dtype) for w in weights]
        if not self.gated:
            weights = [None, *weights]
        impl = self.impl
        if impl == "auto":
            impl = "grouped_mm" if _grouped_mm_ok(x_MD, *weights[1:]) else "bmm"
        if x_MD.shape[0] == 0:
            impl = "loop"
        return getattr(self, f"_{impl}")(x_MD, counts, *weights)

    def _loop(self, x_MD, counts, gate, up, down):
        outs = []
        for e, x in enumerate(torch.split(x_MD, counts)):
            h = self._act(F.linear(x, gate[e]) if self.gated else None, F.linear(x, up[e]))
            outs.append(F.linear(h, down[e]))
        return torch.cat(outs) if outs else x_MD.new_zeros(0, down.shape[1])

    def _grouped_mm(self, x_MD, counts, gate, up, down):
        offs = torch.tensor(counts, device=x_MD.device).cumsum(0).to(torch.int32)

        def mm(x, w):  # rows of group e times w[e]ᵀ
            return torch._grouped_mm(x, w.transpose(1, 2), offs=offs)

        h = self._act(mm(x_MD, gate) if self.gated else None, mm(x_MD, up))
        return mm(h, down)

    def _bmm(self, x_MD, counts, gate, up, down):
        E, C = len(counts), max(counts)
        counts_t = torch.tensor(counts, device=x_MD.device)
        expert = torch.repeat_interleave(torch.arange(E, device=x_MD.device), counts_t)
        starts = torch.cumsum(counts_t, 0) - counts_t
        slot = torch.arange(x_MD.shape[0], device=x_MD.device) - starts[expert]
        padded = x_MD.new_zeros(E, C, x_MD.shape[1]).index_put((expert, slot), x_MD)

        def mm(x, w):
            return torch.bmm(x, w.transpose(1, 2))

        h = self._act(mm(padded, gate) if self.gated else None, mm(padded, up))
        return mm(h, down)[expert, slot]
