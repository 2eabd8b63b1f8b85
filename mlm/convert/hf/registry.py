"""The supported architectures, by config.json `model_type` and transformers class, and the config
translation that picks one."""

from __future__ import annotations

from mlm.config import ModelConfig
from mlm.convert.hf.adapter import Adapter
from mlm.convert.hf.deepseek_v3 import DEEPSEEK_V3
from mlm.convert.hf.gpt2 import GPT2
from mlm.convert.hf.llama import LLAMA
from mlm.convert.hf.mamba2 import MAMBA2
from mlm.convert.hf.mistral import MISTRAL
from mlm.convert.hf.mixtral import MIXTRAL
from mlm.convert.hf.nemotron_h import NEMOTRON_H
from mlm.convert.hf.qwen2 import QWEN2
from mlm.convert.hf.qwen2_moe import QWEN2_MOE
from mlm.convert.hf.qwen3 import QWEN3
from mlm.convert.hf.qwen3_moe import QWEN3_MOE
from mlm.convert.hf.qwen3_next import QWEN3_NEXT
from mlm.errors import MlmError

ADAPTERS: dict[str, Adapter] = {
    a.model_type: a
    for a in (
        LLAMA,
        GPT2,
        MISTRAL,
        QWEN2,
        QWEN3,
        MIXTRAL,
        QWEN2_MOE,
        QWEN3_MOE,
        DEEPSEEK_V3,
        MAMBA2,
        NEMOTRON_H,
        QWEN3_NEXT,
    )
}
_ALIASES = {a.hf_class: a.model_type for a in ADAPTERS.values()}


def adapter(arch: str) -> Adapter:
    """The adapter for a model_type ("llama", "gpt2") or transformers class name."""
    name = _ALIASES.get(arch, arch)
    if name not in ADAPTERS:
        raise MlmError(
            f"Hugging Face architecture {arch!r} is not supported; supported model_type values: "
            f"{', '.join(ADAPTERS)} (classes {', '.join(_ALIASES)})"
        )
    return ADAPTERS[name]


def config_from_hf(hf_config: dict) -> ModelConfig:
    """A ModelConfig from a Hugging Face config.json dict (or a transformers config object).

    The vocabulary keeps mlm's padding (`make_vocab_size_divisible_by`); the engine pads and
    un-pads the embedding rows."""
    if hasattr(hf_config, "to_dict"):
        hf_config = hf_config.to_dict()
    model_type = hf_config.get("model_type")
    if model_type not in ADAPTERS:
        raise MlmError(
            f"Hugging Face config model_type={model_type!r} is not supported; supported: {', '.join(ADAPTERS)}"
        )
    return ADAPTERS[model_type].config_from_hf(hf_config)


def config_to_hf(cfg: ModelConfig, arch: str) -> dict:
    """The Hugging Face config.json dict for `cfg` (transformers 4.x keys, which 5.x also reads)."""
    return adapter(arch).config_to_hf(cfg)


def arch_of(cfg: ModelConfig, source: str = "") -> str:
    """The Hugging Face model_type a config converts to: `source` (the transformers class or
    model_type it was imported from) when supported; else multi-latent attention: deepseek_v3;
    Gated DeltaNet layers: qwen3_next; Mamba-2 layers alone: mamba2, with others: nemotron_h;
    learned positions: gpt2; MoE layers: qwen3_moe with q/k norms, qwen2_moe with shared experts,
    else mixtral; dense: qwen3 with q/k norms, qwen2 with q/k/v biases, otherwise llama."""
    if _ALIASES.get(source, source) in ADAPTERS:
        return _ALIASES.get(source, source)
    if "mla" in cfg.mixer_kinds():
        return "deepseek_v3"
    if "gdn" in cfg.mixer_kinds():
        return "qwen3_next"
    if "mamba" in cfg.mixer_kinds():
        return "mamba2" if set(cfg.mixer_kinds()) == {"mamba"} and not cfg.mlp_kinds() else "nemotron_h"
    if cfg.position_embedding == "learned":
        return "gpt2"
    if any(s.mlp == "moe" for s in cfg.layer_specs()):
        if cfg.qk_norm:
            return "qwen3_moe"
        return "qwen2_moe" if cfg.moe.shared_expert_ffn_hidden_size else "mixtral"
    if cfg.qk_norm:
        return "qwen3"
    return "qwen2" if cfg.qkv_bias else "llama"
