"""Hugging Face ⇄ mlm: configs and state dicts of Llama (`LlamaForCausalLM`), Mistral
(`MistralForCausalLM`, Llama's layout; full attention only) and GPT-2 (`GPT2LMHeadModel`).

One adapter per architecture, in the style of torchtitan's `state_dict_adapter.py` and litgpt's
`convert_hf_checkpoint.py`: a map from Hugging Face key templates to mlm key templates (`{}` is the
layer index, `None` drops the key, a tuple splits one fused HF tensor into several mlm tensors),
plus the few layout changes a template cannot say:

- GPT-2's `Conv1D` stores weights as [in, out]; mlm's `nn.Linear` as [out, in] (transposed here).
- GPT-2 fuses q, k, v into `c_attn` ([D, 3D]); mlm keeps `attn.q`, `attn.k`, `attn.v` apart.
- mlm pads the embedding and output rows to `cfg.padded_vocab_size()` (Megatron's padding):
  import appends zero rows, export slices them off.

Llama needs no q/k permutation: mlm's RoPE uses HF's rotate-half layout (tests/test_hf_numerics.py
checks the logits). Every tensor's shape is checked against the shape the config implies, and
errors name the key and both shapes.

    cfg = config_from_hf(json.load(open("config.json")))
    model = GPT(cfg); load_hf_into(model, hf_state)            # HF → mlm
    hf_state, hf_config = mlm_to_hf(model.state_dict(), cfg, "llama")   # mlm → HF
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import google_crc32c
import numpy as np
import torch
from torch import nn

from mlm.config import ModelConfig
from mlm.errors import MlmError
from mlm.model.gpt import GPT, VOCAB_ROWS

Template = str | tuple[str, ...] | None


@dataclass(frozen=True)
class Adapter:
    """How one Hugging Face architecture's state dict maps onto mlm's."""

    model_type: str
    """config.json's `model_type`."""
    hf_class: str
    """The transformers class, written to config.json's `architectures`."""
    from_hf: dict[str, Template]
    """HF key template → mlm key template(s), or None to drop the key."""
    conv1d: frozenset[str] = field(default_factory=frozenset)
    """HF templates stored [in, out] (GPT-2's Conv1D), transposed on the way through."""
    prefix: str = ""
    """A prefix some checkpoints of this architecture leave out (GPT-2's `transformer.`)."""


LLAMA = Adapter(
    model_type="llama",
    hf_class="LlamaForCausalLM",
    from_hf={
        "model.embed_tokens.weight": "embed.weight",
        "model.layers.{}.input_layernorm.weight": "layers.{}.attn_norm.weight",
        "model.layers.{}.self_attn.q_proj.weight": "layers.{}.attn.q.weight",
        "model.layers.{}.self_attn.k_proj.weight": "layers.{}.attn.k.weight",
        "model.layers.{}.self_attn.v_proj.weight": "layers.{}.attn.v.weight",
        "model.layers.{}.self_attn.o_proj.weight": "layers.{}.attn.out.weight",
        "model.layers.{}.self_attn.rotary_emb.inv_freq": None,
        "model.layers.{}.post_attention_layernorm.weight": "layers.{}.mlp_norm.weight",
        "model.layers.{}.mlp.gate_proj.weight": "layers.{}.mlp.gate.weight",
        "model.layers.{}.mlp.up_proj.weight": "layers.{}.mlp.up.weight",
        "model.layers.{}.mlp.down_proj.weight": "layers.{}.mlp.down.weight",
        "model.norm.weight": "final_norm.weight",
        "model.rotary_emb.inv_freq": None,
        "model.rotary_emb.original_inv_freq": None,
        "lm_head.weight": "output.weight",
    },
)

# Mistral is Llama's network and key names plus sliding-window attention, which mlm does not have:
# it converts when the window covers every position the model takes (see _mistral_config).
MISTRAL = Adapter(model_type="mistral", hf_class="MistralForCausalLM", from_hf=LLAMA.from_hf)

