"""Mixtral (`MixtralForCausalLM`) ⇄ mlm: Mistral's attention, and in every layer a mixture of
experts whose SwiGLU `w1` (gate), `w3` (up), `w2` (down) are stacked over the experts into one mlm
tensor each. Routing is softmax, top-k, renormalised: mlm's default router. Key and field tables:
docs/hf.md (Mixtures of experts).
"""

from __future__ import annotations

from mlm.config import ModelConfig, MoEConfig
from mlm.convert.hf.llama import LLAMA_RULES, check_window, llama_fields, llama_keys, llama_to_hf
from mlm.convert.hf.moe import ROUTER_RULES, MoEAdapter
from mlm.convert.keymap import Target, stacked
from mlm.errors import MlmError

_MOE = "model.layers.{layer}.block_sparse_moe"
KEYS: dict[str, Target] = llama_keys(
    {
        f"{_MOE}.gate.weight": "layers.{layer}.mlp.router.weight",
        f"{_MOE}.experts.{{expert}}.w1.weight": stacked("layers.{layer}.mlp.experts.gate.weight"),
        f"{_MOE}.experts.{{expert}}.w3.weight": stacked("layers.{layer}.mlp.experts.up.weight"),
        f"{_MOE}.experts.{{expert}}.w2.weight": stacked("layers.{layer}.mlp.experts.down.weight"),
    }
)


class MixtralAdapter(MoEAdapter):
    model_type = "mixtral"
    hf_class = "MixtralForCausalLM"
    from_hf = KEYS

    def config_from_hf(self, c: dict) -> ModelConfig:
        jitter = c.get("router_jitter_noise") or 0.0
        if jitter > 0:
            raise MlmError(
                f"Hugging Face config router_jitter_noise={jitter}: mlm's router has no jitter (Mixtral "
                "scales the input of router and experts by U(1 ± noise) in training); set it to 0.0 "
                "in config.json to convert (it changes nothing at inference)"
            )
        check_window(c.get("sliding_window"), self.get(c, "max_position_embeddings"))
        fields = llama_fields(self, c, theta=1e6, eps=1e-5)
        return ModelConfig(**fields, mlp_kind="moe", moe=MoEConfig(**self.router(c, renormalise=True)))

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        rules = {
            **LLAMA_RULES,
            "qkv_bias": False,
            "qk_norm": False,
            **ROUTER_RULES,
            "moe.router_pre_softmax": False,
            "moe.shared_expert_ffn_hidden_size": None,
        }
        self.require(cfg, rules, mlp=("moe",))
        return {
            **llama_to_hf(self, cfg),
            "intermediate_size": cfg.expert_ffn_size,  # every layer is MoE: only the experts' width
            "num_local_experts": cfg.moe.num_experts,
            **self.router_to_hf(cfg),
            "router_jitter_noise": 0.0,
            "sliding_window": None,
        }


MIXTRAL = MixtralAdapter()
