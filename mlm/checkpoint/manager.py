"""Checkpoint directories: save and load sharded tensors, the manifest, `latest` and keep-last.

`DIR/iter_NNNNNNN/` holds one zarr group per state group (`model/`, `optim/`) and
`manifest.json`. Each tensor is one array in its global shape; every rank writes its own slice,
and a load reads whatever slices the loading ranks hold, so a checkpoint loads under any split.
A checkpoint counts only once `manifest.json` exists (written last), and `DIR/latest` is replaced
only after that, so a save killed at any point leaves `latest` naming a complete checkpoint.
The layout is documented in docs/formats-checkpoint.md.
"""

from __future__ import annotations

import difflib
import functools
import json
import os
import re
import shutil
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import zarr

from mlm import __version__
from mlm.checkpoint import store
from mlm.config import Config, config_from_dict
from mlm.errors import MlmError, check_version
from mlm.fileio import atomic_outputs, fsync_dir, fsync_dirs, fsync_file, read_json

FORMAT = "mlm-checkpoint"
FORMAT_VERSIONS = [1]
MANIFEST = "manifest.json"
LATEST = "latest"
_ITER_RE = re.compile(r"iter_(\d+)")
_TENSOR_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:-]*/[A-Za-z0-9_][A-Za-z0-9_.:-]*")
"""A manifest's tensor name: group/key, each a plain file name (mlm's keys are dotted)."""
RESERVED = {"format", "format_version", "mlm_version", "iteration", "tensors"}
CHECKSUMS = "crc32c"
"""Manifest field of each tensor: chunk key → CRC-32C of the chunk file (8 hex digits)."""


@dataclass
class ShardedTensor:
    """This rank's slice of a tensor that is stored whole, in its global shape, under `key`."""

    key: str
    """Tensor name inside its group, e.g. "layers.0.attn.qkv.weight"."""
    local: torch.Tensor
    """This rank's slice, on any device; written from a CPU copy, loaded into in place."""
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    """Where `local` starts in the global tensor."""
    writer: bool = True
    """False on replicas of a slice another rank writes; exactly one writer per slice."""
    chunk: tuple[int, ...] | None = None
    """Chunk shape of the stored array (default `local.shape`); only the shard at offset 0's counts."""
    padded_rows: bool = False
    """Dim 0 is padded with zero rows (the vocabulary, padded per tp): a stored tensor padded to
    another size loads its rows in common; rows beyond the stored ones load as zeros."""

    def __post_init__(self) -> None:
        self.global_shape, self.global_offset = tuple(self.global_shape), tuple(self.global_offset)
        spans = zip(self.global_offset, self.local.shape, self.global_shape, strict=False)
        ranks_match = len(self.global_shape) == len(self.global_offset) == self.local.dim()
        if not ranks_match or not all(0 <= o and o + s <= n for o, s, n in spans):
            raise ValueError(
                f"ShardedTensor {self.key}: slice of shape {tuple(self.local.shape)} at offset "
                f"{self.global_offset} does not fit in global shape {self.global_shape}"
            )

    @classmethod
    def full(cls, key: str, tensor: torch.Tensor) -> ShardedTensor:
        """An unsharded tensor: this rank holds (and writes) all of it."""
        return cls(key, tensor, tuple(tensor.shape), (0,) * tensor.dim())


def iter_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def _is_complete(d: Path) -> bool:
    return (d / MANIFEST).is_file()


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """The complete checkpoints under `root`, oldest iteration first."""
    dirs = [d for d in Path(root).glob("iter_*") if _ITER_RE.fullmatch(d.name) and _is_complete(d)]
    return sorted(dirs, key=lambda d: int(d.name[5:]))


def _write_durable(path: Path, text: str) -> None:
    """Replace `path` atomically with `text`, fsynced, so a crash leaves the old or the new file."""
    with atomic_outputs([path]) as (tmp,):
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    fsync_dir(path.parent)