_QKV = ("layers.{}.attn.q", "layers.{}.attn.k", "layers.{}.attn.v")
GPT2 = Adapter(
    model_type="gpt2",
    hf_class="GPT2LMHeadModel",
    from_hf={
        "transformer.wte.weight": "embed.weight",
        "transformer.wpe.weight": "pos_embed.weight",
        "transformer.h.{}.ln_1.weight": "layers.{}.attn_norm.weight",
        "transformer.h.{}.ln_1.bias": "layers.{}.attn_norm.bias",
        "transformer.h.{}.attn.c_attn.weight": tuple(f"{k}.weight" for k in _QKV),
        "transformer.h.{}.attn.c_attn.bias": tuple(f"{k}.bias" for k in _QKV),
        "transformer.h.{}.attn.c_proj.weight": "layers.{}.attn.out.weight",
        "transformer.h.{}.attn.c_proj.bias": "layers.{}.attn.out.bias",
        "transformer.h.{}.attn.bias": None,  # causal-mask buffers of older checkpoints
        "transformer.h.{}.attn.masked_bias": None,
        "transformer.h.{}.ln_2.weight": "layers.{}.mlp_norm.weight",
        "transformer.h.{}.ln_2.bias": "layers.{}.mlp_norm.bias",
        "transformer.h.{}.mlp.c_fc.weight": "layers.{}.mlp.up.weight",
        "transformer.h.{}.mlp.c_fc.bias": "layers.{}.mlp.up.bias",
        "transformer.h.{}.mlp.c_proj.weight": "layers.{}.mlp.down.weight",
        "transformer.h.{}.mlp.c_proj.bias": "layers.{}.mlp.down.bias",
        "transformer.ln_f.weight": "final_norm.weight",
        "transformer.ln_f.bias": "final_norm.bias",
        "lm_head.weight": "output.weight",
    },
    conv1d=frozenset(
        {
            "transformer.h.{}.attn.c_attn.weight",
            "transformer.h.{}.attn.c_proj.weight",
            "transformer.h.{}.mlp.c_fc.weight",
            "transformer.h.{}.mlp.c_proj.weight",
        }
    ),
    prefix="transformer.",
)

ADAPTERS: dict[str, Adapter] = {a.model_type: a for a in (LLAMA, GPT2, MISTRAL)}
_ALIASES = {a.hf_class: a.model_type for a in ADAPTERS.values()}
_LAYER = re.compile(r"\.(\d+)\.")


def adapter(arch: str) -> Adapter:
    """The adapter for a model_type ("llama", "gpt2") or transformers class name."""
    name = _ALIASES.get(arch, arch)
    if name not in ADAPTERS:
        raise MlmError(
            f"Hugging Face architecture {arch!r} is not supported; supported model_type values: "
            f"{', '.join(ADAPTERS)} (classes {', '.join(_ALIASES)})"
        )
    return ADAPTERS[name]


# ---------------------------------------------------------------- configs


def _get(c: dict, key: str, model_type: str):
    if c.get(key) is None:
        raise MlmError(
            f"Hugging Face config (model_type {model_type!r}) has no {key!r}; is it a complete config.json?"
        )
    return c[key]


def _llama_rope(c: dict) -> tuple[float, dict | None]:
    """(theta, llama3 scaling or None) from a transformers 4.x (`rope_theta` + `rope_scaling`) or
    5.x (`rope_parameters`, theta inside) config."""
    rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    theta = rope.get("rope_theta", c.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise MlmError(
            f"rope partial_rotary_factor={rope['partial_rotary_factor']}: mlm rotates the whole head (1.0)"
        )
    if rope_type == "default":
        return float(theta), None
    if rope_type != "llama3":
        raise MlmError(f"rope_scaling rope_type={rope_type!r}: mlm supports 'default' (none) and 'llama3'")
    need = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in need if k not in rope]
    if missing:
        raise MlmError(f"rope_scaling (llama3) lacks {', '.join(missing)}; it needs {', '.join(need)}")
    return float(theta), rope


