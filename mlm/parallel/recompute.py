"""Activation recompute applied from outside, per layer (Megatron's --recompute-granularity).

    apply_recompute(model, "full")        # every layer's activations recomputed in backward
    apply_recompute(model, "selective")   # only the modules that declare `selective_recompute`
                                          # (the attention core: its inputs are small, its work is not)

The wrapped module keeps its parameters and names: its `forward` is replaced on the instance by
one that runs under `torch.utils.checkpoint` while training with gradients (the RNG state is
restored for the recompute, so dropout masks repeat; the rerun runs under
`mlm.model.aux_loss.recompute_pass`, so statistics are not counted twice). Evaluation and
serving run it plainly.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from mlm.errors import MlmError
from mlm.model.aux_loss import recompute_pass
from mlm.model.contract import declaring

MODES = ("none", "selective", "full")


def _checkpointed(module: nn.Module, forward):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        if module.training and torch.is_grad_enabled():
            calls = 0

            def once_then_recompute(*a, **kw):  # the second call is the rerun inside backward
                nonlocal calls
                calls += 1
                if calls == 1:
                    return forward(*a, **kw)
                with recompute_pass():
                    return forward(*a, **kw)

            return checkpoint(once_then_recompute, *args, use_reentrant=False, **kwargs)
        return forward(*args, **kwargs)

    return run


def apply_recompute(model: nn.Module, mode: str, layers: list[str] | None = None) -> list[str]:
    """Recompute the activations of `model.layers` (those keyed in `layers`, default all) in
    backward: whole layers ("full") or their modules marked `selective_recompute`; return the
    names of the modules wrapped."""
    if mode not in MODES:
        raise MlmError(f"model.recompute={mode!r}: must be one of {', '.join(MODES)}")
    wrapped = []
    if mode == "none":
        return wrapped
    for key, layer in model.layers.items():
        if layers is not None and key not in layers:
            continue
        targets = (
            [("", layer)]
            if mode == "full"
            else [(n, m) for n, m, on in declaring(layer, "selective_recompute") if on]
        )
        for name, module in targets:
            if "forward" in module.__dict__:
                raise MlmError(f"layers.{key}.{name}: recompute is already applied")
            module.forward = _checkpointed(module, module.forward)
            wrapped.append(f"layers.{key}{'.' + name if name else ''}")
    return wrapped
