"""The norm modules: RMSNorm (Llama; also Qwen3's per-head q/k norms and MLA's latent norms, over
`size` features) and LayerNorm (GPT-2), computed by the model's `Ops`.

With model.norm_zero_centered (Megatron's --apply-layernorm-1p, Qwen3-Next's norms) a norm
multiplies by 1 + weight, its weight starting at 0 (`init_values`): weight decay then pulls the
scale towards 1, not 0. 1 + weight is formed in fp32 and handed to the same kernels as a weight,
so x̂ · (1 + w) is computed in fp32 and rounded once (bitwise HF's `Qwen3NextRMSNorm` in fp32,
tests/distributed/test_gated_attention.py).
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.lean import output_dtype
from mlm.config import ModelConfig
from mlm.model.ops import Ops


class _ZeroCentered:
    """What both norms share under model.norm_zero_centered: the weight the kernels see, and
    the weight's init."""

    zero_centered: bool

    def scale(self) -> torch.Tensor:
        """The kernels' weight: 1 + weight in fp32 when zero-centred, else the weight itself."""
        return 1 + self.weight.float() if self.zero_centered else self.weight

    def init_values(self, local: str, shape: tuple[int, ...], seed: int, name: str) -> torch.Tensor | None:
        """A zero-centred norm's weight: zeros (the scale 1 + 0); otherwise Megatron's rule
        (`mlm.model.init`: norm weights 1, biases 0)."""
        return torch.zeros(shape) if self.zero_centered and local == "weight" else None


class RMSNorm(_ZeroCentered, nn.RMSNorm):
    """Llama's norm over the hidden state (or over `size` features)."""

    def __init__(self, cfg: ModelConfig, size: int | None = None, ops: Ops | None = None):
        super().__init__(size or cfg.hidden_size, eps=cfg.norm_eps)
        self.ops = ops or Ops()
        self.zero_centered = cfg.norm_zero_centered
        if self.zero_centered:
            nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.zero_centered:
            return self.ops.rms_norm(x, self.weight, self.eps)
        # the fp32 scale would promote the output: round once to the dtype the weight gives
        return self.ops.rms_norm(x, self.scale(), self.eps).to(output_dtype(x, self.weight))


class LayerNorm(_ZeroCentered, nn.LayerNorm):
    """GPT-2's norm (with a bias)."""

    def __init__(self, cfg: ModelConfig, size: int | None = None, ops: Ops | None = None):
        super().__init__(size or cfg.hidden_size, eps=cfg.norm_eps)
        self.ops = ops or Ops()
        self.zero_centered = cfg.norm_zero_centered
        if self.zero_centered:
            nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.zero_centered:
            return self.ops.layer_norm(x, self.weight, self.bias, self.eps)
        return self.ops.layer_norm(x, self.scale(), self.bias, self.eps).to(output_dtype(x, self.weight))
