"""AdamW with its weight-decay groups, and its state as checkpoint tensors."""

from __future__ import annotations

import torch
from torch import nn

from mlm.checkpoint.keys import MOMENTS, moment_key
from mlm.config import OptimizerConfig


def exempt(name: str, p: nn.Parameter, rule: str) -> bool:
    """Whether parameter `name` has no weight decay under `optimizer.weight_decay_exempt` `rule`:
    1d (Megatron-LM's: biases and 1-d parameters, i.e. norms), 1d_and_embeddings (also the
    embeddings) or none."""
    if rule == "none":
        return False
    return p.ndim < 2 or name.endswith(".bias") or (rule == "1d_and_embeddings" and "embed" in name)


def make_optimizer(model: nn.Module, cfg: OptimizerConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW over the trainable parameters in two groups, decayed and exempt. Each group's
    `wd_mult` (1 or 0) scales the step's weight decay (`TrainOptimizer.step`), as Megatron-LM's."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:  # e.g. the MoE router's expert bias (updated by its own rule)
            continue
        (no_decay if exempt(name, p, cfg.weight_decay_exempt) else decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay, "wd_mult": 1.0}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0, "wd_mult": 0.0})
    return torch.optim.AdamW(
        groups,
        lr=cfg.lr,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_eps,
        fused=device.type in ("cuda", "cpu"),
    )


def set_schedule(opt: torch.optim.Optimizer, lr: float, weight_decay: float) -> None:
    """This step's learning rate and weight decay on every group of `opt` (scaled by its `wd_mult`)."""
    for group in opt.param_groups:
        group["lr"] = lr
        group["weight_decay"] = weight_decay * group["wd_mult"]


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
