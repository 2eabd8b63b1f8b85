"""Benchmark Megatron-style GPT index construction on a synthetic 1e9-token document table.

    python bench/sample_index.py [--tokens 1e9] [--seq-length 4096]

Times `build_gpt_indices` (document shuffle + sample index + sample shuffle) for one epoch of
a table of lognormal document lengths totalling `--tokens`, and for context the same sample
index built by a Python port of Megatron's C++ loop on a 1e7-token slice (then scaled
linearly: the loop is O(samples + documents)). Also times blending indices for 1e7 samples.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # mlm, and tests.helpers

from mlm.datasets.blended import build_blending_indices  # noqa: E402
from mlm.datasets.gpt import build_gpt_indices, build_sample_index  # noqa: E402
from tests.helpers.sample_data import megatron_sample_index_loop  # noqa: E402


def doc_table(tokens: float, rng) -> np.ndarray:
    sizes = np.maximum(1, rng.lognormal(mean=6.5, sigma=1.0, size=int(tokens / 1000 * 1.1))).astype(np.int32)
    cut = np.searchsorted(np.cumsum(sizes, dtype=np.int64), int(tokens))
    return sizes[: cut + 1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=float, default=1e9)
    ap.add_argument("--seq-length", type=int, default=4096)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    sizes = doc_table(args.tokens, rng)
    t0 = time.perf_counter()
    idx = build_gpt_indices(sizes, np.arange(len(sizes), dtype=np.int32), args.seq_length, None, seed=1234)
    full = time.perf_counter() - t0
    print(
        f"{int(sizes.sum(dtype=np.int64)):,} tokens in {len(sizes):,} documents, seq_length {args.seq_length}: "
        f"{len(idx['shuffle_index']):,} samples, all three indices in {full:.2f} s"
    )

    small = doc_table(1e7, rng)
    doc_index = np.arange(len(small), dtype=np.int32)
    t0 = time.perf_counter()
    build_sample_index(small, doc_index, args.seq_length)
    ours = time.perf_counter() - t0
    t0 = time.perf_counter()
    megatron_sample_index_loop(small, doc_index, args.seq_length)
    loop = time.perf_counter() - t0
    scale = args.tokens / 1e7
    print(
        f"sample index on 1e7 tokens: numpy {ours * 1e3:.1f} ms, Python port of Megatron's loop {loop * 1e3:.0f} ms "
        f"(x{loop / ours:.0f}); the loop scaled to {args.tokens:.0e} tokens: ~{loop * scale:.0f} s"
    )

    t0 = time.perf_counter()
    build_blending_indices([0.5, 0.3, 0.2], 10_000_000)
    print(f"blending indices, 3 datasets, 1e7 samples: {time.perf_counter() - t0:.2f} s")


if __name__ == "__main__":
    main()
