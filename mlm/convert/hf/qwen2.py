"""Qwen2 / Qwen2.5 (`Qwen2ForCausalLM`) ⇄ mlm: Llama's network with biases on q, k and v
(`qkv_bias`). Its sliding window applies only with use_sliding_window (released configs leave it
off); with it on, a window shorter than the context is refused.
"""

from __future__ import annotations

from mlm.config import ModelConfig
from mlm.convert.hf.adapter import Adapter
from mlm.convert.hf.llama import DENSE_MLP, LLAMA_RULES, llama_fields, llama_keys, llama_to_hf
from mlm.convert.hf.qwen2_moe import QKV_BIASES, qwen_window
from mlm.convert.keymap import Target

KEYS: dict[str, Target] = llama_keys(DENSE_MLP, QKV_BIASES)


class Qwen2Adapter(Adapter):
    model_type = "qwen2"
    hf_class = "Qwen2ForCausalLM"
    from_hf = KEYS

    def config_from_hf(self, c: dict) -> ModelConfig:
        qwen_window(c, self.get(c, "max_position_embeddings"))
        return ModelConfig(**llama_fields(self, c), qkv_bias=True)

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        self.require(cfg, dict(LLAMA_RULES, qkv_bias=True, qk_norm=False))
        return {
            **llama_to_hf(self, cfg),
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": cfg.num_layers,
        }


QWEN2 = Qwen2Adapter()
