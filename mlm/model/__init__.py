"""The plain decoder-only transformer (`gpt`), the layer (`layers`) and the kinds its layers are
built from (`kinds`: torch-free specs beside their modules), and what is computed from its config
(`stats`). The names below import torch on first use, so that `mlm.model.kinds` stays torch-free."""

from __future__ import annotations

import importlib

_EXPORTS = {
    "GPT": "mlm.model.gpt",
    "Chunk": "mlm.model.gpt",
    "build_model": "mlm.model.gpt",
    "active_parameter_count": "mlm.model.stats",
    "flops_per_token": "mlm.model.stats",
    "parameter_count": "mlm.model.stats",
    "parameter_counts": "mlm.model.stats",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'mlm.model' has no attribute {name!r}")
