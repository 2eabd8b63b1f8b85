"""Read documents from raw inputs: JSONL (plain, .gz, .zst) and plain text.

Every bad line is reported with its file and line number; with `skip_bad_lines` it is
counted by reason instead, and the build's summary lists the counts.
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import io
import json
import os
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, TypeVar

import zstandard

from mlm.errors import MlmError

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
COMPRESSED_SUFFIXES = (".gz", ".zst", ".zstd")
T = TypeVar("T")


@dataclass
class SourceStats:
    """What was read from one input file."""

    path: str
    bytes: int
    documents: int = 0
    skipped: Counter = field(default_factory=Counter)

    def as_json(self) -> dict:
        return {
            "path": self.path,
            "bytes": self.bytes,
            "documents": self.documents,
            "skipped": dict(self.skipped),
        }


def input_format(path: Path, requested: str) -> str:
    """`jsonl` or `text`, from the option or from the file name."""
    if requested != "auto":
        return requested
    name = path.name
    for c in COMPRESSED_SUFFIXES:
        name = name.removesuffix(c)
    return "jsonl" if name.endswith(JSONL_SUFFIXES) else "text"


class _CountingReader(io.RawIOBase):
    """Counts the (compressed) bytes read from a file, for progress by input size."""

    def __init__(self, f: BinaryIO):
        self.f, self.count = f, 0

    def readable(self):
        return True

    def readinto(self, b):
        n = self.f.readinto(b)
        self.count += n or 0
        return n


def open_input(path: Path) -> tuple[BinaryIO, _CountingReader]:
    """A buffered binary stream of the decompressed content, and the raw byte counter."""
    raw = _CountingReader(open(path, "rb"))  # noqa: SIM115 - closed with the returned stream
    if path.suffix == ".gz":
        stream = gzip.GzipFile(fileobj=io.BufferedReader(raw, 1 << 20), mode="rb")
    elif path.suffix in (".zst", ".zstd"):
        stream = zstandard.ZstdDecompressor().stream_reader(io.BufferedReader(raw, 1 << 20), closefd=True)
    else:
        return io.BufferedReader(raw, 1 << 20), raw
    return io.BufferedReader(stream, 1 << 20), raw


class BadInput(MlmError):
    """A line (or file) that is not a document; `reason` is the summary's category."""

    def __init__(self, where: str, reason: str, detail: str, fix: str):
        super().__init__(f"{where}: {detail}. {fix}")
        self.reason = reason


def _decode(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadInput(
            where,
            "not UTF-8",
            f"not valid UTF-8 (byte 0x{data[e.start]:02x} at column {e.start + 1})",
            "Re-encode the file as UTF-8, or pass --skip-bad-lines to skip such lines",
        ) from None


def json_object(line: bytes, where: str, example: str) -> dict:
    """The JSON object on one JSONL line; BadInput when it is not UTF-8, not JSON or not an object
    (`example` shows what a line should look like)."""
    text = _decode(line, where)
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadInput(
            where,
            "bad JSON",
            f"not valid JSON ({e.msg} at column {e.colno})",
            "Fix the line, or pass --skip-bad-lines to skip such lines",
        ) from None
    if not isinstance(obj, dict):
        raise BadInput(
            where,
            "not an object",
            f"a JSON {type(obj).__name__}, not an object",
            f"Each line must be an object such as {example}, or pass --skip-bad-lines to skip such lines",
        )
    return obj


def key_names(obj: dict) -> str:
    """The first keys of a JSON object, for a message about a missing one."""
    return ", ".join(list(obj)[:8]) or "none"


def _jsonl_doc(key: str, line: bytes, where: str) -> str | None:
    if not line.strip():
        return None  # blank lines separate nothing in JSONL; not a document
    obj = json_object(line, where, '{"text": "..."}')
    if key not in obj:
        raise BadInput(
            where,
            "missing key",
            f"no key {key!r} (keys: {key_names(obj)})",
            "Choose the key with --json-key, or pass --skip-bad-lines to skip such lines",
        )
    value = obj[key]
    if not isinstance(value, str):
        raise BadInput(
            where,
            "not a string",
            f"{key!r} is a {type(value).__name__}, not a string",
            "Choose another key with --json-key, or pass --skip-bad-lines",
        )
    return value


def _text_line(line: bytes, where: str) -> str:
    return _decode(line, where).rstrip("\r\n")


@contextlib.contextmanager
def _reading(path: Path) -> Iterator[tuple[BinaryIO, _CountingReader]]:
    """`open_input(path)`, with a missing file and corrupt or truncated compressed input as MlmError."""
    if not path.is_file():
        raise MlmError(f"input not found: {path}")
    stream, raw = open_input(path)
    with stream:
        try:
            yield stream, raw
        except (OSError, EOFError, zstandard.ZstdError) as e:
            raise MlmError(f"{path}: cannot read ({e}); is the file complete?") from None


def iter_lines(
    path: Path, parse: Callable[[bytes, str], T | None], skip_bad_lines: bool, stats: SourceStats
) -> Iterator[tuple[T, int]]:
    """Yield (parse(line, where), raw bytes consumed so far) for each line of one input file,
    `where` being "file:line". `parse` returns None for a line that is no document (a blank JSONL
    line) and raises BadInput for a bad one: raised on, or with `skip_bad_lines` counted by reason."""
    with _reading(path) as (stream, raw):
        for lineno, line in enumerate(stream, 1):
            where = f"{path}:{lineno}"
            try:
                value = parse(line, where)
            except BadInput as e:
                if not skip_bad_lines:
                    raise
                stats.skipped[e.reason] += 1
                continue
            if value is None:
                continue
            stats.documents += 1
            yield value, raw.count


def iter_documents(
    path: Path, fmt: str, key: str, text_unit: str, skip_bad_lines: bool, stats: SourceStats
) -> Iterator[tuple[str, int]]:
    """Yield (document text, raw bytes consumed so far) for one input file."""
    if fmt == "text" and text_unit == "file":
        with _reading(path) as (stream, raw):
            data = stream.read()
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError as e:
                line = data.count(b"\n", 0, e.start) + 1
                err = BadInput(
                    f"{path}:{line}",
                    "not UTF-8",
                    f"not valid UTF-8 (byte 0x{data[e.start]:02x})",
                    "Re-encode the file as UTF-8, or pass --skip-bad-lines to skip such files",
                )
                if not skip_bad_lines:
                    raise err from None
                stats.skipped[err.reason] += 1
                return
            stats.documents += 1
            yield text, raw.count
        return
    parse = functools.partial(_jsonl_doc, key) if fmt == "jsonl" else _text_line
    yield from iter_lines(path, parse, skip_bad_lines, stats)


def expand_inputs(inputs: list[str | os.PathLike]) -> list[Path]:
    """Files as given; a folder stands for the files in it (sorted)."""
    out: list[Path] = []
    for i in inputs:
        p = Path(i)
        if p.is_dir():
            out.extend(sorted(q for q in p.iterdir() if q.is_file()))
        elif p.is_file():
            out.append(p)
        else:
            raise MlmError(f"input not found: {p}")
    if not out:
        raise MlmError(f"no input files in {', '.join(map(str, inputs))}")
    return out
