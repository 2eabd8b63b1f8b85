"""Megatron-LM's indexed dataset: `PREFIX.bin` (tokens) + `PREFIX.idx` (index), byte for byte.

`.idx` layout (little endian), as written by megatron/core/datasets/indexed_dataset.py:

    magic            9 bytes   b"MMIDIDX\\x00\\x00"
    version          uint64    1
    dtype code       uint8     1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
    sequence count   uint64    S
    document count   uint64    D + 1 (document_indices has a leading 0)
    sequence_lengths int32[S]  tokens per sequence
    sequence_pointers int64[S] byte offset of each sequence in .bin
    document_indices int64[D+1] sequence index where each document starts, then S

`.bin` is the token ids of every sequence, concatenated, in the dtype above. mlm writes one
sequence per document; an empty document adds a document_indices entry and no sequence.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

from mlm.errors import MlmError, check_version

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count

DTYPE_CODES: dict[int, type[np.generic]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODE_OF = {np.dtype(v): k for k, v in DTYPE_CODES.items()}


def optimal_dtype(vocab_size: int) -> np.dtype:
    """Megatron's choice: uint16 when the vocabulary has fewer than 65500 ids, else int32."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


def check_dtype_fits(dtype: np.dtype, vocab_size: int) -> None:
    """Raise if token ids up to vocab_size - 1 do not fit `dtype`."""
    if np.dtype(dtype) not in _CODE_OF:
        raise MlmError(f"dtype={np.dtype(dtype).name} is not an indexed-dataset dtype; use uint16 or int32")
    top = np.iinfo(dtype).max
    if vocab_size - 1 > top:
        raise MlmError(
            f"vocab size {vocab_size} does not fit dtype {np.dtype(dtype).name} (largest id {top}); "
            "use --dtype int32 (or leave --dtype unset to choose automatically)"
        )


def data_paths(prefix: str | os.PathLike) -> tuple[Path, Path]:
    """(`PREFIX.bin`, `PREFIX.idx`)."""
    p = str(prefix)
    return Path(p + ".bin"), Path(p + ".idx")


