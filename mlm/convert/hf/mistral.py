"""Mistral (`MistralForCausalLM`) ⇄ mlm: Llama's network and key names plus sliding-window
attention, which mlm does not have. It converts when the window covers every position the model
takes (or is null: full attention).
"""

from __future__ import annotations

from mlm.config import ModelConfig
from mlm.convert.hf.llama import LlamaAdapter, check_window


class MistralAdapter(LlamaAdapter):
    model_type = "mistral"
    hf_class = "MistralForCausalLM"

    def config_from_hf(self, c: dict) -> ModelConfig:
        check_window(c.get("sliding_window"), self.get(c, "max_position_embeddings"))
        return super().config_from_hf(c)

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        hf = super().config_to_hf(cfg)
        del hf["attention_bias"], hf["mlp_bias"]  # Llama's; MistralConfig has neither
        return {**hf, "sliding_window": None}


MISTRAL = MistralAdapter()
