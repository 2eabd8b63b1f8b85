"""Benchmark opening a large Megatron indexed dataset: mlm's `IndexedDataset`, which checks every
length, pointer and document index of the `.idx` against the `.bin` (O(n), in blocks of 4M
entries), against megatron-core's `IndexedDataset`, which checks none.

    python bench/idx_check.py [--sequences 5e7] [--repeat 3]

The dataset is synthetic: `--sequences` sequences of lognormal lengths (mean ≈ 1,100 tokens),
one per document, uint16 tokens; the `.bin` is a sparse file of the right size (nothing reads
its bytes on open). Both readers open the same files with a warm page cache; the best of
`--repeat` opens is printed with the ratio. Without megatron-core the baseline is the index's
bare `numpy.memmap` views (what Megatron's reader builds).
"""

from __future__ import annotations

import argparse
import struct
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlm.datasets.indexed import INDEX_MAGIC, INDEX_VERSION, IndexedDataset  # noqa: E402


def write_dataset(prefix: Path, sequences: int, rng) -> int:
    """A synthetic dataset of `sequences` uint16 sequences at `prefix`; its token count."""
    lengths = np.maximum(1, rng.lognormal(6.5, 1.0, sequences)).astype(np.int32)
    pointers = np.zeros(sequences, np.int64)
    np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
    pointers *= 2
    docs = np.arange(sequences + 1, dtype=np.int64)
    with open(f"{prefix}.idx", "wb") as f:
        f.write(struct.pack("<9sQBQQ", INDEX_MAGIC, INDEX_VERSION, 8, sequences, sequences + 1))
        for part in (lengths, pointers, docs):
            f.write(part.tobytes())
    tokens = int(lengths.sum(dtype=np.int64))
    with open(f"{prefix}.bin", "wb") as f:
        f.truncate(tokens * 2)
    return tokens


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sequences", type=float, default=5e7)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    n = int(args.sequences)
    with tempfile.TemporaryDirectory() as tmp:
        prefix = Path(tmp) / "synthetic"
        tokens = write_dataset(prefix, n, np.random.default_rng(0))
        idx_mb = (prefix.with_suffix(".idx")).stat().st_size / 2**20
        print(f"dataset: {n:,} sequences, {tokens / 1e9:.1f}B tokens, .idx {idx_mb:,.0f} MiB")
        try:
            import warnings

            warnings.filterwarnings("ignore")
            from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronIndexedDataset

            def baseline():
                return MegatronIndexedDataset(str(prefix), multimodal=False, mmap=True)

            name = "megatron-core IndexedDataset"
        except ImportError:

            def baseline():
                idx = np.memmap(f"{prefix}.idx", mode="r", dtype=np.uint8)
                return idx[34 : 34 + 4 * n].view(np.int32), idx[34 + 4 * n : 34 + 12 * n].view(np.int64)

            name = "bare numpy.memmap views"
        ours = best(lambda: IndexedDataset(prefix), args.repeat)
        theirs = best(baseline, args.repeat)
        print(f"mlm IndexedDataset (checked): {ours:.3f} s")
        print(f"{name} (unchecked): {theirs:.4f} s")
        print(f"ratio: {ours / theirs:.1f}x; the check costs {(ours - theirs) / n * 1e9:.1f} ns per sequence")


if __name__ == "__main__":
    main()