def _llama_config(c: dict, model_type: str = "llama") -> ModelConfig:
    g = lambda key: _get(c, key, model_type)  # noqa: E731
    for key in ("attention_bias", "mlp_bias"):
        if c.get(key):
            raise MlmError(
                f"Hugging Face config {key}=true: mlm's Llama has no biases; only {key}=false converts"
            )
    if c.get("hidden_act", "silu") != "silu":
        raise MlmError(
            f"Hugging Face config hidden_act={c['hidden_act']!r}: mlm's Llama MLP is SwiGLU ('silu')"
        )
    D, H = g("hidden_size"), g("num_attention_heads")
    if c.get("head_dim") not in (None, D // H) or D % H:
        raise MlmError(
            f"Hugging Face config head_dim={c.get('head_dim')}: mlm needs head_dim = hidden_size / "
            f"num_attention_heads = {D}/{H}"
        )
    theta, scaling = _llama_rope(c)
    rope = {}
    if scaling is not None:
        rope = dict(
            rope_scaling_factor=float(scaling["factor"]),
            rope_low_freq_factor=float(scaling["low_freq_factor"]),
            rope_high_freq_factor=float(scaling["high_freq_factor"]),
            rope_original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        )
    return ModelConfig(
        num_layers=g("num_hidden_layers"),
        hidden_size=D,
        num_attention_heads=H,
        num_query_groups=c.get("num_key_value_heads") or H,
        ffn_hidden_size=g("intermediate_size"),
        vocab_size=g("vocab_size"),
        max_position_embeddings=g("max_position_embeddings"),
        normalization="rmsnorm",
        norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        position_embedding="rope",
        rope_base=theta,
        **rope,
        activation="swiglu",
        add_bias=False,
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        attention_dropout=float(c.get("attention_dropout", 0.0)),
        init_std=float(c.get("initializer_range", 0.02)),
    )


def _mistral_config(c: dict) -> ModelConfig:
    window, positions = c.get("sliding_window"), _get(c, "max_position_embeddings", "mistral")
    if window is not None and window < positions:
        raise MlmError(
            f"Hugging Face config sliding_window={window} < max_position_embeddings={positions}: mlm has "
            f"no sliding-window attention, so positions beyond {window} would attend differently. Set "
            f"max_position_embeddings to {window} (or less) in config.json to convert it exactly, or "
            "sliding_window to null if the model uses full attention"
        )
    return _llama_config(c, "mistral")


_GPT2_ACT = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


def _gpt2_config(c: dict) -> ModelConfig:
    g = lambda key: _get(c, key, "gpt2")  # noqa: E731
    act = c.get("activation_function", "gelu_new")
    if act not in _GPT2_ACT:
        raise MlmError(
            f"Hugging Face config activation_function={act!r}: mlm converts {', '.join(_GPT2_ACT)}"
        )
    rules = {
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "add_cross_attention": False,
    }
    for key, want in rules.items():
        if c.get(key, want) != want:
            raise MlmError(f"Hugging Face config {key}={c[key]}: mlm's attention needs {key}={want}")
    return ModelConfig(
        num_layers=g("n_layer"),
        hidden_size=g("n_embd"),
        num_attention_heads=g("n_head"),
        ffn_hidden_size=c.get("n_inner"),
        vocab_size=g("vocab_size"),
        max_position_embeddings=g("n_positions"),
        normalization="layernorm",
        norm_eps=float(c.get("layer_norm_epsilon", 1e-5)),
        position_embedding="learned",
        activation=_GPT2_ACT[act],
        add_bias=True,
        tie_embeddings=bool(c.get("tie_word_embeddings", True)),
        # mlm has one rate for embeddings and residuals; GPT-2's embd_pdrop and resid_pdrop are equal (0.1)
        hidden_dropout=float(c.get("resid_pdrop", 0.1)),
        attention_dropout=float(c.get("attn_pdrop", 0.1)),
        init_std=float(c.get("initializer_range", 0.02)),
    )


def config_from_hf(hf_config: dict) -> ModelConfig:
    """A ModelConfig from a Hugging Face config.json dict (or a transformers config object).

    The vocabulary keeps mlm's padding (`make_vocab_size_divisible_by`); the adapter pads and
    un-pads the embedding rows."""
    if hasattr(hf_config, "to_dict"):
        hf_config = hf_config.to_dict()
    model_type = hf_config.get("model_type")
    if model_type not in ADAPTERS:
        raise MlmError(
            f"Hugging Face config model_type={model_type!r} is not supported; supported: {', '.join(ADAPTERS)}"
        )
    if model_type == "mistral":
        return _mistral_config(hf_config)
    return _llama_config(hf_config) if model_type == "llama" else _gpt2_config(hf_config)


def _require(cfg: ModelConfig, arch: str, rules: dict[str, object]) -> None:
    bad = [f"model.{k}={getattr(cfg, k)!r} (needs {v!r})" for k, v in rules.items() if getattr(cfg, k) != v]
    if bad:
        raise MlmError(f"this model cannot be written as Hugging Face {arch}: {'; '.join(bad)}")


def config_to_hf(cfg: ModelConfig, arch: str) -> dict:
    """The Hugging Face config.json dict for `cfg` (transformers 4.x keys, which 5.x also reads)."""
    a = adapter(arch)
    if a in (LLAMA, MISTRAL):
        _require(
            cfg,
            a.model_type,
            dict(normalization="rmsnorm", position_embedding="rope", activation="swiglu", add_bias=False),
        )
        scaling = None
        if cfg.rope_scaling_factor is not None:
            scaling = {
                "rope_type": "llama3",
                "factor": cfg.rope_scaling_factor,
                "low_freq_factor": cfg.rope_low_freq_factor,
                "high_freq_factor": cfg.rope_high_freq_factor,
                "original_max_position_embeddings": cfg.rope_original_max_position_embeddings,
            }
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
            "rope_theta": cfg.rope_base,
            "rope_scaling": scaling,
            "tie_word_embeddings": cfg.tie_embeddings,
            "attention_dropout": cfg.attention_dropout,
            "initializer_range": cfg.init_std,
            **({"sliding_window": None} if a is MISTRAL else {"attention_bias": False, "mlp_bias": False}),
        }
    _require(
        cfg,
        "gpt2",
        dict(normalization="layernorm", position_embedding="learned", add_bias=True),
    )
    if cfg.activation not in ("gelu_tanh", "gelu") or cfg.query_groups != cfg.num_attention_heads:
        raise MlmError(
            f"this model cannot be written as Hugging Face gpt2: model.activation={cfg.activation!r} "
            f"(needs 'gelu_tanh' or 'gelu'), model.num_query_groups={cfg.num_query_groups} "
            f"(needs unset or {cfg.num_attention_heads}: GPT-2 has no GQA)"
        )
    return {
        "architectures": [a.hf_class],
        "model_type": a.model_type,
        "vocab_size": cfg.vocab_size,
        "n_embd": cfg.hidden_size,
        "n_layer": cfg.num_layers,
        "n_head": cfg.num_attention_heads,
        "n_positions": cfg.max_position_embeddings,
        "n_inner": cfg.ffn_hidden_size,
        "activation_function": "gelu_new" if cfg.activation == "gelu_tanh" else "gelu",
        "layer_norm_epsilon": cfg.norm_eps,
        "resid_pdrop": cfg.hidden_dropout,
        "embd_pdrop": cfg.hidden_dropout,
        "attn_pdrop": cfg.attention_dropout,
        "initializer_range": cfg.init_std,
        "tie_word_embeddings": cfg.tie_embeddings,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
    }


