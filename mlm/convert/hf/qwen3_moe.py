"""Qwen3-MoE (`Qwen3MoeForCausalLM`) ⇄ mlm: Qwen2-MoE's experts and layer rule without the shared
expert, and Qwen3's attention (no biases, `qk_norm`, an explicit head_dim). Released configs set
norm_topk_prob=true: mlm's default router. Key and field tables: docs/hf.md (Mixtures of experts).
"""

from __future__ import annotations

from mlm.config import ModelConfig
from mlm.convert.hf.llama import DENSE_MLP, LLAMA_RULES, llama_keys
from mlm.convert.hf.moe import ROUTER_RULES
from mlm.convert.hf.qwen2_moe import QWEN_EXPERTS, QwenMoeAdapter
from mlm.convert.hf.qwen3 import QK_NORMS, check_qwen3_attention
from mlm.convert.keymap import Target

KEYS: dict[str, Target] = llama_keys({**DENSE_MLP, **QWEN_EXPERTS}, QK_NORMS)


class Qwen3MoeAdapter(QwenMoeAdapter):
    model_type = "qwen3_moe"
    hf_class = "Qwen3MoeForCausalLM"
    from_hf = KEYS

    def config_from_hf(self, c: dict) -> ModelConfig:
        check_qwen3_attention(self, c)
        return self.qwen_config(c, {}, qk_norm=True)

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        rules = {
            **LLAMA_RULES,
            "qkv_bias": False,
            "qk_norm": True,
            **ROUTER_RULES,
            "moe.shared_expert_ffn_hidden_size": None,
        }
        self.require(cfg, rules, mlp=("dense", "moe"))
        return {
            **self.qwen_to_hf(cfg),
            "attention_bias": False,
            "use_sliding_window": False,
            "sliding_window": None,
        }


QWEN3_MOE = Qwen3MoeAdapter()
