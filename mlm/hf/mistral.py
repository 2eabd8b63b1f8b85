"""Mistral (`MistralForCausalLM`) ⇄ mlm: Llama's network and key names plus sliding-window
attention, which mlm does not have. It converts when the window covers every position the model
takes (or is null: full attention).
"""

from __future__ import annotations

from mlm.config import ModelConfig
from mlm.errors import MlmError
from mlm.hf.llama import LlamaAdapter


class MistralAdapter(LlamaAdapter):
    model_type = "mistral"
    hf_class = "MistralForCausalLM"

    def config_from_hf(self, c: dict) -> ModelConfig:
        window, positions = c.get("sliding_window"), self.get(c, "max_position_embeddings")
        if window is not None and window < positions:
            raise MlmError(
                f"Hugging Face config sliding_window={window} < max_position_embeddings={positions}: mlm "
                f"has no sliding-window attention, so positions beyond {window} would attend differently. "
                f"Set max_position_embeddings to {window} (or less) in config.json to convert it exactly, "
                "or sliding_window to null if the model uses full attention"
            )
        return super().config_from_hf(c)

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        hf = super().config_to_hf(cfg)
        del hf["attention_bias"], hf["mlp_bias"]  # Llama's; MistralConfig has neither
        return {**hf, "sliding_window": None}


MISTRAL = MistralAdapter()
