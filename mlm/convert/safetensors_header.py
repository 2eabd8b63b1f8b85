"""A safetensors file's header, checked before anything is read or allocated: an 8-byte
little-endian length, then a JSON object of `name: {dtype, shape, data_offsets}` whose offsets
count from the end of the header. The length must fit the file and the library's 100 MB limit;
every tensor's offsets must lie in the file, span exactly its shape × dtype, and not overlap
another's. Hugging Face and TensorRT-LLM folders are read through this first, so a bad file is
one `error:` line naming it and the field, never a traceback or an allocation its header claims."""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path

from mlm.errors import MlmError

MAX_HEADER_BYTES = 100_000_000
"""The safetensors library's own limit on the header."""
ITEMSIZE = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


@dataclass(frozen=True)
class HeaderEntry:
    dtype: str
    shape: tuple[int, ...]
    start: int
    """Byte offset of the tensor's data in the file."""
    nbytes: int


def read_header(path: Path) -> dict[str, HeaderEntry]:
    """The tensors of safetensors file `path`, checked against its size; MlmError naming the file
    and the field that is wrong."""

    def bad(what: str) -> MlmError:
        return MlmError(f"{path}: {what}; the file is damaged or not safetensors")

    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise bad(f"{size} bytes, shorter than the 8-byte header length")
        n = int.from_bytes(head, "little")
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise bad(f"header length {n} is more than the {size - 8} bytes after it (or {MAX_HEADER_BYTES})")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:  # JSON or UTF-8
            raise bad(f"the header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise bad("the header is not a JSON object")
    data = size - 8 - n
    entries = {}
    for name, v in header.items():
        if name == "__metadata__":
            continue
        where = f"tensor {name[:120]!r}"
        if not isinstance(v, dict):
            raise bad(f"{where} is not an object")
        dtype, shape, offsets = v.get("dtype"), v.get("shape"), v.get("data_offsets")
        if dtype not in ITEMSIZE:
            raise bad(f"{where}: dtype {str(dtype)[:40]!r} is not one of {', '.join(ITEMSIZE)}")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise bad(f"{where}: shape {str(shape)[:80]} is not a list of sizes")
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1] <= data
        ):
            raise bad(
                f"{where}: data_offsets {str(offsets)[:80]} are not a range within the {data} data bytes"
            )
        need = math.prod(shape) * ITEMSIZE[dtype]
        if offsets[1] - offsets[0] != need:
            raise bad(
                f"{where}: data_offsets span {offsets[1] - offsets[0]} bytes, but shape {shape} of {dtype} "
                f"takes {need}"
            )
        entries[name] = HeaderEntry(dtype, tuple(shape), 8 + n + offsets[0], need)
    spans = sorted((e.start, e.start + e.nbytes, k) for k, e in entries.items() if e.nbytes)
    for (_, end, a), (start, _, b) in itertools.pairwise(spans):
        if start < end:
            raise bad(f"tensors {a[:120]!r} and {b[:120]!r} overlap")
    return entries
