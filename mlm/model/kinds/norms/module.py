"""The norm modules: RMSNorm (Llama; also Qwen3's per-head q/k norms and MLA's latent norms, over
`size` features) and LayerNorm (GPT-2), computed by the model's `Ops`."""

from __future__ import annotations

import torch
from torch import nn

from mlm.config import ModelConfig
from mlm.model.ops import Ops


class RMSNorm(nn.RMSNorm):
    """Llama's norm over the hidden state (or over `size` features)."""

    def __init__(self, cfg: ModelConfig, size: int | None = None, ops: Ops | None = None):
        super().__init__(size or cfg.hidden_size, eps=cfg.norm_eps)
        self.ops = ops or Ops()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


class LayerNorm(nn.LayerNorm):
    """GPT-2's norm (with a bias)."""

    def __init__(self, cfg: ModelConfig, size: int | None = None, ops: Ops | None = None):
        super().__init__(size or cfg.hidden_size, eps=cfg.norm_eps)
        self.ops = ops or Ops()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.layer_norm(x, self.weight, self.bias, self.eps)
