"""Reading a Megatron-core `torch_dist` checkpoint with plain `torch.distributed.checkpoint`, never
unpickling more than it needs.

A torch_dist directory (Megatron's `dist_checkpointing.save`, e.g. `SAVE/iter_0000100/`) holds
`.metadata` (torch DCP's pickled `Metadata`: every key's global shape, dtype and chunks),
`__R_T.distcp` data files, `common.pt` (everything that is not a sharded tensor: in Megatron-LM
training the `args` Namespace, `iteration`, …) and `metadata.json` (`"sharded_backend": "torch_dist"`).
Tensors are stored as global tensors addressed by offset, so the source's tp, pp and ep do not
matter to the reader.

Unpickling: torch's own `FileSystemReader.read_metadata` runs a plain `pickle.load` on `.metadata`
and its default planner `torch.load(weights_only=False)`s every bytes entry. Here `.metadata` goes
through `_MetadataUnpickler`, which allows only DCP's metadata, storage and plan classes, `torch.Size` and torch's
dtype / layout / memory-format constants; only tensor entries are requested here (bytes entries,
e.g. `_extra_state` or RNG states, are not read; `mlm.convert.megatron_optim` reads the optimizer's
with `torch.load(weights_only=True)`); `common.pt` is read with `torch.load(weights_only=True)`
allowing `argparse.Namespace` as the only extra class.
"""

from __future__ import annotations

import argparse
import json
import pickle
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from mlm.errors import MlmError

_DCP_CLASSES = {  # the classes a DCP .metadata pickle names, by module (no other name of these modules)
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "StorageMeta",
        "MetadataIndex",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo", "_StoragePrefix", "SerializationFormat"},
    # Megatron's save keeps its global SavePlan in the metadata too
    "torch.distributed.checkpoint.planner": {
        "WriteItemType",
        "LoadItemType",
        "WriteItem",
        "ReadItem",
        "TensorWriteData",
        "BytesIOWriteData",
        "SavePlan",
        "LoadPlan",
    },
}
_TORCH_CONSTANTS = (torch.dtype, torch.layout, torch.memory_format)
_OTHERS = {
    ("collections", "OrderedDict"),
    ("torch.serialization", "_get_layout"),  # a name → torch.layout lookup
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id as torch's own dcp.save writes it
    ("pathlib", "PurePosixPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's `.metadata` and nothing else: its dataclasses, torch.Size, torch dtypes."""

    def find_class(self, module: str, name: str):
        # exact names only: pickle resolves a dotted name attribute by attribute, and these modules
        # import `os` ("os.system" would be found through them)
        if name in _DCP_CLASSES.get(module, ()):
            cls = super().find_class(module, name)
            if isinstance(cls, type) and cls.__module__ == module:
                return cls
        if module == "torch":
            value = getattr(torch, name, None)
            if value is torch.Size or isinstance(value, _TORCH_CONSTANTS):
                return value
        if (module, name) in _OTHERS:
            return super().find_class(module, name)
        raise MlmError(
            f".metadata of the checkpoint names {module}.{name}, which a torch DCP metadata file does not "
            "hold; it is not read (only DCP's metadata classes, torch dtypes and paths are unpickled)"
        )


class _Reader(FileSystemReader):
    """A FileSystemReader whose metadata comes from the restricted unpickler."""

    def read_metadata(self) -> Metadata:
        path = Path(self.path) / ".metadata"
        with open(path, "rb") as f:
            md = _MetadataUnpickler(f).load()
        if not isinstance(md, Metadata):
            raise MlmError(f"{path}: holds a {type(md).__name__}, not torch DCP Metadata")
        md.storage_meta = getattr(md, "storage_meta", None)
        return md


def checkpoint_dir(src: str | Path) -> Path:
    """The torch_dist directory `src` names: itself (`iter_NNNNNNN/` or any dir with `.metadata`) or,
    for a Megatron-LM save root, the iteration `latest_checkpointed_iteration.txt` names."""
    src = Path(src)
    if not src.is_dir():
        raise MlmError(f"--from-megatron {src}: not a directory; pass a Megatron checkpoint directory")
    tracker = src / "latest_checkpointed_iteration.txt"
    if not (src / ".metadata").exists() and tracker.exists():
        text = tracker.read_text().strip()
        name = "release" if text == "release" else f"iter_{int(text):07d}" if text.isdigit() else None
        if name is None:
            raise MlmError(f"{tracker}: holds {text!r}, expected an iteration number or 'release'")
        src = src / name
    if not (src / ".metadata").exists():
        legacy = sorted(p.name for p in src.glob("mp_rank_*"))
        what = (
            f"it holds {', '.join(legacy)}: the legacy per-rank format (--ckpt-format torch), not read yet"
            if legacy
            else "no torch_dist .metadata file (nor latest_checkpointed_iteration.txt) in it"
        )
        raise MlmError(
            f"--from-megatron {src}: not a Megatron torch_dist checkpoint: {what}. Pass the save directory "
            "or one iter_NNNNNNN/ written with --ckpt-format torch_dist"
        )
    meta_json = src / "metadata.json"
    if meta_json.exists():
        backend = json.loads(meta_json.read_text()).get("sharded_backend")
        if backend != "torch_dist":
            raise MlmError(f"{meta_json}: sharded_backend {backend!r}; only torch_dist is read")
    return src


class MegatronCheckpoint:
    """A torch_dist directory: its tensors' global shapes, and each tensor read whole on request."""

    def __init__(self, path: Path):
        self.path = path
        md = _Reader(path).read_metadata()
        tensors = {k: v for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
        # the optimizer's state (Megatron-LM saves it by default: optimizer.distributed.* or
        # optimizer.state.*) is read by mlm.convert.megatron_optim
        self.optimizer_keys = sorted(k for k in tensors if k.startswith("optimizer."))
        self.optimizer_meta = {k: tensors[k] for k in self.optimizer_keys}
        self.tensors: dict[str, TensorStorageMetadata] = {
            k: v for k, v in tensors.items() if not k.startswith("optimizer.")
        }

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.tensors[key].size)

    def read(self, key: str) -> torch.Tensor:
        """The global tensor `key`, whole (every chunk of every source rank)."""
        meta = self.tensors[key]
        out = {key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)}
        with warnings.catch_warnings():  # "torch.distributed is disabled … load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(out, storage_reader=_Reader(self.path), no_dist=True)
        return out[key]

    def common(self) -> tuple[dict, str | None]:
        """(`common.pt`, {} where absent or unreadable; None, or why it was not read). Read with
        `argparse.Namespace` the only class allowed besides tensors and builtins: a common.pt holding
        another (e.g. one of Megatron's enums in `args`) is not read."""
        path = self.path / "common.pt"
        if not path.exists():
            return {}, None
        try:
            with torch.serialization.safe_globals([argparse.Namespace]):
                return torch.load(path, map_location="cpu", weights_only=True), None
        except pickle.UnpicklingError as e:
            why = str(e).split("Unsupported global: ")[-1].splitlines()[0]
            return {}, f"{path.name} not read: it holds a class outside the allow-list ({why})"
