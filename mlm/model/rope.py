"""Rotary position embeddings in the rotate-half layout (Hugging Face's and Megatron's default),
with Llama-3.1 frequency scaling."""

from __future__ import annotations

import math

import torch

from mlm.config import ModelConfig


def inv_frequencies(cfg: ModelConfig) -> torch.Tensor:
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if cfg.rope_scaling_factor is None:
        return inv
    factor, low, high = cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    old_len = cfg.rope_original_max_position_embeddings
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def rope_tables(
    cfg: ModelConfig,
    seq_len: int,
    device=None,
    positions: torch.Tensor | None = None,
    inv: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [T, head_dim] in fp32 for positions 0 .. seq_len - 1, or of the shape of
    `positions` + [head_dim] for those positions (each row is the same either way). `inv`: the
    frequencies (`inv_frequencies(cfg)` on `device`), when the caller keeps them."""
    inv = inv_frequencies(cfg).to(device) if inv is None else inv
    if positions is not None:
        freqs = positions.to(torch.float32)[..., None] * inv
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()
    t = torch.arange(seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x_BTHD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, T, heads, D] by cos, sin of shape [T, D] (every row alike) or [B, T, D]."""
    half = x_BTHD.shape[-1] // 2
    x1, x2 = x_BTHD[..., :half], x_BTHD[..., half:]
    rotated = torch.cat([-x2, x1], dim=-1)
    if cos.ndim == 2:
        cos, sin = cos[None], sin[None]
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    return (x_BTHD.float() * cos + rotated.float() * sin).to(x_BTHD.dtype)
