"""Conversations packed into training sequences, with the loss mask `mlm data build --chat` wrote.

A chat dataset is two Megatron indexed datasets with the same documents: the tokens (PREFIX) and
a uint8 loss mask (PREFIX_loss_mask: 1 where the token is a target, the assistant's). Each epoch
shuffles the split's conversations (numpy RandomState(seed), one draw per epoch) and packs them,
in that order, into sequences of seq_length + 1 tokens: `first_fit` puts each conversation into
the first sequence with room for it (Megatron-Bridge's default, `first_fit_shuffle`); `none`
gives each conversation a sequence of its own. The sequences of an epoch are then shuffled, and
epochs follow each other until the run's samples are drawn. A conversation never crosses a
sequence; the rest of a sequence is padding that nothing attends to and no loss counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mlm.datasets.cache import cached_arrays
from mlm.datasets.gpt import SPLIT_NAMES, GPTDatasetConfig, parse_split, split_description, split_ranges
from mlm.datasets.indexed import IndexedDataset
from mlm.datasets.meta import loss_mask_prefix
from mlm.errors import MlmError

PACKINGS = ("first_fit", "none")
INDEX_VERSION = 1  # bump when the packing below changes: old caches are then ignored
PAD_ID = 0
"""The token id of padding (any id does: no token attends to padding and no loss counts it)."""


def first_fit(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """The bin of each item, taken in order, under first fit: the first bin (lowest index) with
    room for it. A segment tree of the bins' free room finds it in O(log n)."""
    n = len(lengths)
    size = 1
    while size < n:
        size *= 2
    room = [capacity] * (2 * size)  # node: the most room of any bin below it
    bins = np.empty(n, dtype=np.int64)
    for i, length in enumerate(lengths.tolist()):
        node = 1
        while node < size:
            node = 2 * node if room[2 * node] >= length else 2 * node + 1
        bins[i] = node - size
        room[node] -= length
        node //= 2
        while node:
            room[node] = max(room[2 * node], room[2 * node + 1])
            node //= 2
    return bins


def build_packs(
    lengths: np.ndarray,
    documents: np.ndarray,
    capacity: int,
    packing: str,
    num_samples: int | None,
    seed: int,
) -> dict[str, np.ndarray]:
    """`pack_documents` (the documents of every pack, pack after pack) and `pack_index` (where each
    pack's documents start, and one past the last): whole epochs until `num_samples` packs."""
    rng = np.random.RandomState(seed)
    parts, counts = [], []
    total = 0
    while True:
        order = documents[rng.permutation(len(documents))]
        if packing == "first_fit":
            bins = first_fit(lengths[order], capacity)
        else:
            bins = np.arange(len(order))
        by_bin = np.argsort(bins, kind="stable")  # each pack's documents in the order they came
        per_bin = np.bincount(bins)
        starts = np.concatenate(([0], np.cumsum(per_bin)[:-1]))
        shuffled = rng.permutation(len(per_bin))
        for b in shuffled.tolist():
            parts.append(order[by_bin[starts[b] : starts[b] + per_bin[b]]])
        counts.append(per_bin[shuffled])
        total += len(per_bin)
        if num_samples is None or total >= num_samples:
            break
    pack_counts = np.concatenate(counts)
    return {
        "pack_documents": np.concatenate(parts).astype(np.int64),
        "pack_index": np.concatenate(([0], np.cumsum(pack_counts))).astype(np.int64),
    }


@dataclass(frozen=True)
class PackedSample:
    """One training sequence of seq_length + 1 tokens."""

    tokens: np.ndarray
    """int64 token ids; padding is PAD_ID."""
    targets: np.ndarray
    """uint8: 1 where the token is a target of the loss (its conversation's loss mask)."""
    documents: np.ndarray
    """int64: the conversation (0, 1, ...) each token belongs to; padding is one more."""


