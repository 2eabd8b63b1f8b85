"""Qwen3 (`Qwen3ForCausalLM`) ⇄ mlm: Llama's network with an RMSNorm over each head's query and
key before RoPE (`self_attn.q_norm` / `k_norm` ⇄ `attn.q_norm` / `k_norm`, mlm's `qk_norm`), an
explicit head_dim (`kv_channels`), no biases; Qwen2's sliding-window rule.
"""

from __future__ import annotations

from mlm.config import ModelConfig
from mlm.convert.hf.adapter import Adapter
from mlm.convert.hf.llama import DENSE_MLP, LLAMA_RULES, llama_fields, llama_keys, llama_to_hf
from mlm.convert.hf.qwen2_moe import qwen_window
from mlm.convert.keymap import Target
from mlm.errors import MlmError

QK_NORMS: dict[str, Target] = {
    f"model.layers.{{layer}}.self_attn.{p}_norm.weight": f"layers.{{layer}}.attn.{p}_norm.weight"
    for p in "qk"
}
"""Qwen3's (dense and MoE) per-head query and key norms."""

KEYS: dict[str, Target] = llama_keys(DENSE_MLP, QK_NORMS)


def check_qwen3_attention(a: Adapter, c: dict) -> None:
    """MlmError for what Qwen3's (dense and MoE) attention has and mlm does not: biases on its four
    projections, a sliding window used and shorter than the context."""
    if c.get("attention_bias"):
        raise MlmError(
            "Hugging Face config attention_bias=true: mlm has biases on q, k, v (qkv_bias) or on "
            "every linear layer (add_bias), not on the attention's four; only attention_bias=false converts"
        )
    qwen_window(c, a.get(c, "max_position_embeddings"))


class Qwen3Adapter(Adapter):
    model_type = "qwen3"
    hf_class = "Qwen3ForCausalLM"
    from_hf = KEYS

    def config_from_hf(self, c: dict) -> ModelConfig:
        check_qwen3_attention(self, c)
        return ModelConfig(**llama_fields(self, c), qk_norm=True)

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        self.require(cfg, dict(LLAMA_RULES, qkv_bias=False, qk_norm=True))
        return {
            **llama_to_hf(self, cfg),
            "attention_bias": False,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": cfg.num_layers,
        }


QWEN3 = Qwen3Adapter()
