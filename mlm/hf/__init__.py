"""Hugging Face ⇄ mlm: configs and state dicts of Llama (`LlamaForCausalLM`), Mistral
(`MistralForCausalLM`, Llama's layout; full attention only) and GPT-2 (`GPT2LMHeadModel`).

One adapter per architecture (`llama`, `mistral`, `gpt2`, on the base in `adapter`), in the style
of torchtitan's `state_dict_adapter.py` and litgpt's `convert_hf_checkpoint.py`: a map from
Hugging Face key templates to mlm key templates (`templates`: `{layer}` and `{expert}` index the
keys, None drops one, a rule splits, transposes or stacks tensors), plus the translation of
config.json both ways. `registry` picks the adapter; `engine` applies it tensor by tensor,
checking every shape against the config (errors name the key and both shapes) and padding the
vocabulary rows to `cfg.padded_vocab_size()`.

    cfg = config_from_hf(json.load(open("config.json")))
    model = GPT(cfg); load_hf_into(model, hf_state)                     # HF → mlm
    hf_state, hf_config = mlm_to_hf(model.state_dict(), cfg, "llama")   # mlm → HF
"""

from mlm.hf.adapter import Adapter
from mlm.hf.engine import LazyTensor, hf_to_mlm, iter_hf_to_mlm, load_hf_into, mlm_to_hf
from mlm.hf.gpt2 import GPT2
from mlm.hf.llama import LLAMA
from mlm.hf.mistral import MISTRAL
from mlm.hf.registry import ADAPTERS, adapter, arch_of, config_from_hf, config_to_hf
from mlm.hf.templates import KeyMap, Rule, stacked, transposed

__all__ = [
    "ADAPTERS",
    "GPT2",
    "LLAMA",
    "MISTRAL",
    "Adapter",
    "KeyMap",
    "LazyTensor",
    "Rule",
    "adapter",
    "arch_of",
    "config_from_hf",
    "config_to_hf",
    "hf_to_mlm",
    "iter_hf_to_mlm",
    "load_hf_into",
    "mlm_to_hf",
    "stacked",
    "transposed",
]
