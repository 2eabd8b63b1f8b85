"""Fixed-length training samples cut across document boundaries (Megatron's GPTDataset).

A split's documents (sequences of the indexed dataset) are repeated for as many epochs as the
requested samples need and shuffled (`document_index`); the shuffled stream of tokens is cut
into samples of seq_length + 1 tokens that overlap by one token (`sample_index`: where each
sample starts, as (position in document_index, token offset)); samples are then shuffled
(`shuffle_index`). The construction, the random stream (numpy RandomState(seed): documents,
then samples) and the separate last epoch follow megatron/core/datasets/gpt_dataset.py, so the
same seed gives the same order. `sample_index` is built with numpy (searchsorted over
cumulative lengths) instead of Megatron's C++ loop; a test checks the two agree.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mlm.datasets.cache import cached_arrays
from mlm.datasets.indexed import IndexedDataset
from mlm.errors import MlmError

SPLIT_NAMES = ("train", "valid", "test")
INDEX_VERSION = 1  # bump when the construction below changes: old caches are then ignored


def parse_split(split: str) -> list[float]:
    """ "969,30,1" → normalised weights for train, valid, test (missing ones are 0)."""
    try:
        parts = [float(x) for x in split.replace("/", ",").split(",")]
    except ValueError:
        raise MlmError(f"split={split!r}: must be up to three numbers such as '969,30,1'") from None
    if not 1 <= len(parts) <= 3 or any(p < 0 for p in parts) or sum(parts) <= 0:
        raise MlmError(
            f"split={split!r}: must be up to three non-negative numbers with a positive sum, e.g. '969,30,1'"
        )
    parts += [0.0] * (3 - len(parts))
    total = sum(parts)
    return [p / total for p in parts]


def split_ranges(weights: list[float], num_documents: int) -> list[tuple[int, int]]:
    """Document ranges [begin, end) of each split, rounded as Megatron rounds them."""
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + int(round(w * float(num_documents))))
    diff = bounds[-1] - num_documents
    bounds = [0] + [b - diff for b in bounds[1:]]
    return [(bounds[i], bounds[i + 1]) for i in range(len(weights))]


def build_document_index(
    documents: np.ndarray, num_epochs: int, rng: np.random.RandomState, separate_final_epoch: bool
):
    if not separate_final_epoch or num_epochs == 1:
        index = np.tile(documents.astype(np.int32), num_epochs)
        rng.shuffle(index)
        return index
    first = build_document_index(documents, num_epochs - 1, rng, False)
    last = build_document_index(documents, 1, rng, False)
    return np.concatenate((first, last))


def build_sample_index(sizes: np.ndarray, document_index: np.ndarray, seq_length: int) -> np.ndarray:
    """[num_samples + 1, 2] of (position in document_index, offset): sample i spans the tokens
    from row i to row i + 1 inclusive, i.e. stream positions i*L .. i*L + L."""
    lengths = sizes[document_index].astype(np.int64)
    ends = np.cumsum(lengths)
    num_samples = (int(ends[-1]) - 1) // seq_length
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    doc = np.searchsorted(ends, positions, side="right")
    offset = positions - (ends[doc] - lengths[doc])
    dtype = (
        np.int32 if max(len(document_index), int(sizes.max(initial=0))) < np.iinfo(np.int32).max else np.int64
    )
    out = np.stack([doc, offset], axis=1).astype(dtype)
    out[0] = 0  # Megatron starts at (0, 0) even when the first document is empty
    return out


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def build_gpt_indices(
    sizes: np.ndarray, documents: np.ndarray, seq_length: int, num_samples: int | None, seed: int
) -> dict[str, np.ndarray]:
    """Megatron's three indices for `documents` (indices into `sizes`)."""
    tokens_per_epoch = int(sizes[documents].sum(dtype=np.int64))
    if tokens_per_epoch < seq_length + 1:
        raise MlmError(
            f"the split has {tokens_per_epoch} tokens, fewer than seq_length + 1 = {seq_length + 1}; "
            "use more data, a larger share of the split, or a shorter seq_length"
        )
    num_epochs = 1
    if num_samples is not None:
        while (num_epochs * tokens_per_epoch - 1) // seq_length < num_samples:
            num_epochs += 1
    separate_final_epoch = False
    if num_epochs > 1:
        sans_final = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
        per_epoch = (tokens_per_epoch - 1) // seq_length
        separate_final_epoch = (num_samples - sans_final) < int(0.80 * per_epoch)
    rng = np.random.RandomState(seed)
    document_index = build_document_index(documents, num_epochs, rng, separate_final_epoch)
    sample_index = build_sample_index(sizes, document_index, seq_length)
    total = len(sample_index) - 1
    shuffled = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length if separate_final_epoch else total
    shuffle_index = build_shuffle_index(shuffled, total, rng)
    return {"document_index": document_index, "sample_index": sample_index, "shuffle_index": shuffle_index}