def arch_of(cfg: ModelConfig) -> str:
    """The Hugging Face model_type a config converts to (Llama-style models export as llama)."""
    if cfg.position_embedding == "learned":
        return "gpt2"
    return "llama"


# ---------------------------------------------------------------- state dicts


def _mlm_shapes(cfg: ModelConfig, padded_vocab: int | None) -> dict[str, torch.Size]:
    with torch.device("meta"):
        model = GPT(cfg, padded_vocab)
    return {k: v.shape for k, v in model.state_dict().items()}


def _shape(t) -> list[int]:
    return list(t.shape)


def _check_mlm_state(mlm_state: dict, cfg: ModelConfig, padded_vocab: int | None) -> None:
    want = _mlm_shapes(cfg, padded_vocab)
    missing = sorted(want.keys() - mlm_state.keys())
    unknown = sorted(mlm_state.keys() - want.keys())
    if missing or unknown:
        raise MlmError(
            f"mlm state dict does not match the config: missing {missing or 'none'}; unexpected {unknown or 'none'} "
            "(was it saved from a model with this config?)"
        )
    for k, shape in want.items():
        if mlm_state[k].shape != shape:
            raise MlmError(
                f"mlm state dict {k}: shape {_shape(mlm_state[k])}, but the config needs {list(shape)}"
            )


