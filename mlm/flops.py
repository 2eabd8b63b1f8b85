"""Model FLOPs per token (Megatron's count), torch-free so that `mlm plan` can use it without
importing torch; `mlm.model.flops_per_token` is this function."""

from __future__ import annotations

from mlm.config import ModelConfig


def flops_per_token(cfg: ModelConfig, seq_length: int) -> float:
    """Training FLOPs per token (forward + backward = 3 × forward), as Megatron counts them:
    every matmul, attention over the full (not causally halved) sequence, the logits layer,
    no recompute. Per layer 12·D²·(1 + G/H + T/D + F·m/(2D)), m = 3 gated / 2 plain MLP;
    plus 6·D·V for the logits."""
    D, H, G = cfg.hidden_size, cfg.num_attention_heads, cfg.query_groups
    m = 3 if cfg.activation == "swiglu" else 2
    per_layer = 12 * D * D * (1 + G / H + seq_length / D + cfg.ffn_size * m / (2 * D))
    return cfg.num_layers * per_layer + 6 * D * cfg.padded_vocab_size()
