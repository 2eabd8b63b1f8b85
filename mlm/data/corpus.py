"""The embedded default corpus: the standard library's own Python sources.

Every Python install carries them, so the demo needs no download and commits no text from
elsewhere. One document per `.py` file, sorted by path, tests and site-packages excluded.
"""

from __future__ import annotations

import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from mlm.fileio import atomic_outputs, check_writable

_EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


@dataclass
class CorpusSummary:
    path: str
    documents: int
    bytes: int
    skipped_not_utf8: int


def stdlib_files(root: str | os.PathLike | None = None) -> list[Path]:
    """The stdlib's `.py` files, sorted, with test folders and `test_*.py` left out."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if d not in _EXCLUDED_DIRS)
        files.extend(Path(dirpath) / f for f in filenames if f.endswith(".py") and not f.startswith("test_"))
    return sorted(files, key=lambda p: p.relative_to(base).as_posix())


def write_stdlib_corpus(out: str | os.PathLike, overwrite: bool = False, repeat: int = 1) -> CorpusSummary:
    """Write the stdlib corpus as JSONL (`text`, `path`); `repeat` copies it for benchmarks."""
    out = Path(out)
    check_writable([out], overwrite)
    base = Path(sysconfig.get_paths()["stdlib"])
    docs = nbytes = bad = 0
    with atomic_outputs([out]) as (tmp,), open(tmp, "w", encoding="utf-8") as f:
        for _ in range(repeat):
            for path in stdlib_files(base):
                try:
                    text = path.read_text(encoding="utf-8")
                except UnicodeDecodeError:
                    bad += 1
                    continue
                line = json.dumps({"text": text, "path": path.relative_to(base).as_posix()}) + "\n"
                f.write(line)
                docs += 1
                nbytes += len(line)
    return CorpusSummary(str(out), docs, nbytes, bad)
