"""Write artifacts without ever leaving a half-written file under the real name.

`atomic_outputs` hands out temporary paths beside the final ones and renames them into place
only when the block finishes without an exception; on any error (Ctrl-C included) the
temporaries are removed. A SIGKILL can leave `*.tmp-PID` files, never a partial real file.
`staged_dir` does the same for a whole output folder.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path

from mlm.errors import MlmError


def fsync_dir(d: str | os.PathLike) -> None:
    """Flush a directory's entries to disk (the names of the files created in it)."""
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str | os.PathLike) -> None:
    """Flush a file's data to disk."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dirs(paths, top: str | os.PathLike) -> None:
    """fsync the parent directories of `paths`, each up to and including `top` (once each)."""
    top, done = Path(top), set()
    for p in paths:
        d = Path(p).parent
        while d not in done:
            fsync_dir(d)
            done.add(d)
            if d == top or d == d.parent:
                break
            d = d.parent


WRITE_ERRNOS = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT)
"""Errors that mean an output cannot be written where it was asked for (`write_error`)."""


def write_error(e: OSError, folder: Path) -> MlmError:
    """One line for an output folder that cannot be written: permissions, a read-only file
    system, a full disk."""
    return MlmError(
        f"cannot write in {folder}: {e.strerror}; choose a writable output folder "
        "(or fix its permissions, or free space) and run again"
    )


def check_writable(paths: Sequence[Path], overwrite: bool) -> None:
    """Refuse to replace existing outputs unless `overwrite`; make sure the folder exists."""
    if not overwrite:
        existing = [str(p) for p in paths if p.exists()]
        if existing:
            raise MlmError(f"output already exists: {', '.join(existing)}. Pass --overwrite to replace it.")
    for p in paths:
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            if e.errno in WRITE_ERRNOS:
                raise write_error(e, p.parent) from None
            raise


@contextlib.contextmanager
def atomic_outputs(paths: Sequence[str | os.PathLike]) -> Iterator[list[Path]]:
    """Yield temporary paths for `paths`; rename them into place (in order) on success. An error
    writing a temporary (permissions, read-only, disk full) becomes one MlmError naming its folder;
    a temporary that cannot be removed (a read-only file system) does not hide the first error."""
    finals = [Path(p) for p in paths]
    temps = [p.with_name(f"{p.name}.tmp-{os.getpid()}") for p in finals]
    try:
        yield temps
    except BaseException as e:
        for t in temps:
            with contextlib.suppress(OSError):
                t.unlink(missing_ok=True)
        if isinstance(e, OSError) and e.errno in WRITE_ERRNOS and e.filename is not None:
            folder = Path(e.filename).parent
            if folder in {t.parent for t in temps}:
                raise write_error(e, folder) from None
        raise
    for t, f in zip(temps, finals, strict=True):
        os.replace(t, f)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write a small text file atomically."""
    with atomic_outputs([path]) as (tmp,):
        tmp.write_text(text)


@contextlib.contextmanager
def staged_dir(out: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty folder `OUT.tmp-PID` beside `out`; rename it to `out` when the block finishes
    without an exception, remove it on any error (Ctrl-C included). `out` must not exist."""
    out = Path(out)
    check_new_dir(out)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        yield tmp
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            free = shutil.disk_usage(out.parent).free
            raise MlmError(
                f"no space left on the device while writing {out} ({e.strerror}); the partial output "
                f"was removed ({free / 1e9:.3g} GB free now): free space or choose another OUT, then run again"
            ) from e
        if isinstance(e, OSError) and e.errno in WRITE_ERRNOS:
            raise write_error(e, out.parent) from None
        raise
    check_new_dir(out)
    os.rename(tmp, out)


def check_new_dir(out: Path) -> None:
    """Refuse an output folder that exists, or is a link (a dangling one included)."""
    if out.is_symlink():
        raise MlmError(f"{out} is a link (to {os.readlink(out)}); pass a new output path, not a link")
    if out.exists():
        raise MlmError(f"{out} already exists; pass a new output path, or remove it first (rm -r {out})")


def _read(path: Path, kind: str, parse, errors, missing: str | None, fix: str) -> dict:
    try:
        text = path.read_text()
    except FileNotFoundError:
        if missing is None:
            raise
        raise MlmError(f"{path}: {missing}") from None
    try:
        return parse(text)
    except errors as e:
        raise MlmError(f"{path}: not valid {kind} ({e}){'; ' + fix if fix else ''}") from None


def read_json(path: str | os.PathLike, missing: str | None = None, fix: str = ""):
    """The JSON in `path`; MlmError naming the file (and `fix`) when it is not valid JSON, and,
    given `missing` (what to say), when it does not exist."""
    import json

    return _read(Path(path), "JSON", json.loads, (json.JSONDecodeError, UnicodeDecodeError), missing, fix)


def read_toml(path: str | os.PathLike, missing: str | None = None, fix: str = "") -> dict:
    """The TOML in `path`; MlmError naming the file (and `fix`) when it is not valid TOML, and,
    given `missing`, when it does not exist."""
    import tomllib

    return _read(
        Path(path), "TOML", tomllib.loads, (tomllib.TOMLDecodeError, UnicodeDecodeError), missing, fix
    )
