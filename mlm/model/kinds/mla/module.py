"""Multi-Latent Attention, the mixer kind "mla" (DeepSeek-V2/V3; Megatron's MLASelfAttention).

Keys and values come up from one small latent per token; queries from their own latent (or
straight from the hidden state without `q_lora_rank`); each head's query and key split into a
part without position (nope) and a RoPE part, whose key half is one head shared by all heads:

    q      = q_up(q_norm(q_down(x)))             [B, T, H, nope + rope]   (or q(x))
    c, k_r = kv_down(x)                          [B, T, kv_lora], [B, T, rope]
    k_n, v = kv_up(kv_norm(c))                   [B, T, H, nope], [B, T, H, v]
    o      = softmax(q · [k_n ; rope(k_r)] · scale) v,   scale = (nope + rope)^-½ · YaRN mscale²

Under tensor parallelism (`tp_plan`, Megatron's layout) the down-projections and their norms are
replicated and run on this rank's tokens (its sequence shard under sequence parallelism); their
outputs, the latents and the rope key, then enter the tp region (all-gathered over the sequence
under sequence parallelism: kv_lora + rope (+ q_lora) values per token instead of the hidden
state's D, 2112 instead of 7168 for DeepSeek-V3); the up-projections are column-parallel by head
and the output row-parallel. Without a query latent the query projection is column-parallel on
the hidden state, which enters the tp region for it.

Serving caches per token only the normed latent and the roped key (kv_lora + rope values, not
H · (nope + rope + v)) and absorbs the up-projection into the query and the output: scores
q_nᵀ W_UK c = (W_UKᵀ q_n)ᵀ c, output W_UV (Σ p c); attention becomes one-key-head (MQA) attention
over [c ; k_r] with the latent as the value (`cache.attend(..., value_dim=kv_lora)`).

Shape legend: B batch, T sequence, D hidden, H heads (this rank's), C kv_lora_rank, R rope dims,
N nope dims, E value dims.
"""

from __future__ import annotations

import torch
from torch import nn

from mlm.config import ModelConfig
from mlm.model.attention_core import AttentionCore
from mlm.model.kinds.norms.module import RMSNorm
from mlm.model.ops import Ops
from mlm.model.rope import yarn_mscale


def mla_softmax_scale(cfg: ModelConfig) -> float:
    """(nope + rope)^-½, times YaRN's mscale(factor, mscale_all_dim)² when that is set (DeepSeek)."""
    scale = cfg.mla.qk_head_dim**-0.5
    if (
        cfg.rope.scaling_factor is not None
        and cfg.rope.scaling_type == "yarn"
        and cfg.rope.yarn_mscale_all_dim
    ):
        scale *= yarn_mscale(cfg.rope.scaling_factor, cfg.rope.yarn_mscale_all_dim) ** 2
    return scale


