"""The "dense" MLP: SwiGLU (Llama: down(silu(gate x) · up x)), or down(act(up x)) with GeLU (GPT-2)
or squared ReLU (Nemotron-H).

Shape legend: B batch, T sequence, D hidden, F ffn hidden.
"""

from __future__ import annotations

import torch
from torch import nn

from mlm.config import ModelConfig
from mlm.model.layers import TP_INPUT
from mlm.model.ops import Ops


class MLP(nn.Module):
    tp_plan = {TP_INPUT: "enter", "gate": "column", "up": "column", "down": "row"}
    residual_projections = ("down",)

    def __init__(self, cfg: ModelConfig, layer: int = 0, ops: Ops | None = None, ffn_size: int | None = None):
        super().__init__()
        self.ops = ops or Ops()
        self.gated = cfg.activation == "swiglu"
        D, F_ = cfg.hidden_size, ffn_size or cfg.ffn_size
        self.gate = nn.Linear(D, F_, bias=cfg.add_bias) if self.gated else None
        self.up = nn.Linear(D, F_, bias=cfg.add_bias)
        self.down = nn.Linear(F_, D, bias=cfg.add_bias)
        self.activation = cfg.activation

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        if self.gated:
            h_BTF = self.ops.swiglu(self.gate(x_BTD), self.up(x_BTD))
        else:
            h_BTF = self.ops.activation(self.up(x_BTD), self.activation)
        return self.down(h_BTF)
