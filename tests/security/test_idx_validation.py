"""A `.idx` is checked whole when opened: every length and pointer against the `.bin`, pointers
that never go back, document indices from 0 to the sequence count in order. Checked at its last
entry only, a middle entry of 2³¹−1, a negative length or a pointer past the end was accepted
(and training would read the wrong tokens)."""

import re
import struct

import numpy as np
import pytest

from mlm.datasets.indexed import IndexedDataset, IndexedDatasetWriter, data_paths
from mlm.errors import MlmError

HEADER = struct.calcsize("<9sQBQQ")
DOCS = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]


def _dataset(prefix):
    bin_path, idx_path = data_paths(prefix)
    w = IndexedDatasetWriter(bin_path, idx_path, np.uint16)
    w.add_documents(np.concatenate([np.array(d, np.uint16) for d in DOCS]), np.array([len(d) for d in DOCS]))
    w.finalize()
    return idx_path


def _patch(idx_path, section, index, value):
    """Set entry `index` of the index's lengths (int32), pointers or document indices (int64)."""
    n = len(DOCS)
    offsets = {"lengths": (HEADER, "<i"), "pointers": (HEADER + 4 * n, "<q"), "docs": (HEADER + 12 * n, "<q")}
    start, fmt = offsets[section]
    data = bytearray(idx_path.read_bytes())
    struct.pack_into(fmt, data, start + struct.calcsize(fmt) * index, value)
    idx_path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("section", "index", "value", "message"),
    [
        ("lengths", 1, 2**31 - 1, "sequence 1 has length 2147483647"),
        ("lengths", 1, -1, "sequence 1 has length -1"),
        ("pointers", 2, 10**6, "sequence 2 has length 1 at byte 1000000"),
        ("pointers", 2, 0, "sequence 2 has length 1 at byte 0 (the one before starts at 6"),
        ("pointers", 0, -4, "sequence 0 has length 3 at byte -4"),
        ("docs", 0, 1, "document indices must run from 0 to 4"),
        ("docs", 2, 9, "document indices must run from 0 to 4"),
        ("docs", 2, 0, "go back at entry 2"),
    ],
)
def test_a_corrupt_index_entry_is_named(tmp_path, section, index, value, message):
    prefix = tmp_path / "d"
    idx = _dataset(prefix)
    assert [list(IndexedDataset(prefix)[i]) for i in range(len(DOCS))] == DOCS
    _patch(idx, section, index, value)
    with pytest.raises(MlmError, match=rf"d\.idx: .*{re.escape(message)}.*rebuild the dataset"):
        IndexedDataset(prefix)
