"""Auxiliary losses (MoE load balancing) on their way to the total loss, through the
pipeline: Megatron's approach (`MoEAuxLossAutoScaler`). A module that computes an auxiliary
loss `aux` from its input returns its output through `attach(out, aux)`: the identity forward;
in backward, `aux` also receives the gradient `scale` (the factor the pipeline multiplies the
main loss by: loss scale / micro-batches), so the gradients are those of loss + Σ aux whatever
stage the module sits on, with nothing sent between stages. The values are kept for logging
(not again when activation recompute reruns a forward: see `recomputing`).
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

_RECOMPUTING = contextvars.ContextVar("mlm_recomputing", default=False)


def recomputing() -> bool:
    """Whether this forward is activation recompute's rerun (inside backward): statistics that a
    forward records must not be counted twice."""
    return _RECOMPUTING.get()


@contextlib.contextmanager
def recompute_pass():
    """Mark the forwards inside as recompute reruns (`mlm.parallel.recompute` uses it)."""
    token = _RECOMPUTING.set(True)
    try:
        yield
    finally:
        _RECOMPUTING.reset(token)


class AuxLosses:
    """The model's auxiliary losses of the current step: name → sum over micro-batches."""

    def __init__(self):
        self.scale = 1.0
        """Gradient factor of every auxiliary loss (set by the pipeline before a step)."""
        self.values: dict[str, torch.Tensor] = {}
        self.partial: set[str] = set()
        """Names whose values are this rank's share of the sequence's loss (sequence or context
        parallelism): summed over those ranks to log."""
        self.partial_factor = 1.0
        """Gradient factor of the shares on top of `scale`: cp under context parallelism, where
        gradients are averaged over the cp ranks while the shares add up to the loss."""

    def attach(self, out: torch.Tensor, aux: torch.Tensor, name: str, partial: bool = False) -> torch.Tensor:
        """`out`, carrying `aux` (a scalar) into backward; records its value under `name` (kept on
        the device until `pop`, so that attaching never waits for the device). `partial`: `aux`
        is this tp rank's share of the loss (its sequence shard's); the shares add up to it."""
        if not recomputing():
            self.values[name] = self.values.get(name, 0.0) + aux.detach()
            if partial:
                self.partial.add(name)
        if not (out.requires_grad and aux.requires_grad):
            return out
        return _Attach.apply(out, aux, self.scale * (self.partial_factor if partial else 1.0))

    def pop(self) -> dict[str, float]:
        """The values recorded since the last pop, as numbers; starts over."""
        values, self.values = self.values, {}
        return {k: float(v) for k, v in values.items()}


class _Attach(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, aux, scale: float):
        ctx.save_for_backward(aux)
        ctx.scale = scale
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None
