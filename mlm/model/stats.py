"""Parameter count and model FLOPs per token (Megatron's formula, used for MFU; it lives in
`mlm.flops`, torch-free, for the planner)."""

from __future__ import annotations

import torch

from mlm.config import ModelConfig
from mlm.flops import flops_per_token

__all__ = ["flops_per_token", "parameter_count"]


def parameter_count(cfg: ModelConfig) -> int:
    """Exact, from the model built on the meta device (no memory is used)."""
    from mlm.model.gpt import GPT

    with torch.device("meta"):
        model = GPT(cfg)
    return sum(p.numel() for p in model.parameters())
