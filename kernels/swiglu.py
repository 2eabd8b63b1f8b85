"""The MLP's activations, elementwise in fp32 with one rounding to the input dtype:
SwiGLU silu(a) · b (Llama: a = gate x, b = up x) and GeLU, exact (erf) or tanh-approximated (GPT-2).

The forwards save only their inputs; the backwards recompute the activation:
    silu'(a) = σ(a) · (1 + a · (1 − σ(a))),
    gelu'(a) = Φ(a) + a · φ(a)  (exact),
    gelu_tanh'(a) = ½(1 + t) + ½ a (1 − t²) · √(2/π) (1 + 3 · 0.044715 a²),  t = tanh(√(2/π)(a + 0.044715 a³)).

The torch path saves the same: `kernels.lean.swiglu` (its inputs) and `F.gelu` (its input).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

BLOCK = 1024  # elements per program
_SQRT_2_OVER_PI = 0.7978845608028654
_INV_SQRT_2 = 0.7071067811865476
_INV_SQRT_2PI = 0.3989422804014327


def swiglu_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """silu(a) · b in fp32, rounded once to the inputs' dtype."""
    return (F.silu(a.float()) * b.float()).to(a.dtype)


def gelu_reference(a: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GeLU in fp32 (approximate: 'none' or 'tanh', as `F.gelu`), rounded once to a's dtype."""
    return F.gelu(a.float(), approximate=approximate).to(a.dtype)


@triton.jit
def _tanh(z):
    # sign(z) · (1 − e) / (1 + e) with e = exp(−2|z|) ≤ 1: no overflow, no cancellation near 0
    e = tl.exp(-2.0 * tl.abs(z))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(z < 0, -t, t)


@triton.jit
def _swiglu_forward(A, B, Y, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    a = tl.load(A + offsets, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + offsets, mask=mask, other=0.0).to(tl.float32)
    y = a * tl.sigmoid(a) * b
    tl.store(Y + offsets, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_backward(DY, A, B, DA, DB, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    dy = tl.load(DY + offsets, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(A + offsets, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + offsets, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(a)
    silu = a * sig
    da = dy * b * sig * (1.0 + a * (1.0 - sig))
    tl.store(DA + offsets, da.to(DA.dtype.element_ty), mask=mask)
    tl.store(DB + offsets, (dy * silu).to(DB.dtype.element_ty), mask=mask)


@triton.jit
def _gelu_forward(A, Y, n, TANH: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    a = tl.load(A + offsets, mask=mask, other=0.0).to(tl.float32)
    if TANH:
        y = 0.5 * a * (1.0 + _tanh(_SQRT_2_OVER_PI * (a + 0.044715 * a * a * a)))
    else:
        y = 0.5 * a * (1.0 + tl.math.erf(a * _INV_SQRT_2))
    tl.store(Y + offsets, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _gelu_backward(DY, A, DA, n, TANH: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    dy = tl.load(DY + offsets, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(A + offsets, mask=mask, other=0.0).to(tl.float32)
    if TANH:
        t = _tanh(_SQRT_2_OVER_PI * (a + 0.044715 * a * a * a))
        grad = 0.5 * (1.0 + t) + 0.5 * a * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * a * a)
    else:
        grad = 0.5 * (1.0 + tl.math.erf(a * _INV_SQRT_2)) + a * _INV_SQRT_2PI * tl.exp(-0.5 * a * a)
    tl.store(DA + offsets, (dy * grad).to(DA.dtype.element_ty), mask=mask)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1)


class SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
        a_, b_ = _flat(a), _flat(b)
        y = torch.empty_like(a_)
        n = a_.numel()
        _swiglu_forward[(triton.cdiv(n, BLOCK),)](a_, b_, y, n, BLOCK=BLOCK)
        ctx.save_for_backward(a_, b_)
        ctx.shape = a.shape
        return y.view(a.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        a_, b_ = ctx.saved_tensors
        da, db = torch.empty_like(a_), torch.empty_like(b_)
        n = a_.numel()
        _swiglu_backward[(triton.cdiv(n, BLOCK),)](_flat(dy), a_, b_, da, db, n, BLOCK=BLOCK)
        return da.view(ctx.shape), db.view(ctx.shape)


class GeLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: torch.Tensor, approximate: str) -> torch.Tensor:
        a_ = _flat(a)
        y = torch.empty_like(a_)
        n = a_.numel()
        ctx.tanh = approximate == "tanh"
        _gelu_forward[(triton.cdiv(n, BLOCK),)](a_, y, n, TANH=ctx.tanh, BLOCK=BLOCK)
        ctx.save_for_backward(a_)
        ctx.shape = a.shape
        return y.view(a.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (a_,) = ctx.saved_tensors
        da = torch.empty_like(a_)
        n = a_.numel()
        _gelu_backward[(triton.cdiv(n, BLOCK),)](_flat(dy), a_, da, n, TANH=ctx.tanh, BLOCK=BLOCK)
        return da.view(ctx.shape), None


def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """silu(a) · b for a, b of one shape and dtype (Triton forward and backward)."""
    return SwiGLUFunction.apply(a, b)


def gelu(a: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GeLU of a, exact ('none') or tanh-approximated ('tanh'), as `F.gelu` (Triton forward and backward)."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate={approximate!r}: must be one of none, tanh")
    return GeLUFunction.apply(a, approximate)
