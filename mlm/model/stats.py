"""Parameter counts (total, and active per token for MoE models) and model FLOPs per token
(Megatron's formula, used for MFU; it lives in `mlm.flops`, torch-free, for the planner)."""

from __future__ import annotations

import torch

from mlm.config import ModelConfig
from mlm.flops import flops_per_token

__all__ = ["active_parameter_count", "flops_per_token", "parameter_count", "parameter_counts"]


def parameter_counts(cfg: ModelConfig) -> tuple[int, int]:
    """(total, active per token), exact, from the model built on the meta device (no memory is
    used). Active: what one token's forward uses, the total less, in every MoE layer, the
    (E − k)/E share of the routed experts' weights it skips (shared experts and the router count
    in full; a dense model's active count is its total)."""
    from mlm.model.gpt import GPT
    from mlm.model.moe.layer import MoE

    with torch.device("meta"):
        model = GPT(cfg)
    total = sum(p.numel() for p in model.parameters())
    skipped = 0
    for module in model.modules():
        if isinstance(module, MoE):
            E, k = module.options.num_experts, module.options.router_topk
            routed = sum(p.numel() for p in module.experts.parameters())  # E whole experts
            skipped += routed // E * (E - k)
    return total, total - skipped


def parameter_count(cfg: ModelConfig) -> int:
    """Exact, from the model built on the meta device (no memory is used)."""
    return parameter_counts(cfg)[0]


def active_parameter_count(cfg: ModelConfig) -> int:
    """Parameters one token's forward uses (`parameter_counts`)."""
    return parameter_counts(cfg)[1]