def _remove(d: Path) -> None:
    """Delete a checkpoint dir, manifest first: a crash midway leaves an incomplete (ignored) dir.
    A link (to a checkpoint elsewhere) is removed itself, never what it names."""
    if d.is_symlink():
        d.unlink()
        return
    (d / MANIFEST).unlink(missing_ok=True)
    shutil.rmtree(d)


def _prepare(root: Path, it_dir: Path, group_names: list[str]) -> None:
    """Rank 0: clear a dir left by an earlier save of this iteration; create the zarr groups."""
    if it_dir.exists():
        latest = root / LATEST
        if latest.is_file() and latest.read_text().strip() == it_dir.name:
            others = [d for d in list_checkpoints(root) if d != it_dir]
            if others:  # `latest` must never name a dir being rewritten
                _write_durable(latest, others[-1].name + "\n")
            else:
                latest.unlink()
        _remove(it_dir)
    it_dir.mkdir(parents=True)
    for name in group_names:
        zarr.open_group(str(it_dir / name), mode="w")


def _open_created(path: Path) -> store.Array:
    if not (path / "zarr.json").is_file():
        raise MlmError(
            f"{path}: array not created; the shard of this tensor at offset 0 must have writer=True "
            "on exactly one rank (and every rank must pass the same group names)"
        )
    return store.open_array(path, str(path))


def _checksum_file(it_dir: Path, rank: int) -> Path:
    return it_dir / f"{CHECKSUMS}.rank{rank:05d}.json"


