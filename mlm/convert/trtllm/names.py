"""TensorRT-LLM's checkpoint layout for mlm's models: tensor names and per-rank slices, both ways.

docs/formats-foreign.md ("TensorRT-LLM checkpoint") gives the sources, the name table and each tensor's
per-rank split. Shapes: V vocabulary, D hidden, H heads, G KV heads, K head dim, F ffn, E experts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mlm.config import ModelConfig
from mlm.convert.layouts import tp_join, tp_join_pair, tp_shard, tp_shard_pair
from mlm.errors import MlmError

LLAMA, GPT, MIXTRAL = "LlamaForCausalLM", "GPTForCausalLM", "MixtralForCausalLM"

# How a tensor is laid out over tp ranks.
WHOLE = "whole"  # the same on every rank
EMBED = "embed"  # vocabulary rows cut to the real vocabulary, whole on every rank
COLUMN = "column"  # split by rows (dim 0)
ROW = "row"  # split by columns (dim 1)
QKV = "qkv"  # q, k, v split by heads and stacked per rank
LM_HEAD = "lm_head"  # vocabulary rows zero-padded to a multiple of tp, split by rows
EXPERT_FC = "expert_fc"  # [E, 2F, D]: up then gate, each split over tp along F first
EXPERT_PROJ = "expert_proj"  # [E, D, F], split over tp along F
_DIM = {COLUMN: 0, ROW: 1, EXPERT_PROJ: 2}  # the dim each plain tensor-parallel split cuts


@dataclass(frozen=True)
class Rule:
    """One TensorRT-LLM tensor and the mlm tensor(s) it is made of."""

    trt: str
    """TensorRT-LLM name; `{}` is the layer's index within its pipeline stage."""
    mlm: tuple[str, ...]
    """mlm key(s); `{}` is the global layer number."""
    split: str
    dtype: str | None = None
    """Stored in this TensorRT-LLM dtype whatever the checkpoint's (None: config.json's dtype)."""


def _rules(trt: str, split: str, *mlm: str, bias: bool = False, dtype: str | None = None) -> tuple[Rule, ...]:
    """The rule of `trt`.weight, made of the mlm `mlm`.weight(s), and with `bias` the rule of their
    biases (whole on every rank where the weight is row-parallel)."""
    ends = {"weight": split} | ({"bias": WHOLE if split == ROW else split} if bias else {})
    return tuple(Rule(f"{trt}.{end}", tuple(f"{m}.{end}" for m in mlm), s, dtype) for end, s in ends.items())


def _layer(trt: str, split: str, *mlm: str, **kw) -> tuple[Rule, ...]:
    """`_rules` of a layer's tensor (`{}` the layer)."""
    return _rules(f"transformer.layers.{{}}.{trt}", split, *(f"layers.{{}}.{m}" for m in mlm), **kw)


def _attention(bias: bool) -> tuple[Rule, ...]:
    return (
        *_layer("input_layernorm", WHOLE, "attn_norm", bias=bias),
        *_layer("attention.qkv", QKV, "attn.q", "attn.k", "attn.v", bias=bias),
        *_layer("attention.dense", ROW, "attn.out", bias=bias),
        *_layer("post_layernorm", WHOLE, "mlp_norm", bias=bias),
    )


LAYER_RULES = {
    LLAMA: (
        *_attention(bias=False),
        *_layer("mlp.fc", COLUMN, "mlp.gate"),  # silu(fc(x)) · gate(x): the names cross
        *_layer("mlp.gate", COLUMN, "mlp.up"),
        *_layer("mlp.proj", ROW, "mlp.down"),
    ),
    MIXTRAL: (
        *_attention(bias=False),
        *_layer("mlp.router", WHOLE, "mlp.router", dtype="float32"),
        *_layer("mlp.fc", EXPERT_FC, "mlp.experts.up", "mlp.experts.gate"),
        *_layer("mlp.proj", EXPERT_PROJ, "mlp.experts.down"),
    ),
    GPT: (
        *_attention(bias=True),
        *_layer("mlp.fc", COLUMN, "mlp.up", bias=True),
        *_layer("mlp.proj", ROW, "mlp.down", bias=True),
    ),
}
_EMBEDDING = _rules("transformer.vocab_embedding", EMBED, "embed")
FIRST_RULES = {
    LLAMA: _EMBEDDING,
    MIXTRAL: _EMBEDDING,
    GPT: (*_EMBEDDING, *_rules("transformer.position_embedding", WHOLE, "pos_embed")),
}
# lm_head's source is output.weight, or embed.weight when the embeddings are tied (see sources)
_LM_HEAD = _rules("lm_head", LM_HEAD, "output")
LAST_RULES = {
    LLAMA: (*_rules("transformer.ln_f", WHOLE, "final_norm"), *_LM_HEAD),
    MIXTRAL: (*_rules("transformer.ln_f", WHOLE, "final_norm"), *_LM_HEAD),
    GPT: (*_rules("transformer.ln_f", WHOLE, "final_norm", bias=True), *_LM_HEAD),
}