class SFTDataset:
    """Packed sequences of one split of a chat dataset (see the module's docstring)."""

    def __init__(
        self,
        dataset: IndexedDataset,
        split: str,
        num_samples: int | None,
        config: GPTDatasetConfig,
        packing: str = "first_fit",
        build: bool = True,
    ):
        if packing not in PACKINGS:
            raise MlmError(f"data.packing={packing!r}: must be one of {', '.join(PACKINGS)}")
        self.dataset, self.config = dataset, config
        prefix = dataset.path_prefix
        self.mask = IndexedDataset(loss_mask_prefix(prefix))
        sizes = np.asarray(dataset.sequence_lengths)
        if not np.array_equal(np.asarray(self.mask.sequence_lengths), sizes):
            raise MlmError(
                f"{self.mask.path_prefix}: its sequence lengths differ from {prefix}'s; the loss mask "
                "belongs to another build: rebuild both with `mlm data build --chat`"
            )
        begin, end = split_ranges(parse_split(config.split), len(sizes))[SPLIT_NAMES.index(split)]
        documents = np.arange(begin, end, dtype=np.int64)
        documents = documents[sizes[documents] > 0]
        if len(documents) == 0:
            raise MlmError(
                f"{prefix}: split {config.split!r} leaves no conversations for {split} "
                f"(the dataset has {len(sizes)}); give {split} a larger share"
            )
        capacity = config.seq_length + 1
        longest = int(np.argmax(sizes[documents]))
        if sizes[documents[longest]] > capacity:
            too_long = int((sizes[documents] > capacity).sum())
            raise MlmError(
                f"{prefix}: conversation {int(documents[longest])} has {int(sizes[documents[longest]])} tokens "
                f"({too_long} of the {split} split have more than seq_length + 1 = {capacity}); raise "
                "data.seq_length, or rebuild with `mlm data build --chat --seq-length N --skip-bad-lines` "
                "to leave them out"
            )
        self.description = {
            "class": "SFTDataset",
            "index_version": INDEX_VERSION,
            **split_description(dataset, config, split, (begin, end), num_samples),
            "packing": packing,
        }
        cache_dir = config.cache_dir or str(Path(prefix).parent / "cache")
        arrays = cached_arrays(
            cache_dir,
            f"SFTDataset-{split}",
            self.description,
            ["pack_documents", "pack_index"],
            lambda: build_packs(sizes, documents, capacity, packing, num_samples, config.seed),
            build=build,
        )
        self.pack_documents, self.pack_index = arrays["pack_documents"], arrays["pack_index"]
        self.num_samples = num_samples
        packed = int(sizes[self.pack_documents].sum(dtype=np.int64))
        self.efficiency = packed / (len(self) * capacity)
        """The share of sequence positions that hold conversation tokens (the rest is padding)."""

    def __len__(self) -> int:
        return len(self.pack_index) - 1

    def __getitem__(self, i: int) -> PackedSample:
        capacity = self.config.seq_length + 1
        docs = self.pack_documents[int(self.pack_index[i]) : int(self.pack_index[i + 1])]
        tokens = np.full(capacity, PAD_ID, dtype=np.int64)
        targets = np.zeros(capacity, dtype=np.uint8)
        documents = np.full(capacity, len(docs), dtype=np.int64)
        at = 0
        for k, d in enumerate(docs.tolist()):
            ids = self.dataset.get(d)
            n = len(ids)
            tokens[at : at + n] = ids
            targets[at : at + n] = self.mask.get(d)
            documents[at : at + n] = k
            at += n
        return PackedSample(tokens, targets, documents)


def packing_efficiency(dataset) -> float:
    """The share of sequence positions holding tokens: of an SFTDataset, or of a blend of them
    weighted as the blend draws from each."""
    parts = getattr(dataset, "datasets", None)
    if parts is None:
        return dataset.efficiency
    return float(sum(w * d.efficiency for w, d in zip(dataset.weights, parts, strict=True)))
