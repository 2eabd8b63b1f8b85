"""MKL-packed weights for full decode batches on the CPU (fp32).

A decode step multiplies a few rows (one per sequence) by every weight matrix of the model. For
so few rows MKL's sgemm spends a large share of each call packing the weight into its blocked
layout, again at every call. `pack_weights` packs each large linear's weight once for `rows`
rows (the engine's max_seqs: a full decode batch), as Inductor's CPU weight prepacking does with
the same torch ops (`torch.ops.mkl._mkl_reorder_linear_weight` / `_mkl_linear`). A product of exactly
`rows` rows then uses the packed copy; any other row count (prompts, a partial batch) falls back
to the weight itself inside `_mkl_linear`, so those steps are unchanged. The packed product is
MKL's sgemm over the same operands: the serving tests compare tokens and logits with the plain
forward.

Measured on a 2-core Xeon (`bench/serve_step.py`, median of 15 steps): a decode step of 16
sequences on SmolLM2-135M's shape went from 73.6 to 64.5 ms. The price is one more copy of the
weights in memory (the plain ones stay for the other row counts and for anything else that reads
the model), so it is on only where it applies (CPU, fp32, a torch built with MKL) and can be
turned off (`mlm serve --no-packed-weights`). A weight changed after packing (written in place, as an
optimizer step or load_state_dict does, or converted or moved) is multiplied as it is now, without
its stale packed copy; a write through `.data` (which bumps no version counter) is not seen.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from mlm.model.gpt import GPT
from mlm.parallel.tensor import ColumnParallelLinear, OpLinear, RowParallelLinear


def packing_applies(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `pack_weights` can run for a model on `device` in `dtype`."""
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkl.is_available()
        and hasattr(torch.ops.mkl, "_mkl_linear")
    )


class PackedLinearOp:
    """`op(x, weight, bias)` like `F.linear`, through `weight`'s MKL-packed copy when x has `rows`
    rows (the packed copy is made here, from `weight` as it is now)."""

    def __init__(self, weight: torch.Tensor, rows: int):
        self.rows, self.nbytes = rows, weight.nbytes
        self.source = _state(weight)
        self.packed = torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), rows)

    def __call__(self, x, weight, bias=None):
        # MKL's packed product has no backward; a weight changed since packing: the copy is stale
        if torch.is_grad_enabled() or _state(weight) != self.source:
            return F.linear(x, weight, bias)
        return torch.ops.mkl._mkl_linear(x, self.packed, weight, bias, self.rows)


def _state(weight: torch.Tensor) -> tuple:
    """What changes with `weight`'s values: its memory, dtype and in-place writes (version)."""
    version = None if weight.is_inference() else weight._version  # inference tensors have none
    return weight.data_ptr(), weight.dtype, weight.device, version


MIN_ELEMENTS = 1 << 16
"""Weights smaller than this (256 KiB in fp32) stay plain: they stay in cache between calls, and
the packed call's own cost outweighs what it saves (the tiny shape of bench/serve.py, hidden 64,
ran 48 decode steps 2.3 ms slower packed)."""


def pack_weights(model: GPT, rows: int) -> int:
    """Give the layers' linears and the output layer of `model` (this rank's shard) packed copies
    of their weights as they are now (those of `MIN_ELEMENTS` or more), for products of `rows`
    rows, in place; again after an earlier call, whose copies are dropped first. Return the bytes
    of the weights packed, which is what the copies add to the resident memory (MKL reserves more
    address space for a packed buffer than it fills)."""
    unpack_weights(model)
    ops = []
    for name, module in list(model.layers.named_modules()):
        if type(module) is nn.Linear:
            module = OpLinear(module, F.linear)
            parent, _, attr = name.rpartition(".")
            setattr(model.layers.get_submodule(parent), attr, module)
        packable = isinstance(module, ColumnParallelLinear | RowParallelLinear | OpLinear)
        if packable and module.linear_op is F.linear and module.weight.numel() >= MIN_ELEMENTS:  # not fp8's
            module.linear_op = PackedLinearOp(module.weight, rows)
            ops.append(module.linear_op)
    if model.output_weight().numel() >= MIN_ELEMENTS:
        model.output_op = PackedLinearOp(model.output_weight(), rows)
        ops.append(model.output_op)
    return sum(op.nbytes for op in ops)


def unpack_weights(model: GPT) -> None:
    """Drop the packed copies `pack_weights` gave `model` (before packing again, or for an engine
    built with packing off on a model an earlier engine packed): plain products again, the packed
    memory freed."""
    for module in model.layers.modules():
        if isinstance(module.__dict__.get("linear_op"), PackedLinearOp):
            module.linear_op = F.linear
    model.__dict__.pop("output_op", None)
