"""Qwen3-MoE (`Qwen3MoeForCausalLM`) ⇄ mlm: Qwen2-MoE's experts and layer rule without the shared
expert, and Qwen3's attention: no biases, an RMSNorm over each head's query and key before RoPE
(`self_attn.q_norm` / `k_norm` [head_dim] ⇄ `attn.q_norm` / `k_norm`, mlm's `qk_norm`) and an
explicit head_dim (`kv_channels`). Released configs set norm_topk_prob=true: mlm's default
router. Field mapping: `mlm.convert.hf.moe`.
"""

from __future__ import annotations

from mlm.config import ModelConfig, MoEConfig
from mlm.convert.hf.llama import DENSE_MLP, LLAMA_RULES, llama_fields, llama_keys, llama_to_hf
from mlm.convert.hf.moe import ROUTER_RULES, MoEAdapter, sparse_layers, sparse_layers_to_hf
from mlm.convert.hf.qwen2_moe import QWEN_EXPERTS
from mlm.convert.hf.qwen3 import QK_NORMS, check_qwen3_attention
from mlm.convert.keymap import Target

KEYS: dict[str, Target] = llama_keys({**DENSE_MLP, **QWEN_EXPERTS}, QK_NORMS)


class Qwen3MoeAdapter(MoEAdapter):
    model_type = "qwen3_moe"
    hf_class = "Qwen3MoeForCausalLM"
    from_hf = KEYS

    def config_from_hf(self, c: dict) -> ModelConfig:
        check_qwen3_attention(self, c)
        moe = MoEConfig(
            **self.router(c, renormalise=bool(c.get("norm_topk_prob", False))),
            ffn_hidden_size=self.get(c, "moe_intermediate_size"),
        )
        return ModelConfig(
            **llama_fields(self, c),
            qk_norm=True,
            mlp_kind="moe",
            mlp_kind_freq=sparse_layers(self, c, moe.num_experts),
            moe=moe,
        )

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
            **llama_to_hf(self, cfg),
            "moe_intermediate_size": cfg.expert_ffn_size,
            "num_experts": cfg.moe.num_experts,
            "norm_topk_prob": not cfg.moe.router_pre_softmax,
            **self.router_to_hf(cfg),
            **sparse_layers_to_hf(cfg),
            "attention_bias": False,
            "use_sliding_window": False,
            "sliding_window": None,
        }


QWEN3_MOE = Qwen3MoeAdapter()
