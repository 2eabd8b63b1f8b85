"""Hugging Face ⇄ mlm: configs and state dicts of Llama (`LlamaForCausalLM`), Mistral
(`MistralForCausalLM`, Llama's layout; full attention only), Qwen2 / Qwen2.5 (`Qwen2ForCausalLM`),
Qwen3 (`Qwen3ForCausalLM`), GPT-2 (`GPT2LMHeadModel`), the
mixtures of experts Mixtral (`MixtralForCausalLM`), Qwen2-MoE (`Qwen2MoeForCausalLM`) and
Qwen3-MoE (`Qwen3MoeForCausalLM`), and DeepSeek-V3 (`DeepseekV3ForCausalLM`: multi-latent
attention, DeepSeek's router, MTP depths in DeepSeek's checkpoint layout).

One adapter per architecture (`llama`, `mistral`, `qwen2`, `qwen3`, `gpt2`, `mixtral`, `qwen2_moe`, `qwen3_moe`,
`deepseek_v3`, on the base in `adapter`; `moe` holds what the MoE ones share), in the style
of torchtitan's `state_dict_adapter.py` and litgpt's `convert_hf_checkpoint.py`: a map from
Hugging Face key templates to mlm key templates (`mlm.convert.keymap`: `{layer}`, `{expert}` and `{depth}`
index the keys, None drops one, a rule splits, transposes, stacks or copies tensors), plus the
translation of config.json both ways. `registry` picks the adapter; `engine` applies it tensor by tensor,
checking every shape against the config (errors name the key and both shapes) and padding the
vocabulary rows to `cfg.padded_vocab_size()`.

    cfg = config_from_hf(json.load(open("config.json")))
    model = GPT(cfg); load_hf_into(model, hf_state)                     # HF → mlm
    hf_state, hf_config = mlm_to_hf(model.state_dict(), cfg, "llama")   # mlm → HF
"""

from mlm.convert.hf.adapter import Adapter
from mlm.convert.hf.deepseek_v3 import DEEPSEEK_V3
from mlm.convert.hf.engine import LazyTensor, hf_to_mlm, iter_hf_to_mlm, load_hf_into, mlm_to_hf, saved_state
from mlm.convert.hf.gpt2 import GPT2
from mlm.convert.hf.llama import LLAMA
from mlm.convert.hf.mistral import MISTRAL
from mlm.convert.hf.mixtral import MIXTRAL
from mlm.convert.hf.qwen2 import QWEN2
from mlm.convert.hf.qwen2_moe import QWEN2_MOE
from mlm.convert.hf.qwen3 import QWEN3
from mlm.convert.hf.qwen3_moe import QWEN3_MOE
from mlm.convert.hf.registry import ADAPTERS, adapter, arch_of, config_from_hf, config_to_hf
from mlm.convert.keymap import KeyMap, Rule, copied, stacked, transposed

__all__ = [
    "ADAPTERS",
    "DEEPSEEK_V3",
    "GPT2",
    "LLAMA",
    "MISTRAL",
    "MIXTRAL",
    "QWEN2",
    "QWEN2_MOE",
    "QWEN3",
    "QWEN3_MOE",
    "Adapter",
    "KeyMap",
    "LazyTensor",
    "Rule",
    "adapter",
    "arch_of",
    "config_from_hf",
    "config_to_hf",
    "copied",
    "hf_to_mlm",
    "iter_hf_to_mlm",
    "load_hf_into",
    "mlm_to_hf",
    "saved_state",
    "stacked",
    "transposed",
]
