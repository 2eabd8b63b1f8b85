"""TensorRT-LLM's checkpoint layout for mlm's models: tensor names and per-rank slices, both ways.

Followed from TensorRT-LLM's own converters; docs/formats.md ("TensorRT-LLM checkpoint") gives
the sources with their commits, the folder, the name table and each tensor's per-rank split. In
short: rank = pp_rank × tp + tp_rank; stage p holds layers `tensor_split(range(L), pp)[p]`,
renumbered from 0; the fused `attention.qkv` of tp rank r is its q heads, then k, then v (KV heads
repeated when fewer than tp); Llama's `mlp.fc` is mlm's gate and `mlp.gate` mlm's up (the names
cross); Mixtral's `mlp.fc` [E, 2F, D] is each expert's up then gate, each split over tp along F.

Shape legend: V vocabulary, D hidden, H heads, G KV heads, K head dim, F ffn (an expert's under
MoE), L layers, E experts.
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


def _r(trt: str, split: str, *mlm: str, dtype: str | None = None) -> Rule:
    return Rule(trt, mlm, split, dtype)


_L = "transformer.layers.{}."
_QKV = ("layers.{}.attn.q", "layers.{}.attn.k", "layers.{}.attn.v")

_LLAMA_ATTENTION = (
    _r(_L + "input_layernorm.weight", WHOLE, "layers.{}.attn_norm.weight"),
    _r(_L + "attention.qkv.weight", QKV, *(f"{k}.weight" for k in _QKV)),
    _r(_L + "attention.dense.weight", ROW, "layers.{}.attn.out.weight"),
    _r(_L + "post_layernorm.weight", WHOLE, "layers.{}.mlp_norm.weight"),
)
LAYER_RULES = {
    LLAMA: (
        *_LLAMA_ATTENTION,
        _r(_L + "mlp.fc.weight", COLUMN, "layers.{}.mlp.gate.weight"),  # silu(fc(x)) · gate(x)
        _r(_L + "mlp.gate.weight", COLUMN, "layers.{}.mlp.up.weight"),
        _r(_L + "mlp.proj.weight", ROW, "layers.{}.mlp.down.weight"),
    ),
    MIXTRAL: (
        *_LLAMA_ATTENTION,
        _r(_L + "mlp.router.weight", WHOLE, "layers.{}.mlp.router.weight", dtype="float32"),
        _r(
            _L + "mlp.fc.weight",
            EXPERT_FC,
            "layers.{}.mlp.experts.up.weight",
            "layers.{}.mlp.experts.gate.weight",
        ),
        _r(_L + "mlp.proj.weight", EXPERT_PROJ, "layers.{}.mlp.experts.down.weight"),
    ),
    GPT: (
        _r(_L + "input_layernorm.weight", WHOLE, "layers.{}.attn_norm.weight"),
        _r(_L + "input_layernorm.bias", WHOLE, "layers.{}.attn_norm.bias"),
        _r(_L + "attention.qkv.weight", QKV, *(f"{k}.weight" for k in _QKV)),
        _r(_L + "attention.qkv.bias", QKV, *(f"{k}.bias" for k in _QKV)),
        _r(_L + "attention.dense.weight", ROW, "layers.{}.attn.out.weight"),
        _r(_L + "attention.dense.bias", WHOLE, "layers.{}.attn.out.bias"),
        _r(_L + "post_layernorm.weight", WHOLE, "layers.{}.mlp_norm.weight"),
        _r(_L + "post_layernorm.bias", WHOLE, "layers.{}.mlp_norm.bias"),
        _r(_L + "mlp.fc.weight", COLUMN, "layers.{}.mlp.up.weight"),
        _r(_L + "mlp.fc.bias", COLUMN, "layers.{}.mlp.up.bias"),
        _r(_L + "mlp.proj.weight", ROW, "layers.{}.mlp.down.weight"),
        _r(_L + "mlp.proj.bias", WHOLE, "layers.{}.mlp.down.bias"),
    ),
}
FIRST_RULES = {
    LLAMA: (_r("transformer.vocab_embedding.weight", EMBED, "embed.weight"),),
    MIXTRAL: (_r("transformer.vocab_embedding.weight", EMBED, "embed.weight"),),
    GPT: (
        _r("transformer.vocab_embedding.weight", EMBED, "embed.weight"),
        _r("transformer.position_embedding.weight", WHOLE, "pos_embed.weight"),
    ),
}
# lm_head's source is output.weight, or embed.weight when the embeddings are tied (see sources)
LAST_RULES = {
    LLAMA: (
        _r("transformer.ln_f.weight", WHOLE, "final_norm.weight"),
        _r("lm_head.weight", LM_HEAD, "output.weight"),
    ),
    MIXTRAL: (
        _r("transformer.ln_f.weight", WHOLE, "final_norm.weight"),
        _r("lm_head.weight", LM_HEAD, "output.weight"),
    ),
    GPT: (
        _r("transformer.ln_f.weight", WHOLE, "final_norm.weight"),
        _r("transformer.ln_f.bias", WHOLE, "final_norm.bias"),
        _r("lm_head.weight", LM_HEAD, "output.weight"),
    ),
}


def stage_layers(num_layers: int, pp: int, pp_rank: int) -> list[int]:
    """The global layers of pipeline stage `pp_rank` (TensorRT-LLM's `Mapping.pp_layers`)."""
    base, extra = divmod(num_layers, pp)
    start = pp_rank * base + min(pp_rank, extra)
    return list(range(start, start + base + (pp_rank < extra)))


def rank_rules(
    arch: str, cfg: ModelConfig, tp: int, pp: int, rank: int
) -> list[tuple[str, Rule, int | None]]:
    """(TensorRT-LLM name, rule, global layer or None) of every tensor in `rank{rank}.safetensors`."""
    pp_rank = rank // tp
    out: list[tuple[str, Rule, int | None]] = []
    if pp_rank == 0:
        out += [(r.trt, r, None) for r in FIRST_RULES[arch]]
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


_DIM = {COLUMN: 0, ROW: 1, EXPERT_PROJ: 2}
"""The dim each plain tensor-parallel split cuts."""


def lm_head_rows(vocab: int, tp: int) -> int:
    """Rows of lm_head on each tp rank: the vocabulary padded to a multiple of tp, split."""
    return math.ceil(vocab / tp)


def _kv_heads(cfg: ModelConfig, tp: int, tp_rank: int) -> slice:
    """KV heads on tp rank `tp_rank` (one repeated head when there are fewer heads than ranks)."""
    G = cfg.query_groups
    if G < tp:
        g = tp_rank * G // tp
        return slice(g, g + 1)
    return slice(tp_rank * G // tp, (tp_rank + 1) * G // tp)


def shard(rule: Rule, tensors: list[torch.Tensor], cfg: ModelConfig, tp: int, tp_rank: int) -> torch.Tensor:
    """Tp rank `tp_rank`'s tensor for `rule`, from the global mlm tensors of `sources`."""
    t = tensors[0]
    if rule.split == WHOLE:
        return t
    if rule.split == EMBED:
        return t[: cfg.vocab_size]
    if rule.split in _DIM:
        return tp_shard(t, _DIM[rule.split], tp, tp_rank)
    if rule.split == EXPERT_FC:  # [E, F, D] up, gate → this rank's [E, 2F/tp, D]
        return tp_shard_pair(*tensors, 1, tp, tp_rank)
    if rule.split == LM_HEAD:
        rows = lm_head_rows(cfg.vocab_size, tp)
        start = tp_rank * rows
        part = t[start : min(start + rows, cfg.vocab_size)]
        pad = part.new_zeros(rows - part.shape[0], *part.shape[1:])
        return torch.cat([part, pad])  # a new tensor: never shares memory with the embedding
    assert rule.split == QKV, rule
    K = cfg.head_dim
    q, k, v = (x.view(-1, K, *x.shape[1:]) for x in tensors)  # [heads, K, (D)]
    kv = _kv_heads(cfg, tp, tp_rank)
    parts = (q.chunk(tp, 0)[tp_rank], k[kv], v[kv])
    return torch.cat([p.reshape(-1, *p.shape[2:]) for p in parts])


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
    local_kv = max(G // tp, 1)
    qs, ks, vs = zip(*(p.split([H // tp * K, local_kv * K, local_kv * K]) for p in parts), strict=True)
    if G >= tp:
        return torch.cat(qs), torch.cat(ks), torch.cat(vs)
    dup = tp // G  # ranks g·dup … (g+1)·dup − 1 hold KV head g
    k_heads = [_same(f"{name} (k of KV head {g})", list(ks[g * dup : (g + 1) * dup])) for g in range(G)]
    v_heads = [_same(f"{name} (v of KV head {g})", list(vs[g * dup : (g + 1) * dup])) for g in range(G)]
    return torch.cat(qs), torch.cat(k_heads), torch.cat(v_heads)


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