def _layer_keys(template: str, cfg: ModelConfig) -> list[tuple[str, int | None]]:
    if "{}" in template:
        return [(template.format(i), i) for i in range(cfg.num_layers)]
    return [(template, None)]


def _fill(target: Template, layer: int | None) -> tuple[str, ...]:
    targets = target if isinstance(target, tuple) else (target,)
    return tuple(t.format(layer) if layer is not None else t for t in targets)


def mlm_to_hf(
    mlm_state: dict[str, torch.Tensor], cfg: ModelConfig, arch: str, padded_vocab: int | None = None
) -> tuple[dict[str, torch.Tensor], dict]:
    """mlm state dict → (Hugging Face state dict, config.json dict).

    Padding rows are sliced off the vocabulary, GPT-2's q/k/v are fused into `c_attn` and its
    Conv1D weights transposed. With tied embeddings `lm_head.weight` is left out, as
    `save_pretrained` does. Tensors are contiguous and keep their dtype."""
    a = adapter(arch)
    hf_config = config_to_hf(cfg, a.model_type)
    _check_mlm_state(mlm_state, cfg, padded_vocab)
    out: dict[str, torch.Tensor] = {}
    for hf_template, target in a.from_hf.items():
        if target is None:
            continue
        for hf_key, layer in _layer_keys(hf_template, cfg):
            keys = _fill(target, layer)
            if keys[0] not in mlm_state:  # lm_head when tied, wpe with RoPE
                continue
            t = torch.cat([mlm_state[k] for k in keys]) if len(keys) > 1 else mlm_state[keys[0]]
            if keys[0] in VOCAB_ROWS:
                t = t[: cfg.vocab_size]
            if hf_template in a.conv1d:
                t = t.t()
            out[hf_key] = t.contiguous()
    return out, hf_config


def _hf_shapes(cfg: ModelConfig, a: Adapter, padded_vocab: int | None) -> dict[str, torch.Size]:
    """The HF key → shape that `cfg` implies: the export of a model built on the meta device."""
    with torch.device("meta"):
        state = GPT(cfg, padded_vocab).state_dict()
    hf_state, _ = mlm_to_hf(state, cfg, a.model_type, padded_vocab)
    return {k: v.shape for k, v in hf_state.items()}


