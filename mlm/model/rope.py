"""Rotary position embeddings: the rotate-half layout (Hugging Face's and Megatron's default) and
DeepSeek's interleaved pairs (MLA's rope dims), with Llama-3.1 or YaRN frequency scaling."""

from __future__ import annotations

import math

import torch

from mlm.config import ModelConfig


def _llama3(inv: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    factor, low, high = cfg.rope.scaling_factor, cfg.rope.low_freq_factor, cfg.rope.high_freq_factor
    old_len = cfg.rope.original_max_position_embeddings
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def _yarn(inv: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """YaRN (arXiv 2309.00071): dims rotating fewer than beta_slow times over the original context
    are interpolated (÷ factor), more than beta_fast times kept, a linear ramp between (the
    correction range rounded outwards, as DeepSeek's and HF's code do)."""
    d, base, old_len = cfg.rope_dim, cfg.rope.base, cfg.rope.original_max_position_embeddings

    def dim_of(rotations: float) -> float:  # the dim that turns `rotations` times over old_len
        return d * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(dim_of(cfg.rope.yarn_beta_fast)), 0)
    high = min(math.ceil(dim_of(cfg.rope.yarn_beta_slow)), d - 1)
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    return inv / cfg.rope.scaling_factor * (1 - keep) + inv * keep


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 · mscale · ln(factor) + 1 (1 when factor ≤ 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def attention_factor(cfg: ModelConfig) -> float:
    """What YaRN multiplies cos and sin by: mscale(mscale) / mscale(mscale_all_dim) when both are
    set (1 for DeepSeek-V3), else mscale(1); 1 without YaRN."""
    if cfg.rope.scaling_factor is None or cfg.rope.scaling_type != "yarn":
        return 1.0
    f, m, m_all = cfg.rope.scaling_factor, cfg.rope.yarn_mscale, cfg.rope.yarn_mscale_all_dim
    return yarn_mscale(f, m) / yarn_mscale(f, m_all) if m and m_all else yarn_mscale(f)


def inv_frequencies(cfg: ModelConfig) -> torch.Tensor:
    d = cfg.rope_dim
    inv = 1.0 / (cfg.rope.base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if cfg.rope.scaling_factor is None:
        return inv
    return _yarn(inv, cfg) if cfg.rope.scaling_type == "yarn" else _llama3(inv, cfg)


def rope_tables(
    cfg: ModelConfig,
    seq_len: int,
    device=None,
    positions: torch.Tensor | None = None,
    inv: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [T, rope_dim] in fp32 for positions 0 .. seq_len - 1, or of the shape of
    `positions` + [rope_dim] for those positions (each row is the same either way), times YaRN's
    attention factor. `inv`: the frequencies (`inv_frequencies(cfg)` on `device`), when the
    caller keeps them."""
    inv = inv_frequencies(cfg).to(device) if inv is None else inv
    if positions is not None:
        freqs = positions.to(torch.float32)[..., None] * inv
    else:
        freqs = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    factor = attention_factor(cfg)
    if factor != 1.0:
        return emb.cos() * factor, emb.sin() * factor
    return emb.cos(), emb.sin()


def _broadcast(cos: torch.Tensor, sin: torch.Tensor):
    if cos.ndim == 2:
        cos, sin = cos[None], sin[None]
    return cos[:, :, None, :], sin[:, :, None, :]


def apply_rope(
    x_BTHD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kernels: str = "torch"
) -> torch.Tensor:
    """Rotate x [B, T, heads, D] by cos, sin of shape [T, D] (every row alike) or [B, T, D];
    kernels="triton": the same by `kernels.rope` (see `model.kernels`)."""
    if kernels == "triton":
        from kernels.rope import rope

        return rope(x_BTHD, cos, sin)
    half = x_BTHD.shape[-1] // 2
    x1, x2 = x_BTHD[..., :half], x_BTHD[..., half:]
    rotated = torch.cat([-x2, x1], dim=-1)
    cos, sin = _broadcast(cos, sin)
    return (x_BTHD.float() * cos + rotated.float() * sin).to(x_BTHD.dtype)


def apply_rope_interleaved(
    x_BTHD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kernels: str = "torch"
) -> torch.Tensor:
    """DeepSeek's RoPE: dims (0, 1), (2, 3), ... rotated as pairs; the result comes out with the
    pairs' first elements in the first half, their second in the second (HF's
    `apply_rotary_pos_emb_interleave`: q and k alike, so their dot products are DeepSeek's);
    kernels="triton": the same by `kernels.rope` (see `model.kernels`)."""
    if kernels == "triton":
        from kernels.rope import rope_interleaved

        return rope_interleaved(x_BTHD, cos, sin)
    half = x_BTHD.shape[-1] // 2
    cos, sin = _broadcast(cos[..., :half], sin[..., :half])
    x1, x2 = x_BTHD[..., 0::2].float(), x_BTHD[..., 1::2].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x_BTHD.dtype)
