"""Sharded checkpoints: every tensor stored once in its global shape (zarr), loadable under any split.

See `manager` for the save/load protocol, `store` for tensor I/O and docs/formats-checkpoint.md for the layout.
"""

from mlm.checkpoint.manager import (
    ShardedTensor,
    checkpoint_config,
    list_checkpoints,
    load_checkpoint,
    read_group,
    read_manifest,
    resolve_checkpoint,
    save_checkpoint,
)
from mlm.checkpoint.rng import rng_state_from_json, rng_state_to_json

__all__ = [
    "ShardedTensor",
    "checkpoint_config",
    "list_checkpoints",
    "load_checkpoint",
    "read_group",
    "read_manifest",
    "resolve_checkpoint",
    "rng_state_from_json",
    "rng_state_to_json",
    "save_checkpoint",
]
