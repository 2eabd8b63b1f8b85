"""Hugging Face ⇄ mlm: configs and state dicts of Llama, Mistral, Qwen2 / Qwen2.5, Qwen3, GPT-2,
Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3 and the hybrids Mamba-2, Nemotron-H and Qwen3-Next (the
classes and what each converts: docs/hf.md).

One adapter per architecture (in the style of torchtitan's `state_dict_adapter.py` and litgpt's
`convert_hf_checkpoint.py`): a key-template table (`mlm.convert.keymap`) and the translation of
config.json both ways. `registry` picks the adapter, `engine` applies it (docs/hf.md: the code).

    cfg = config_from_hf(json.load(open("config.json")))
    model = GPT(cfg); load_hf_into(model, hf_state)                     # HF → mlm
    hf_state, hf_config = mlm_to_hf(model.state_dict(), cfg, "llama")   # mlm → HF
"""

from mlm.convert.hf.adapter import Adapter
from mlm.convert.hf.deepseek_v3 import DEEPSEEK_V3
from mlm.convert.hf.engine import LazyTensor, hf_to_mlm, iter_hf_to_mlm, load_hf_into, mlm_to_hf, saved_state
from mlm.convert.hf.gpt2 import GPT2
from mlm.convert.hf.llama import LLAMA
from mlm.convert.hf.mamba2 import MAMBA2
from mlm.convert.hf.mistral import MISTRAL
from mlm.convert.hf.mixtral import MIXTRAL
from mlm.convert.hf.nemotron_h import NEMOTRON_H
from mlm.convert.hf.qwen2 import QWEN2
from mlm.convert.hf.qwen2_moe import QWEN2_MOE
from mlm.convert.hf.qwen3 import QWEN3
from mlm.convert.hf.qwen3_moe import QWEN3_MOE
from mlm.convert.hf.qwen3_next import QWEN3_NEXT
from mlm.convert.hf.registry import ADAPTERS, adapter, arch_of, config_from_hf, config_to_hf
from mlm.convert.keymap import KeyMap, Rule, copied, stacked, transposed

__all__ = [
    "ADAPTERS",
    "DEEPSEEK_V3",
    "GPT2",
    "LLAMA",
    "MAMBA2",
    "MISTRAL",
    "MIXTRAL",
    "NEMOTRON_H",
    "QWEN2",
    "QWEN2_MOE",
    "QWEN3",
    "QWEN3_MOE",
    "QWEN3_NEXT",
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
