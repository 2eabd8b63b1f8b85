"""The ops the layer kinds compute with, each in two implementations: torch (`kernels.lean`:
autograd Functions that save only what their backward needs) and Triton (the top-level `kernels`
package), chosen by `model.kernels` (`resolve_kernels`). A module holds the choice in its
`kernels` attribute ("torch" or "triton", set by `GPT.set_kernels`) and passes it here."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from kernels import lean
from mlm.errors import MlmError
from mlm.model.attention import _importable


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, kernels: str = "torch") -> torch.Tensor:
    """RMSNorm saving only its input (and, Triton, rstd); output in the compute dtype (`kernels.lean`)."""
    if kernels == "triton":
        from kernels.rmsnorm import rms_norm as fused

        return fused(x, weight, eps)
    return lean.rms_norm(x, weight, eps)


def layer_norm(x, weight, bias, eps: float, kernels: str = "torch") -> torch.Tensor:
    """LayerNorm saving its input, mean and rstd; output in the compute dtype (`kernels.lean`)."""
    if kernels == "triton":
        from kernels.layernorm import layer_norm as fused

        return fused(x, weight, bias, eps)
    return lean.layer_norm(x, weight, bias, eps)


def swiglu(a: torch.Tensor, b: torch.Tensor, kernels: str = "torch") -> torch.Tensor:
    """silu(a) · b saving only a and b (the backward recomputes silu)."""
    if kernels == "triton":
        from kernels.swiglu import swiglu as fused

        return fused(a, b)
    return lean.swiglu(a, b)


def gelu(a: torch.Tensor, approximate: str, kernels: str = "torch") -> torch.Tensor:
    """GeLU ('none': erf, 'tanh': GPT-2's), saving only its input (F.gelu's autograd does too)."""
    if kernels == "triton":
        from kernels.swiglu import gelu as fused

        return fused(a, approximate=approximate)
    return F.gelu(a, approximate=approximate)


def resolve_kernels(requested: str, device: torch.device) -> str:
    """The kernels that will run for `model.kernels=requested` on `device`: torch, or triton (the
    top-level `kernels` package); auto is triton on CUDA when triton imports, else torch. Triton
    off CUDA runs only under its interpreter (TRITON_INTERPRET=1, set before triton is imported)."""
    if requested == "auto":
        return "triton" if device.type == "cuda" and _importable("triton") else "torch"
    if requested == "triton":
        if not _importable("triton"):
            raise MlmError(
                "model.kernels='triton' needs the triton package: pip install triton "
                "(or pip install -e .[dev]), or use model.kernels=torch or auto"
            )
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise MlmError(
                f"model.kernels='triton' on {device.type} runs only under the Triton interpreter: set "
                "TRITON_INTERPRET=1 before starting (slow; meant for tests), or use model.kernels=torch or auto"
            )
    return requested
