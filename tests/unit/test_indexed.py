"""The indexed dataset is Megatron-LM's layout, byte for byte, in both directions."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from mlm.datasets.indexed import IndexedDataset, IndexedDatasetWriter, data_paths, optimal_dtype
from mlm.errors import MlmError


def write(prefix, docs, dtype=np.uint16):
    bin_path, idx_path = data_paths(prefix)
    w = IndexedDatasetWriter(bin_path, idx_path, dtype)
    lengths = np.array([len(d) for d in docs])
    w.add_documents(np.concatenate([np.asarray(d) for d in docs] or [np.zeros(0)]).astype(dtype), lengths)
    w.finalize()
    return bin_path, idx_path


def test_header_and_arrays_are_megatron_layout(tmp_path):
    docs = [[5, 6, 7], [], [8, 9], [10]]
    bin_path, idx_path = write(tmp_path / "d", docs)
    raw = idx_path.read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    version, code, n_seq, n_doc = struct.unpack("<QBQQ", raw[9:34])
    assert (version, code, n_seq, n_doc) == (1, 8, 3, 5)  # uint16 is code 8; documents + 1 entries
    off = 34
    lengths = np.frombuffer(raw, np.int32, n_seq, off)
    off += 4 * n_seq
    pointers = np.frombuffer(raw, np.int64, n_seq, off)
    off += 8 * n_seq
    doc_idx = np.frombuffer(raw, np.int64, n_doc, off)
    off += 8 * n_doc
    assert off == len(raw)
    assert lengths.tolist() == [3, 2, 1]
    assert pointers.tolist() == [0, 6, 10]  # byte offsets: 3 and 2 uint16 tokens before
    assert doc_idx.tolist() == [0, 1, 1, 2, 3]  # the empty document repeats the sequence index
    assert np.frombuffer(bin_path.read_bytes(), np.uint16).tolist() == [5, 6, 7, 8, 9, 10]


def _independent_megatron_writer(prefix, docs, dtype, code):
    """A minimal writer of the layout, written from the format description alone."""
    lengths = [len(d) for d in docs if len(d)]
    pointers, pos = [], 0
    for n in lengths:
        pointers.append(pos)
        pos += n * np.dtype(dtype).itemsize
    doc_idx, seqs = [0], 0
    for d in docs:
        seqs += 1 if len(d) else 0
        doc_idx.append(seqs)
    with open(f"{prefix}.bin", "wb") as f:
        for d in docs:
            f.write(np.asarray(d, dtype).tobytes())
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code))
        f.write(struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(doc_idx)))
        f.write(struct.pack(f"<{len(lengths)}i", *lengths))
        f.write(struct.pack(f"<{len(pointers)}q", *pointers))
        f.write(struct.pack(f"<{len(doc_idx)}q", *doc_idx))


@pytest.mark.parametrize("dtype,code", [(np.uint16, 8), (np.int32, 4)])
def test_reads_file_from_independent_writer(tmp_path, dtype, code):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 30000, size=n).tolist() for n in (17, 0, 1, 300, 0, 5)]
    _independent_megatron_writer(tmp_path / "m", docs, dtype, code)
    ds = IndexedDataset(tmp_path / "m")
    assert ds.dtype == np.dtype(dtype)
    assert len(ds) == 4 and ds.num_documents == 6
    for d, doc in enumerate(docs):
        assert ds.document(d).tolist() == doc
    assert ds.get(2, offset=10, length=5).tolist() == docs[3][10:15]  # sequence 2 is document 3
    # and our writer produces the very same bytes
    write(tmp_path / "ours", docs, dtype)
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"ours{ext}").read_bytes() == (tmp_path / f"m{ext}").read_bytes()


def test_optimal_dtype_matches_megatron():
    assert optimal_dtype(65499) == np.uint16
    assert optimal_dtype(65500) == np.int32


def test_refuses_wrong_magic_version_and_mismatched_bin(tmp_path):
    write(tmp_path / "d", [[1, 2, 3], [4]])
    idx = tmp_path / "d.idx"
    good = idx.read_bytes()
    idx.write_bytes(b"NOTMAGIC!" + good[9:])
    with pytest.raises(MlmError, match="d.idx: not a Megatron indexed-dataset index"):
        IndexedDataset(tmp_path / "d")
    idx.write_bytes(good[:9] + struct.pack("<Q", 2) + good[17:])
    with pytest.raises(MlmError, match="index version 2; this mlm reads version 1"):
        IndexedDataset(tmp_path / "d")
    idx.write_bytes(good)
    (tmp_path / "d.bin").write_bytes(b"\x00\x00")
    with pytest.raises(MlmError, match="do not belong together"):
        IndexedDataset(tmp_path / "d")
    with pytest.raises(MlmError, match="dataset file not found"):
        IndexedDataset(tmp_path / "missing")
