"""Derived index arrays cached on disk, named by a hash of the JSON that describes their inputs.

As in Megatron (`unique_description_hash`): `DIR/HASH-NAME-description.json` is written after
the arrays, so its presence means the set is complete. Rank 0 builds (`build=True`); other
ranks load, and fail clearly when the cache is missing instead of building it twice.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from mlm.errors import MlmError
from mlm.fileio import atomic_outputs, atomic_write_text


def description_hash(description: dict) -> str:
    return hashlib.md5(json.dumps(description, indent=4, sort_keys=True).encode()).hexdigest()


def cached_arrays(
    cache_dir: str | os.PathLike,
    kind: str,
    description: dict,
    names: list[str],
    build_fn: Callable[[], dict[str, np.ndarray]],
    build: bool = True,
) -> dict[str, np.ndarray]:
    """Load `names` from the cache, or build them with `build_fn` and save them atomically."""
    cache_dir = Path(cache_dir)
    stem = f"{description_hash(description)}-{kind}"
    desc_path = cache_dir / f"{stem}-description.json"
    paths = {n: cache_dir / f"{stem}-{n}.npy" for n in names}
    if desc_path.is_file() and all(p.is_file() for p in paths.values()):
        return {n: np.load(p, mmap_mode="r", allow_pickle=False) for n, p in paths.items()}
    if not build:
        raise MlmError(
            f"{kind} indices not found in {cache_dir} ({desc_path.name}); build them first with "
            "`mlm data index` (or let rank 0 build them) using the same parameters"
        )
    arrays = build_fn()
    cache_dir.mkdir(parents=True, exist_ok=True)
    with atomic_outputs([paths[n] for n in names]) as temps:
        for n, t in zip(names, temps, strict=True):
            with open(t, "wb") as f:
                np.save(f, arrays[n], allow_pickle=False)
    atomic_write_text(desc_path, json.dumps(description, indent=4, sort_keys=True) + "\n")
    return arrays
