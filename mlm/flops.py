"""Model FLOPs per token (Megatron's count, with MoE layers counted by what a token uses),
torch-free so that `mlm plan` can use it without importing torch; `mlm.model.flops_per_token`
is this function."""

from __future__ import annotations

from mlm.config import LayerSpec, ModelConfig
from mlm.model import kinds
from mlm.model.kinds.mtp.spec import eh_proj_flops
from mlm.model.kinds.spec import Flops


def mixer_flops(cfg: ModelConfig, kind: str, seq_length: int) -> Flops:
    """Training FLOPs per token of one mixer of `kind` (its spec's count: gqa 6·(2·D·K·(H + G) +
    2·T·H·K), MLA Megatron's multi-latent term, `mlm.model.kinds`)."""
    return kinds.mixer(kind).flops(cfg, seq_length)


def mlp_flops(cfg: ModelConfig, kind: str) -> Flops:
    """Training FLOPs per token of one MLP of `kind`: 6·m·D·F for a width-F dense MLP (m = 3
    matrices gated, 2 plain); an MoE layer the k experts a token uses, the shared experts and the
    router (its spec's count)."""
    return kinds.mlp(kind).flops(cfg)


def part_flops(cfg: ModelConfig, spec: LayerSpec, seq_length: int) -> Flops:
    """Training FLOPs per token of one layer of `spec`, by where they run: its mixer's and its MLP's."""
    total = Flops()
    if spec.mixer is not None:
        total = total + mixer_flops(cfg, spec.mixer, seq_length)
    if spec.mlp is not None:
        total = total + mlp_flops(cfg, spec.mlp)
    return total


def layer_flops(cfg: ModelConfig, seq_length: int) -> list[float]:
    """Training FLOPs per token of every layer of the main model (layers of other kinds differ)."""
    specs = cfg.layer_specs()
    per_kind = {spec: part_flops(cfg, spec, seq_length).total for spec in set(specs)}
    return [per_kind[spec] for spec in specs]


def logits_flops(cfg: ModelConfig) -> float:
    """Training FLOPs per token of the output layer: 6·D·V (V the padded vocabulary)."""
    return 6 * cfg.hidden_size * cfg.padded_vocab_size()


def mtp_depth_flops(cfg: ModelConfig, seq_length: int) -> float:
    """Training FLOPs per token of one MTP depth (Megatron's count): its layer (of the last
    layer's kind, over the same sequence), eh_proj and its logits."""
    return layer_flops(cfg, seq_length)[-1] + eh_proj_flops(cfg) + logits_flops(cfg)


def flops_per_token(cfg: ModelConfig, seq_length: int) -> float:
    """Training FLOPs per token (forward + backward = 3 × forward), as Megatron counts them:
    every matmul, attention over the full (not causally halved) sequence, the logits layer,
    no recompute. Each layer's mixer and MLP as their kinds' specs count them (`part_flops`): per
    gqa + dense layer 6·(2·D·K·(H + G) + 2·T·H·K + m·D·F), m = 3 gated / 2 plain MLP, K the head
    dim (with K = D/H: Megatron's 12·D²·(1 + G/H + T/D + F·m/(2D))); an MoE layer's MLP term is
    m·D·(k·F_expert + F_shared) + D·E (the experts a token uses, so MFU follows the active
    parameters); plus 6·D·V for
    the logits; each MTP depth adds a layer, its eh_proj and another 6·D·V (`mtp_depth_flops`).
    Norms are left out, as Megatron leaves them out of every layer (its MLA and MTP terms add
    3·(Q + C) and 18·D per token for theirs: < 0.001 %)."""
    main = sum(layer_flops(cfg, seq_length)) + logits_flops(cfg)
    return main + cfg.mtp_num_layers * mtp_depth_flops(cfg, seq_length)