class IndexedDatasetWriter:
    """Stream documents to a `.bin` file and write the matching `.idx` on `finalize`.

    The writer takes explicit paths so that the caller can hand it temporary names
    (see `mlm.fileio.atomic_outputs`). Index arrays are kept as numpy chunks.
    """

    def __init__(self, bin_path: str | os.PathLike, idx_path: str | os.PathLike, dtype: np.dtype):
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF:
            raise MlmError(f"dtype={self.dtype.name} is not an indexed-dataset dtype")
        self.idx_path = Path(idx_path)
        self._bin = open(bin_path, "wb")  # noqa: SIM115 - closed in finalize/close
        self._lengths: list[np.ndarray] = []
        self._doc_starts: list[np.ndarray] = [np.zeros(1, np.int64)]
        self.num_sequences = 0
        self.num_documents = 0
        self.num_empty_documents = 0
        self.num_tokens = 0

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents given as their concatenated tokens and per-document lengths.

        A zero length is an empty document: a document entry with no sequence.
        """
        lengths = np.asarray(lengths, dtype=np.int64)
        assert int(lengths.sum()) == len(tokens), "lengths must add up to the token count"
        self._bin.write(np.ascontiguousarray(tokens, dtype=self.dtype).tobytes(order="C"))
        nonempty = lengths[lengths > 0]
        self._lengths.append(nonempty.astype(np.int32))
        self._doc_starts.append(self.num_sequences + np.cumsum(lengths > 0, dtype=np.int64))
        self.num_sequences += len(nonempty)
        self.num_documents += len(lengths)
        self.num_empty_documents += len(lengths) - len(nonempty)
        self.num_tokens += len(tokens)

    def add_dataset(self, other: IndexedDataset) -> None:
        """Append every document of `other` (Megatron's merge_datasets)."""
        if other.dtype != self.dtype:
            raise MlmError(f"{other.path_prefix}: dtype {other.dtype.name} differs from {self.dtype.name}")
        with open(other.bin_path, "rb") as src:
            while block := src.read(64 << 20):
                self._bin.write(block)
        self._lengths.append(np.asarray(other.sequence_lengths, dtype=np.int32))
        self._doc_starts.append(self.num_sequences + np.asarray(other.document_indices[1:], np.int64))
        self.num_sequences += len(other)
        self.num_documents += other.num_documents
        self.num_empty_documents += int((np.diff(other.document_indices) == 0).sum())
        self.num_tokens += int(other.sequence_lengths.sum(dtype=np.int64))

    def finalize(self) -> None:
        self._bin.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int32)
        pointers = np.zeros(len(lengths), np.int64)
        np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
        pointers *= self.dtype.itemsize
        doc_indices = np.concatenate(self._doc_starts)
        with open(self.idx_path, "wb") as f:
            f.write(
                _HEADER.pack(INDEX_MAGIC, INDEX_VERSION, _CODE_OF[self.dtype], len(lengths), len(doc_indices))
            )
            f.write(lengths.tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(doc_indices.tobytes(order="C"))

    def close(self) -> None:
        self._bin.close()


_BLOCK = 1 << 22
"""Index entries checked at a time (bounds the check's memory at about 100 MiB)."""


class IndexedDataset:
    """Read a Megatron indexed dataset through numpy memmaps (Megatron-made files included).

    `ds[i]` is sequence i; `ds.get(i, offset, length)` a slice of it without reading the rest.
    """

    def __init__(self, path_prefix: str | os.PathLike):
        self.path_prefix = str(path_prefix)
        self.bin_path, self.idx_path = data_paths(path_prefix)
        for p in (self.idx_path, self.bin_path):
            if not p.is_file():
                raise MlmError(
                    f"dataset file not found: {p}. Build it with `mlm data build ... --output-prefix {path_prefix}`"
                )
        idx_size = self.idx_path.stat().st_size
        with open(self.idx_path, "rb") as f:
            head = f.read(_HEADER.size)
        if len(head) < _HEADER.size or head[:9] != INDEX_MAGIC:
            raise MlmError(
                f"{self.idx_path}: not a Megatron indexed-dataset index (magic {head[:9]!r}, expected {INDEX_MAGIC!r})"
            )
        _, version, code, n_seq, n_doc = _HEADER.unpack(head)
        check_version(self.idx_path, version, [INDEX_VERSION], "index version")
        if code not in DTYPE_CODES:
            raise MlmError(f"{self.idx_path}: unknown dtype code {code}; known codes {sorted(DTYPE_CODES)}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        need = _HEADER.size + n_seq * (4 + 8) + n_doc * 8
        if idx_size < need:
            raise MlmError(
                f"{self.idx_path}: truncated ({idx_size} bytes, header promises {need}); rebuild the dataset"
            )
        idx = np.memmap(self.idx_path, mode="r", dtype=np.uint8)
        off = _HEADER.size
        self.sequence_lengths = idx[off : off + 4 * n_seq].view(np.int32)
        off += 4 * n_seq
        self.sequence_pointers = idx[off : off + 8 * n_seq].view(np.int64)
        off += 8 * n_seq
        self.document_indices = idx[off : off + 8 * n_doc].view(np.int64)
        bin_size = self.bin_path.stat().st_size
        self._check(bin_size)
        self._bin = (
            np.memmap(self.bin_path, mode="r", dtype=self.dtype) if bin_size else np.zeros(0, self.dtype)
        )

    def _check(self, bin_size: int) -> None:
        """MlmError naming the first sequence or document entry of the index that is impossible:
        a negative length, a pointer that goes back or whose sequence ends past the .bin, document
        indices that do not run from 0 to the sequence count in order. In blocks, O(n)."""
        lengths, pointers, docs = self.sequence_lengths, self.sequence_pointers, self.document_indices
        rebuild = "the .idx is damaged, or the .bin and .idx do not belong together: rebuild the dataset"
        previous = 0
        for start in range(0, len(lengths), _BLOCK):
            n = lengths[start : start + _BLOCK].astype(np.int64)
            p = pointers[start : start + _BLOCK]
            ends = p + n * self.dtype.itemsize
            bad = (n < 0) | (p < previous) | (ends > bin_size)
            bad[1:] |= p[1:] < p[:-1]
            if bad.any():
                i = int(np.argmax(bad))
                raise MlmError(
                    f"{self.idx_path}: sequence {start + i} has length {int(n[i])} at byte {int(p[i])} (the one "
                    f"before starts at {int(p[i - 1]) if i else previous}; {self.bin_path} has {bin_size} bytes); "
                    + rebuild
                )
            previous = int(p[-1]) if len(p) else previous
        steps = np.diff(docs) if len(docs) > 1 else np.zeros(0, np.int64)
        if len(docs) == 0 or docs[0] != 0 or docs[-1] != len(lengths) or (steps < 0).any():
            first = int(np.argmax(steps < 0)) + 1 if (steps < 0).any() else None
            raise MlmError(
                f"{self.idx_path}: document indices must run from 0 to {len(lengths)} (the sequence count) in "
                f"order; they {'are empty' if len(docs) == 0 else f'run from {int(docs[0])} to {int(docs[-1])}'}"
                f"{f' and go back at entry {first}' if first is not None else ''}; " + rebuild
            )

    def __len__(self) -> int:
        """Number of sequences (documents that are not empty)."""
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize + offset
        if length is None:
            length = int(self.sequence_lengths[i]) - offset
        return self._bin[start : start + length]

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def document(self, d: int) -> np.ndarray:
        """Tokens of document d (empty for an empty document)."""
        beg, end = int(self.document_indices[d]), int(self.document_indices[d + 1])
        if beg == end:
            return np.zeros(0, self.dtype)
        return np.concatenate([self.get(i) for i in range(beg, end)])
