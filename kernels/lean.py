"""The torch path of the norms and the MLP's SwiGLU (`model.kernels=torch`): autograd Functions that
save only what their backward needs, with no triton import (triton is optional). The Triton
Functions (kernels/rmsnorm.py, layernorm.py, swiglu.py) save the same inputs and output the same
dtype (`output_dtype`).

    RMSNorm    saves its input; the backward recomputes the per-row statistic (one reduction over
               the row) and applies autograd's formulas for torch's composite rms_norm, in its order
    LayerNorm  saves its input, mean and rstd (`torch.native_layer_norm`); the backward is torch's
               `native_layer_norm_backward`
    SwiGLU     silu(a) · b saves a and b; the backward recomputes silu(a)

Each computes in fp32 and rounds once. A norm's output is in the compute dtype (`output_dtype`:
autocast's when autocast is on for the input's device), so the linear layers after it read it
without an autocast copy and share one saved tensor (q, k, v; gate, up). In fp32 every Function
runs exactly torch's ops in torch's order (the `.float()` casts are no-ops), so outputs and
gradients are bitwise those of `nn.RMSNorm`, `nn.LayerNorm` and `F.silu(a) * b`
(tests/unit/test_kernels.py), and fp32 training is unchanged to the bit (tests/distributed/test_golden.py).

Autocast: torch.amp's custom_fwd/custom_bwd are bound to one device type, so the Functions read
autocast's state for the input's device themselves and compute with it off; their backwards are
plain fp32 math that needs no autocast state. GeLU needs no Function: `F.gelu` saves only its
input already.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """Autocast's dtype on x's device, or None where autocast is off."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


def output_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """A norm's output dtype: autocast's when it is on for x's device (the dtype the next linear
    computes in), else x's and weight's promoted dtype (as torch's norms)."""
    return autocast_dtype(x) or torch.promote_types(x.dtype, weight.dtype)


def _fp32(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.float()


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = output_dtype(x, weight)
    with torch.autocast(x.device.type, enabled=False):
        return F.rms_norm(x.float(), x.shape[-1:], weight.float(), eps).to(dtype)


def _layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float):
    """(y in `output_dtype`, mean, rstd)."""
    dtype = output_dtype(x, weight)
    with torch.autocast(x.device.type, enabled=False):
        y, mean, rstd = torch.native_layer_norm(x.float(), x.shape[-1:], weight.float(), _fp32(bias), eps)
    return y.to(dtype), mean, rstd


def _swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (F.silu(a.float()) * b.float()).to(torch.promote_types(a.dtype, b.dtype))


class RMSNormFunction(torch.autograd.Function):
    """x enters twice, as torch's composite rms_norm uses it twice (in x · rstd and in mean(x²)):
    in fp32 the backward returns the two terms of dx apart, so that autograd adds them to x's other
    gradients (the residual's) one at a time as for torch's own graph: bitwise equal sums."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, x_again: torch.Tensor, weight: torch.Tensor, eps: float):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return _rms_norm(x, weight, eps)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        # autograd's formulas for torch's composite rms_norm (aten/src/ATen/native/layer_norm.cpp:
        # rstd = rsqrt(mean(x²) + eps), y = x · rstd · w), node by node in its order, written out so
        # that torch.compile traces it (no autograd.grad inside)
        x, weight = ctx.saved_tensors
        x32, w, g = x.float(), weight.float(), dy.float()
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True).add_(ctx.eps))
        xr = x32.mul(rstd)
        dw = (g * xr).sum(tuple(range(g.dim() - 1)))  # y = xr · w
        dxr = g * w
        dx1 = dxr * rstd  # xr = x · rstd
        drstd = (dxr * x32).sum(-1, keepdim=True)
        dmean = -0.5 * drstd * rstd.pow(3)  # rsqrt
        dx2 = dmean.expand_as(x32) / x32.shape[-1] * (2 * x32)  # mean, then pow(2)
        if x.dtype == torch.float32:
            return dx1, dx2, dw.to(weight.dtype), None
        return (dx1 + dx2).to(x.dtype), None, dw.to(weight.dtype), None


class LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float):
        y, mean, rstd = _layer_norm(x, weight, bias, eps)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        dx, dw, db = torch.ops.aten.native_layer_norm_backward(
            dy.float(), x.float(), x.shape[-1:], mean, rstd, weight.float(), _fp32(bias),
            [True, True, bias is not None],
        )  # fmt: skip
        return dx.to(x.dtype), dw.to(weight.dtype), None if bias is None else db.to(bias.dtype), None


class SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        return _swiglu(a, b)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        a, b = ctx.saved_tensors
        a32, dy32 = a.float(), dy.float()
        # autograd's own order for F.silu(a) * b: d(silu) = dy · b, then silu's backward
        da = torch.ops.aten.silu_backward(dy32 * b.float(), a32)
        return da.to(a.dtype), (dy32 * F.silu(a32)).to(b.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [..., N] with weight [N], saving only x; output in `output_dtype`. Without
    autograd (serving), the forward alone: the same numbers without a Function's overhead."""
    if not torch.is_grad_enabled():
        return _rms_norm(x, weight, eps)
    return RMSNormFunction.apply(
        x, x.view_as(x), weight, eps
    )  # a view: torch.compile refuses one tensor twice


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """LayerNorm of x [..., N] with weight [N] and optional bias [N], saving x, mean and rstd;
    output in `output_dtype` (without autograd, the forward alone)."""
    if not torch.is_grad_enabled():
        return _layer_norm(x, weight, bias, eps)[0]
    return LayerNormFunction.apply(x, weight, bias, eps)


def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """silu(a) · b, saving only a and b; output in their promoted dtype (without autograd, the
    forward alone)."""
    if not torch.is_grad_enabled():
        return _swiglu(a, b)
    return SwiGLUFunction.apply(a, b)