def stage_layers(num_layers: int, pp: int, pp_rank: int) -> list[int]:
    """The global layers of pipeline stage `pp_rank` (TensorRT-LLM's `Mapping.pp_layers`)."""
    return torch.arange(num_layers).tensor_split(pp)[pp_rank].tolist()


def rank_rules(
    arch: str, cfg: ModelConfig, tp: int, pp: int, rank: int
) -> list[tuple[str, Rule, int | None]]:
    """(TensorRT-LLM name, rule, global layer or None) of every tensor in `rank{rank}.safetensors`."""
    pp_rank = rank // tp
    out = [(r.trt, r, None) for r in FIRST_RULES[arch]] if pp_rank == 0 else []
    for j, layer in enumerate(stage_layers(cfg.num_layers, pp, pp_rank)):
        out += [(r.trt.format(j), r, layer) for r in LAYER_RULES[arch]]
    if pp_rank == pp - 1:
        out += [(r.trt, r, None) for r in LAST_RULES[arch]]
    return out


def sources(rule: Rule, layer: int | None, cfg: ModelConfig) -> tuple[str, ...]:
    """The mlm keys a rule reads for `layer`."""
    keys = tuple(k.format(layer) if layer is not None else k for k in rule.mlm)
    if keys == ("output.weight",) and cfg.tie_embeddings:
        return ("embed.weight",)
    return keys


def shard(rule: Rule, tensors: list[torch.Tensor], cfg: ModelConfig, tp: int, tp_rank: int) -> torch.Tensor:
    """Tp rank `tp_rank`'s tensor for `rule`, from the global mlm tensors of `sources`."""
    t, V = tensors[0], cfg.vocab_size
    if rule.split == WHOLE:
        return t
    if rule.split == EMBED:
        return t[:V]
    if rule.split in _DIM:
        return tp_shard(t, _DIM[rule.split], tp, tp_rank)
    if rule.split == EXPERT_FC:  # [E, F, D] up, gate → this rank's [E, 2F/tp, D]
        return tp_shard_pair(*tensors, 1, tp, tp_rank)
    if rule.split == LM_HEAD:  # the vocabulary padded to a multiple of tp; a new tensor, never the embedding
        rows = math.ceil(V / tp)
        part = t[tp_rank * rows : min((tp_rank + 1) * rows, V)]
        return torch.cat([part, part.new_zeros(rows - part.shape[0], *part.shape[1:])])
    assert rule.split == QKV, rule
    q, k, v = tensors  # each KV head repeated over tp / G ranks where there are fewer than tp
    G, dup = cfg.query_groups, max(tp // cfg.query_groups, 1)
    k, v = (x.unflatten(0, (G, -1)).repeat_interleave(dup, 0).flatten(0, 1) for x in (k, v))
    return torch.cat([tp_shard(x, 0, tp, tp_rank) for x in (q, k, v)])


def _same(name: str, parts: list[torch.Tensor]) -> torch.Tensor:
    for r, p in enumerate(parts[1:], 1):
        if not torch.equal(p, parts[0]):
            raise MlmError(
                f"{name} differs between tp rank 0 and tp rank {r}; every tp rank must hold the same"
            )
    return parts[0]


def gather(
    name: str, rule: Rule, parts: list[torch.Tensor], cfg: ModelConfig, tp: int
) -> tuple[torch.Tensor, ...]:
    """The global mlm tensor(s) of `sources(rule)` from every tp rank's `name` (the inverse of
    `shard`). Vocabulary rows come back as the real vocabulary (no padding)."""
    if rule.split in (WHOLE, EMBED):
        return (_same(name, parts),)
    if rule.split == LM_HEAD:
        return (tp_join(parts, 0)[: cfg.vocab_size],)
    if rule.split in _DIM:
        return (tp_join(parts, _DIM[rule.split]),)
    if rule.split == EXPERT_FC:
        return tp_join_pair(parts, 1)
    assert rule.split == QKV, rule
    K, H, G = cfg.head_dim, cfg.num_attention_heads, cfg.query_groups
    kv_rows, dup = max(G // tp, 1) * K, max(tp // G, 1)  # ranks g·dup … (g+1)·dup − 1 hold KV head g
    qs, ks, vs = zip(*(p.split([H // tp * K, kv_rows, kv_rows]) for p in parts), strict=True)
    k, v = (
        [_same(f"{name} ({x} of KV head {g})", list(xs[g * dup : (g + 1) * dup])) for g in range(tp // dup)]
        for x, xs in (("k", ks), ("v", vs))
    )
    return torch.cat(qs), torch.cat(k), torch.cat(v)


def fixed_dtypes(arch: str, cfg: ModelConfig) -> dict[str, str]:
    """mlm key → the TensorRT-LLM dtype it is stored in whatever config.json's dtype (Mixtral's
    router: float32, as TensorRT-LLM's MoE layer declares it)."""
    return {
        key: rule.dtype
        for rule in LAYER_RULES[arch]
        if rule.dtype
        for layer in range(cfg.num_layers)
        for key in sources(rule, layer, cfg)
    }
