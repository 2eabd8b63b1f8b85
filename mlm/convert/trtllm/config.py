"""TensorRT-LLM's config.json for mlm's models, and the mlm model a config.json describes.

The fields, their values and the TensorRT-LLM sources they follow (`PretrainedConfig`,
`LLaMAConfig`, `GPTConfig`, `MoeConfig`, `Mapping`) are in docs/formats-foreign.md ("TensorRT-LLM
checkpoint"); what is refused, and why, in docs/trtllm.md.

    config = trt_config(cfg, tp=2, pp=1, dtype="bfloat16")   # → config.json dict
    cfg, arch, tp, pp = read_trt_config(config)             # and back (MlmError if unsupported)
"""

from __future__ import annotations

from mlm.config import ModelConfig, MoEConfig, RopeConfig
from mlm.convert.common import attention_options
from mlm.convert.hf.llama import LLAMA_RULES, check_llama3_scaling, llama3_rope_scaling
from mlm.convert.trtllm.names import GPT, LLAMA, MIXTRAL
from mlm.errors import MlmError

DTYPES = ("bfloat16", "float16", "float32")
ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
# Architectures a config.json may name → the layout (Mixtral's: Llama's with MoE MLPs): TensorRT-LLM's
# Hugging Face converters write the Hugging Face class, mlm TensorRT-LLM's own model classes.
READS = {LLAMA: LLAMA, "MistralForCausalLM": LLAMA, MIXTRAL: LLAMA, GPT: GPT, "GPT2LMHeadModel": GPT}
# The ModelConfig fields each layout needs (Mixtral: Llama's)
STYLES = {
    LLAMA: LLAMA_RULES,
    GPT: dict(normalization="layernorm", position_embedding="learned", activation="gelu_tanh", add_bias=True),
}
RENORMALIZE = 1  # MoeConfig's normalization_mode of Mixtral: softmax over the top-k logits
GPT_ACTS = ("gelu_new", "gelu", "gelu_fast", "gelu_pytorch_tanh")  # all tanh GELU in TensorRT-LLM
_MIXTRAL_ROUTING = (
    "every layer MoE, softmax over the experts' logits, top-k renormalised, SwiGLU experts, no shared expert"
)


def dtype_choice(dtype: str) -> str:
    """A TensorRT-LLM dtype name from --dtype (bfloat16, float16, float32, or bf16, fp16, fp32)."""
    name = ALIASES.get(dtype, dtype)
    if name not in DTYPES:
        raise MlmError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)} (or bf16, fp16, fp32)")
    return name


def _listed(fields: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in fields.items())


def architecture(cfg: ModelConfig) -> str:
    """The TensorRT-LLM architecture mlm writes `cfg` as, or an MlmError saying why there is none."""
    kinds = sorted({(s.mixer, s.mlp) for s in cfg.layer_specs()})
    if cfg.mtp_num_layers:
        raise MlmError(
            f"model.mtp_num_layers={cfg.mtp_num_layers}: TensorRT-LLM's layouts that mlm writes have no "
            "multi-token prediction depths; export it to Hugging Face (DeepSeek's MTP layout) instead"
        )
    check_llama3_scaling(cfg, "TensorRT-LLM")
    bad = ["model.qk_norm=true"] if cfg.qk_norm else []
    bad += attention_options(cfg)
    bad += ["model.qkv_bias=true"] if cfg.qkv_bias and not cfg.add_bias else []
    if bad and kinds in ([("gqa", "dense")], [("gqa", "moe")]):
        raise MlmError(
            f"this model ({', '.join(bad)}) has no TensorRT-LLM architecture mlm exports: its Llama and "
            "GPT-2 layouts have no query/key norms and no biases on q, k, v alone"
        )
    if kinds == [("gqa", "moe")]:
        return _mixtral(cfg)
    if ("gqa", "moe") in kinds and set(kinds) <= {("gqa", "dense"), ("gqa", "moe")}:
        raise MlmError(
            "this model mixes dense and MoE layers (model.first_k_dense / model.mlp_kind_freq); "
            f"TensorRT-LLM's {MIXTRAL} layout that mlm writes has {_MIXTRAL_ROUTING}; export it to "
            "Hugging Face instead (mlm export hf CKPT OUT)"
        )
    if kinds != [("gqa", "dense")]:
        raise MlmError(
            f"this model's layer kinds {kinds} have no TensorRT-LLM architecture mlm exports; "
            f"it writes grouped-query attention with dense MLPs, or with MoE MLPs in every layer ({MIXTRAL})"
        )
    for arch, style in STYLES.items():
        if all(getattr(cfg, k) == v for k, v in style.items()):
            return arch
    raise MlmError(
        f"this model ({_listed({k: getattr(cfg, k) for k in LLAMA_RULES})}) has no TensorRT-LLM "
        f"architecture mlm exports; supported: {LLAMA} ({_listed(LLAMA_RULES)}) and {GPT} (GPT-2: "
        f"{_listed(STYLES[GPT])}; TensorRT-LLM's GELU is the tanh one)"
    )


