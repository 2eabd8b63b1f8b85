"""Megatron-LM's `args` (the Namespace its checkpoints pickle) ⇄ mlm's config, both directions in
one place: `args_overrides` and `run_settings` (import), `megatron_args` and `unread_flags`
(export). The fields read, refused and written are listed in docs/megatron.md ("The model
config"), docs/megatron-resume.md and docs/megatron-export.md."""

from __future__ import annotations

import argparse

from mlm.config import Config, ModelConfig, OptimizerConfig, toml_value
from mlm.errors import MlmError
from mlm.train.schedule import lengths

_ARGS = {
    "num_attention_heads": "num_attention_heads",
    "kv_channels": "kv_channels",
    "max_position_embeddings": "max_position_embeddings",
    "norm_epsilon": "norm_eps",
    "rotary_base": "rope.base",
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
in `args_overrides`: num_query_groups when group_query_attention, position_embedding_type,
normalization, swiglu (exact GELU otherwise), squared_relu, use_rope_scaling with rope_scaling_factor, the aux-loss
coefficient by moe_router_load_balancing_type, and vocab_size; and the args it refuses)."""


REFUSED_ARGS = {
    "rotary_interleaved": "interleaved RoPE (mlm rotates halves)",
    "apply_layernorm_1p": "zero-centered norm weights (1 + weight)",
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


def saved_args(common: dict) -> dict:
    """Megatron-LM's saved `args` (a Namespace in common.pt or a legacy rank file) as a dict; {} where absent."""
    return vars(common["args"]) if hasattr(common.get("args"), "__dict__") else {}


def args_overrides(common: dict) -> list[str]:
    """model.* fields from Megatron-LM's saved `args` (a Namespace in common.pt), as --set strings."""
    args = saved_args(common)
    for name, what in REFUSED_ARGS.items():
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
            f"Megatron args no_rope_freq={nope!r}: layers without RoPE are not imported by "
            "mlm convert from-megatron (mlm applies RoPE in every layer)"
        )
    if args.get("rotary_percent", 1.0) != 1.0:
        raise MlmError(
            f"Megatron args rotary_percent={args['rotary_percent']}: mlm rotates the whole head (1.0) only"
        )
    kind = args.get("position_embedding_type")
    if args.get("multi_latent_attention") and kind == "none":  # MLA applies its own RoPE either way
        kind = "rope"
    if kind not in (None, "rope", "learned_absolute", "none"):
        raise MlmError(
            f"Megatron args position_embedding_type={kind!r}: mlm imports 'rope', 'learned_absolute' and 'none'"
        )
    out = {ours: args[theirs] for theirs, ours in _ARGS.items() if args.get(theirs) is not None}
    if args.get("group_query_attention") and args.get("num_query_groups"):
        out["num_query_groups"] = args["num_query_groups"]
    if kind is not None:
        out["position_embedding"] = {"rope": "rope", "none": "none"}.get(kind, "learned")
    if args.get("normalization") in ("RMSNorm", "LayerNorm"):
        out["normalization"] = args["normalization"].lower()
    if "swiglu" in args:  # args.openai_gelu is not read: it reaches Megatron-LM's legacy models only,
        # never megatron-core's GPTModel (core_transformer_config_from_args), which computes exact GELU
        out["activation"] = "swiglu" if args["swiglu"] else "gelu"
    if args.get("squared_relu"):
        out["activation"] = "squared_relu"
    if args.get("use_rope_scaling"):  # Llama 3.1's scaling; Megatron fixes the other three constants
        out |= {"rope.scaling_factor": args.get("rope_scaling_factor", 8.0), "rope.scaling_type": "llama3"}
        out |= {"rope.low_freq_factor": 1.0, "rope.high_freq_factor": 4.0}
        out["rope.original_max_position_embeddings"] = 8192
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
        out |= _mla_fields(args)
    out |= _hybrid_fields(args)
    return [f"model.{k}={toml_value(v)}" for k, v in out.items()]


def is_hybrid(cfg: ModelConfig) -> bool:
    """Whether `cfg` is written as Megatron's HybridModel: a Mamba layer, or a layer with a mixer or
    an MLP alone (GPTModel's layers are attention and an MLP)."""
    return bool({"mamba", "gdn"} & set(cfg.mixer_kinds())) or any(
        s.mixer is None or s.mlp is None for s in cfg.layer_specs()
    )


