"""Multi-token prediction (DeepSeek-V3 §2.2; Megatron's MultiTokenPredictionLayer): D depths after
the main model, depth k predicting the token k + 1 ahead of each position.

    h⁰ = final_norm(main model's last hidden states)
    hᵏ = final_normₖ(layerₖ(eh_projₖ([enormₖ(embed(t_{i+k})) ; hnormₖ(hᵏ⁻¹)])))   (embedding first)
    lossₖ = CE(output(hᵏ_i), t_{i+k+1}) over the positions that have that token

The embedding and the output layer are the main model's (a pipeline's last stage holds a copy of
the embedding, its gradient summed with the first stage's as for tied embeddings). The total
loss adds mtp_loss_scaling_factor / D · Σₖ lossₖ; the losses are logged apart (`mtp_loss.k`).

`MTPTargets` shifts the tokens before context parallelism splits the sequence, so no depth
needs another rank's tokens: depth k reads, at position i, the token i + k (its input) and
i + k + 1 (its label), both from the [B, T + 1] sample. The last k positions have no label:
weight 0. Each depth's loss is the mean over the positions that have one (T − k per sequence),
computed as a weighted sum so that every context-parallel share adds up to it.

Shape legend: B batch, T sequence (this rank's share under cp), D hidden, J = depths + 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mlm.config import LayerSpec, ModelConfig
from mlm.model.layers import Block, make_norm, to_residual
from mlm.model.ops import Ops


class MTPLayer(nn.Module):
    """One depth: enorm, hnorm, eh_proj [D, 2D], a transformer layer and its own final norm."""

    tp_plan = {
        "enorm": "replicated",
        "hnorm": "replicated",
        "eh_proj": "replicated",
        "final_norm": "replicated",
    }

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, layer: int, ops: Ops | None = None):
        super().__init__()
        D = cfg.hidden_size
        self.enorm = make_norm(cfg, ops=ops)
        self.hnorm = make_norm(cfg, ops=ops)
        self.eh_proj = nn.Linear(2 * D, D, bias=False)
        self.layer = Block(cfg, spec, layer, ops)
        self.final_norm = make_norm(cfg, ops=ops)
        self.fp32_residual = cfg.fp32_residual_connection

    def forward(self, e_BTD, h_BTD, rope=None, documents_BT=None) -> torch.Tensor:
        x_BTD = self.eh_proj(torch.cat([self.enorm(e_BTD), self.hnorm(h_BTD)], dim=-1))
        x_BTD = to_residual(x_BTD, self.fp32_residual)  # the layer's residual stream
        return self.final_norm(self.layer(x_BTD, rope, None, documents_BT))


@dataclass
class MTPTargets:
    """The tokens ahead of every position, `ahead_BTJ[b, i, j]` = sample token i + 1 + j (−1 past
    the end), and the loss weights of each depth; `split` keeps some positions (a cp rank's)."""

    ahead_BTJ: torch.Tensor
    weights_BTJ: torch.Tensor  # [..., k]: depth k's weight at each position (column 0 unused)

    @classmethod
    def of(cls, tokens_BS: torch.Tensor, depths: int, shares: int = 1) -> MTPTargets:
        """From samples [B, T + 1]. `shares`: how many ranks split each sequence (cp): each rank's
        weighted sum is then its share times `shares`, so that their mean is the loss (as the
        main loss, a mean per rank, is averaged over cp)."""
        B, S = tokens_BS.shape
        T = S - 1
        padded = torch.cat([tokens_BS, tokens_BS.new_full((B, depths), -1)], dim=1)
        ahead_BTJ = torch.stack([padded[:, 1 + j : 1 + j + T] for j in range(depths + 1)], dim=-1)
        counts = torch.tensor([B * max(T - k, 1) for k in range(depths + 1)], device=tokens_BS.device)
        weights_BTJ = (ahead_BTJ >= 0).float() * shares / counts
        return cls(ahead_BTJ, weights_BTJ)

    def split(self, positions: torch.Tensor) -> MTPTargets:
        return MTPTargets(self.ahead_BTJ[:, positions], self.weights_BTJ[:, positions])

    def inputs(self, k: int) -> torch.Tensor:
        """Depth k's input tokens [B, T] (the token k ahead; 0 where there is none: no label either)."""
        return self.ahead_BTJ[..., k - 1].clamp(min=0)

    def labels(self, k: int) -> torch.Tensor:
        return self.ahead_BTJ[..., k].clamp(min=0)

    def weights(self, k: int) -> torch.Tensor:
        return self.weights_BTJ[..., k]
