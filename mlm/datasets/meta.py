"""`PREFIX.json`: what built a dataset (tokenizer, counts, sources), beside Megatron's .bin/.idx.

Megatron-made datasets have no such file; readers treat it as optional. A file with another
`format_version` is refused with the versions this mlm reads.
"""

from __future__ import annotations

import os
from pathlib import Path

from mlm.errors import MlmError, check_version
from mlm.fileio import read_json

META_FORMAT = "mlm-indexed-dataset"
META_VERSION = 1


def meta_path(prefix: str | os.PathLike) -> Path:
    return Path(str(prefix) + ".json")


def read_meta(prefix: str | os.PathLike) -> dict | None:
    """The sidecar of `prefix`, or None when the dataset has none (e.g. made by Megatron)."""
    p = meta_path(prefix)
    if not p.is_file():
        return None
    meta = read_json(p, fix="rebuild the dataset or delete the file")
    if not isinstance(meta, dict) or meta.get("format") != META_FORMAT:
        raise MlmError(
            f"{p}: not an mlm dataset description (format {meta.get('format')!r}, expected {META_FORMAT!r})"
        )
    check_version(p, meta.get("format_version"), [META_VERSION], "format_version")
    return meta


def new_meta(**fields) -> dict:
    import mlm

    return {"format": META_FORMAT, "format_version": META_VERSION, "mlm_version": mlm.__version__, **fields}


def loss_mask_prefix(prefix: str | os.PathLike) -> str:
    """The prefix of a chat dataset's loss mask (uint8, 1 where the token is a target), beside it."""
    return f"{prefix}_loss_mask"