MAMBA_ARGS = {
    "mamba_state_dim": "state_dim",
    "mamba_head_dim": "head_dim",
    "mamba_num_groups": "num_groups",
    "mamba_num_heads": "num_heads",
}
"""Megatron-LM's Mamba args → `model.mamba.` fields."""
GDN_ARGS = {
    "linear_num_key_heads": "num_key_heads",
    "linear_num_value_heads": "num_value_heads",
    "linear_key_head_dim": "key_head_dim",
    "linear_value_head_dim": "value_head_dim",
    "linear_conv_kernel_dim": "conv_kernel",
}
"""Megatron-LM's gated delta net args → `model.gdn.` fields."""


def _hybrid_fields(args: dict) -> dict:
    """model.layer_pattern (and the layers it makes) from a HybridModel's `hybrid_layer_pattern`
    (or the older `hybrid_override_pattern`), and model.mamba.* from its Mamba args."""
    pattern = args.get("hybrid_layer_pattern") or args.get("hybrid_override_pattern")
    if not pattern:
        return {}
    from mlm.model.kinds.pattern import parse

    layers, mtp = parse(pattern, "Megatron args hybrid_layer_pattern")
    out = {"layer_pattern": pattern, "num_layers": len(layers), "mtp_num_layers": mtp}
    out |= {
        f"mamba.{ours}": args[theirs] for theirs, ours in MAMBA_ARGS.items() if args.get(theirs) is not None
    }
    out |= {f"gdn.{ours}": args[theirs] for theirs, ours in GDN_ARGS.items() if args.get(theirs) is not None}
    return out


_MLA_ARGS = {
    "q_lora_rank": "mla.q_lora_rank",
    "kv_lora_rank": "mla.kv_lora_rank",
    "qk_head_dim": "mla.qk_nope_head_dim",
    "qk_pos_emb_head_dim": "mla.qk_rope_head_dim",
    "v_head_dim": "mla.v_head_dim",
}
"""Megatron-LM's MLA args → mlm `model.` fields (Megatron's qk_head_dim is the part without RoPE)."""


def _mla_fields(args: dict) -> dict:
    """mlm fields for a run with --multi-latent-attention: the MLA dims, interleaved RoPE, and its YaRN
    with MLATransformerConfig's constants (docs/megatron.md); MlmError where mlm's model differs."""
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
        out |= {"rope.scaling_factor": factor, "rope.scaling_type": "yarn", "rope.yarn_mscale": mscale}
        out |= {"rope.yarn_mscale_all_dim": mscale_all, "rope.original_max_position_embeddings": 4096}
        out |= {"rope.yarn_beta_fast": 32.0, "rope.yarn_beta_slow": 1.0}
    return out


def training_position(common: dict) -> dict:
    """Megatron-LM's `iteration` and `args.consumed_train_samples` where common.pt has them, for the
    manifest's `source` (a record; where the optimizer state is carried, `resumed_run` also makes
    them the mlm run's iteration and consumed samples)."""
    found = {
        "iteration": common.get("iteration"),
        "consumed_train_samples": saved_args(common).get("consumed_train_samples"),
    }
    return {k: int(v) for k, v in found.items() if isinstance(v, int)}


def _mla_args(cfg: ModelConfig) -> dict:
    """Megatron-LM's MLA arguments for an MLA `cfg` (qk_head_dim: the dims without RoPE). mlm's
    YaRN attention factor with mscale_all_dim 0 is mscale(factor): Megatron's with mscale 1."""
    m, yarn = cfg.mla, cfg.rope.scaling_factor is not None
    mscale_all = cfg.rope.yarn_mscale_all_dim if yarn else 0.0
    return dict(
        multi_latent_attention=True,
        qk_layernorm=True,  # the latent norms
        group_query_attention=False,
        q_lora_rank=m.q_lora_rank,
        kv_lora_rank=m.kv_lora_rank,
        qk_head_dim=m.qk_nope_head_dim,
        qk_pos_emb_head_dim=m.qk_rope_head_dim,
        v_head_dim=m.v_head_dim,
        rope_type="yarn" if yarn else "rope",
        rotary_scaling_factor=cfg.rope.scaling_factor if yarn else 1.0,
        mscale=cfg.rope.yarn_mscale if yarn and mscale_all else 1.0,
        mscale_all_dim=mscale_all,
        use_rope_scaling=False,
    )


def moe_layer_freq(cfg: ModelConfig) -> int | list[int]:
    """Megatron's moe_layer_freq for `cfg`: mlp_kind_freq, or a 0/1 list per layer where first_k_dense
    or a list decides."""
    if isinstance(cfg.mlp_kind_freq, int) and not cfg.first_k_dense:
        return cfg.mlp_kind_freq
    return [int(spec.mlp == "moe") for spec in cfg.layer_specs()]


