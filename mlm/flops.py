"""Model FLOPs per token (Megatron's count, with MoE layers counted by what a token uses),
torch-free so that `mlm plan` can use it without importing torch; `mlm.model.flops_per_token`
is this function."""

from __future__ import annotations

from dataclasses import dataclass

from mlm.config import ModelConfig


@dataclass(frozen=True)
class MLPFlops:
    """Training FLOPs per token of one layer's MLP, by where they run (the planner times them apart)."""

    tp: float
    """The dense MLP, or an MoE layer's shared experts: split over tensor parallelism."""
    routed: float
    """The k routed experts a token goes to (each expert whole on one rank)."""
    router: float
    """The router (and the shared experts' gate): replicated over tensor parallelism."""

    @property
    def total(self) -> float:
        return self.tp + self.routed + self.router


def attention_flops(cfg: ModelConfig, seq_length: int) -> float:
    """Training FLOPs per token of one attention block: 6·(2·D·K·(H + G) + 2·T·H·K)."""
    D, H, G, K = cfg.hidden_size, cfg.num_attention_heads, cfg.query_groups, cfg.head_dim
    return 6 * (2 * D * K * (H + G) + 2 * seq_length * H * K)


def mlp_flops(cfg: ModelConfig, kind: str) -> MLPFlops:
    """Training FLOPs per token of one MLP of `kind` ("dense" or "moe"): 6·m·D·F for a width-F MLP
    (m = 3 matrices gated, 2 plain); an MoE layer counts k experts of `expert_ffn_size`, the shared
    experts, and the router's 6·D·E (+ 6·D for the shared experts' gate)."""
    D = cfg.hidden_size
    m = 3 if cfg.activation == "swiglu" else 2
    if kind != "moe":
        return MLPFlops(6 * m * D * cfg.ffn_size, 0.0, 0.0)
    moe = cfg.moe
    shared = moe.shared_expert_ffn_hidden_size or 0
    gate = 6 * D if shared and moe.shared_expert_gate else 0
    return MLPFlops(
        6 * m * D * shared,
        6 * m * D * moe.router_topk * cfg.expert_ffn_size,
        6 * D * moe.num_experts + gate,
    )


def layer_flops(cfg: ModelConfig, seq_length: int) -> list[float]:
    """Training FLOPs per token of every layer (dense and MoE layers differ)."""
    attention, specs = attention_flops(cfg, seq_length), cfg.layer_specs()
    per_kind = {kind: attention + mlp_flops(cfg, kind).total for kind in {s.mlp for s in specs}}
    return [per_kind[spec.mlp] for spec in specs]


def flops_per_token(cfg: ModelConfig, seq_length: int) -> float:
    """Training FLOPs per token (forward + backward = 3 × forward), as Megatron counts them:
    every matmul, attention over the full (not causally halved) sequence, the logits layer,
    no recompute. Per dense layer 6·(2·D·K·(H + G) + 2·T·H·K + m·D·F), m = 3 gated / 2 plain MLP,
    K the head dim (with K = D/H: Megatron's 12·D²·(1 + G/H + T/D + F·m/(2D))); an MoE layer's
    MLP term is m·D·(k·F_expert + F_shared) + D·E (`mlp_flops`: the experts a token uses, so MFU
    follows the active parameters); plus 6·D·V for the logits."""
    return sum(layer_flops(cfg, seq_length)) + 6 * cfg.hidden_size * cfg.padded_vocab_size()
