"""The learning-rate and weight-decay schedules: Megatron-LM's `OptimizerParamScheduler` formulas
(megatron/core/optimizer_param_scheduler.py, core_v0.16.1), evaluated at optimizer step `step`
(from 0), as Megatron evaluates them after `step` scheduler steps. mlm's one difference is its
default `warmup_offset` 1: warm-up step s runs at position s + 1, so the first step trains
(docs/train.md, "Megatron-LM's schedule")."""

from __future__ import annotations

import math

from mlm.config import OptimizerConfig


def lengths(cfg: OptimizerConfig, total_iters: int, batch: int = 1) -> tuple[float, float, float]:
    """(warm-up, decay, wsd's final decay) in optimizer steps: from `*_iters`, or `*_samples` over
    `batch` samples a step, or the warm-up as `warmup_fraction` of the decay (a fraction of a step
    included, as Megatron-LM keeps them: its scheduler counts samples)."""
    decay = cfg.decay_samples / batch if cfg.decay_samples is not None else cfg.decay_iters or total_iters
    if cfg.warmup_fraction is not None:
        warmup = cfg.warmup_fraction * decay
    else:
        warmup = cfg.warmup_samples / batch if cfg.warmup_samples is not None else cfg.warmup_iters
    wsd = cfg.wsd_decay_samples / batch if cfg.wsd_decay_samples is not None else cfg.wsd_decay_iters
    return warmup, decay, wsd


def _cosine(ratio: float) -> float:
    return 0.5 * (math.cos(math.pi * ratio) + 1.0)


_WSD = {
    "linear": lambda r: 1.0 - r,
    "cosine": _cosine,
    "exponential": lambda r: 2.0 * 0.5**r - 1.0,
    "minus_sqrt": lambda r: 1.0 - math.sqrt(r),
}
"""The final decay of wsd: coefficient of (lr - min_lr) at the fraction r of it done."""


def lr_at(step: int, cfg: OptimizerConfig, total_iters: int, batch: int = 1) -> float:
    """The learning rate of optimizer step `step` (from 0) of a run of `total_iters` steps of
    `batch` samples. Megatron-LM counts its scheduler in samples: lengths given in samples
    (`lengths`) and inverse-square-root without warm-up (its position is at least one sample)
    depend on `batch`."""
    lr, (warmup, decay, wsd) = cfg.lr, lengths(cfg, total_iters, batch)
    if warmup > 0 and step + cfg.warmup_offset <= warmup:
        return cfg.lr_warmup_init + (lr - cfg.lr_warmup_init) * (step + cfg.warmup_offset) / warmup
    if cfg.decay_style == "constant":
        return lr
    if step > decay:
        return cfg.min_lr
    if cfg.decay_style == "inverse-square-root":
        return max(cfg.min_lr, lr * math.sqrt(max(warmup * batch, 1) / max(step * batch, 1)))
    if cfg.decay_style == "wsd":
        start = decay - wsd
        coeff = 1.0 if step <= start else _WSD[cfg.wsd_decay_style]((step - start) / wsd)
    else:
        ratio = min(1.0, max(0.0, (step - warmup) / max(decay - warmup, 1e-12)))
        coeff = 1.0 - ratio if cfg.decay_style == "linear" else _cosine(ratio)
    return cfg.min_lr + coeff * (lr - cfg.min_lr)


def weight_decay_at(step: int, cfg: OptimizerConfig, total_iters: int) -> float:
    """The weight decay of optimizer step `step` (before each group's exemption)."""
    if cfg.weight_decay_incr_style == "constant":
        return cfg.weight_decay
    start, end = cfg.start_weight_decay, cfg.end_weight_decay
    ratio = min(1.0, step / max(total_iters, 1))
    coeff = ratio if cfg.weight_decay_incr_style == "linear" else _cosine(1.0 - ratio)
    return start + coeff * (end - start)