def _mixtral(cfg: ModelConfig) -> str:
    """MIXTRAL for an MoE model TensorRT-LLM's Mixtral layout holds, else an MlmError naming every
    setting it cannot (docs/trtllm.md, "Mixture of experts: Mixtral")."""
    m = cfg.moe
    gate = " with a gate" if m.shared_expert_gate else ""
    refused = {  # model.moe field → (refused?, why)
        "num_experts": (m.num_experts < 2, " (TensorRT-LLM builds a dense MLP for one)"),
        "router_score_function": (m.router_score_function != "softmax", " (needs 'softmax')"),
        "router_pre_softmax": (m.router_pre_softmax, " (top-k weights not renormalised)"),
        "router_num_groups": (m.router_num_groups is not None, " (group-limited routing)"),
        "router_topk_scaling_factor": (m.router_topk_scaling_factor not in (None, 1.0), ""),
        "router_enable_expert_bias": (m.router_enable_expert_bias, " (a selection bias on the router)"),
        "shared_expert_ffn_hidden_size": (m.shared_expert_ffn_hidden_size, f" (a shared expert{gate})"),
    }
    bad = [f"model.{k}={getattr(cfg, k)!r}" for k, v in LLAMA_RULES.items() if getattr(cfg, k) != v]
    for k, (no, why) in refused.items():
        if no:
            value = getattr(m, k)
            bad.append(f"model.moe.{k}={'true' if value is True else repr(value)}{why}")
    if bad:
        raise MlmError(
            f"this MoE model has no TensorRT-LLM layout mlm exports: {'; '.join(bad)}; mlm writes "
            f"{MIXTRAL} ({_MIXTRAL_ROUTING}); export it to Hugging Face instead (mlm export hf CKPT OUT)"
        )
    return MIXTRAL


def check_mesh(cfg: ModelConfig, tp: int, pp: int) -> None:
    """Refuse a tp/pp that TensorRT-LLM's layout cannot split this model over."""
    if tp < 1 or pp < 1:
        raise MlmError(f"--tp {tp} --pp {pp}: both must be at least 1")
    moe = cfg.layer_specs()[0].mlp == "moe"  # every layer (architecture() refuses a mix)
    H, G, F = cfg.num_attention_heads, cfg.query_groups, cfg.expert_ffn_size if moe else cfg.ffn_size
    bad = [f"model.num_attention_heads={H}"] if H % tp else []
    if G % tp and tp % G:
        bad.append(f"model.num_query_groups={G} (and is no multiple of it)")
    if F % tp:
        bad.append(f"model.moe.ffn_hidden_size={F} (each expert's)" if moe else f"model.ffn_hidden_size={F}")
    if bad:
        raise MlmError(
            f"--tp {tp} does not divide {', '.join(bad)}; choose a tp that divides the heads and the ffn "
            "size, and divides the KV heads or is a multiple of them"
        )
    if pp > cfg.num_layers:
        raise MlmError(f"--pp {pp} is more than model.num_layers={cfg.num_layers}; every stage needs a layer")


