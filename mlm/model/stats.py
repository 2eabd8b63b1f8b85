"""Parameter counts (the main model's total and active per token, the MTP depths' apart) and
model FLOPs per token (Megatron's formula, used for MFU; it lives in `mlm.flops`, torch-free, for
the planner)."""

from __future__ import annotations

import torch

from mlm.config import ModelConfig
from mlm.counts import ParameterCounts
from mlm.flops import flops_per_token

__all__ = [
    "ParameterCounts",
    "active_parameter_count",
    "flops_per_token",
    "parameter_count",
    "parameter_counts",
]


def parameter_counts(cfg: ModelConfig) -> ParameterCounts:
    """Exact counts from the model built on the meta device (no memory is used): the main model
    (total, active per token) and the MTP depths (`GPT.mtp`, parameters `mtp.*`) apart. Active:
    what one token's forward uses, the total less, in every MoE layer, the (E − k)/E share of the
    routed experts' weights it skips (shared experts and the router count in full)."""
    from mlm.model.gpt import GPT
    from mlm.model.moe.layer import MoE

    with torch.device("meta"):
        model = GPT(cfg)
    mtp = model.mtp if model.mtp is not None else torch.nn.ModuleDict()

    def counts(modules) -> tuple[int, int]:
        total = sum(p.numel() for p in modules.parameters())
        skipped = 0
        for module in modules.modules():
            if isinstance(module, MoE):
                E, k = module.options.num_experts, module.options.router_topk
                routed = sum(p.numel() for p in module.experts.parameters())  # E whole experts
                skipped += routed // E * (E - k)
        return total, total - skipped

    mtp_total, mtp_active = counts(mtp)
    total, active = counts(model)
    return ParameterCounts(total - mtp_total, active - mtp_active, mtp_total, mtp_active)


def parameter_count(cfg: ModelConfig) -> int:
    """The main model's parameters, exact (`parameter_counts`; MTP depths apart)."""
    return parameter_counts(cfg).total


def active_parameter_count(cfg: ModelConfig) -> int:
    """Parameters one token's forward through the main model uses (`parameter_counts`)."""
    return parameter_counts(cfg).active
