"""The "gqa" mixer: multi-head attention with grouped key/value heads (MHA when G = H, MQA when
G = 1), RoPE, and Qwen3's per-head q/k norms when model.qk_norm. Qwen3-Next's attention adds two
options: model.attention_output_gate (the output times sigmoid(gate(x)) per head and dim before
the out-projection; HF's q_proj holds [query | gate] per head, here `gate` is its own
column-parallel linear) and model.rotary_percent (RoPE on each head's first R = K · percent dims,
the rest passed through; HF's partial_rotary_factor).

Shape legend: B batch, T sequence, D hidden, H attention heads, G key/value groups, K head dim,
R the dims RoPE rotates.
"""

from __future__ import annotations

import torch
from torch import nn

from mlm.config import ModelConfig
from mlm.model.attention_core import AttentionCore
from mlm.model.kinds.norms.module import RMSNorm
from mlm.model.layers import TP_INPUT
from mlm.model.ops import Ops


class Attention(nn.Module):
    """Under a serving cache (`cache`) the keys and values of the new tokens go to the cache and
    attention runs over what it holds (`cache.attend`); otherwise causal over T."""

    residual_projections = ("out",)
    tp_plan = {
        TP_INPUT: "enter",
        "q": "column",
        "k": "column",
        "v": "column",
        "gate": "column",
        "out": "row",
        "q_norm": "head_shared",
        "k_norm": "head_shared",
    }

    def __init__(self, cfg: ModelConfig, layer: int = 0, ops: Ops | None = None):
        super().__init__()
        self.ops = ops = ops or Ops()
        self.layer, self.head_dim = layer, cfg.head_dim
        self.rope_dim = int(cfg.head_dim * cfg.rotary_percent)  # the spec checks it is even
        K, H, G = cfg.head_dim, cfg.num_attention_heads, cfg.query_groups
        qkv_bias = cfg.add_bias or cfg.qkv_bias
        self.q = nn.Linear(cfg.hidden_size, H * K, bias=qkv_bias)
        self.k = nn.Linear(cfg.hidden_size, G * K, bias=qkv_bias)
        self.v = nn.Linear(cfg.hidden_size, G * K, bias=qkv_bias)
        # Qwen3-Next: the output gate, one value per head and dim (HF's q_proj bias covers it too)
        self.gate = nn.Linear(cfg.hidden_size, H * K, bias=qkv_bias) if cfg.attention_output_gate else None
        self.out = nn.Linear(H * K, cfg.hidden_size, bias=cfg.add_bias)
        # Qwen3: RMSNorm over each head's query and key (weights [K], shared by the heads)
        self.q_norm = RMSNorm(cfg, K, ops) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg, K, ops) if cfg.qk_norm else None
        self.core = AttentionCore(cfg, ops=ops)

    def forward(self, x_BTD: torch.Tensor, rope=None, cache=None, documents_BT=None) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        K = self.head_dim
        q_BTHK = self.q(x_BTD).view(B, T, -1, K)
        k_BTGK = self.k(x_BTD).view(B, T, -1, K)
        v_BTGK = self.v(x_BTD).view(B, T, -1, K)
        if self.q_norm is not None:
            q_BTHK, k_BTGK = self.q_norm(q_BTHK), self.k_norm(k_BTGK)
        if rope is not None:
            q_BTHK, k_BTGK = self._rope(q_BTHK, rope), self._rope(k_BTGK, rope)
        if cache is None:
            o_BTHK = self.core(q_BTHK, k_BTGK, v_BTGK, documents_BT)
        else:
            o_BTHK = cache.attend(self.layer, q_BTHK, k_BTGK, v_BTGK)
        o_BTX = o_BTHK.reshape(B, T, -1)
        if self.gate is not None:  # in the compute dtype, as HF's
            o_BTX = o_BTX * torch.sigmoid(self.gate(x_BTD))
        return self.out(o_BTX)

    def _rope(self, x_BTNK: torch.Tensor, rope) -> torch.Tensor:
        """RoPE on each head's first R dims (all K unless model.rotary_percent), the rest as they are."""
        R = self.rope_dim
        if R == x_BTNK.shape[-1]:
            return self.ops.rope(x_BTNK, *rope)
        return torch.cat([self.ops.rope(x_BTNK[..., :R], *rope), x_BTNK[..., R:]], dim=-1)