def trt_config(cfg: ModelConfig, tp: int, pp: int, dtype: str) -> dict:
    """The config.json dict for `cfg` written for tp × pp ranks in `dtype` (a TensorRT-LLM dtype name)."""
    arch = architecture(cfg)
    check_mesh(cfg, tp, pp)
    out = {
        "architecture": arch,
        "dtype": dtype,
        "logits_dtype": "float32",
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.query_groups,
        "head_size": cfg.head_dim,
        "intermediate_size": cfg.expert_ffn_size if arch == MIXTRAL else cfg.ffn_size,
        "norm_epsilon": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "use_parallel_embedding": False,
        "embedding_sharding_dim": 0,
        "mapping": {"world_size": tp * pp, "tp_size": tp, "pp_size": pp},
        "quantization": {"quant_algo": None, "kv_cache_quant_algo": None},
    }
    if arch == GPT:
        gpt2 = {"position_embedding_type": "learned_absolute", "gpt_variant": "gpt2", "bias": True}
        return out | {"hidden_act": "gelu_new", **gpt2}
    scaling = llama3_rope_scaling(cfg)  # the Hugging Face rope_scaling dict, as LLaMAConfig keeps it
    out |= {
        "hidden_act": "silu" if arch == LLAMA else "swiglu",
        "position_embedding_type": "rope_gpt_neox",
        "rotary_base": cfg.rope.base,
        "rotary_scaling": None if scaling is None else {"type": "llama3", **scaling},
        "attn_bias": False,
        "mlp_bias": False,
    }
    if arch == MIXTRAL:  # only the fields every MoeConfig version has (from_dict takes them as kwargs)
        moe = {"num_experts": cfg.moe.num_experts, "top_k": cfg.moe.router_topk}
        out["moe"] = moe | {"normalization_mode": RENORMALIZE}
    return out


def _need(c: dict, key: str):
    if c.get(key) is None:
        raise MlmError(f"config.json has no {key!r}; TensorRT-LLM's PretrainedConfig needs it")
    return c[key]


def _rules(c: dict, rules: dict[str, tuple]) -> None:
    """Each field `k: (default, wanted)` must have the wanted value."""
    bad = [f"{k}={c.get(k, d)!r} (mlm reads {w!r})" for k, (d, w) in rules.items() if c.get(k, d) != w]
    if bad:
        raise MlmError(f"config.json: {'; '.join(bad)}")


def read_trt_config(c: dict) -> tuple[ModelConfig, str, int, int]:
    """(mlm model, layout architecture, tp, pp) of a TensorRT-LLM config.json dict; MlmError naming the
    field when mlm cannot read it."""
    arch = READS.get(c.get("architecture"))
    if arch is None:
        raise MlmError(
            f"config.json architecture {c.get('architecture')!r} is not supported; supported: {', '.join(READS)}"
        )
    dtype = _need(c, "dtype")
    if dtype not in DTYPES:
        raise MlmError(f"config.json dtype {dtype!r}: mlm reads {', '.join(DTYPES)}")
    quant = c.get("quantization") or {}
    if quant.get("quant_algo") or quant.get("kv_cache_quant_algo"):
        raise MlmError(f"config.json quantization {quant}: mlm reads unquantized checkpoints only")
    mapping = _need(c, "mapping")
    tp, pp = mapping.get("tp_size", 1), mapping.get("pp_size", 1)
    world = mapping.get("world_size", 1)
    if tp * pp != world or mapping.get("cp_size", 1) != 1:
        raise MlmError(
            f"config.json mapping {mapping}: world_size={world} must equal tp_size({tp}) × pp_size({pp}) "
            "(context parallelism is not read)"
        )
    moe = _read_moe(c, tp)
    if moe is not None and arch != LLAMA:
        raise MlmError(
            f"config.json: architecture {c['architecture']!r} with MoE; mlm reads MoE as {MIXTRAL}"
        )
    D, H = _need(c, "hidden_size"), _need(c, "num_attention_heads")
    style = _read_style(c, arch, moe)
    cfg = ModelConfig(
        num_layers=_need(c, "num_hidden_layers"),
        hidden_size=D,
        num_attention_heads=H,
        num_query_groups=c.get("num_key_value_heads") or H,
        kv_channels=ModelConfig.kv_channels_from(D, H, c.get("head_size")),
        ffn_hidden_size=c.get("intermediate_size") or 4 * D,
        vocab_size=_need(c, "vocab_size"),
        max_position_embeddings=_need(c, "max_position_embeddings"),
        norm_eps=float(c.get("norm_epsilon", 1e-5)),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        **style,
        **({} if moe is None else dict(mlp_kind="moe", moe=moe)),
    )
    check_mesh(cfg, tp, pp)
    return cfg, arch if moe is None else MIXTRAL, tp, pp