_UNREAD = {
    "norm_epsilon": 1e-5,
    "use_rope_scaling": False,
    "rope_scaling_factor": 8.0,
    "qk_layernorm": False,
    "moe_router_num_groups": None,
    "moe_router_group_topk": None,
    "moe_router_dtype": None,
    "moe_expert_capacity_factor": None,
    "moe_pad_expert_input_to_capacity": False,
    "moe_token_drop_policy": "probs",
    "moe_shared_expert_gate": False,
    "moe_router_load_balancing_type": "aux_loss",
    "moe_aux_loss_coeff": 0.0,
    "moe_z_loss_coeff": None,
    "moe_router_bias_update_rate": 1e-3,
    "multi_latent_attention": False,
    "q_lora_rank": None,
    "kv_lora_rank": 32,
    "qk_head_dim": 128,
    "qk_pos_emb_head_dim": 64,
    "v_head_dim": 128,
    "rope_type": None,
    "rotary_scaling_factor": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 0.0,
    "mtp_num_layers": None,
}
"""Args the export writes that Megatron-LM's `--use-checkpoint-args` does not read
(`load_args_from_checkpoint`, core_v0.16.1), with Megatron-LM's defaults: where the model's
value differs, Megatron-LM builds another model (or trains it otherwise) unless given the flag."""


def unread_flags(args: argparse.Namespace) -> list[str]:
    """Megatron-LM command-line flags for the `_UNREAD` args whose value differs from Megatron-LM's
    default (a store-true flag alone, else the flag and its value)."""
    out = []
    for name, default in _UNREAD.items():
        value = getattr(args, name, default)
        if value == default or (name == "rope_scaling_factor" and not args.use_rope_scaling):
            continue
        if name == "moe_router_load_balancing_type" and not getattr(args, "moe_aux_loss_coeff", 0.0):
            continue  # "none" and "aux_loss" with coefficient 0 are the same
        flag = "--" + name.replace("_", "-")
        values = value if isinstance(value, list) else [value]
        out.append(flag if value is True else " ".join([flag, *map(str, values)]))
    return out


def config_field(cfg: ModelConfig, dotted: str):
    """The value of `cfg`'s field `dotted` (`norm_eps`, `moe.router_topk`)."""
    section, _, name = dotted.rpartition(".")
    return getattr(getattr(cfg, section) if section else cfg, name)


def _same_meaning(cfg: ModelConfig, moe: bool) -> dict:
    """`_ARGS` read backwards: the Megatron-LM args of the same meaning as `cfg`'s fields, the MoE
    ones (`moe`) or the others."""
    return {
        theirs: config_field(cfg, ours) for theirs, ours in _ARGS.items() if ours.startswith("moe.") == moe
    }


def _one_or_list(values: list):
    return values[0] if len(values) == 1 else values


