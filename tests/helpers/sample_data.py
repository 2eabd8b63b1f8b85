"""What the dataset tests share (and bench/sample_index.py): Megatron's sample index built by its
own loop (`megatron_sample_index_loop`), and a small indexed dataset of random tokens
(`make_dataset`)."""

from __future__ import annotations

import numpy as np

from mlm.datasets.indexed import IndexedDataset, IndexedDatasetWriter, data_paths


def megatron_sample_index_loop(sizes, document_index, seq_length):
    """Megatron's helpers.cpp build_sample_idx (drop last partial, one extra token), as a loop."""
    num_samples = (int(sizes[document_index].sum()) - 1) // seq_length
    out = np.zeros((num_samples + 1, 2), np.int64)
    doc_idx_index, doc_offset = 0, 0
    for i in range(1, num_samples + 1):
        remaining = seq_length + 1
        while remaining != 0:
            doc_length = int(sizes[document_index[doc_idx_index]]) - doc_offset
            remaining -= doc_length
            if remaining <= 0:
                doc_offset += remaining + doc_length - 1
                remaining = 0
            else:
                doc_idx_index += 1
                doc_offset = 0
        out[i] = (doc_idx_index, doc_offset)
    return out


def make_dataset(tmp_path, lengths, seed=0, name="d"):
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths, np.int64)
    tokens = rng.integers(3, 1000, size=int(lengths.sum())).astype(np.uint16)
    w = IndexedDatasetWriter(*data_paths(tmp_path / name), np.uint16)
    w.add_documents(tokens, lengths)
    w.finalize()
    return IndexedDataset(tmp_path / name)