def _template(key: str) -> tuple[str, int | None]:
    """A key's template and layer: model.layers.3.mlp.up_proj.weight → (model.layers.{}.mlp.up_proj.weight, 3)."""
    m = _LAYER.search(key)
    if m is None:
        return key, None
    return f"{key[: m.start()]}.{{}}.{key[m.end() :]}", int(m.group(1))


LazyTensor = tuple[torch.Size, Callable[[], torch.Tensor]]
"""A tensor not read yet: its shape, and a function that reads it."""


def hf_to_mlm(
    hf_state: dict[str, torch.Tensor],
    cfg: ModelConfig,
    arch: str | None = None,
    padded_vocab: int | None = None,
) -> dict[str, torch.Tensor]:
    """Hugging Face state dict → mlm state dict, keys exactly as `GPT(cfg).state_dict()` has them.

    `arch` defaults to the one `cfg` describes (learned positions: gpt2, else llama). The
    vocabulary rows are padded with zeros to `padded_vocab` (default `cfg.padded_vocab_size()`).
    Tensors keep their dtype; untransposed ones share memory with `hf_state`."""
    lazy = {k: (t.shape, lambda t=t: t) for k, t in hf_state.items()}
    return dict(iter_hf_to_mlm(lazy, cfg, arch, padded_vocab))


def iter_hf_to_mlm(
    hf_tensors: dict[str, LazyTensor],
    cfg: ModelConfig,
    arch: str | None = None,
    padded_vocab: int | None = None,
    passthrough: Callable[[str], object] | None = None,
) -> Iterator[tuple[str, object]]:
    """`hf_to_mlm` one tensor at a time: every key and shape is checked before the first tensor is
    read, then each is read, converted and yielded (mlm key, tensor) in turn, so memory holds one
    Hugging Face tensor. With tied embeddings a stored `lm_head.weight` must equal the embedding
    (compared by CRC-32C as they pass; MlmError after the last tensor otherwise). `passthrough`:
    a tensor that converts to itself (no split, transpose or padding) is not read; (mlm key,
    passthrough(its Hugging Face key)) is yielded instead, for a caller that copies the bytes."""
    a = adapter(arch or arch_of(cfg))
    config_to_hf(cfg, a.model_type)  # raises if cfg is not this architecture
    V = padded_vocab or cfg.padded_vocab_size()
    want = _hf_shapes(cfg, a, padded_vocab)
    found: dict[str, str] = {}  # HF key as stored → with the prefix
    unknown, bad = [], []
    for key, (shape, _) in hf_tensors.items():
        k = key
        if a.prefix and not k.startswith(a.prefix) and not k.startswith("lm_head."):
            k = a.prefix + k
        template, layer = _template(k)
        if template not in a.from_hf:
            unknown.append(key)
        elif layer is not None and layer >= cfg.num_layers:
            unknown.append(f"{key} (layer {layer}, but num_layers={cfg.num_layers})")
        elif a.from_hf[template] is None:
            continue
        elif k == "lm_head.weight" and cfg.tie_embeddings:
            found[key] = k  # checked against the embedding, then dropped
        elif shape != want[k]:
            bad.append(
                f"{key}: shape {list(shape)} in the Hugging Face state, but the config needs {list(want[k])}"
            )
        else:
            found[key] = k
    if unknown:
        raise MlmError(
            f"Hugging Face {a.model_type} state has keys mlm does not know: {', '.join(unknown)}; "
            f"known templates: {', '.join(a.from_hf)}"
        )
    if bad:
        raise MlmError(
            "Hugging Face state does not match the config: "
            + "; ".join(bad)
            + " (build the config with config_from_hf from the checkpoint's own config.json)"
        )
    missing = sorted(want.keys() - set(found.values()))
    if missing:
        raise MlmError(f"Hugging Face {a.model_type} state lacks {', '.join(missing)}")

    shapes = _mlm_shapes(cfg, padded_vocab)
    embed_key = next(k for k, v in a.from_hf.items() if v == "embed.weight")
    tied: dict[str, tuple] = {}
    for key, k in found.items():
        template, layer = _template(k)
        keys = _fill(a.from_hf[template], layer)
        tied_key = cfg.tie_embeddings and k in (embed_key, "lm_head.weight")
        shape = hf_tensors[key][0]
        same = len(keys) == 1 and template not in a.conv1d and (keys[0] not in VOCAB_ROWS or shape[0] == V)
        if passthrough is not None and same and not tied_key:
            yield keys[0], passthrough(key)  # stored as it is: the caller copies it
            continue
        t = hf_tensors[key][1]()
        if tied_key:
            tied[k] = (t.shape, t.dtype, _digest(t))
            if k == "lm_head.weight":
                continue
        if template in a.conv1d:
            t = t.t().contiguous()
        parts = t.split([shapes[mk][0] for mk in keys]) if len(keys) > 1 else (t,)
        for mk, p in zip(keys, parts, strict=True):
            if mk in VOCAB_ROWS and p.shape[0] != V:
                p = torch.cat([p, p.new_zeros(V - p.shape[0], *p.shape[1:])])
            yield mk, p.contiguous()
    if "lm_head.weight" in tied and tied["lm_head.weight"] != tied[embed_key]:
        raise MlmError(
            f"the config ties embeddings (tie_word_embeddings=true) but lm_head.weight differs from "
            f"{embed_key}; use a config with tie_word_embeddings=false for this checkpoint"
        )


