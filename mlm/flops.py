"""Model FLOPs per token (Megatron's count, with MoE layers counted by what a token uses),
torch-free so that `mlm plan` can use it without importing torch; `mlm.model.flops_per_token`
is this function."""

from __future__ import annotations

from dataclasses import dataclass

from mlm.config import ModelConfig


@dataclass(frozen=True)
class AttentionFlops:
    """Training FLOPs per token of one attention block, by where they run (the planner times them apart)."""

    tp: float
    """The projections split over tensor parallelism by heads: q, k, v and out (MLA: the query and
    key/value up-projections, or q without a query latent, and out)."""
    core: float
    """Scores and values over the sequence (split over tp by heads)."""
    replicated: float = 0.0
    """MLA's down-projections (to the query and key/value latents): replicated over tensor
    parallelism, every tp rank computes them whole over its own tokens (its sequence shard under
    sequence parallelism, the whole sequence without)."""

    @property
    def total(self) -> float:
        return self.tp + self.core + self.replicated


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


def attention_flops(cfg: ModelConfig, seq_length: int) -> AttentionFlops:
    """Training FLOPs per token of one attention block (6 = 3 passes × 2 FLOPs per multiply-add).

    gqa: 6·(2·D·K·(H + G) + 2·T·H·K): q and out D·H·K each, k and v D·G·K each; the core T·H·K
    for the scores and as much for the values.
    mla (Megatron's multi-latent term, norms aside): the query latent Q (q_lora_rank) 6·D·Q down and
    6·Q·H·(N + R) up (without it, q 6·D·H·(N + R)); the key/value latent C and the shared rope key
    6·D·(C + R) down, 6·C·H·(N + E) up; out 6·H·E·D; the core 6·T·H·((N + R) + E): scores over the
    nope and rope dims, values of E dims (no per-head key or value comes from the hidden state)."""
    D, H, T = cfg.hidden_size, cfg.num_attention_heads, seq_length
    if cfg.attention_kind == "mla":
        m = cfg.mla
        QK, E = m.qk_head_dim, m.v_head_dim
        if m.q_lora_rank is None:
            q_tp, q_down = D * H * QK, 0
        else:
            q_tp, q_down = m.q_lora_rank * H * QK, D * m.q_lora_rank
        kv_down = D * (m.kv_lora_rank + m.qk_rope_head_dim)
        kv_up = m.kv_lora_rank * H * (m.qk_nope_head_dim + E)
        return AttentionFlops(6 * (q_tp + kv_up + H * E * D), 6 * T * H * (QK + E), 6 * (q_down + kv_down))
    G, K = cfg.query_groups, cfg.head_dim
    return AttentionFlops(6 * 2 * D * K * (H + G), 6 * 2 * T * H * K)


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
    """Training FLOPs per token of every layer of the main model (dense and MoE layers differ)."""
    attention, specs = attention_flops(cfg, seq_length).total, cfg.layer_specs()
    per_kind = {kind: attention + mlp_flops(cfg, kind).total for kind in {s.mlp for s in specs}}
    return [per_kind[spec.mlp] for spec in specs]


def logits_flops(cfg: ModelConfig) -> float:
    """Training FLOPs per token of the output layer: 6·D·V (V the padded vocabulary)."""
    return 6 * cfg.hidden_size * cfg.padded_vocab_size()


def eh_proj_flops(cfg: ModelConfig) -> float:
    """Training FLOPs per token of one MTP depth's eh_proj ([D, 2D]): 6·2·D²."""
    return 6 * 2 * cfg.hidden_size**2


def mtp_depth_flops(cfg: ModelConfig, seq_length: int) -> float:
    """Training FLOPs per token of one MTP depth (Megatron's count): its layer (of the last
    layer's kind, over the same sequence), eh_proj and its logits."""
    return layer_flops(cfg, seq_length)[-1] + eh_proj_flops(cfg) + logits_flops(cfg)


def flops_per_token(cfg: ModelConfig, seq_length: int) -> float:
    """Training FLOPs per token (forward + backward = 3 × forward), as Megatron counts them:
    every matmul, attention over the full (not causally halved) sequence, the logits layer,
    no recompute. Per dense layer 6·(2·D·K·(H + G) + 2·T·H·K + m·D·F), m = 3 gated / 2 plain MLP,
    K the head dim (with K = D/H: Megatron's 12·D²·(1 + G/H + T/D + F·m/(2D))); MLA's attention
    as `attention_flops`; an MoE layer's MLP term is m·D·(k·F_expert + F_shared) + D·E
    (`mlp_flops`: the experts a token uses, so MFU follows the active parameters); plus 6·D·V for
    the logits; each MTP depth adds a layer, its eh_proj and another 6·D·V (`mtp_depth_flops`).
    Norms are left out, as Megatron leaves them out of every layer (its MLA and MTP terms add
    3·(Q + C) and 18·D per token for theirs: < 0.001 %)."""
    main = sum(layer_flops(cfg, seq_length)) + logits_flops(cfg)
    return main + cfg.mtp_num_layers * mtp_depth_flops(cfg, seq_length)
