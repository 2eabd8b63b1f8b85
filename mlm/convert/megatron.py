"""`mlm convert from-megatron DIR OUT`: a Megatron-core `torch_dist` checkpoint (or Megatron-LM's
legacy per-rank layout, `--ckpt-format torch`: `mlm.convert.megatron_legacy`) → mlm checkpoint.

    import_megatron("megatron/save", "ckpt/from-megatron", ["model.num_attention_heads=32", ...])

Reads the weights of a Megatron-core `GPTModel` (local or Transformer Engine spec, dense or MoE,
multi-latent attention, multi-token prediction depths; saved at any tp / pp / ep: torch_dist
stores global tensors) with `mlm.convert.megatron_dcp`, maps
Megatron's sharded keys to mlm's names (the table `_LAYER` below), splits the fused tensors, and writes
an mlm checkpoint with `save_streaming` (chunk checksums, the config in the manifest): iteration 0
with the weights, or Megatron's iteration with the optimizer state too (below).

Layouts: all layers of a homogeneous stack share one key `decoder.layers.<sub>` with the layer on a
leading axis (heterogeneous stacks save `decoder.layers.<n>.<sub>`; both are read); experts add a
global-expert axis (`decoder.layers.mlp.experts.experts.linear_fc1.weight` is [L, E, 2F, H]);
`linear_qkv` holds, for each query group, that group's query heads, then its key head, then its
value head; `linear_fc1` of a gated MLP is [gate; up]. Norms appear under the names torch_dist gives
both specs (`self_attention.linear_qkv.layer_norm_weight`, `mlp.linear_fc1.layer_norm_weight`) or
as `input_layernorm` / `pre_mlp_layernorm` (Transformer Engine MoE layers). RoPE is rotate-half on
both sides (Megatron's default `rotary_interleaved=False`), so q and k are not permuted; MLA's
rope dims are interleaved pairs on both (`_mla_args`).

The model config: structural fields read off the tensor shapes (layers, width, MLP and expert
widths, experts, biases, tied output, LayerNorm vs RMSNorm, qk norms; query groups and head dim
once the heads are known), then the `args` that
Megatron-LM saves in `common.pt` (in each rank file of the legacy layout), read with the allow-list of
`mlm.convert.megatron_pickle` (the fields of `_ARGS`, and those `_args_overrides` and `_mla_args`
read or refuse; docs/convert.md lists them), then the
user's `--set model.*` (or `preset=`), each over the one before. Every tensor's shape is checked
against `GPT(config)` before anything is written. Megatron-LM's `iteration` and
`consumed_train_samples` are recorded in the manifest's `source`. Where the checkpoint holds
the distributed optimizer's state (Megatron-LM's default; torch_dist, or the legacy
`distrib_optim.pt`), its Adam moments go through the same table and splits into the "optim" group and the mlm checkpoint continues the run
(`mlm.convert.megatron_optim`); with `weights_only` (or without optimizer state) `mlm train --load`
starts a new run from the weights. Not read: RNG states, Transformer Engine `_extra_state`.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from mlm.config import Config, DataConfig, ModelConfig, load_config, toml_value
from mlm.convert.common import Progress, Report, check_finite_logits, noop, write_import
from mlm.convert.megatron_dcp import MegatronCheckpoint, checkpoint_dir, iteration_dir
from mlm.convert.megatron_legacy import LegacyCheckpoint, is_legacy
from mlm.errors import MlmError
from mlm.fileio import check_new_dir, staged_dir
from mlm.model.gpt import GPT

_TOP = {
    "embedding.word_embeddings.weight": "embed.weight",
    "embedding.position_embeddings.weight": "pos_embed.weight",
    "decoder.final_layernorm.weight": "final_norm.weight",
    "decoder.final_layernorm.bias": "final_norm.bias",
    "output_layer.weight": "output.weight",
}
"""Megatron keys outside the layers → mlm keys."""

_LAYER = {
    "self_attention.linear_qkv.layer_norm_weight": "attn_norm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "attn_norm.bias",
    "input_layernorm.weight": "attn_norm.weight",
    "input_layernorm.bias": "attn_norm.bias",
    "self_attention.linear_qkv.weight": "qkv",
    "self_attention.linear_qkv.bias": "qkv",
    "self_attention.linear_proj.weight": "attn.out.weight",
    "self_attention.linear_proj.bias": "attn.out.bias",
    "self_attention.q_layernorm.weight": "attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "attn.k_norm.weight",
    "self_attention.linear_q_proj.weight": "attn.q.weight",
    "self_attention.linear_q_down_proj.weight": "attn.q_down.weight",
    "self_attention.linear_q_up_proj.layer_norm_weight": "attn.q_norm.weight",
    "self_attention.linear_q_up_proj.weight": "attn.q_up.weight",
    "self_attention.linear_kv_down_proj.weight": "attn.kv_down.weight",
    "self_attention.kv_layernorm.weight": "attn.kv_norm.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "attn.kv_norm.weight",
    "self_attention.linear_kv_up_proj.weight": "attn.kv_up.weight",
    "mlp.linear_fc1.layer_norm_weight": "mlp_norm.weight",
    "mlp.linear_fc1.layer_norm_bias": "mlp_norm.bias",
    "pre_mlp_layernorm.weight": "mlp_norm.weight",
    "pre_mlp_layernorm.bias": "mlp_norm.bias",
    "mlp.linear_fc1.weight": "fc1:mlp",
    "mlp.linear_fc1.bias": "fc1:mlp",
    "mlp.linear_fc2.weight": "mlp.down.weight",
    "mlp.linear_fc2.bias": "mlp.down.bias",
    "mlp.router.weight": "mlp.router.weight",
    "mlp.router.expert_bias": "mlp.router.expert_bias",
    "mlp.experts.experts.linear_fc1.weight": "fc1:mlp.experts",
    "mlp.experts.experts.linear_fc2.weight": "mlp.experts.down.weight",
    "mlp.shared_experts.linear_fc1.weight": "fc1:mlp.shared",
    "mlp.shared_experts.linear_fc2.weight": "mlp.shared.down.weight",
    "mlp.shared_experts.gate_weight": "mlp.shared_gate.weight",
}
"""Megatron sub-keys of a layer (after `decoder.layers.`) → the mlm key under `layers.N.`; `qkv`:
split into attn.{q,k,v}; `fc1:P`: [gate; up] into P.gate and P.up (P.up alone when not gated).
Multi-latent attention (MLASelfAttention) has mlm's layouts as they are: linear_q_proj /
linear_q_up_proj rows per head [nope; rope], linear_kv_down_proj rows [latent; shared rope key],
linear_kv_up_proj rows per head [k nope; v]; its latent norms are q_layernorm / kv_layernorm (local
spec) or fused into linear_q_up_proj / linear_kv_up_proj (Transformer Engine spec)."""

_MLA_SUBS = tuple(sub for sub in _LAYER if ".linear_q_" in sub or "kv_" in sub)
"""The sub-keys of multi-latent attention (with linear_proj, shared with linear_qkv's attention)."""

_MTP = {
    "enorm.weight": "enorm.weight",
    "enorm.bias": "enorm.bias",
    "hnorm.weight": "hnorm.weight",
    "hnorm.bias": "hnorm.bias",
    "eh_proj.weight": "eh_proj.weight",
    "final_layernorm.weight": "final_norm.weight",
    "final_layernorm.bias": "final_norm.bias",
}
"""Megatron sub-keys of multi-token prediction depth d (after `mtp.layers.<d>.`) → mlm keys under
`mtp.<d>.`; its `transformer_layer.<sub>` is one layer named as `_LAYER` names a layer's sub-keys
(no stacked axis), mlm's `mtp.<d>.layer.`. eh_proj is [D, 2D], input [embedding; hidden] as mlm's."""

_ARGS = {
    "num_attention_heads": "num_attention_heads",
    "kv_channels": "kv_channels",
    "max_position_embeddings": "max_position_embeddings",
    "norm_epsilon": "norm_eps",
    "rotary_base": "rope_base",
    "make_vocab_size_divisible_by": "make_vocab_size_divisible_by",
    "hidden_dropout": "hidden_dropout",
    "attention_dropout": "attention_dropout",
    "init_method_std": "init_std",
    "moe_router_topk": "moe.router_topk",
    "moe_router_score_function": "moe.router_score_function",
    "moe_router_pre_softmax": "moe.router_pre_softmax",
    "moe_router_num_groups": "moe.router_num_groups",
    "moe_router_group_topk": "moe.router_group_topk",
    "moe_router_topk_scaling_factor": "moe.router_topk_scaling_factor",
    "moe_router_enable_expert_bias": "moe.router_enable_expert_bias",
    "moe_router_bias_update_rate": "moe.router_bias_update_rate",
    "moe_z_loss_coeff": "moe.z_loss_coeff",
    "moe_expert_capacity_factor": "moe.capacity_factor",
    "moe_pad_expert_input_to_capacity": "moe.pad_to_capacity",
    "moe_token_drop_policy": "moe.token_drop_policy",
    "mtp_num_layers": "mtp_num_layers",
    "mtp_loss_scaling_factor": "mtp_loss_scaling_factor",
}
"""Megatron-LM `args` fields read from common.pt → mlm `model.` fields, same meaning and unit (plus,
in `_args_overrides`: num_query_groups when group_query_attention, position_embedding_type,
normalization, swiglu (exact GELU otherwise), use_rope_scaling with rope_scaling_factor, the aux-loss
coefficient by moe_router_load_balancing_type, and vocab_size; and the args it refuses)."""

_REFUSED_ARGS = {
    "rotary_interleaved": "interleaved RoPE (mlm rotates halves)",
    "apply_layernorm_1p": "zero-centered norm weights (1 + weight)",
    "squared_relu": "the squared-ReLU MLP",
    "apply_residual_connection_post_layernorm": "residuals taken after the norm",
    "layernorm_zero_centered_gamma": "zero-centered norm weights (1 + weight)",
    "qk_l2_norm": "L2-normalized queries and keys",
    "attention_output_gate": "a gate on the attention output",
    "experimental_attention_variant": "another attention (gated delta net, DSA)",
    "glu_linear_offset": "an offset added to the GLU's linear half",
    "activation_func_clamp_value": "clamped activations",
    "moe_apply_probs_on_input": "router probabilities applied to the experts' input",
    "moe_router_force_load_balancing": "forced (random) expert routing",
}
"""Megatron-LM args (when set) whose model mlm's importer does not reproduce, with what they mean
(args built from TransformerConfig's fields included: each changes the logits of the same weights)."""


def _split_key(key: str) -> tuple[int | None, str]:
    """`decoder.layers.<n>.<sub>` → (n, sub); `decoder.layers.<sub>` (stacked) → (None, sub)."""
    rest = key.removeprefix("decoder.layers.")
    head, _, tail = rest.partition(".")
    return (int(head), tail) if head.isdigit() else (None, rest)


def _mtp_key(key: str) -> tuple[int, str] | None:
    """`mtp.layers.<d>.<rest>` → (d, rest); None for any other key."""
    if not key.startswith("mtp.layers."):
        return None
    head, _, rest = key.removeprefix("mtp.layers.").partition(".")
    return (int(head), rest) if head.isdigit() else None


def _known_mtp(key: str) -> bool:
    mtp = _mtp_key(key)
    if mtp is None:
        return False
    rest = mtp[1]
    return rest in _MTP or (
        rest.startswith("transformer_layer.") and rest.removeprefix("transformer_layer.") in _LAYER
    )


def _mtp_depths(ckpt: MegatronCheckpoint) -> int:
    """How many MTP depths the checkpoint holds (`mtp.layers.<d>.*`)."""
    return len({m[0] for m in map(_mtp_key, ckpt.tensors) if m is not None})


def _known(ckpt: MegatronCheckpoint) -> None:
    """MlmError naming the first Megatron key mlm has no mapping for, or the GPTModel parts it lacks."""
    if "tok_embeddings.weight" in ckpt.tensors:
        raise MlmError(
            f"{ckpt.path}: a torchtitan checkpoint (tok_embeddings.weight, layers.N.*), not a Megatron one: "
            f"import it with mlm convert from-torchtitan {ckpt.path} OUT"
        )
    for key in ckpt.tensors:
        if key in _TOP:
            continue
        if key.startswith("decoder.layers.") and _split_key(key)[1] in _LAYER:
            continue
        if _known_mtp(key):
            continue
        raise MlmError(
            f"{ckpt.path}: Megatron module {key!r} is not supported by mlm convert from-megatron (it reads "
            "GPTModel's embedding, self_attention (linear_qkv, linear_proj, q/k_layernorm, or multi-latent "
            "attention's linear_q*/kv* projections and latent norms), dense mlp, MoE router / experts / "
            "shared_experts, norms, output_layer and MTP depths; not other specs)"
        )
    subs = {_split_key(k)[1] for k in ckpt.tensors if k.startswith("decoder.layers.")}
    mla = "self_attention.linear_kv_down_proj.weight" in subs
    needed = (
        "embedding.word_embeddings.weight",
        "self_attention.linear_kv_down_proj.weight" if mla else "self_attention.linear_qkv.weight",
        "self_attention.linear_proj.weight",
    )
    lacking = [n for n in needed if n not in ckpt.tensors and n not in subs]
    if lacking:
        raise MlmError(
            f"{ckpt.path}: not a Megatron GPTModel checkpoint: no {', '.join(lacking)} (it holds "
            f"{', '.join(list(ckpt.tensors)[:4]) or 'no tensors'}{' …' if len(ckpt.tensors) > 4 else ''})"
        )


def _legacy_tp(ckpt: LegacyCheckpoint) -> None:
    """MlmError for a legacy checkpoint saved at tp > 1 that holds MLA or MTP tensors: its reader
    joins the tp shards of the embeddings, linear_qkv, linear_fc1, linear_proj and linear_fc2 only."""
    args = ckpt.common().get("args")
    tp = getattr(args, "tensor_model_parallel_size", None) or 1
    odd = [k for k in ckpt.tensors if _mtp_key(k) is not None or _split_key(k)[1] in _MLA_SUBS]
    if tp > 1 and odd:
        raise MlmError(
            f"{ckpt.path}: a legacy (--ckpt-format torch) checkpoint saved at tp {tp} with {odd[0]}: mlm joins "
            "the tp shards of multi-latent attention and MTP depths from torch_dist only; have Megatron-LM "
            "rewrite it as torch_dist (--ckpt-convert-format torch_dist --ckpt-convert-save DIR) and import that"
        )


def _layers(ckpt: MegatronCheckpoint) -> tuple[int, dict[int, set[str]]]:
    """(number of layers, {layer: its sub-keys})."""
    subs: dict[int, set[str]] = {}
    for key in ckpt.tensors:
        if not key.startswith("decoder.layers."):
            continue
        n, sub = _split_key(key)
        for i in [n] if n is not None else range(ckpt.shape(key)[0]):
            subs.setdefault(i, set()).add(sub)
    absent = sorted(set(range(max(subs, default=-1) + 1)) - set(subs))
    if absent:
        raise MlmError(
            f"{ckpt.path}: holds decoder.layers.{max(subs)} but no tensor of layer {absent[0]}"
            f"{f' (nor of {len(absent) - 1} more)' if len(absent) > 1 else ''}: an incomplete checkpoint; "
            "copy the whole iteration folder as Megatron-LM wrote it"
        )
    return len(subs), subs


def _shape_overrides(ckpt: MegatronCheckpoint) -> list[str]:
    """model.* fields that the tensor shapes determine, as --set strings."""

    def shape(sub: str) -> tuple[int, ...] | None:
        """One layer's shape of `sub`, from the stacked key or the first per-layer key holding it."""
        for key in ckpt.tensors:
            n, s = _split_key(key) if key.startswith("decoder.layers.") else (None, None)
            if s == sub:
                return ckpt.shape(key) if n is not None else ckpt.shape(key)[1:]
        return None

    num_layers, subs = _layers(ckpt)
    moe = [int("mlp.router.weight" in subs[i]) for i in range(num_layers)]
    hidden = ckpt.shape("embedding.word_embeddings.weight")[1]
    out = {
        "num_layers": num_layers,
        "hidden_size": hidden,
        "tie_embeddings": "output_layer.weight" not in ckpt.tensors,
        "position_embedding": "learned" if "embedding.position_embeddings.weight" in ckpt.tensors else "rope",
        "normalization": "layernorm" if "decoder.final_layernorm.bias" in ckpt.tensors else "rmsnorm",
        "add_bias": shape("self_attention.linear_proj.bias") is not None,
        "qkv_bias": shape("self_attention.linear_qkv.bias") is not None,
        "qk_norm": shape("self_attention.q_layernorm.weight") is not None,
    }
    if _mtp_depths(ckpt):
        out["mtp_num_layers"] = _mtp_depths(ckpt)
    if out["normalization"] == "layernorm":
        out["activation"] = "gelu"  # a GPT-2-like model; swiglu from args or --set otherwise
    kv_down = shape("self_attention.linear_kv_down_proj.weight")
    if kv_down is not None:  # multi-latent attention: q_layernorm is its query latent's norm
        latent = shape("self_attention.linear_kv_up_proj.weight")[1]
        out |= {"attention_kind": "mla", "qk_norm": False, "mla.kv_lora_rank": latent}
        out["mla.qk_rope_head_dim"] = kv_down[0] - latent
        q_down = shape("self_attention.linear_q_down_proj.weight")
        if q_down is not None:
            out["mla.q_lora_rank"] = q_down[0]
    fc2 = shape("mlp.linear_fc2.weight")
    if fc2 is not None:
        out["ffn_hidden_size"] = fc2[1]
    if any(moe):
        out["mlp_kind"] = "moe"
        out["mlp_kind_freq"] = 1 if all(moe) else moe
        experts = shape("mlp.experts.experts.linear_fc2.weight")
        out["moe.num_experts"], out["moe.ffn_hidden_size"] = experts[0], experts[2]
        shared = shape("mlp.shared_experts.linear_fc2.weight")
        if shared is not None:
            out["moe.shared_expert_ffn_hidden_size"] = shared[1]
            out["moe.shared_expert_gate"] = shape("mlp.shared_experts.gate_weight") is not None
        if shape("mlp.router.expert_bias") is not None:
            out["moe.router_enable_expert_bias"] = True
            out["moe.router_score_function"] = "sigmoid"
    return [f"model.{k}={toml_value(v)}" for k, v in out.items()]


def _args_overrides(common: dict) -> list[str]:
    """model.* fields from Megatron-LM's saved `args` (a Namespace in common.pt), as --set strings."""
    args = vars(common["args"]) if hasattr(common.get("args"), "__dict__") else {}
    for name, what in _REFUSED_ARGS.items():
        if args.get(name):
            raise MlmError(
                f"Megatron args {name}={args[name]!r}: {what} is not imported by mlm convert from-megatron"
            )
    if args.get("window_size") not in (None, (-1, -1), [-1, -1]):
        raise MlmError(
            f"Megatron args window_size={args['window_size']!r}: sliding-window attention is not imported by "
            "mlm convert from-megatron (mlm attends to the whole causal context)"
        )
    nope = args.get("no_rope_freq")
    if nope and (not isinstance(nope, list) or any(nope)):
        raise MlmError(
            f"Megatron args no_rope_freq={nope!r}: layers without RoPE are not imported by mlm convert "
            "mlm convert from-megatron (mlm applies RoPE in every layer)"
        )
    if args.get("rotary_percent", 1.0) != 1.0:
        raise MlmError(
            f"Megatron args rotary_percent={args['rotary_percent']}: mlm rotates the whole head (1.0) only"
        )
    kind = args.get("position_embedding_type")
    if args.get("multi_latent_attention") and kind == "none":  # MLA applies its own RoPE either way
        kind = "rope"
    if kind not in (None, "rope", "learned_absolute"):
        raise MlmError(
            f"Megatron args position_embedding_type={kind!r}: mlm imports 'rope' and 'learned_absolute' only"
        )
    out = {ours: args[theirs] for theirs, ours in _ARGS.items() if args.get(theirs) is not None}
    if args.get("group_query_attention") and args.get("num_query_groups"):
        out["num_query_groups"] = args["num_query_groups"]
    if kind is not None:
        out["position_embedding"] = "rope" if kind == "rope" else "learned"
    if args.get("normalization") in ("RMSNorm", "LayerNorm"):
        out["normalization"] = args["normalization"].lower()
    if "swiglu" in args:  # args.openai_gelu is not read: it reaches Megatron-LM's legacy models only,
        # never megatron-core's GPTModel (core_transformer_config_from_args), which computes exact GELU
        out["activation"] = "swiglu" if args["swiglu"] else "gelu"
    if args.get("use_rope_scaling"):  # Llama 3.1's scaling; Megatron fixes the other three constants
        out |= {"rope_scaling_factor": args.get("rope_scaling_factor", 8.0), "rope_scaling_type": "llama3"}
        out |= {"rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0}
        out["rope_original_max_position_embeddings"] = 8192
    # one type and coefficient, or lists of equal length (Megatron-LM unwraps one-element lists)
    kinds, coeffs = (args.get(n) for n in ("moe_router_load_balancing_type", "moe_aux_loss_coeff"))
    kinds, coeffs = ([v] if not isinstance(v, list | tuple) else list(v) for v in (kinds, coeffs))
    for kind, coeff in zip(kinds, coeffs, strict=False):
        if coeff and kind in ("aux_loss", "seq_aux_loss"):
            out[f"moe.{'seq_' if kind == 'seq_aux_loss' else ''}aux_loss_coeff"] = coeff
    if args.get("vocab_size"):
        out["vocab_size"] = args["vocab_size"]
    if args.get("multi_latent_attention"):  # kv_channels (hidden / heads, always saved) is not MLA's
        out.pop("kv_channels", None)
        out |= _mla_args(args)
    return [f"model.{k}={toml_value(v)}" for k, v in out.items()]


_MLA_ARGS = {
    "q_lora_rank": "mla.q_lora_rank",
    "kv_lora_rank": "mla.kv_lora_rank",
    "qk_head_dim": "mla.qk_nope_head_dim",
    "qk_pos_emb_head_dim": "mla.qk_rope_head_dim",
    "v_head_dim": "mla.v_head_dim",
}
"""Megatron-LM's MLA args → mlm `model.` fields (Megatron's qk_head_dim is the part without RoPE)."""


def _mla_args(args: dict) -> dict:
    """mlm fields for a run with --multi-latent-attention: the MLA dims, interleaved RoPE on the
    rope dims (Megatron's MLA always applies RoPE to the de-interleaved pairs: `multi_latent_attention`
    in `_apply_rotary_pos_emb_bshd`), and its YaRN (`--rope-type`, default yarn for MLA), with the
    constants Megatron-LM has no arguments for (MLATransformerConfig's original_max_position_embeddings
    4096, beta_fast 32, beta_slow 1). MlmError where mlm's model differs: no latent norms, or an
    attention factor / softmax scale that mlm's YaRN fields cannot express."""
    if args.get("qk_layernorm") is False:
        raise MlmError(
            "Megatron args multi_latent_attention=True with qk_layernorm=False: that MLA has no latent norms "
            "(q_layernorm / kv_layernorm are identities); mlm's MLA normalises the latents (DeepSeek's), so "
            "it is not imported"
        )
    out = {ours: args[theirs] for theirs, ours in _MLA_ARGS.items() if args.get(theirs) is not None}
    out |= {"attention_kind": "mla", "position_embedding": "rope", "mla.rope_interleave": True}
    rope_type = args.get("rope_type") or "yarn"  # MLATransformerConfig's default
    factor = args.get("rotary_scaling_factor") or 1.0
    mscale, mscale_all = args.get("mscale", 1.0), args.get("mscale_all_dim", 0.0)
    if factor > 1 and mscale_all and rope_type == "rope":
        raise MlmError(
            f"Megatron args rope_type='rope' with rotary_scaling_factor={factor}, mscale_all_dim={mscale_all}: "
            "Megatron scales that MLA's softmax by YaRN's mscale without YaRN frequencies, which mlm does "
            "not; it is not imported"
        )
    if rope_type == "yarn" and factor > 1:
        if not (mscale and mscale_all) and not (mscale_all == 0 and mscale == 1):
            raise MlmError(
                f"Megatron args mscale={mscale}, mscale_all_dim={mscale_all}: Megatron's YaRN multiplies cos "
                "and sin by mscale(factor, mscale) / mscale(factor, mscale_all_dim); mlm's fields give that "
                "for both set, or mscale 1 with mscale_all_dim 0, only"
            )
        out |= {"rope_scaling_factor": factor, "rope_scaling_type": "yarn", "rope_yarn_mscale": mscale}
        out |= {"rope_yarn_mscale_all_dim": mscale_all, "rope_original_max_position_embeddings": 4096}
        out |= {"rope_yarn_beta_fast": 32.0, "rope_yarn_beta_slow": 1.0}
    return out


def _training_position(common: dict) -> dict:
    """Megatron-LM's `iteration` and `args.consumed_train_samples` where common.pt has them, for the
    manifest's `source` (a record; where the optimizer state is carried, `resumed_run` also makes
    them the mlm run's iteration and consumed samples)."""
    args = vars(common["args"]) if hasattr(common.get("args"), "__dict__") else {}
    found = {
        "iteration": common.get("iteration"),
        "consumed_train_samples": args.get("consumed_train_samples"),
    }
    return {k: int(v) for k, v in found.items() if isinstance(v, int)}


def _split_qkv(w: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, ...]:
    """Megatron's [G·(H/G + 2)·K, …] (per group: its queries, key, value) → q [H·K, …], k, v [G·K, …]."""
    groups, per, k = cfg.query_groups, cfg.num_attention_heads // cfg.query_groups, cfg.head_dim
    w = w.reshape(groups, (per + 2) * k, *w.shape[1:])
    q, kk, v = w.split([per * k, k, k], dim=1)
    return tuple(t.reshape(-1, *w.shape[2:]).contiguous() for t in (q, kk, v))


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """The inverse of `_split_qkv`: q [H·K, …], k, v [G·K, …] → Megatron's [G·(H/G + 2)·K, …]."""
    rest = q.shape[1:]
    parts = [t.reshape(cfg.query_groups, -1, *rest) for t in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def _fc1_axis(name: str) -> int:
    """The axis of [gate; up] in a `fc1:P` tensor of one layer: 1 under the expert axis, else 0."""
    return 1 if name == "fc1:mlp.experts" else 0


def _mlm_tensors(ckpt: MegatronCheckpoint, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(mlm key, tensor) for every tensor of the checkpoint, one Megatron key read at a time."""
    for key in ckpt.tensors:
        tensor = ckpt.read(key)
        if key in _TOP:
            yield _TOP[key], tensor
            continue
        mtp = _mtp_key(key)
        if mtp is not None:
            d, rest = mtp
            if rest in _MTP:
                yield f"mtp.{d}.{_MTP[rest]}", tensor.contiguous()
            else:
                yield from _layer_tensors(
                    f"mtp.{d}.layer.", rest.removeprefix("transformer_layer."), tensor, cfg
                )
            continue
        n, sub = _split_key(key)
        per_layer = [(n, tensor)] if n is not None else list(enumerate(tensor))
        for i, t in per_layer:
            yield from _layer_tensors(f"layers.{i}.", sub, t, cfg)


def _layer_tensors(
    prefix: str, sub: str, t: torch.Tensor, cfg: ModelConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """(mlm key, tensor) of one layer's Megatron sub-key `sub`, under the mlm layer `prefix`."""
    name, suffix = _LAYER[sub], sub.rsplit(".", 1)[1]
    if name == "qkv":
        for proj, part in zip("qkv", _split_qkv(t, cfg), strict=True):
            yield f"{prefix}attn.{proj}.{suffix}", part
    elif name.startswith("fc1:"):
        mlp, axis = name[4:], _fc1_axis(name)
        if cfg.activation == "swiglu":
            gate, up = t.chunk(2, dim=axis)
            yield f"{prefix}{mlp}.gate.{suffix}", gate.contiguous()
            yield f"{prefix}{mlp}.up.{suffix}", up.contiguous()
        else:
            yield f"{prefix}{mlp}.up.{suffix}", t.contiguous()
    else:
        yield f"{prefix}{name}", t.contiguous()


def _expected_shapes(cfg: ModelConfig, padded_vocab: int) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in GPT(cfg, padded_vocab).state_dict().items()}


def _check_shapes(ckpt: MegatronCheckpoint, cfg: ModelConfig, padded_vocab: int) -> None:
    """MlmError naming the first tensor whose shape (after the splits) differs from GPT(cfg)'s."""
    expected = _expected_shapes(cfg, padded_vocab)
    seen = set()
    for key, shape in _mlm_shapes(ckpt, cfg):
        seen.add(key)
        if expected.get(key) != shape:
            raise MlmError(
                f"{ckpt.path}: tensor {key} has shape {list(shape)} but the model config gives "
                f"{list(expected[key]) if key in expected else 'no such tensor'}; set the model with "
                "--set model.* (e.g. model.num_attention_heads, model.num_query_groups, model.kv_channels, "
                "model.activation) to match the Megatron run"
            )
    missing = sorted(set(expected) - seen)
    if missing:
        raise MlmError(
            f"{ckpt.path}: the model config needs {', '.join(missing[:4])}{' …' if len(missing) > 4 else ''}, "
            "which the Megatron checkpoint lacks; set the model with --set model.* to match the Megatron run"
        )


def _mlm_shapes(ckpt: MegatronCheckpoint, cfg: ModelConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    """The (mlm key, shape) pairs `_mlm_tensors` will yield, from the metadata alone."""
    for key in ckpt.tensors:
        meta = torch.empty(ckpt.shape(key), device="meta")
        fake = _FakeCheckpoint(ckpt, key, meta)
        for name, t in _mlm_tensors(fake, cfg):
            yield name, tuple(t.shape)


class _FakeCheckpoint:
    """One key of a checkpoint, with a meta tensor for its data (to compute the split shapes)."""

    def __init__(self, ckpt: MegatronCheckpoint, key: str, meta: torch.Tensor):
        self.path, self.tensors, self._meta = ckpt.path, {key: ckpt.tensors[key]}, meta

    def read(self, key: str) -> torch.Tensor:
        return self._meta


def _attention_overrides(ckpt: MegatronCheckpoint, heads: int) -> list[str]:
    """model.kv_channels and model.num_query_groups from the qkv and proj shapes, given the heads
    (MLA: its per-head dims, `_mla_head_overrides`)."""
    if any(_split_key(k)[1] == "self_attention.linear_kv_down_proj.weight" for k in ckpt.tensors):
        return _mla_head_overrides(ckpt, heads)
    proj = next(k for k in ckpt.tensors if _split_key(k)[1] == "self_attention.linear_proj.weight")
    qkv = next(k for k in ckpt.tensors if _split_key(k)[1] == "self_attention.linear_qkv.weight")
    width = ckpt.shape(proj)[-1]  # heads · head dim
    rows = ckpt.shape(qkv)[-2]  # (heads + 2 · groups) · head dim
    head_dim = width // heads
    groups = (rows - width) // (2 * head_dim) if head_dim else 0
    if head_dim * heads != width or (heads + 2 * groups) * head_dim != rows or groups < 1:
        raise MlmError(
            f"{ckpt.path}: model.num_attention_heads={heads} does not fit linear_proj's {width} inputs and "
            f"linear_qkv's {rows} rows; set the Megatron run's --num-attention-heads with "
            "--set model.num_attention_heads=N"
        )
    return [f"model.kv_channels={head_dim}", f"model.num_query_groups={groups}"]


def _mla_head_overrides(ckpt: MegatronCheckpoint, heads: int) -> list[str]:
    """model.mla.v_head_dim and qk_nope_head_dim from linear_proj's inputs (heads · v) and
    linear_kv_up_proj's rows (heads · (nope + v)), checked against the query rows (heads · (nope + rope))."""

    def rows(sub: str) -> tuple[int, ...] | None:
        key = next((k for k in ckpt.tensors if _split_key(k)[1] == sub), None)
        return None if key is None else ckpt.shape(key)[-2:]

    width = rows("self_attention.linear_proj.weight")[1]
    kv_up, latent = rows("self_attention.linear_kv_up_proj.weight")
    rope = rows("self_attention.linear_kv_down_proj.weight")[0] - latent
    q = rows("self_attention.linear_q_up_proj.weight") or rows("self_attention.linear_q_proj.weight")
    v, nope = width // heads, kv_up // heads - width // heads
    if (
        v * heads != width
        or (nope + v) * heads != kv_up
        or nope < 1
        or q is None
        or q[0] != heads * (nope + rope)
    ):
        raise MlmError(
            f"{ckpt.path}: model.num_attention_heads={heads} does not fit the multi-latent attention's shapes "
            f"(linear_proj's {width} inputs, linear_kv_up_proj's {kv_up} rows, query rows "
            f"{q[0] if q else 'none'}); set the Megatron run's --num-attention-heads with "
            "--set model.num_attention_heads=N"
        )
    return [f"model.mla.v_head_dim={v}", f"model.mla.qk_nope_head_dim={nope}"]


def model_config(ckpt: MegatronCheckpoint, overrides: list[str]) -> tuple[Config, list[str]]:
    """(the run config: shapes, then common.pt's args, then `overrides`; notes for the report).
    The heads must come from the args, `model.num_attention_heads` or a preset (no shape shows
    them); the query groups and head dim then follow from the qkv and proj shapes; the vocabulary
    size is the embedding's rows unless the args or `model.vocab_size` say it."""
    bad = [s for s in overrides if not (s.startswith("model.") or s.startswith("preset="))]
    if bad:
        raise MlmError(
            f"--set {bad[0]}: mlm convert from-megatron takes model.* fields (or preset=NAME) only"
        )
    common = ckpt.common()
    rows = ckpt.shape("embedding.word_embeddings.weight")[0]
    given = _args_overrides(common) + list(overrides)
    shapes = [*_shape_overrides(ckpt), f"model.vocab_size={rows}"]
    sets = [*shapes, *given]
    if not any(s.startswith(("model.num_attention_heads=", "preset=")) for s in given):
        raise MlmError(
            f"{ckpt.path}: the checkpoint does not say its attention heads (no args in common.pt): "
            "pass the Megatron run's --num-attention-heads as --set model.num_attention_heads=N"
        )
    probe = f"data.seq_length={1 + _mtp_depths(ckpt)}"  # the shortest a model with the MTP depths accepts
    heads = load_config(None, [*sets, probe]).model.num_attention_heads
    sets = [*shapes, *_attention_overrides(ckpt, heads), *given]
    max_pos = load_config(None, [*sets, probe]).model.max_position_embeddings
    seq = min(DataConfig().seq_length, max_pos)  # as import_hf: the default, within the model's positions
    config = load_config(None, [*sets, f"data.seq_length={seq}"])
    notes = []
    if not hasattr(common.get("args"), "__dict__"):
        notes.append(_defaults_note(config.model, given))
    return config, notes


def _defaults_note(cfg: ModelConfig, given: list[str]) -> str:
    """What the logits depend on that neither the shapes nor --set gave (no args in common.pt)."""
    fields = ["rope_base", "norm_eps", "activation", "max_position_embeddings"]
    if "moe" in cfg.mlp_kinds():
        fields += ["moe.router_topk", "moe.router_score_function", "moe.router_pre_softmax"]
    if "mla" in cfg.mixer_kinds():  # Megatron's MLA default is YaRN; without args mlm has none
        fields += ["rope_scaling_factor", "rope_scaling_type"]
    taken = [f for f in fields if not any(s.startswith(f"model.{f}=") for s in given)]
    values = ", ".join(f"{f}={toml_value(_field(cfg, f))}" for f in taken)
    return (
        f"no Megatron-LM args in common.pt: {values} are mlm's defaults (or read off the shapes), not "
        "the run's; pass --set model.FIELD=VALUE where the Megatron run differed"
    )


def _field(cfg: ModelConfig, dotted: str):
    section, _, name = dotted.rpartition(".")
    return getattr(cfg.moe if section else cfg, name)


def import_megatron(
    src: str | os.PathLike,
    out: str | os.PathLike,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    verify: bool = True,
    weights_only: bool = False,
    progress: Progress = noop,
) -> Report:
    """Megatron-core torch_dist or legacy checkpoint (`iter_NNNNNNN/` or the save root) → mlm checkpoint
    folder `out`: with the optimizer state the checkpoint holds (unless `weights_only`), a run
    `mlm train --load` resumes (Megatron's iteration, the "optim" group; `megatron_optim.resumed_run`),
    else iteration 0 with the "model" group. `verify`: read back what was written (checksums)
    and check mlm's logits on it are finite."""
    from mlm.convert.megatron_optim import MOMENTS, MegatronOptimizer, resumed_run  # it reuses this module

    src, out = Path(src), Path(out)
    check_new_dir(out)
    start = time.perf_counter()
    folder = iteration_dir(src)
    ckpt = LegacyCheckpoint(folder) if is_legacy(folder) else MegatronCheckpoint(checkpoint_dir(folder))
    _known(ckpt)
    if isinstance(ckpt, LegacyCheckpoint):
        _legacy_tp(ckpt)
    config, notes = model_config(ckpt, list(overrides))
    if ckpt.optimizer_keys and weights_only:
        notes.append(
            f"the optimizer state ({len(ckpt.optimizer_keys)} tensors, e.g. {ckpt.optimizer_keys[0]}) is not "
            "imported (--weights-only): mlm train starts a new run from the weights"
        )
    if (
        not ckpt.optimizer_keys
        and isinstance(ckpt, LegacyCheckpoint)
        and "optimizer" in ckpt.rank_state(0, 0)
    ):
        notes.append(
            f"{ckpt.rank_folder(0, 0).name}/model_optim_rng.pt holds the optimizer's param groups but no Adam "
            "state, and no distrib_optim.pt is beside it (not copied?): the weights are imported, and mlm "
            "train starts a new run from them"
        )
    common = ckpt.common()
    position = _training_position(common)
    opt, iteration, resume = None, 0, {}
    if ckpt.optimizer_keys and not weights_only:
        opt = MegatronOptimizer(ckpt)
        config, iteration, resume, more = resumed_run(opt, config, common)
        notes += more
    cfg = config.model
    padded = ckpt.shape("embedding.word_embeddings.weight")[0]
    if cfg.vocab_size > padded:
        raise MlmError(
            f"model.vocab_size={cfg.vocab_size} is above the checkpoint's {padded} embedding rows; "
            "set --set model.vocab_size to the tokenizer's vocabulary size"
        )
    _check_shapes(ckpt, cfg, padded)
    total = sum(math.prod(ckpt.shape(k)) * ckpt.tensors[k].properties.dtype.itemsize for k in ckpt.tensors)
    total *= 1 if opt is None else 3  # the weights (or fp32 main params, about as large) and two moments
    # mlm's model group holds the fp32 main weights: Megatron's main params where the weights are not fp32
    low = opt is not None and any(m.properties.dtype != torch.float32 for m in ckpt.tensors.values())
    states = [("model", "", opt.view("main") if low else ckpt)]
    states += [("optim", f"{m}.", opt.view(m)) for m in MOMENTS] if opt is not None else []
    items = (
        (group, prefix + key, t) for group, prefix, state in states for key, t in _mlm_tensors(state, cfg)
    )
    report = Report("import", src, out, "Megatron-core GPTModel", notes=notes)
    with staged_dir(out) as tmp:
        source = {"megatron_dir": str(ckpt.path.resolve()), **position, **resume.pop("source", {})}
        extra = {"config": config.to_dict(), "source": source, **resume}
        groups = ["model", "optim"] if opt is not None else ["model"]
        write_import(tmp, iteration, items, extra, groups, config, report, progress, total)
        if verify:
            check_finite_logits(tmp, config, padded, report, progress)
    report.seconds = time.perf_counter() - start
    return report
