"""FP8 per-tensor scaling: the torch reference of quantise / dequantise / amax / scale, and the
GEMM on quantised operands (torch's `torch._scaled_mm` on CUDA at compute capability ≥ 8.9, an
emulation everywhere else).

A tensor x is stored as q = fp8(clamp(x · s, −max, max)) with one fp32 scale s per tensor, and
read back as q · (1/s). The formats are torch's own dtypes: e4m3 (`torch.float8_e4m3fn`, max 448,
3 mantissa bits: activations and weights) and e5m2 (`torch.float8_e5m2`, max 57344, 2 mantissa
bits: gradients, which need the range). Quantising saturates at the format's max (Transformer
Engine's and torchao's choice), so an amax that grew since the scale was chosen clips instead of
overflowing to inf/NaN.

The GEMM `fp8_linear(a_q, a_scale, b_q, b_scale, out_dtype)` computes a · bᵀ of the dequantised
operands with fp32 accumulation and one rounding to `out_dtype`:
  - CUDA, sm ≥ 8.9: `torch._scaled_mm(a_q, b_qᵀ, scale_a=1/a_scale, scale_b=1/b_scale)` (what
    torchao's Float8Linear calls). This path has never run on a GPU (none was available while it
    was written): it is kept small, on the same quantised operands and scales as the emulation.
  - elsewhere (CPU; and on CUDA for a GEMM whose inner or output width is not a multiple of 16,
    which `_scaled_mm` refuses): the emulation, dequantise to fp32, matmul in fp32, round to `out_dtype`.
    Same numbers as fp8 tensor cores up to the fp32 summation order.
`mlm.parallel.fp8.check_fp8_device` refuses a CUDA device below sm 8.9 (no fp8 tensor cores there).
"""

from __future__ import annotations

import torch

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
"""Format name → torch dtype."""

FP8_MAX = {name: torch.finfo(dtype).max for name, dtype in FORMATS.items()}
"""Largest finite value: e4m3 448, e5m2 57344."""

MIN_CAPABILITY = (8, 9)
"""CUDA compute capability of the first fp8 tensor cores (Ada sm_89, Hopper sm_90)."""


def amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| over the whole tensor, as a 0-d fp32 tensor (0 for an empty tensor)."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return x.detach().abs().amax().float()


def scale_from_amax(amax: torch.Tensor, fmt: str, margin: int = 0) -> torch.Tensor:
    """The per-tensor scale s = fp8_max / amax / 2^margin (fp32), which maps the largest value to
    the format's max (less `margin` powers of two of headroom); 1 where amax is 0 or not finite."""
    amax = amax.float()
    scale = torch.full_like(amax, FP8_MAX[fmt]) / amax / (2.0**margin)  # a division (448 / t is 448 · 1/t)
    ok = (amax > 0) & torch.isfinite(amax)
    return torch.where(ok, scale, torch.ones_like(scale))


def quantize(x: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """fp8(clamp(x · scale, −max, max)): x scaled in fp32, saturated, rounded to the nearest fp8
    value (torch's conversion, round-to-nearest-even)."""
    m = FP8_MAX[fmt]
    return (x.float() * scale).clamp(-m, m).to(FORMATS[fmt])


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q · (1/scale) in fp32, then cast to `dtype`."""
    return (q.float() * scale.float().reciprocal()).to(dtype)


def uses_scaled_mm(device: torch.device) -> bool:
    """Whether `fp8_linear` runs torch's fp8 GEMM here (CUDA sm ≥ 8.9) rather than the emulation."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= MIN_CAPABILITY


def _column_major(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous().t()


def fp8_linear(
    a_q: torch.Tensor,
    a_scale: torch.Tensor,
    b_q: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """a · bᵀ of the dequantised operands: a_q [M, K], b_q [N, K] (fp8) → [M, N] in `out_dtype`,
    accumulated in fp32 and rounded once."""
    # _scaled_mm wants the inner and output widths in multiples of 16 (cuBLASLt's fp8 layouts):
    # other shapes (a token count or a projection width that is not) take the emulation
    aligned = a_q.shape[1] % 16 == 0 and b_q.shape[0] % 16 == 0
    if aligned and uses_scaled_mm(a_q.device):  # never run: no GPU where this was written
        return torch._scaled_mm(
            a_q.contiguous(),
            _column_major(b_q.t()),
            scale_a=a_scale.float().reciprocal(),
            scale_b=b_scale.float().reciprocal(),
            out_dtype=out_dtype,
        )
    with torch.autocast(a_q.device.type, enabled=False):  # fp32, not autocast's bf16 matmul
        return (dequantize(a_q, a_scale) @ dequantize(b_q, b_scale).t()).to(out_dtype)
