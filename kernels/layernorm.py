"""LayerNorm (GPT-2's norm): y = (x − mean) / √(var + eps) · w + b over the last dim, fp32 statistics.

The forward saves only the input and each row's mean and rstd = 1/√(var + eps); the backward computes
    x̂ = (x − mean) · rstd,  dx = rstd · (dy·w − mean(dy·w) − x̂ · mean(dy·w · x̂)),
    dw = Σ_rows dy · x̂,  db = Σ_rows dy,
each program walking several row blocks with its own fp32 partial dw and db, summed on the host.
The output is in the compute dtype (autocast's under autocast); the torch path is
`kernels.lean.layer_norm`, the launch geometry `kernels._launch.Rows` (shared with RMSNorm).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._launch import Rows
from kernels.lean import output_dtype


def layer_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """The torch reference: statistics and affine map in fp32, one rounding to the output dtype."""
    xf = x.float()
    mean = xf.mean(-1, keepdim=True)
    var = (xf - mean).pow(2).mean(-1, keepdim=True)
    y = (xf - mean) * torch.rsqrt(var + eps) * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(torch.promote_types(x.dtype, weight.dtype))


@triton.jit
def _layer_norm_forward(
    X,
    W,
    B,
    Y,
    MEAN,
    RSTD,
    n_rows,
    n_cols,
    eps,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < n_rows, cols < n_cols
    mask = row_ok[:, None] & col_ok[None, :]
    offsets = rows[:, None] * n_cols + cols[None, :]
    x = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) / n_cols
    centred = tl.where(mask, x - mean[:, None], 0.0)
    rstd = tl.math.rsqrt(tl.sum(centred * centred, axis=1) / n_cols + eps)
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = centred * rstd[:, None] * w[None, :]
    if HAS_BIAS:
        y += tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + offsets, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(MEAN + rows, mean, mask=row_ok)
    tl.store(RSTD + rows, rstd, mask=row_ok)


@triton.jit
def _layer_norm_backward(
    DY,
    X,
    W,
    MEAN,
    RSTD,
    DX,
    DW_PARTIAL,
    DB_PARTIAL,
    n_rows,
    n_cols,
    blocks_per_program,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
    db = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for i in range(0, blocks_per_program):
        block = pid * blocks_per_program + i
        rows = (block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_ok = rows < n_rows
        mask = row_ok[:, None] & col_ok[None, :]
        offsets = rows[:, None] * n_cols + cols[None, :]
        x = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + offsets, mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(MEAN + rows, mask=row_ok, other=0.0)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
        x_hat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        dy_w = dy * w[None, :]
        c1 = tl.sum(dy_w, axis=1) / n_cols
        c2 = tl.sum(dy_w * x_hat, axis=1) / n_cols
        dx = (dy_w - c1[:, None] - x_hat * c2[:, None]) * rstd[:, None]
        tl.store(DX + offsets, dx.to(DX.dtype.element_ty), mask=mask)
        dw += tl.sum(dy * x_hat, axis=0)
        db += tl.sum(dy, axis=0)
    tl.store(DW_PARTIAL + pid * n_cols + cols, dw, mask=col_ok)
    tl.store(DB_PARTIAL + pid * n_cols + cols, db, mask=col_ok)


class LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float):
        rows = Rows(x)
        y_MN = torch.empty((rows.M, rows.N), dtype=output_dtype(x, weight), device=x.device)
        mean_M, rstd_M = rows.stats(), rows.stats()
        _layer_norm_forward[(rows.blocks,)](
            rows.x,
            weight,
            weight if bias is None else bias,  # not read without a bias
            y_MN,
            mean_M,
            rstd_M,
            rows.M,
            rows.N,
            eps,
            HAS_BIAS=bias is not None,
            BLOCK_M=rows.BLOCK_M,
            BLOCK_N=rows.BLOCK_N,
        )
        ctx.save_for_backward(rows.x, weight, mean_M, rstd_M)
        ctx.shape, ctx.bias_dtype = rows.shape, None if bias is None else bias.dtype
        return y_MN.view(rows.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x_MN, weight, mean_M, rstd_M = ctx.saved_tensors
        rows = Rows(x_MN)
        dx_MN = torch.empty_like(x_MN)
        programs, per_program, (dw_partial, db_partial) = rows.backward_split(2)
        _layer_norm_backward[(programs,)](
            dy.reshape(rows.M, rows.N).contiguous(),
            x_MN,
            weight,
            mean_M,
            rstd_M,
            dx_MN,
            dw_partial,
            db_partial,
            rows.M,
            rows.N,
            per_program,
            BLOCK_M=rows.BLOCK_M,
            BLOCK_N=rows.BLOCK_N,
        )
        db = None if ctx.bias_dtype is None else db_partial.sum(0).to(ctx.bias_dtype)
        return dx_MN.view(ctx.shape), dw_partial.sum(0).to(weight.dtype), db, None


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """LayerNorm of x [..., N] with weight [N] and optional bias [N] (Triton forward and backward),
    saving x, mean and rstd; output in `kernels.lean.output_dtype` (autocast's under autocast)."""
    return LayerNormFunction.apply(x, weight, bias, eps)