def split_description(
    dataset: IndexedDataset, config: GPTDatasetConfig, split: str, documents: tuple[int, int], num_samples
) -> dict:
    """What a split's cached indices are built from (with the class and its index version, the
    cache's key)."""
    return {
        "dataset_path": str(Path(dataset.path_prefix).resolve()),
        "num_sequences": len(dataset.sequence_lengths),
        "num_tokens": dataset.num_tokens,
        "split": config.split,
        "split_name": split,
        "documents": list(documents),
        "seq_length": config.seq_length,
        "num_samples": num_samples,
        "seed": config.seed,
    }


@dataclass(frozen=True)
class GPTDatasetConfig:
    """How samples are cut from one indexed dataset."""

    seq_length: int
    """Tokens per sample fed to the model; each sample holds seq_length + 1 (inputs + shifted labels)."""
    seed: int = 1234
    """Seed of the document and sample shuffles."""
    split: str = "969,30,1"
    """Shares of documents for train, valid, test."""
    cache_dir: str | None = None
    """Where indices are cached; default: `cache/` beside the dataset."""

    def __post_init__(self):
        if self.seq_length < 1:
            raise MlmError(f"seq_length={self.seq_length}: must be positive")
        parse_split(self.split)


class GPTDataset:
    """Samples of `seq_length + 1` tokens (int64) from one split of one indexed dataset."""

    def __init__(
        self,
        dataset: IndexedDataset | str | os.PathLike,
        split: str,
        num_samples: int | None,
        config: GPTDatasetConfig,
        build: bool = True,
    ):
        if split not in SPLIT_NAMES:
            raise MlmError(f"split {split!r}: must be one of {', '.join(SPLIT_NAMES)}")
        self.dataset = dataset if isinstance(dataset, IndexedDataset) else IndexedDataset(dataset)
        self.config = config
        sizes = self.dataset.sequence_lengths
        which = SPLIT_NAMES.index(split)
        begin, end = split_ranges(parse_split(config.split), len(sizes))[which]
        if begin == end:
            raise MlmError(
                f"{self.dataset.path_prefix}: split {config.split!r} leaves no documents for {split} "
                f"(the dataset has {len(sizes)}); give {split} a larger share"
            )
        self.num_samples = num_samples
        description = {
            "class": "GPTDataset",
            "index_version": INDEX_VERSION,
            **split_description(self.dataset, config, split, (begin, end), num_samples),
        }
        self.description = description
        cache_dir = config.cache_dir or str(Path(self.dataset.path_prefix).parent / "cache")
        arrays = cached_arrays(
            cache_dir,
            f"GPTDataset-{split}",
            description,
            ["document_index", "sample_index", "shuffle_index"],
            lambda: build_gpt_indices(
                np.asarray(sizes),
                np.arange(begin, end, dtype=np.int32),
                config.seq_length,
                num_samples,
                config.seed,
            ),
            build=build,
        )
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]

    def __len__(self) -> int:
        return len(self.shuffle_index)

    def __getitem__(self, i: int) -> np.ndarray:
        j = int(self.shuffle_index[i])
        db, ob = (int(x) for x in self.sample_index[j])
        de, oe = (int(x) for x in self.sample_index[j + 1])
        get, docs = self.dataset.get, self.document_index
        if db == de:
            parts = [get(int(docs[db]), ob, oe - ob + 1)]
        else:
            parts = [get(int(docs[db]), ob)]
            parts += [get(int(docs[k])) for k in range(db + 1, de)]
            parts.append(get(int(docs[de]), 0, oe + 1))
        sample = np.concatenate(parts).astype(np.int64)
        assert len(sample) == self.config.seq_length + 1
        return sample
