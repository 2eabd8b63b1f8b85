"""Llama (`LlamaForCausalLM`) ⇄ mlm: keys one to one, RMSNorm, SwiGLU, RoPE (with Llama-3.1
scaling), no biases.

Llama needs no q/k permutation: mlm's RoPE uses HF's rotate-half layout (tests/interop/hf/test_hf_adapters.py
checks the logits). The Llama-family pieces here (the key table around the MLP, the config
fields, the sliding-window rule) are shared by Mistral, Mixtral, Qwen2-MoE and Qwen3-MoE.
"""

from __future__ import annotations

from mlm.config import ModelConfig, RopeConfig
from mlm.convert.hf.adapter import Adapter
from mlm.convert.keymap import Target
from mlm.errors import MlmError

DENSE_MLP: dict[str, Target] = {
    "model.layers.{layer}.mlp.gate_proj.weight": "layers.{layer}.mlp.gate.weight",
    "model.layers.{layer}.mlp.up_proj.weight": "layers.{layer}.mlp.up.weight",
    "model.layers.{layer}.mlp.down_proj.weight": "layers.{layer}.mlp.down.weight",
}


def llama_keys(mlp: dict[str, Target], attention: dict[str, Target] | None = None) -> dict[str, Target]:
    """The Llama key table with `mlp`'s templates for the MLP and `attention`'s added to the
    attention's (biases, q/k norms), in checkpoint order."""
    return {
        "model.embed_tokens.weight": "embed.weight",
        "model.layers.{layer}.input_layernorm.weight": "layers.{layer}.attn_norm.weight",
        "model.layers.{layer}.self_attn.q_proj.weight": "layers.{layer}.attn.q.weight",
        "model.layers.{layer}.self_attn.k_proj.weight": "layers.{layer}.attn.k.weight",
        "model.layers.{layer}.self_attn.v_proj.weight": "layers.{layer}.attn.v.weight",
        **(attention or {}),
        "model.layers.{layer}.self_attn.o_proj.weight": "layers.{layer}.attn.out.weight",
        "model.layers.{layer}.self_attn.rotary_emb.inv_freq": None,
        "model.layers.{layer}.post_attention_layernorm.weight": "layers.{layer}.mlp_norm.weight",
        **mlp,
        "model.norm.weight": "final_norm.weight",
        "model.rotary_emb.inv_freq": None,
        "model.rotary_emb.original_inv_freq": None,
        "lm_head.weight": "output.weight",
    }


KEYS = llama_keys(DENSE_MLP)


def rope_parameters(c: dict, default_theta: float, whole: str | None) -> tuple[float, str, dict]:
    """(theta, rope_type, the scaling fields) of a transformers 4.x (`rope_theta` + `rope_scaling`)
    or 5.x (`rope_parameters`, theta inside) config; MlmError for a partial_rotary_factor other than
    1 (`whole`: what mlm rotates), unless `whole` is None (the caller reads the factor)."""
    r = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    if whole is not None and r.get("partial_rotary_factor", 1.0) != 1.0:
        raise MlmError(f"rope partial_rotary_factor={r['partial_rotary_factor']}: mlm rotates {whole}")
    theta = float(r.get("rope_theta", c.get("rope_theta", default_theta)))
    return theta, r.get("rope_type", r.get("type", "default")), r


def rope(c: dict, default_theta: float = 10000.0) -> tuple[float, dict | None]:
    """(theta, llama3 scaling or None) of a config.json (`rope_parameters`)."""
    theta, rope_type, r = rope_parameters(c, default_theta, "the whole head (1.0)")
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise MlmError(f"rope_scaling rope_type={rope_type!r}: mlm supports 'default' (none) and 'llama3'")
    need = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in need if k not in r]
    if missing:
        raise MlmError(f"rope_scaling (llama3) lacks {', '.join(missing)}; it needs {', '.join(need)}")
    return theta, r


def check_window(window: int | None, positions: int, key: str = "sliding_window") -> None:
    """MlmError unless a sliding window of `window` (None: none) covers all `positions`: mlm has
    no sliding-window attention."""
    if window is not None and window < positions:
        raise MlmError(
            f"Hugging Face config {key}={window} < max_position_embeddings={positions}: mlm "
            f"has no sliding-window attention, so positions beyond {window} would attend differently. "
            f"Set max_position_embeddings to {window} (or less) in config.json to convert it exactly, "
            "or sliding_window to null if the model uses full attention"
        )