def _finish(
    root: Path,
    it_dir: Path,
    iteration: int,
    group_names: list[str],
    extra_json: str,
    sums: dict | None = None,
) -> None:
    """Rank 0, after every slice is written: manifest (with the chunk checksums every rank wrote
    beside it, or `sums`), then `latest`."""
    tensors = {f"{g}/{k}": info for g in group_names for k, info in store.array_infos(it_dir / g).items()}
    files = sorted(it_dir.glob(f"{CHECKSUMS}.rank*.json"))
    for part in [sums or {}, *(json.loads(f.read_text()) for f in files)]:
        for key, chunks in part.items():
            tensors[key].setdefault(CHECKSUMS, {}).update(chunks)
    for info in tensors.values():
        if CHECKSUMS in info:
            info[CHECKSUMS] = dict(sorted(info[CHECKSUMS].items()))
    for f in files:
        f.unlink()
    # every rank fsynced its chunks and arrays (`store`); the groups' metadata and names here
    metas = [it_dir / g / "zarr.json" for g in group_names]
    for meta in metas:
        fsync_file(meta)
    fsync_dirs(metas, it_dir)
    head = {"format": FORMAT, "format_version": 1, "mlm_version": __version__, "iteration": iteration}
    manifest = {**head, "tensors": tensors, **json.loads(extra_json)}
    _write_durable(it_dir / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    _write_durable(root / LATEST, it_dir.name + "\n")


def save_checkpoint(
    root: str | os.PathLike,
    iteration: int,
    groups: dict[str, list[ShardedTensor]],
    extra: dict,
    *,
    rank: int = 0,
    barrier: Callable[[], None] = lambda: None,
    keep_last: int | None = None,
) -> Path:
    """Save this rank's slices of `groups` as `root/iter_NNNNNNN`; every rank calls it, same args.

    `extra` (JSON-able: config, mesh, consumed samples, scheduler, RNG...) goes into the manifest.
    `keep_last` keeps that many complete checkpoints, the new one included. Returns the iter dir.
    """
    root, it_dir = Path(root), Path(root) / iter_dir_name(iteration)
    if RESERVED & extra.keys():
        raise ValueError(f"extra keys {sorted(RESERVED & extra.keys())} are reserved for the manifest")
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last={keep_last}: must be at least 1 (or None to keep all)")
    extra_json = json.dumps(extra)  # fails here, on every rank, before anything is written
    if rank == 0:
        _prepare(root, it_dir, list(groups))
    barrier()
    for name, tensors in groups.items():  # the writer of each tensor's first slice creates it
        for st in tensors:
            if st.writer and not any(st.global_offset):
                chunk = st.chunk or tuple(st.local.shape)
                store.create_array(it_dir / name / st.key, st.global_shape, chunk, st.local.dtype)
    barrier()
    sums: dict[str, store.Checksums] = {}
    for name, tensors in groups.items():
        for st in (st for st in tensors if st.writer):
            arr = _open_created(it_dir / name / st.key)
            store.check_aligned(arr, st.global_offset, tuple(st.local.shape), f"{it_dir}/{name}/{st.key}")
            sums.setdefault(f"{name}/{st.key}", {}).update(store.write_slice(arr, st.local, st.global_offset))
    if sums:
        _checksum_file(it_dir, rank).write_text(json.dumps(sums))
    barrier()
    if rank == 0:
        _finish(root, it_dir, iteration, list(groups), extra_json)
        if keep_last is not None:
            others = [d for d in list_checkpoints(root) if d != it_dir]
            for d in others[: max(0, len(others) - (keep_last - 1))]:
                _remove(d)
        _remove_leftovers(root, it_dir)
    barrier()
    return it_dir


def _remove_leftovers(root: Path, keep: Path) -> None:
    """Delete the iteration dirs without a manifest that an interrupted save or pruning left (a
    save writes its manifest last, `_remove` deletes it first), now that `keep` is complete."""
    for d in root.glob("iter_*"):
        if (
            d != keep
            and _ITER_RE.fullmatch(d.name)
            and not d.is_symlink()
            and d.is_dir()
            and not _is_complete(d)
        ):
            shutil.rmtree(d, ignore_errors=True)


def save_streaming(
    root: str | os.PathLike,
    iteration: int,
    tensors: Iterable[tuple],
    extra: dict,
    group_names: list[str],
) -> Path:
    """One process writes a whole checkpoint as `tensors` yields (group, key, global tensor, chunk
    shape) or (group, key, write), `write(path)` writing the array itself and returning its checksums (see
    `store.write_pieces`), for the conversion tools. Producing tensor i + 1 overlaps writing tensor i (in a thread); tensor i is
    written before tensor i + 2 is asked for, so a producer may reuse two buffers in turn, and
    memory holds two tensors. Same layout as `save_checkpoint`."""
    root, it_dir = Path(root), Path(root) / iter_dir_name(iteration)
    if RESERVED & extra.keys():
        raise ValueError(f"extra keys {sorted(RESERVED & extra.keys())} are reserved for the manifest")
    extra_json = json.dumps(extra)
    _prepare(root, it_dir, group_names)
    sums, writing = {}, {}
    with ThreadPoolExecutor(1) as writer:  # producing tensor i + 1 overlaps writing tensor i
        for group, key, *item in tensors:
            path = it_dir / group / key
            if callable(item[0]):  # writes the array at `path` itself, returns its checksums
                job = functools.partial(item[0], path)
            else:
                tensor, chunk = item
                arr = store.create_array(path, tuple(tensor.shape), chunk, tensor.dtype)
                job = functools.partial(store.write_slice, arr, tensor, (0,) * tensor.dim())
            for done, future in writing.items():
                sums[done] = future.result()
            writing = {f"{group}/{key}": writer.submit(job)}
        for done, future in writing.items():
            sums[done] = future.result()
    _finish(root, it_dir, iteration, group_names, extra_json, sums)
    return it_dir


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """The complete iter dir that `path` (DIR, following DIR/latest, or DIR/iter_N) names."""
    path = Path(path)
    if _ITER_RE.fullmatch(path.name) or (path / MANIFEST).exists():
        if not path.is_dir():
            raise MlmError(f"{path}: no such checkpoint directory; found {_found(path.parent)}")
        if not _is_complete(path):
            raise MlmError(
                f"{path}: incomplete checkpoint (a save was interrupted); use {path.parent}/latest "
                f"or an earlier iter_* ({_found(path.parent)})"
            )
        return path
    if not path.is_dir():
        raise MlmError(f"{path}: no such checkpoint directory; pass DIR or DIR/iter_NNNNNNN")
    latest = path / LATEST
    if not latest.is_file():
        raise MlmError(f"{path}: no `latest` file; found {_found(path)}; pass DIR/iter_NNNNNNN directly")
    name = latest.read_text().strip()
    if not _ITER_RE.fullmatch(name):
        raise MlmError(
            f"{latest} names {name[:80]!r}, not an iter_NNNNNNN folder beside it; write the name of one of "
            f"{path}'s checkpoints there ({_found(path)})"
        )
    target = path / name
    if target.is_symlink() and target.resolve().parent != path.resolve():
        raise MlmError(
            f"{latest} names {name}, a link to {target.resolve()} outside {path}; `latest` is followed only "
            "within its folder: pass that checkpoint directly"
        )
    if not _is_complete(target):
        raise MlmError(
            f"{latest} names {target.name}, which is missing or incomplete; pass an earlier complete "
            f"checkpoint directly ({_found(path)})"
        )
    return target


def _found(root: Path) -> str:
    names = [d.name for d in list_checkpoints(root)] if root.is_dir() else []
    return f"complete checkpoints: {', '.join(names)}" if names else "no complete iter_* checkpoint"


def read_manifest(iter_dir: str | os.PathLike) -> dict:
    path = Path(iter_dir) / MANIFEST
    manifest = read_json(path, missing=f"not found; {iter_dir} is not a complete checkpoint")
    if manifest.get("format") != FORMAT:
        raise MlmError(f"{path}: format {manifest.get('format')!r}, not {FORMAT!r}; not an mlm checkpoint")
    check_version(path, manifest.get("format_version"), FORMAT_VERSIONS, "checkpoint format_version")
    tensors = manifest.get("tensors")
    if not isinstance(tensors, dict):
        raise MlmError(f"{path}: 'tensors' is not an object of tensor entries; the manifest is damaged")
    bad = next((n for n in tensors if not (_TENSOR_NAME.fullmatch(n) and ".." not in n)), None)
    if bad is not None:
        raise MlmError(
            f"{path}: tensor name {bad[:120]!r} is not GROUP/KEY (letters, digits, '_', '.', ':', '-'; no "
            "'..'); the manifest is damaged or not mlm's"
        )
    bad = next((n for n, info in tensors.items() if not _plain_entry(info)), None)
    if bad is not None:
        raise MlmError(
            f"{path}: tensor {bad}: {str(tensors[bad])[:200]} does not give a shape and chunks of sizes and a "
            "dtype name; the manifest is damaged"
        )
    return manifest


def _plain_entry(info: object) -> bool:
    def sizes(v: object, least: int) -> bool:
        return isinstance(v, list) and all(type(n) is int and least <= n < 2**62 for n in v)

    return (
        isinstance(info, dict)
        and sizes(info.get("shape"), 0)
        and isinstance(info.get("dtype"), str)
        and ("chunks" not in info or sizes(info["chunks"], 1) and len(info["chunks"]) == len(info["shape"]))
    )


def checkpoint_config(manifest: dict, it_dir: Path) -> Config:
    """The run config a checkpoint's manifest records, its depth checked against the model tensors
    stored (a manifest from elsewhere is only a claim)."""
    if not isinstance(manifest.get("config"), dict):
        raise MlmError(f"{it_dir / MANIFEST} has no config; it was not written by mlm train or convert")
    cfg = config_from_dict(manifest["config"], str(it_dir / MANIFEST))
    cfg.model.check_depth(sum(k.startswith("model/") for k in manifest["tensors"]), str(it_dir / MANIFEST))
    return cfg


def array_path(it_dir: Path, name: str) -> Path:
    """The array of the manifest's tensor `name` ("group/key") in `it_dir`; MlmError where a link
    takes it outside the checkpoint."""
    path = it_dir / name
    if not path.resolve().is_relative_to(it_dir.resolve()):
        raise MlmError(
            f"{it_dir}: tensor {name} is a link to {path.resolve()}, outside the checkpoint; copy the "
            "checkpoint with its files, not links"
        )
    return path


def load_checkpoint(
    path: str | os.PathLike,
    groups: dict[str, list[ShardedTensor]],
    *,
    strict: bool = True,
    job_keys: dict[str, set[str]] | None = None,
    verify: bool = True,
) -> dict:
    """Copy each target's slice from the checkpoint into its `local`, in place; return the manifest.

    Values are cast to each `local`'s dtype. `strict`: every stored tensor of a requested group
    must have a target, on this rank or (given `job_keys`, group → keys loaded by any rank, as
    when pipeline stages each hold some layers) on some rank. Groups not requested (e.g. `optim`
    for evaluation) are not read. `verify`: check every chunk read against the CRC-32C the
    manifest records for it.
    """
    it_dir = resolve_checkpoint(path)
    manifest = read_manifest(it_dir)
    for name, targets in groups.items():
        stored = {k.split("/", 1)[1]: v for k, v in manifest["tensors"].items() if k.startswith(f"{name}/")}
        for st in targets:
            if st.key not in stored:
                raise MlmError(
                    f"{it_dir}: tensor {name}/{st.key} is not in the checkpoint; {_near(st.key, stored)}"
                )
        wanted = job_keys[name] if job_keys is not None else {st.key for st in targets}
        unexpected = sorted(stored.keys() - wanted)
        if strict and unexpected:
            raise MlmError(
                f"{it_dir}: {len(unexpected)} tensor(s) in {name}/ that the model does not have: "
                f"{', '.join(unexpected[:10])}; check the config, or load with strict=False"
            )
        for st in targets:
            where = f"{it_dir}: tensor {name}/{st.key}"
            shape = tuple(stored[st.key]["shape"])
            local = st.local
            if st.padded_rows and shape[1:] == st.global_shape[1:] and shape[0] != st.global_shape[0]:
                # another vocabulary padding: read the rows both have, zero the rest
                rows = max(0, min(st.local.shape[0], shape[0] - st.global_offset[0]))
                with torch.no_grad():
                    st.local[rows:].zero_()
                local = st.local[:rows]
            elif shape != st.global_shape:
                raise MlmError(f"{where}: checkpoint has shape {shape}, the model expects {st.global_shape}")
            if local.numel() == 0:
                continue
            arr = store.open_checked(array_path(it_dir, f"{name}/{st.key}"), where, stored[st.key])
            sums = stored[st.key].get(CHECKSUMS) if verify else None
            value = store.read_slice(arr, st.global_offset, tuple(local.shape), where, sums)
            with torch.no_grad():
                local.copy_(value)
    return manifest


def _near(key: str, stored: dict) -> str:
    if not stored:
        return "the checkpoint has no tensors in this group"
    close = difflib.get_close_matches(key, list(stored), n=3) or sorted(stored)[:3]
    return f"it has {len(stored)} here, e.g. {', '.join(close)}"


def read_group(
    ckpt: str | os.PathLike, group: str = "model", verify: bool = True
) -> tuple[dict[str, torch.Tensor], dict, Path]:
    """(every tensor of `group`, whole, in its stored dtype; the manifest; the iter dir) of the
    checkpoint `ckpt` (DIR or DIR/iter_N), for one process (conversion, serving); `verify`: check
    every chunk's checksum."""
    it_dir = resolve_checkpoint(ckpt)
    manifest = read_manifest(it_dir)
    prefix = f"{group}/"
    infos = {k[len(prefix) :]: v for k, v in manifest["tensors"].items() if k.startswith(prefix)}
    if not infos:
        raise MlmError(f"{it_dir}: the checkpoint has no {prefix} tensors")
    for k, v in infos.items():  # backed by the files before anything is allocated
        store.open_checked(array_path(it_dir, prefix + k), f"{it_dir}: tensor {prefix}{k}", v)
    targets = [
        ShardedTensor.full(
            k, torch.empty(v["shape"], dtype=store.dtype_from_name(v["dtype"], f"{it_dir}: {k}"))
        )
        for k, v in infos.items()
    ]
    load_checkpoint(it_dir, {group: targets}, verify=verify)
    return {st.key: st.local for st in targets}, manifest, it_dir


TOKENIZER_DIR = "tokenizer"
"""The checkpoint's own copy of its tokenizer files, beside the iter dirs (manifest `tokenizer`:
{"path": TOKENIZER_DIR, "files": [...]}), written by `mlm convert from-hf` and `mlm train`."""


def checkpoint_tokenizer(manifest: dict, it_dir: Path, vocabulary: bool = True) -> Path | None:
    """The checkpoint's own copy of its tokenizer (with `vocabulary`, only one that holds a
    vocabulary, not just generation_config.json); None when it has none. MlmError when the
    manifest records another folder or the folder is a link out of the checkpoint (a manifest
    from elsewhere must not point mlm at other files)."""
    recorded = manifest.get("tokenizer")
    if not recorded:
        return None
    root = it_dir.parent
    path = root / TOKENIZER_DIR
    if (
        not isinstance(recorded, dict)
        or recorded.get("path") != TOKENIZER_DIR
        or not path.resolve().is_relative_to(root.resolve())
    ):
        raise MlmError(
            f"{it_dir / MANIFEST}: the tokenizer record {str(recorded)[:120]} does not name the checkpoint's "
            f"own folder {TOKENIZER_DIR!r} (or that folder links out of it); the manifest is damaged or not mlm's"
        )
    from mlm.tokenizer import VOCABULARY_FILES

    files = recorded.get("files") or []
    return path if not vocabulary or set(files) & set(VOCABULARY_FILES) else None


def tokenizer_path(manifest: dict, it_dir: Path) -> Path | None:
    """The tokenizer a checkpoint names: its own copy (`checkpoint_tokenizer`), else the run's
    `data.tokenizer`, else the tokenizer recorded by its first dataset (`PREFIX.json`); None when
    it names none."""
    from mlm.datasets.builder import parse_blend
    from mlm.datasets.meta import read_meta

    own = checkpoint_tokenizer(manifest, it_dir)
    if own is not None:
        return own
    data = manifest.get("config", {}).get("data", {})
    if data.get("tokenizer"):
        return Path(data["tokenizer"])
    for _, prefix in parse_blend(data.get("data_path") or [])[:1]:
        meta = read_meta(prefix)
        if meta and meta.get("tokenizer", {}).get("path"):
            return Path(meta["tokenizer"]["path"])
    return None


def keep_tokenizer(root: Path, source: str | os.PathLike | None) -> dict | None:
    """The manifest record of the checkpoint's own tokenizer in `root`, copied from `source` (a
    tokenizer file or folder) the first time (staged, then renamed into place); None when there
    is nothing to copy."""
    from mlm.tokenizer import TOKENIZER_FILES, copy_tokenizer

    own = root / TOKENIZER_DIR
    if not own.is_dir():
        if source is None or not Path(source).exists():
            return None
        tmp = root / f"{TOKENIZER_DIR}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        if not copy_tokenizer(Path(source), tmp):
            return None
        tmp.rename(own)
    files = [n for n in TOKENIZER_FILES if (own / n).is_file()]
    return {"path": TOKENIZER_DIR, "files": files} if files else None