def _digest(t: torch.Tensor) -> int:
    data = t.detach().contiguous().view(torch.uint8).numpy() if t.numel() else np.zeros(0, np.uint8)
    return google_crc32c.value(data.reshape(-1))


def _numerics(cfg: ModelConfig) -> dict[str, object]:
    """The config values that change what the model computes (not dropout, init or max length)."""
    d = dict(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.query_groups,
        ffn_hidden_size=cfg.ffn_size,
        vocab_size=cfg.vocab_size,
        normalization=cfg.normalization,
        norm_eps=cfg.norm_eps,
        position_embedding=cfg.position_embedding,
        activation=cfg.activation,
        add_bias=cfg.add_bias,
        tie_embeddings=cfg.tie_embeddings,
    )
    if cfg.position_embedding == "rope":
        d.update(rope_base=cfg.rope_base, rope_scaling_factor=cfg.rope_scaling_factor)
        if cfg.rope_scaling_factor is not None:
            d.update(
                rope_low_freq_factor=cfg.rope_low_freq_factor,
                rope_high_freq_factor=cfg.rope_high_freq_factor,
                rope_original_max_position_embeddings=cfg.rope_original_max_position_embeddings,
            )
    return d


def load_hf_into(model: GPT, hf_model_or_state: nn.Module | dict[str, torch.Tensor]) -> GPT:
    """Load a transformers model (or its state dict) into an mlm model with `strict=True`.

    Given a model, its config must describe the same network as `model.cfg` (build that with
    `config_from_hf(hf_model.config.to_dict())`); a state dict is checked by its shapes only."""
    cfg = model.cfg
    state = hf_model_or_state
    if isinstance(hf_model_or_state, nn.Module):
        ours, theirs = _numerics(cfg), _numerics(config_from_hf(hf_model_or_state.config.to_dict()))
        diff = [
            f"model.{k}: mlm {ours[k]!r}, Hugging Face {theirs.get(k)!r}"
            for k in ours
            if ours[k] != theirs.get(k)
        ]
        if diff:
            raise MlmError(
                "the Hugging Face model and the mlm model differ: "
                + "; ".join(diff)
                + " (build the mlm model from config_from_hf(hf_model.config.to_dict()))"
            )
        state = hf_model_or_state.state_dict()
    model.load_state_dict(hf_to_mlm(state, cfg, padded_vocab=model.embed.weight.shape[0]), strict=True)
    return model
