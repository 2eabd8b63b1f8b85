"""Qwen2-MoE (`Qwen2MoeForCausalLM`) ⇄ mlm, and what Qwen3-MoE shares with it: Llama's network
with MoE layers chosen by decoder_sparse_step and mlp_only_layers (the others a dense MLP of
intermediate_size), experts of moe_intermediate_size stacked into one mlm tensor each; Qwen2-MoE
adds biases on q, k, v (`qkv_bias`) and a shared expert scaled by sigmoid(`shared_expert_gate` x).
Key and field tables: docs/hf.md (Mixtures of experts).
"""

from __future__ import annotations

from mlm.config import ModelConfig, MoEConfig
from mlm.convert.hf.llama import DENSE_MLP, LLAMA_RULES, check_window, llama_fields, llama_keys, llama_to_hf
from mlm.convert.hf.moe import ROUTER_RULES, MoEAdapter, sparse_layers, sparse_layers_to_hf
from mlm.convert.keymap import Target, stacked
from mlm.errors import MlmError

QWEN_EXPERTS: dict[str, Target] = {
    "model.layers.{layer}.mlp.gate.weight": "layers.{layer}.mlp.router.weight",
    **{
        f"model.layers.{{layer}}.mlp.experts.{{expert}}.{p}_proj.weight": stacked(
            f"layers.{{layer}}.mlp.experts.{p}.weight"
        )
        for p in ("gate", "up", "down")
    },
}
"""The routed experts of Qwen2-MoE and Qwen3-MoE (and the router)."""

_SHARED: dict[str, Target] = {
    **{
        f"model.layers.{{layer}}.mlp.shared_expert.{p}_proj.weight": f"layers.{{layer}}.mlp.shared.{p}.weight"
        for p in ("gate", "up", "down")
    },
    "model.layers.{layer}.mlp.shared_expert_gate.weight": "layers.{layer}.mlp.shared_gate.weight",
}
QKV_BIASES: dict[str, Target] = {
    f"model.layers.{{layer}}.self_attn.{p}_proj.bias": f"layers.{{layer}}.attn.{p}.bias" for p in "qkv"
}
"""Qwen2's (dense and MoE) biases on q, k and v."""

KEYS: dict[str, Target] = llama_keys({**DENSE_MLP, **QWEN_EXPERTS, **_SHARED}, QKV_BIASES)


def qwen_window(c: dict, positions: int) -> None:
    """Qwen's sliding window applies only with use_sliding_window (its sliding_window is kept,
    or 0, otherwise)."""
    if c.get("use_sliding_window"):
        check_window(c.get("sliding_window"), positions)


class QwenMoeAdapter(MoEAdapter):
    """What Qwen2-MoE and Qwen3-MoE share: the router (norm_topk_prob), the experts' width and the
    layers that have experts."""

    def qwen_config(self, c: dict, moe: dict, **fields) -> ModelConfig:
        """A Qwen-MoE config.json's ModelConfig: `fields` added to Llama's, `moe` to the router's."""
        moe = MoEConfig(
            **self.router(c, renormalise=bool(c.get("norm_topk_prob", False))),
            ffn_hidden_size=self.get(c, "moe_intermediate_size"),
            **moe,
        )
        freq = sparse_layers(self, c, moe.num_experts)
        return ModelConfig(**llama_fields(self, c), **fields, mlp_kind="moe", mlp_kind_freq=freq, moe=moe)

    def qwen_to_hf(self, cfg: ModelConfig, **shared) -> dict:
        """The config.json keys of every Qwen-MoE (the caller checked `cfg`), `shared` among them."""
        return {
            **llama_to_hf(self, cfg),
            "moe_intermediate_size": cfg.expert_ffn_size,
            **shared,
            "num_experts": cfg.moe.num_experts,
            "norm_topk_prob": not cfg.moe.router_pre_softmax,
            **self.router_to_hf(cfg),
            **sparse_layers_to_hf(cfg),
        }


class Qwen2MoeAdapter(QwenMoeAdapter):
    model_type = "qwen2_moe"
    hf_class = "Qwen2MoeForCausalLM"
    from_hf = KEYS

    def config_from_hf(self, c: dict) -> ModelConfig:
        qwen_window(c, self.get(c, "max_position_embeddings"))
        shared = self.get(c, "shared_expert_intermediate_size")
        if shared < 1:
            raise MlmError(
                f"Hugging Face config shared_expert_intermediate_size={shared}: must be positive "
                "(Qwen2-MoE always has a shared expert)"
            )
        moe = dict(shared_expert_ffn_hidden_size=shared, shared_expert_gate=True)
        return self.qwen_config(c, moe, qkv_bias=bool(c.get("qkv_bias", True)))  # transformers 4.x: always

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        rules = {**LLAMA_RULES, "qk_norm": False, **ROUTER_RULES, "moe.shared_expert_gate": True}
        if not cfg.moe.shared_expert_ffn_hidden_size:
            raise MlmError(
                "this model cannot be written as Hugging Face qwen2_moe: "
                "model.moe.shared_expert_ffn_hidden_size is unset (Qwen2-MoE always has a gated shared "
                "expert; set it with model.moe.shared_expert_gate=true)"
            )
        self.require(cfg, rules, mlp=("dense", "moe"))
        return {
            **self.qwen_to_hf(cfg, shared_expert_intermediate_size=cfg.moe.shared_expert_ffn_hidden_size),
            "qkv_bias": cfg.qkv_bias,  # read by transformers 5; 4.x always has the biases
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": cfg.num_layers,
        }


QWEN2_MOE = Qwen2MoeAdapter()
