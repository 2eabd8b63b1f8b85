"""Learning-rate schedules: linear warm-up, then cosine / linear / constant / WSD decay to min_lr
(Megatron's OptimizerParamScheduler semantics)."""

from __future__ import annotations

import math

from mlm.config import OptimizerConfig


def lr_at(step: int, cfg: OptimizerConfig, total_iters: int) -> float:
    """The LR for optimizer step `step` (0-based) of a run of `total_iters` steps."""
    warmup = cfg.warmup_iters
    if warmup > 0 and step < warmup:
        return cfg.lr * (step + 1) / warmup
    if cfg.decay_style == "constant":
        return cfg.lr
    decay_end = cfg.decay_iters or total_iters
    if cfg.decay_style == "wsd":
        decay_start = max(warmup, decay_end - cfg.wsd_decay_iters)
        if step < decay_start:
            return cfg.lr
        frac = min(1.0, (step - decay_start) / max(1, decay_end - decay_start))
        return cfg.lr - (cfg.lr - cfg.min_lr) * frac
    frac = min(1.0, max(0.0, (step - warmup) / max(1, decay_end - warmup)))
    if cfg.decay_style == "linear":
        coeff = 1.0 - frac
    else:
        coeff = 0.5 * (math.cos(math.pi * frac) + 1.0)
    return cfg.min_lr + coeff * (cfg.lr - cfg.min_lr)
