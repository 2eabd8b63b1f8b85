"""The units a user writes: dtype names (`--dtype bf16`, `precision = "bf16"`) and byte sizes
(`--max-shard-size 5GB`, `--kv-memory 2GiB`), one table and one parser for every command."""

from __future__ import annotations

import re

import torch

from mlm.errors import MlmError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""A dtype's short name → torch dtype."""

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*")


def parse_size(text: str | int, option: str) -> int:
    """Bytes: '5GB' → 5·10⁹, '500MB' → 5·10⁸, '2GiB' → 2·2³⁰, '1e9' and '1000' as they are
    (Hugging Face's convention: KB = 1000, KiB = 1024). `option` names the setting in the error."""
    if isinstance(text, int):
        return text
    m = _SIZE.fullmatch(text)
    unit = m.group(2).upper() if m else ""
    if m is None or unit not in _UNITS or float(m.group(1)) <= 0:
        raise MlmError(
            f"{option} {text!r}: expected a positive size, e.g. 5GB, 500MB, 2GiB, 1e9 or 1000 (bytes)"
        )
    return int(float(m.group(1)) * _UNITS[unit])