def megatron_args(config: Config, padded_vocab: int, iteration: int, consumed: int) -> argparse.Namespace:
    """Megatron-LM's `args` for the run `config` (builtins only: mlm's reader and
    `torch.load(weights_only=True)` read it), as `--use-checkpoint-args` and `mlm convert from-megatron`
    read them."""
    cfg = config.model
    rope = cfg.position_embedding == "rope"
    args = _same_meaning(cfg, moe=False) | dict(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_hidden_size or 4 * cfg.hidden_size,
        group_query_attention=cfg.query_groups != cfg.num_attention_heads,
        num_query_groups=cfg.query_groups,
        kv_channels=cfg.head_dim,
        seq_length=config.data.seq_length,
        position_embedding_type={"rope": "rope", "none": "none"}.get(
            cfg.position_embedding, "learned_absolute"
        ),
        add_position_embedding=cfg.position_embedding == "learned",
        use_rotary_position_embeddings=rope,
        rotary_base=int(cfg.rope.base) if float(cfg.rope.base).is_integer() else cfg.rope.base,
        rotary_percent=1.0,
        rotary_interleaved=False,
        use_rope_scaling=cfg.rope.scaling_factor is not None,
        rope_scaling_factor=cfg.rope.scaling_factor or 8.0,
        normalization="RMSNorm" if cfg.normalization == "rmsnorm" else "LayerNorm",
        apply_layernorm_1p=False,
        swiglu=cfg.activation == "swiglu",
        openai_gelu=cfg.activation == "gelu_tanh",
        squared_relu=cfg.activation == "squared_relu",
        untie_embeddings_and_output_weights=not cfg.tie_embeddings,
        add_bias_linear=cfg.add_bias,
        add_qkv_bias=cfg.qkv_bias,
        qk_layernorm=cfg.qk_norm,
        multi_latent_attention=False,
        vocab_size=cfg.vocab_size,
        padded_vocab_size=padded_vocab,
        tensor_model_parallel_size=1,  # every tensor is one whole chunk: Megatron reshards on load
        pipeline_model_parallel_size=1,
        expert_model_parallel_size=1,
        ckpt_format="torch_dist",
        iteration=iteration,
        consumed_train_samples=consumed,
        no_save_optim=True,  # weights only: Megatron-LM's load then asks for no optimizer or RNG state
        no_save_rng=True,
        num_experts=None,
        moe_layer_freq=1,
        mtp_num_layers=cfg.mtp_num_layers or None,
    )
    if "mla" in cfg.mixer_kinds():
        args.update(_mla_args(cfg))
    if is_hybrid(cfg):  # HybridModel: Megatron derives num_layers from the pattern (one per symbol)
        m = cfg.mamba
        args.update(num_layers=None, hybrid_layer_pattern=cfg.pattern(), hybrid_override_pattern=None)
        args.update({theirs: config_field(cfg, f"mamba.{ours}") for theirs, ours in MAMBA_ARGS.items()})
        args["mamba_num_heads"] = m.heads(cfg.hidden_size)
        args.update({theirs: config_field(cfg, f"gdn.{ours}") for theirs, ours in GDN_ARGS.items()})
    if any(spec.mlp == "moe" for spec in cfg.layer_specs()):
        moe = cfg.moe
        balancing = [
            (kind, coeff)
            for kind, coeff in (("aux_loss", moe.aux_loss_coeff), ("seq_aux_loss", moe.seq_aux_loss_coeff))
            if coeff
        ]
        args.update(_same_meaning(cfg, moe=True))
        args.update(
            num_experts=moe.num_experts,
            moe_layer_freq=moe_layer_freq(cfg),
            moe_ffn_hidden_size=moe.ffn_hidden_size or args["ffn_hidden_size"],
            moe_router_dtype="fp32",  # mlm computes the router in fp32
            # as Megatron-LM's arguments.py leaves them: one type and coefficient unwrapped, lists for two
            moe_router_load_balancing_type=_one_or_list([k for k, _ in balancing]) or "none",
            moe_aux_loss_coeff=_one_or_list([c for _, c in balancing]) or 0.0,
            moe_z_loss_coeff=moe.z_loss_coeff or None,
            moe_token_dispatcher_type=moe.token_dispatcher,
            moe_shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size,
            moe_shared_expert_gate=moe.shared_expert_gate,
            moe_grouped_gemm=False,
        )
    return argparse.Namespace(**args)


_SAME = {  # Megatron-LM args → mlm fields of the same meaning
    "lr": "optimizer.lr",
    "min_lr": "optimizer.min_lr",
    "lr_warmup_init": "optimizer.lr_warmup_init",
    "lr_warmup_fraction": "optimizer.warmup_fraction",
    "adam_beta1": "optimizer.adam_beta1",
    "adam_beta2": "optimizer.adam_beta2",
    "adam_eps": "optimizer.adam_eps",
    "clip_grad": "optimizer.clip_grad",
    "global_batch_size": "train.global_batch_size",
    "micro_batch_size": "train.micro_batch_size",
    "seq_length": "data.seq_length",
}


_IN_ITERS = {  # mlm fields counted in iterations ← Megatron-LM's args in iterations, or in samples
    "optimizer.warmup_iters": ("lr_warmup_iters", "lr_warmup_samples"),
    "optimizer.decay_iters": ("lr_decay_iters", "lr_decay_samples"),
    "optimizer.wsd_decay_iters": ("lr_wsd_decay_iters", "lr_wsd_decay_samples"),
    "train.train_iters": ("train_iters", "train_samples"),
}

_DECAY_STYLES = {"constant": "constant", "linear": "linear", "cosine": "cosine",
                 "inverse-square-root": "inverse-square-root", "WSD": "wsd"}  # fmt: skip
"""Megatron-LM's --lr-decay-style → mlm's optimizer.decay_style (the same formula, mlm.train.schedule)."""


