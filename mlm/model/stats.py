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
    what one token's forward uses, the total less what modules say a token skips
    (`inactive_parameters`: an MoE layer's (E − k)/E share of its routed experts)."""
    from mlm.model.gpt import GPT

    with torch.device("meta"):
        model = GPT(cfg)
    mtp = model.mtp if model.mtp is not None else torch.nn.ModuleDict()

    def counts(modules) -> tuple[int, int]:
        total = sum(p.numel() for p in modules.parameters())
        skipped = sum(m.inactive_parameters() for m in modules.modules() if hasattr(m, "inactive_parameters"))
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
