"""Model FLOPs per token (Megatron's count), torch-free so that `mlm plan` can use it without
importing torch; `mlm.model.flops_per_token` is this function."""

from __future__ import annotations

from mlm.config import ModelConfig


def flops_per_token(cfg: ModelConfig, seq_length: int) -> float:
    """Training FLOPs per token (forward + backward = 3 × forward), as Megatron counts them:
    every matmul, attention over the full (not causally halved) sequence, the logits layer,
    no recompute. Per layer 6·(2·D·K·(H + G) + 2·T·H·K + m·D·F), m = 3 gated / 2 plain MLP,
    K the head dim (with K = D/H: Megatron's 12·D²·(1 + G/H + T/D + F·m/(2D))); plus 6·D·V
    for the logits."""
    D, H, G, K = cfg.hidden_size, cfg.num_attention_heads, cfg.query_groups, cfg.head_dim
    m = 3 if cfg.activation == "swiglu" else 2
    per_layer = 6 * (2 * D * K * (H + G) + 2 * seq_length * H * K + m * D * cfg.ffn_size)
    return cfg.num_layers * per_layer + 6 * D * cfg.padded_vocab_size()