class MultiLatentAttention(nn.Module):
    residual_projections = ("out",)
    tp_plan = {
        "enter_hidden": "enter",
        "enter_latents": "enter",
        "q": "column",
        "q_down": "replicated",
        "q_norm": "replicated",
        "q_up": "column",
        "kv_down": "replicated",
        "kv_norm": "replicated",
        "kv_up": "column",
        "out": "row",
    }

    def __init__(self, cfg: ModelConfig, layer: int = 0, ops: Ops | None = None):
        super().__init__()
        self.ops = ops = ops or Ops()
        m = cfg.mla
        self.layer = layer
        self.nope, self.rope_dim, self.v_dim, self.latent = (
            m.qk_nope_head_dim,
            m.qk_rope_head_dim,
            m.v_head_dim,
            m.kv_lora_rank,
        )
        D, H, QK = cfg.hidden_size, cfg.num_attention_heads, m.qk_head_dim
        bias = cfg.add_bias
        if m.q_lora_rank is None:
            self.q = nn.Linear(D, H * QK, bias=bias)
            self.q_down = self.q_norm = self.q_up = None
        else:
            self.q = None
            self.q_down = nn.Linear(D, m.q_lora_rank, bias=bias)
            self.q_norm = RMSNorm(cfg, m.q_lora_rank, ops)
            self.q_up = nn.Linear(m.q_lora_rank, H * QK, bias=False)
        self.kv_down = nn.Linear(D, m.kv_lora_rank + m.qk_rope_head_dim, bias=bias)
        self.kv_norm = RMSNorm(cfg, m.kv_lora_rank, ops)
        self.kv_up = nn.Linear(m.kv_lora_rank, H * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.out = nn.Linear(H * m.v_head_dim, D, bias=bias)
        # tensor parallelism's entries into the tp region (identity here): the hidden state for the
        # query projection (without a query latent), the latents for the up-projections
        self.enter_hidden: nn.Module | None = nn.Identity() if self.q is not None else None
        self.enter_latents: nn.Module = nn.Identity()
        self.interleaved = m.rope_interleave  # RoPE on adjacent pairs (DeepSeek's layout)
        self.core = AttentionCore(cfg, scale=mla_softmax_scale(cfg), ops=ops)

    def projections(self, x_BTD: torch.Tensor):
        """(q_nope [B, T, H, N], q_rope [B, T, H, R], normed latent c [B, T, C], rope key [B, T, R]),
        before RoPE; the latent and rope key are what serving caches. Under tp the down-projections
        run on this rank's tokens and their outputs are gathered (`enter_latents`)."""
        B = x_BTD.shape[0]
        c_BTC, k_BTR = self.kv_down(x_BTD).split([self.latent, self.rope_dim], dim=-1)
        c_BTC = self.kv_norm(c_BTC)
        if self.q is not None:
            q = self.q(self.enter_hidden(x_BTD))
            c_BTC, k_BTR = self.enter_latents(torch.cat([c_BTC, k_BTR], dim=-1)).split(
                [self.latent, self.rope_dim], dim=-1
            )
        else:
            cq_BTQ = self.q_norm(self.q_down(x_BTD))
            sizes = [cq_BTQ.shape[-1], self.latent, self.rope_dim]
            entered = self.enter_latents(torch.cat([cq_BTQ, c_BTC, k_BTR], dim=-1))
            cq_BTQ, c_BTC, k_BTR = entered.split(sizes, dim=-1)
            q = self.q_up(cq_BTQ)
        q_BTHQ = q.view(B, q.shape[1], -1, self.nope + self.rope_dim)
        return q_BTHQ[..., : self.nope], q_BTHQ[..., self.nope :], c_BTC, k_BTR

    def forward(self, x_BTD: torch.Tensor, rope=None, cache=None, documents_BT=None) -> torch.Tensor:
        qn_BTHN, qr_BTHR, c_BTC, kr_BTR = self.projections(x_BTD)
        B, T = c_BTC.shape[:2]  # the whole sequence under sequence parallelism
        qr_BTHR = self.ops.rope(qr_BTHR, *rope, interleaved=self.interleaved)
        kr_BT1R = self.ops.rope(kr_BTR[:, :, None], *rope, interleaved=self.interleaved)
        if cache is not None:
            return self.out(self._absorbed(cache, qn_BTHN, qr_BTHR, c_BTC, kr_BT1R).reshape(B, T, -1))
        kv_BTHX = self.kv_up(c_BTC).view(B, T, -1, self.nope + self.v_dim)
        kn_BTHN, v_BTHE = kv_BTHX[..., : self.nope], kv_BTHX[..., self.nope :]
        H = qn_BTHN.shape[2]
        q_BTHQ = torch.cat([qn_BTHN, qr_BTHR], dim=-1)
        k_BTHQ = torch.cat([kn_BTHN, kr_BT1R.expand(B, T, H, self.rope_dim)], dim=-1)
        o_BTHE = self.core(q_BTHQ, k_BTHQ, v_BTHE, documents_BT)
        return self.out(o_BTHE.reshape(B, T, -1))

    def up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, N, C], W_UV [H, E, C]): kv_up's rows per head (this rank's heads under tp)."""
        w_HXC = self.kv_up.weight.view(-1, self.nope + self.v_dim, self.latent)
        return w_HXC[:, : self.nope], w_HXC[:, self.nope :]

    def _absorbed(self, cache, qn_BTHN, qr_BTHR, c_BTC, kr_BT1R) -> torch.Tensor:
        """Attention over the cached latents with kv_up absorbed: [B, T, H, E]."""
        w_uk_HNC, w_uv_HEC = self.up_weights()
        q_BTHC = torch.einsum("bthn,hnc->bthc", qn_BTHN, w_uk_HNC)
        q_BTHX = torch.cat([q_BTHC, qr_BTHR], dim=-1)
        kv_BT1X = torch.cat([c_BTC[:, :, None], kr_BT1R], dim=-1)
        o_BTHC = cache.attend(self.layer, q_BTHX, kv_BT1X, None, scale=self.core.scale, value_dim=self.latent)
        return torch.einsum("bthc,hec->bthe", o_BTHC, w_uv_HEC)
