"""Reading a Megatron-core `torch_dist` checkpoint (or any torch DCP folder) with plain
`torch.distributed.checkpoint`, never unpickling more than it needs: `.metadata` through
`_MetadataUnpickler` (DCP's own classes and torch constants only, where torch runs a plain
`pickle.load`), bytes entries only when asked for by name (`MegatronCheckpoint.values`, each with
`torch.load(weights_only=True)`), `common.pt` with `mlm.convert.megatron.unpickle`. A damaged or
incomplete file is an MlmError naming it. The layout: docs/formats-foreign.md ("Megatron-core torch_dist
checkpoint"); what is unpickled: docs/megatron.md ("What is unpickled").
"""

from __future__ import annotations

import json
import pickle
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from mlm.convert.common import refused_name
from mlm.convert.megatron.unpickle import load_megatron_pickle
from mlm.errors import MlmError

_DCP_CLASSES = {  # the classes a DCP .metadata pickle names, by module (no other name of these modules)
    "torch.distributed.checkpoint.metadata": set(
        "Metadata TensorStorageMetadata BytesStorageMetadata ChunkStorageMetadata TensorProperties "
        "StorageMeta MetadataIndex _MEM_FORMAT_ENCODING".split()
    ),
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo", "_StoragePrefix", "SerializationFormat"},
    # Megatron's save keeps its global SavePlan in the metadata too
    "torch.distributed.checkpoint.planner": set(
        "WriteItemType LoadItemType WriteItem ReadItem TensorWriteData BytesIOWriteData SavePlan LoadPlan".split()
    ),
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
            f"names {module}.{name}, which a torch DCP metadata file does not hold; it is not read (only "
            "DCP's metadata classes, torch dtypes and paths are unpickled)"
        )


class _Reader(FileSystemReader):
    """A FileSystemReader whose metadata comes from the restricted unpickler (or is given, read once)."""

    def __init__(self, path: Path, metadata: Metadata | None = None):
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self) -> Metadata:
        if self._metadata is not None:
            return self._metadata
        path = Path(self.path) / ".metadata"
        with open(path, "rb") as f:
            try:
                md = _MetadataUnpickler(f).load()
            except MlmError as e:  # the allow-list's refusal
                raise MlmError(f"{path}: {e}") from None
            except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as e:
                raise MlmError(
                    f"{path}: not a readable torch DCP metadata file ({type(e).__name__}: {e}); copy it "
                    "again (a save interrupted before its .metadata was written is not a checkpoint)"
                ) from None
        if not isinstance(md, Metadata):
            raise MlmError(
                f"{path}: holds a {type(md).__name__}, not torch DCP Metadata; pass the directory as "
                "Megatron's dist_checkpointing.save (or torch DCP) wrote it"
            )
        folder = Path(self.path).resolve()
        for info in (getattr(md, "storage_data", None) or {}).values():
            name = getattr(info, "relative_path", None)
            if not isinstance(name, str) or Path(name).name != name or name in ("", ".."):
                raise MlmError(
                    f"{path}: names the data file {str(name)[:120]!r}, not a file name in {self.path}; the "
                    "metadata is damaged or was not written by torch DCP"
                )
            if not (folder / name).resolve().is_relative_to(folder):
                raise MlmError(
                    f"{Path(self.path) / name}: a link to {(folder / name).resolve()}, outside the checkpoint; "
                    "copy the checkpoint with its files, not links"
                )
        md.storage_meta = getattr(md, "storage_meta", None)
        return md


def iteration_dir(src: str | Path) -> Path:
    """The checkpoint folder `src` names: itself, or for a Megatron-LM save root (a
    `latest_checkpointed_iteration.txt` and no checkpoint of its own) the `iter_NNNNNNN/` or
    `release/` the tracker names."""
    src = Path(src)
    if not src.is_dir():
        raise MlmError(
            f"mlm convert from-megatron {src}: not a directory; pass a Megatron checkpoint directory"
        )
    tracker = src / "latest_checkpointed_iteration.txt"
    own = (src / ".metadata").exists() or any(src.glob("mp_rank_*"))
    if not own and tracker.exists():
        text = tracker.read_text().strip()
        name = "release" if text == "release" else f"iter_{int(text):07d}" if text.isdigit() else None
        if name is None:
            raise MlmError(f"{tracker}: holds {text!r}, expected an iteration number or 'release'")
        if not (src / name).is_dir():
            raise MlmError(
                f"{tracker}: names {name}/, which {src} does not hold; copy that iteration folder too, or "
                "pass an iter_NNNNNNN/ it holds"
            )
        src = src / name
    return src


