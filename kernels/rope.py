"""Rotary position embeddings on x [B, T, heads, D] with fp32 tables cos, sin of shape [T, D] (every
batch row alike) or [B, T, D], in the two layouts of `mlm.model.rope`:

- rotate-half (Llama, Megatron): out = x · cos + [−x₂, x₁] · sin, x₁ and x₂ the halves of x;
- interleaved (DeepSeek's MLA): the pairs (x₀, x₁), (x₂, x₃), ... rotated by the tables' first
  half, the result de-interleaved: the pairs' first elements in the first half, their second in the
  second (HF's `apply_rotary_pos_emb_interleave`).

Products in fp32, one rounding to x's dtype. The backward is the transposed rotation (sin negated),
from the saved tables alone; the tables get no gradient.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._launch import row_blocks


def _broadcast(cos: torch.Tensor, sin: torch.Tensor):
    if cos.ndim == 2:
        cos, sin = cos[None], sin[None]
    return cos[:, :, None, :], sin[:, :, None, :]


def rope_reference(x_BTHD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE in torch (fp32 products)."""
    half = x_BTHD.shape[-1] // 2
    rotated = torch.cat([-x_BTHD[..., half:], x_BTHD[..., :half]], dim=-1)
    cos, sin = _broadcast(cos, sin)
    return (x_BTHD.float() * cos + rotated.float() * sin).to(x_BTHD.dtype)


def rope_interleaved_reference(x_BTHD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE in torch (fp32 products), output de-interleaved."""
    half = x_BTHD.shape[-1] // 2
    cos, sin = _broadcast(cos[..., :half], sin[..., :half])
    x1, x2 = x_BTHD[..., 0::2].float(), x_BTHD[..., 1::2].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x_BTHD.dtype)


@triton.jit
def _rope(
    X,
    COS,
    SIN,
    Y,
    n_rows,
    heads,
    table_rows,
    half,
    IN_INTERLEAVED: tl.constexpr,
    OUT_INTERLEAVED: tl.constexpr,
    BACKWARD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Row r of X [rows, 2·half] (rows ordered b, t, head) rotated by table row (r // heads) %
    table_rows: y₁ = x₁c₁ − x₂s₁, y₂ = x₂c₂ + x₁s₂ (BACKWARD: y₁ = x₁c₁ + x₂s₂, y₂ = x₂c₂ − x₁s₁),
    x₁, x₂ the pairs' elements (IN_INTERLEAVED) or the halves, y written likewise (OUT_INTERLEAVED);
    an interleaved layout uses the tables' first half for both."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    j = tl.arange(0, BLOCK_H)
    mask = (rows < n_rows)[:, None] & (j < half)[None, :]
    base = rows[:, None] * (2 * half)
    if IN_INTERLEAVED:
        in1, in2 = base + 2 * j[None, :], base + 2 * j[None, :] + 1
    else:
        in1, in2 = base + j[None, :], base + half + j[None, :]
    if OUT_INTERLEAVED:
        out1, out2 = base + 2 * j[None, :], base + 2 * j[None, :] + 1
    else:
        out1, out2 = base + j[None, :], base + half + j[None, :]
    table = ((rows // heads) % table_rows)[:, None] * (2 * half)
    t1 = table + j[None, :]
    t2 = t1 if (IN_INTERLEAVED or OUT_INTERLEAVED) else t1 + half
    c1, s1 = tl.load(COS + t1, mask=mask, other=0.0), tl.load(SIN + t1, mask=mask, other=0.0)
    c2, s2 = tl.load(COS + t2, mask=mask, other=0.0), tl.load(SIN + t2, mask=mask, other=0.0)
    x1 = tl.load(X + in1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X + in2, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        y1, y2 = x1 * c1 + x2 * s2, x2 * c2 - x1 * s1
    else:
        y1, y2 = x1 * c1 - x2 * s1, x2 * c2 + x1 * s2
    tl.store(Y + out1, y1.to(Y.dtype.element_ty), mask=mask)
    tl.store(Y + out2, y2.to(Y.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, backward: bool):
    D, heads = x.shape[-1], x.shape[-2]
    x_RD = x.contiguous().view(-1, D)
    y_RD = torch.empty_like(x_RD)
    R, half = x_RD.shape[0], D // 2
    BLOCK_H, BLOCK_M = row_blocks(half)
    _rope[(triton.cdiv(R, BLOCK_M),)](
        x_RD,
        cos,
        sin,
        y_RD,
        R,
        heads,
        cos.shape[0],
        half,
        IN_INTERLEAVED=interleaved and not backward,
        OUT_INTERLEAVED=interleaved and backward,
        BACKWARD=backward,
        BLOCK_M=BLOCK_M,
        BLOCK_H=BLOCK_H,
    )
    return y_RD.view(x.shape)


class RoPEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_BTHD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool):
        D = x_BTHD.shape[-1]
        assert D % 2 == 0 and cos.shape[-1] == D and sin.shape == cos.shape, (x_BTHD.shape, cos.shape)
        assert x_BTHD.ndim == 4 and cos.ndim in (2, 3), (x_BTHD.shape, cos.shape)
        cos_, sin_ = (t.float().contiguous().view(-1, D) for t in (cos, sin))
        ctx.save_for_backward(cos_, sin_)
        ctx.interleaved = interleaved
        return _launch(x_BTHD, cos_, sin_, interleaved, backward=False)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        cos_, sin_ = ctx.saved_tensors
        return _launch(dy, cos_, sin_, ctx.interleaved, backward=True), None, None, None


def rope(x_BTHD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [B, T, heads, D] (Triton forward and backward)."""
    return RoPEFunction.apply(x_BTHD, cos, sin, False)


def rope_interleaved(x_BTHD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved (DeepSeek) RoPE of x [B, T, heads, D], output de-interleaved (Triton forward and backward)."""
    return RoPEFunction.apply(x_BTHD, cos, sin, True)