def scheduler_arguments(cfg: OptimizerConfig, total_iters: int, global_batch: int) -> dict:
    """megatron-core's `OptimizerParamScheduler` arguments for mlm's optimizer settings over a run of
    `total_iters` steps of `global_batch` samples, in samples as Megatron-LM's
    `get_optimizer_param_scheduler` builds them (the inverse of `run_settings`' schedule)."""
    warmup, decay, wsd = (n * global_batch for n in lengths(cfg, total_iters, global_batch))
    wd = (cfg.weight_decay, cfg.weight_decay)
    if cfg.weight_decay_incr_style != "constant":
        wd = (cfg.start_weight_decay, cfg.end_weight_decay)
    style = {ours: theirs for theirs, ours in _DECAY_STYLES.items()}[cfg.decay_style]
    return dict(
        init_lr=cfg.lr_warmup_init, max_lr=cfg.lr, min_lr=cfg.min_lr, lr_warmup_steps=warmup,
        lr_decay_steps=decay, lr_decay_style=style, start_wd=wd[0], end_wd=wd[1],
        wd_incr_steps=total_iters * global_batch, wd_incr_style=cfg.weight_decay_incr_style,
        wsd_decay_steps=wsd, lr_wsd_decay_style=cfg.wsd_decay_style,
    )  # fmt: skip


def run_settings(args: dict) -> tuple[dict[str, object], list[str]]:
    """({"optimizer.lr": …, "train.train_iters": …}: the mlm settings that mean what Megatron-LM's
    `args` mean, Megatron's schedule and weight-decay groups included; notes naming what is not
    carried). Iteration counts come from `*_iters`, or from `*_samples` divided by
    global_batch_size where it divides."""
    out = {ours: args[theirs] for theirs, ours in _SAME.items() if args.get(theirs) is not None}
    out |= {
        "optimizer.warmup_offset": 0,
        "optimizer.weight_decay_exempt": "1d",
        "model.train_padded_vocab": True,
    }
    notes = []
    gbs = args.get("global_batch_size")
    for ours, (iters, samples) in _IN_ITERS.items():
        if args.get(iters):
            out[ours] = int(args[iters])
        if args.get(samples) and gbs and args[samples] % gbs == 0:
            out[ours] = args[samples] // gbs
        elif args.get(samples) and ours == "train.train_iters" and gbs:
            out[ours] = args[samples] // gbs  # as Megatron-LM's update_train_iters: whole steps
            notes.append(
                f"args.train_samples={args[samples]} is not a whole number of global batches ({gbs}): "
                f"{out[ours]} steps, as Megatron-LM trains"
            )
        elif args.get(samples) and gbs:  # Megatron's scheduler counts samples: a fraction of a step
            out[ours.replace("_iters", "_samples")] = int(args[samples])
        elif args.get(samples):
            notes.append(f"args.{samples}={args[samples]} without args.global_batch_size: not carried")
    style = args.get("lr_decay_style")
    if style in _DECAY_STYLES:
        out["optimizer.decay_style"] = _DECAY_STYLES[style]
    elif style is not None:
        notes.append(f"args.lr_decay_style={style} has no mlm equal: optimizer.decay_style is mlm's (set it)")
    if style == "WSD" and args.get("lr_wsd_decay_style"):
        out["optimizer.wsd_decay_style"] = args["lr_wsd_decay_style"]
    incr = args.get("weight_decay_incr_style") or "constant"
    if incr == "constant" and args.get("weight_decay") is not None:
        out["optimizer.weight_decay"] = args["weight_decay"]
    elif incr in ("linear", "cosine"):
        out["optimizer.weight_decay_incr_style"] = incr
        out |= {f"optimizer.{k}": args[k] for k in ("start_weight_decay", "end_weight_decay")}
    for name in ("decoupled_lr", "decoupled_min_lr"):
        if args.get(name) is not None:
            notes.append(
                f"args.{name}={args[name]} (the embeddings' own learning rate) has no mlm equal: not carried"
            )
    return out, notes


READ = frozenset({
    *_ARGS, *REFUSED_ARGS, *_MLA_ARGS, *_SAME, *(n for pair in _IN_ITERS.values() for n in pair),
    "window_size", "no_rope_freq", "rotary_percent", "position_embedding_type", "multi_latent_attention",
    "group_query_attention", "num_query_groups", "normalization", "swiglu", "use_rope_scaling",
    "rope_scaling_factor", "moe_router_load_balancing_type", "moe_aux_loss_coeff", "vocab_size",
    "qk_layernorm", "rope_type", "rotary_scaling_factor", "mscale", "mscale_all_dim", "lr_decay_style",
    "lr_wsd_decay_style", "weight_decay_incr_style", "weight_decay", "start_weight_decay",
    "end_weight_decay", "decoupled_lr", "decoupled_min_lr",
})  # fmt: skip
"""Every Megatron-LM argument the translations here read (`args_overrides`, `run_settings`)."""