def _read_style(c: dict, arch: str, moe: MoEConfig | None) -> dict:
    """The layout's ModelConfig fields (`STYLES`, RoPE's); MlmError for a config.json field of the
    norm, positions, activation or biases with a value mlm does not read."""
    rules = dict(use_parallel_embedding=(False, False), rotary_pct=(1.0, 1.0), qk_layernorm=(False, False))
    if arch == GPT:
        _rules(c, rules | dict(position_embedding_type=("learned_absolute",) * 2, bias=(True, True)))
        if c.get("hidden_act") not in GPT_ACTS:
            raise MlmError(f"config.json hidden_act={c.get('hidden_act')!r}: mlm reads {', '.join(GPT_ACTS)}")
        return STYLES[GPT]
    act = "silu" if moe is None else "swiglu"
    no_bias = dict(attn_bias=(False, False), mlp_bias=(False, False))
    _rules(c, rules | dict(position_embedding_type=(None, "rope_gpt_neox"), hidden_act=(None, act)) | no_bias)
    base = float(c.get("rotary_base", 10000.0))
    scaling = c.get("rotary_scaling")
    if scaling is None:
        return STYLES[LLAMA] | {"rope": RopeConfig(base=base)}
    if scaling.get("rope_type", scaling.get("type")) != "llama3":
        raise MlmError(f"config.json rotary_scaling {scaling}: mlm reads none or rope_type 'llama3'")
    rope = RopeConfig(
        base=base,
        scaling_factor=float(scaling["factor"]),
        low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
    )
    return STYLES[LLAMA] | {"rope": rope}


def _read_moe(c: dict, tp: int) -> MoEConfig | None:
    """The MoE of a config.json (its `moe` dict, or the older top-level moe_* fields), None where it
    has none (TensorRT-LLM's `MoeConfig.has_moe`: more than one expert); MlmError for a routing or
    an expert split mlm does not read."""
    m = c.get("moe")
    if m is None:
        m = {k: c[f"moe_{k}"] for k in ("num_experts", "top_k", "normalization_mode") if f"moe_{k}" in c}
    if m.get("num_experts", 0) <= 1:
        return None
    bad = []
    if m.get("normalization_mode", RENORMALIZE) != RENORMALIZE:
        bad.append(f"normalization_mode={m['normalization_mode']} (mlm reads {RENORMALIZE}, RENORMALIZE)")
    for k in ("shared_expert_intermediate_size", "device_limited_n_group", "device_limited_topk_group"):
        if m.get(k):
            bad.append(f"{k}={m[k]} (mlm reads none)")
    reads = {"moe_tp_size": (-1, None, tp), "moe_ep_size": (-1, None, 1), "moe_cluster_size": (-1, None, 1)}
    split = {k: c["mapping"].get(k, -1) for k in reads}
    if any(split[k] not in ok for k, ok in reads.items()):
        bad.append(f"mapping {split} (mlm reads experts split over tp: moe_tp_size = tp_size, moe_ep_size 1)")
    if bad:
        raise MlmError(f"config.json moe: {'; '.join(bad)}")
    return MoEConfig(num_experts=m["num_experts"], router_topk=_need(m, "top_k"))