def checkpoint_dir(src: str | Path) -> Path:
    """The torch_dist directory `src` names: itself (`iter_NNNNNNN/` or any dir with `.metadata`) or,
    for a Megatron-LM save root, the iteration `latest_checkpointed_iteration.txt` names."""
    src = iteration_dir(src)
    if (src / "manifest.json").exists() or (src / "latest").exists():
        raise MlmError(
            f"mlm convert from-megatron {src}: an mlm checkpoint (it holds {'manifest.json' if (src / 'manifest.json').exists() else 'latest'}), "
            "not a Megatron one: mlm train --load and mlm convert read it as it is; mlm export megatron exports it"
        )
    if not (src / ".metadata").exists():
        raise MlmError(
            f"mlm convert from-megatron {src}: not a Megatron checkpoint: no torch_dist .metadata file, no legacy "
            "mp_rank_* folders (nor latest_checkpointed_iteration.txt) in it. Pass the save directory "
            "or one iter_NNNNNNN/ written with --ckpt-format torch_dist or torch"
        )
    meta_json = src / "metadata.json"
    if meta_json.exists():
        try:
            meta = json.loads(meta_json.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            meta = None
        if not isinstance(meta, dict):
            raise MlmError(
                f'{meta_json}: not Megatron\'s JSON object ({{"sharded_backend": "torch_dist", …}}); copy '
                "the checkpoint again"
            )
        backend = meta.get("sharded_backend")
        if backend != "torch_dist":
            raise MlmError(
                f"{meta_json}: sharded_backend {backend!r}; only torch_dist is read: have Megatron-LM rewrite "
                "it (--ckpt-convert-format torch_dist --ckpt-convert-save DIR) and import that"
            )
    return src


class _BytesPlanner(DefaultLoadPlanner):
    """Loads bytes entries with `torch.load(weights_only=True)` (torch's planner unpickles them
    with weights_only=False) into `values`."""

    def __init__(self):
        super().__init__(flatten_state_dict=False)
        self.values: dict = {}

    def load_bytes(self, read_item, value) -> None:
        key = read_item.dest_index.fqn
        try:
            self.values[key] = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:  # refused by the weights-only allow-list: nothing ran
            raise MlmError(
                f"{key} not read: it names {refused_name(e)}, a class outside plain values (ints, floats, "
                "strings, containers of them, tensors)"
            ) from None


def _causes(e: BaseException) -> list[BaseException]:
    """The exceptions DCP's CheckpointException wraps (per failed rank, an exception or an
    (exception, frames) pair), innermost first."""
    if not isinstance(e, CheckpointException):
        return [e]
    inner = [c[0] if isinstance(c, tuple) else c for c in getattr(e, "failures", {}).values()]
    return [c for x in inner if isinstance(x, BaseException) for c in _causes(x)] + [e]


def _damaged(path: Path, keys: list[str], e: CheckpointException) -> MlmError:
    """The error for a DCP read that failed other than by the allow-list: torch's own failure, by name."""
    causes = _causes(e)
    cause = causes[0] if causes else e
    first = (str(cause).strip().splitlines() or [""])[-1]
    return MlmError(
        f"{path}: {', '.join(keys[:3])}{' …' if len(keys) > 3 else ''} not read: the checkpoint's data files "
        f"are damaged or incomplete ({type(cause).__name__}{': ' + first if first else ''}); copy it again"
    )


class MegatronCheckpoint:
    """A torch_dist directory (or any torch DCP directory, e.g. torchtitan's `step-N/`): its
    tensors' global shapes, each tensor read whole on request, bytes entries of plain values."""

    def __init__(self, path: Path):
        self.path = path
        self._metadata = md = _Reader(path).read_metadata()
        entries = md.state_dict_metadata
        self.stored = {k: v for k, v in entries.items() if isinstance(v, TensorStorageMetadata)}
        """Every tensor entry, the optimizer's included."""
        self.bytes_keys = sorted(k for k, v in entries.items() if isinstance(v, BytesStorageMetadata))
        # the optimizer's state (Megatron-LM saves it by default: optimizer.distributed.* or
        # optimizer.state.*) is read by mlm.convert.megatron.optim
        self.optimizer_meta = {k: v for k, v in sorted(self.stored.items()) if k.startswith("optimizer.")}
        self.optimizer_keys = list(self.optimizer_meta)
        self.tensors = {k: v for k, v in self.stored.items() if k not in self.optimizer_meta}

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.stored[key].size)

    def read(self, key: str) -> torch.Tensor:
        """The global tensor `key`, whole (every chunk of every source rank)."""
        return self.read_all([key])[key]

    def read_all(self, keys: list[str]) -> dict[str, torch.Tensor]:
        """The global tensors `keys` (any of `stored`), whole, in one pass over the files."""
        out = {
            k: torch.empty(tuple(self.stored[k].size), dtype=self.stored[k].properties.dtype) for k in keys
        }
        self._load(out, keys)
        return out

    def values(self, keys: list[str]) -> dict:
        """The bytes entries `keys` (of `bytes_keys`), each read with `torch.load(weights_only=True)`:
        plain values (ints, floats, strings, containers of them, tensors); another class is refused,
        and so is a key the checkpoint holds no bytes entry for."""
        absent = [k for k in keys if k not in self.bytes_keys]
        if absent:
            raise MlmError(
                f"{self.path}: holds no entry {absent[0]} (a Megatron ShardedObject); the checkpoint is "
                "incomplete or was not saved by Megatron-core: copy it again"
            )
        planner = _BytesPlanner()
        self._load(dict.fromkeys(keys), keys, planner)
        return planner.values

    def _load(self, state: dict, keys: list[str], planner: DefaultLoadPlanner | None = None) -> None:
        """`dcp.load` of `state` in this process; MlmError for `load_bytes`' refusal or a damaged file."""
        with warnings.catch_warnings():  # "torch.distributed is disabled … load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            try:
                reader = _Reader(self.path, self._metadata)
                dcp.load(state, storage_reader=reader, planner=planner, no_dist=True)
            except CheckpointException as e:  # wraps load_bytes' refusal, or a read error
                refused = next((c for c in _causes(e) if isinstance(c, MlmError)), None)
                if refused is not None:
                    raise MlmError(f"{self.path}: {refused}") from None
                raise _damaged(self.path, keys, e) from None

    def common(self) -> dict:
        """`common.pt`, read with `mlm.convert.megatron.unpickle`'s allow-list, or {} where absent.
        MlmError naming the class where common.pt holds one outside the allow-list."""
        path = self.path / "common.pt"
        if not path.exists():
            return {}
        common = load_megatron_pickle(path)
        if not isinstance(common, dict):
            raise MlmError(
                f"{path}: holds a {type(common).__name__}, not the dict Megatron's dist_checkpointing saves "
                "(args, iteration, …); copy the checkpoint again or remove the stray common.pt"
            )
        return common
