"""RMSNorm (Llama's norm): y = x / √(mean(x²) + eps) · w over the last dim, with fp32 statistics.

The forward saves only the input and each row's rstd = 1/√(mean(x²) + eps); the backward computes
    x̂ = x · rstd,  dx = rstd · (dy·w − x̂ · mean(dy·w · x̂)),  dw = Σ_rows dy · x̂,
each program walking several row blocks and keeping its own fp32 partial dw, summed on the host.
The output is in the compute dtype (autocast's under autocast); the torch path is
`kernels.lean.rms_norm`, the launch geometry `kernels._launch.Rows` (shared with LayerNorm).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._launch import Rows
from kernels.lean import output_dtype


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The torch reference: statistics and product in fp32, one rounding to the output dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return y.to(torch.promote_types(x.dtype, weight.dtype))


@triton.jit
def _rms_norm_forward(X, W, Y, RSTD, n_rows, n_cols, eps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < n_rows, cols < n_cols
    mask = row_ok[:, None] & col_ok[None, :]
    offsets = rows[:, None] * n_cols + cols[None, :]
    x = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    y = x * rstd[:, None] * w[None, :]
    tl.store(Y + offsets, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=row_ok)


@triton.jit
def _rms_norm_backward(
    DY,
    X,
    W,
    RSTD,
    DX,
    DW_PARTIAL,
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
    for i in range(0, blocks_per_program):
        block = pid * blocks_per_program + i
        rows = (block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_ok = rows < n_rows
        mask = row_ok[:, None] & col_ok[None, :]
        offsets = rows[:, None] * n_cols + cols[None, :]
        x = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + offsets, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
        x_hat = x * rstd[:, None]
        dy_w = dy * w[None, :]
        c = tl.sum(dy_w * x_hat, axis=1) / n_cols
        dx = (dy_w - x_hat * c[:, None]) * rstd[:, None]
        tl.store(DX + offsets, dx.to(DX.dtype.element_ty), mask=mask)
        dw += tl.sum(dy * x_hat, axis=0)
    tl.store(DW_PARTIAL + pid * n_cols + cols, dw, mask=col_ok)


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rows = Rows(x)
        y_MN = torch.empty((rows.M, rows.N), dtype=output_dtype(x, weight), device=x.device)
        rstd_M = rows.stats()
        _rms_norm_forward[(rows.blocks,)](
            rows.x, weight, y_MN, rstd_M, rows.M, rows.N, eps, BLOCK_M=rows.BLOCK_M, BLOCK_N=rows.BLOCK_N
        )
        ctx.save_for_backward(rows.x, weight, rstd_M)
        ctx.shape = rows.shape
        return y_MN.view(rows.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x_MN, weight, rstd_M = ctx.saved_tensors
        rows = Rows(x_MN)
        dx_MN = torch.empty_like(x_MN)
        programs, per_program, (dw_partial,) = rows.backward_split(1)
        _rms_norm_backward[(programs,)](
            dy.reshape(rows.M, rows.N).contiguous(),
            x_MN,
            weight,
            rstd_M,
            dx_MN,
            dw_partial,
            rows.M,
            rows.N,
            per_program,
            BLOCK_M=rows.BLOCK_M,
            BLOCK_N=rows.BLOCK_N,
        )
        return dx_MN.view(ctx.shape), dw_partial.sum(0).to(weight.dtype), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [..., N] with weight [N] (Triton forward and backward), saving x and rstd;
    output in `kernels.lean.output_dtype` (autocast's under autocast, as the torch path)."""
    return RMSNormFunction.apply(x, weight, eps)
