"""AdamW with Megatron's parameter groups, and its state as checkpoint tensors."""

from __future__ import annotations

import torch
from torch import nn

from mlm.checkpoint.keys import MOMENTS, moment_key
from mlm.config import OptimizerConfig


def no_decay(name: str, p: nn.Parameter) -> bool:
    """Norm weights, biases (all 1-d) and embeddings are exempt from weight decay."""
    return p.ndim < 2 or "embed" in name


def make_optimizer(model: nn.Module, cfg: OptimizerConfig, device: torch.device) -> torch.optim.AdamW:
    decay, exempt = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:  # e.g. the MoE router's expert bias (updated by its own rule)
            continue
        (exempt if cfg.no_decay_norms_biases_embeddings and no_decay(name, p) else decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}]
    if exempt:
        groups.append({"params": exempt, "weight_decay": 0.0})
    return torch.optim.AdamW(
        groups,
        lr=cfg.lr,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_eps,
        fused=device.type in ("cuda", "cpu"),
    )


def adam_state_tensors(model: nn.Module, opt: torch.optim.AdamW, step: int) -> dict[str, torch.Tensor]:
    """{"exp_avg.NAME": t, "exp_avg_sq.NAME": t} for every parameter, creating the state
    (zeros, at `step`) where the optimizer has none yet, so that a checkpoint can be loaded into it."""
    out = {}
    fused = opt.defaults.get("fused") or False
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        state = opt.state[p]
        if not state:
            state["step"] = torch.tensor(
                float(step), dtype=torch.float32, device=p.device if fused else "cpu"
            )
            for moment in MOMENTS:
                state[moment] = torch.zeros_like(p, memory_format=torch.preserve_format)
        for moment in MOMENTS:
            out[moment_key(moment, name)] = state[moment]
    return out


def set_adam_step(opt: torch.optim.AdamW, step: int) -> None:
    for state in opt.state.values():
        state["step"].fill_(float(step))