def rmsnorm_swiglu_fields(a: Adapter, c: dict, eps: float = 1e-6) -> dict:
    """The ModelConfig fields of a config.json that Llama's family and DeepSeek-V3 share (RMSNorm,
    RoPE, SwiGLU, no biases); the caller adds the attention's and RoPE's."""
    return dict(
        num_layers=a.get(c, "num_hidden_layers"),
        hidden_size=a.get(c, "hidden_size"),
        num_attention_heads=a.get(c, "num_attention_heads"),
        ffn_hidden_size=a.get(c, "intermediate_size"),
        vocab_size=a.get(c, "vocab_size"),
        max_position_embeddings=a.get(c, "max_position_embeddings"),
        normalization="rmsnorm",
        norm_eps=float(c.get("rms_norm_eps", eps)),
        position_embedding="rope",
        activation="swiglu",
        add_bias=False,
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        init_std=float(c.get("initializer_range", 0.02)),
    )


def llama_fields(a: Adapter, c: dict, theta: float = 10000.0, eps: float = 1e-6) -> dict:
    """The ModelConfig fields of a Llama-family config.json (`theta`, `eps`: the architecture's
    defaults for rope_theta and rms_norm_eps); MlmError for an activation other than SiLU."""
    if c.get("hidden_act", "silu") != "silu":
        raise MlmError(
            f"Hugging Face config hidden_act={c['hidden_act']!r}: mlm's {a.model_type} MLP is SwiGLU ('silu')"
        )
    D, H = a.get(c, "hidden_size"), a.get(c, "num_attention_heads")
    theta, scaling = rope(c, theta)
    scaled = {}
    if scaling is not None:
        scaled = dict(
            scaling_factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        )
    return dict(
        **rmsnorm_swiglu_fields(a, c, eps),
        num_query_groups=c.get("num_key_value_heads") or H,
        kv_channels=ModelConfig.kv_channels_from(D, H, c.get("head_dim")),
        rope=RopeConfig(base=theta, **scaled),
        attention_dropout=float(c.get("attention_dropout", 0.0)),
    )


LLAMA_RULES = dict(normalization="rmsnorm", position_embedding="rope", activation="swiglu", add_bias=False)
"""What every Llama-family architecture needs of a ModelConfig."""


def check_llama3_scaling(cfg: ModelConfig, target: str) -> None:
    """MlmError unless `cfg`'s RoPE scaling, if any, is Llama-3.1's (the one `target` writes)."""
    if cfg.rope.scaling_factor is not None and cfg.rope.scaling_type != "llama3":
        raise MlmError(
            f"this model cannot be written as {target}: model.rope.scaling_type={cfg.rope.scaling_type!r} "
            "(its RoPE scaling is written as Llama-3.1's, rope_type llama3); export a model with "
            "model.rope.scaling_type=llama3 or no model.rope.scaling_factor"
        )


def llama3_rope_scaling(cfg: ModelConfig) -> dict | None:
    """Hugging Face's `rope_scaling` dict of Llama 3.1's RoPE scaling (None without scaling)."""
    if cfg.rope.scaling_factor is None:
        return None
    return {
        "rope_type": "llama3",
        "factor": cfg.rope.scaling_factor,
        "low_freq_factor": cfg.rope.low_freq_factor,
        "high_freq_factor": cfg.rope.high_freq_factor,
        "original_max_position_embeddings": cfg.rope.original_max_position_embeddings,
    }


def llama_to_hf(a: Adapter, cfg: ModelConfig) -> dict:
    """The config.json keys every Llama-family architecture shares (the caller checked `cfg`)."""
    check_llama3_scaling(cfg, f"Hugging Face {a.model_type}")
    return {
        "architectures": [a.hf_class],
        "model_type": a.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.query_groups,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope.base,
        "rope_scaling": llama3_rope_scaling(cfg),
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_dropout": cfg.attention_dropout,
        "initializer_range": cfg.init_std,
    }


class LlamaAdapter(Adapter):
    model_type = "llama"
    hf_class = "LlamaForCausalLM"
    from_hf = KEYS

    def config_from_hf(self, c: dict) -> ModelConfig:
        for key in ("attention_bias", "mlp_bias"):
            if c.get(key):
                raise MlmError(
                    f"Hugging Face config {key}=true: mlm's Llama has no biases; only {key}=false converts"
                )
        return ModelConfig(**llama_fields(self, c))

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        self.require(cfg, dict(LLAMA_RULES, qkv_bias=False, qk_norm=False))
        return {**llama_to_hf(self, cfg), "attention_bias": False, "mlp_bias": False}


LLAMA = LlamaAdapter()
