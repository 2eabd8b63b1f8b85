"""The ops the layer kinds compute with, behind one switch: `Ops`, one instance per model, shared
by every module (each holds it as `self.ops`), chosen once at build time (`GPT.set_kernels`,
`GPT.set_attention_backend`):

    kernels             norms, SwiGLU / GeLU (squared ReLU: torch always), RoPE, Mamba-2's scan,
                        Gated DeltaNet's delta rule: torch (`kernels.lean`: autograd Functions
                        that save only what their backward needs) or triton (the top-level
                        `kernels` package), from model.kernels (`resolve_kernels`)
    attention_backend   the attention core: sdpa, flash or te (`mlm.model.attention`), from
                        model.attention_backend

The module functions below take the choice as an argument, for code that holds no model."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from kernels import lean
from mlm.errors import MlmError
from mlm.model.attention import attention, importable
from mlm.model.rope import apply_rope, apply_rope_interleaved


class Ops:
    """The implementation switch of one model (see the module doc)."""

    def __init__(self, kernels: str = "torch", attention_backend: str = "sdpa"):
        self.kernels = kernels
        self.attention_backend = attention_backend

    def __repr__(self) -> str:
        return f"Ops(kernels={self.kernels!r}, attention_backend={self.attention_backend!r})"

    def rms_norm(self, x, weight, eps: float):
        return rms_norm(x, weight, eps, self.kernels)

    def layer_norm(self, x, weight, bias, eps: float):
        return layer_norm(x, weight, bias, eps, self.kernels)

    def swiglu(self, a, b):
        return swiglu(a, b, self.kernels)

    def gelu(self, a, approximate: str):
        return gelu(a, approximate, self.kernels)

    def activation(self, a, name: str):
        """The non-gated MLP activation `name` (model.activation): gelu, gelu_tanh or squared_relu."""
        if name == "squared_relu":
            return squared_relu(a)
        return gelu(a, "tanh" if name == "gelu_tanh" else "none", self.kernels)

    def rope(self, x, cos, sin, interleaved: bool = False):
        """RoPE on the rotate-half layout, or on adjacent pairs (`interleaved`: DeepSeek's)."""
        rotate = apply_rope_interleaved if interleaved else apply_rope
        return rotate(x, cos, sin, kernels=self.kernels)

    def ssd(self, x, dt, A, B, C, chunk: int, initial_state=None, starts=None):
        """Mamba-2's chunked scan (`kernels.ssd.ssd`): (y, the final state), fp32."""
        from kernels.ssd import ssd

        return ssd(x, dt, A, B, C, chunk, initial_state, starts, backend=self.kernels)

    def gated_delta_rule(self, q, k, v, g, beta, chunk: int, initial_state=None, starts=None):
        """Gated DeltaNet's chunked delta rule (`kernels.delta_rule.gated_delta_rule`, q and k
        L2-normalised inside): (o in q's dtype, the final state fp32)."""
        from kernels.delta_rule import gated_delta_rule

        return gated_delta_rule(
            q, k, v, g, beta, initial_state=initial_state, starts=starts, output_final_state=True,
            chunk_size=chunk, backend=self.kernels,
        )  # fmt: skip

    def attention(self, q, k, v, dropout: float, training: bool, scale: float | None = None):
        """Causal attention through the chosen backend (`mlm.model.attention.attention`)."""
        return attention(q, k, v, self.attention_backend, dropout, training, scale)


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


def squared_relu(a: torch.Tensor) -> torch.Tensor:
    """relu(a)² (Nemotron-H's MLP, Megatron's --squared-relu); torch under every model.kernels (no
    Triton kernel yet)."""
    return torch.square(F.relu(a))


def resolve_kernels(requested: str, device: torch.device) -> str:
    """The kernels that will run for `model.kernels=requested` on `device`: torch, or triton (the
    top-level `kernels` package); auto is triton on CUDA when triton imports, else torch. Triton
    off CUDA runs only under its interpreter (TRITON_INTERPRET=1, set before triton is imported)."""
    if requested == "auto":
        return "triton" if device.type == "cuda" and importable("triton") else "torch"
    if requested == "triton":
        if not importable("triton"):
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
