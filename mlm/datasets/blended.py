"""Several datasets mixed by weight with exactly proportional sampling.

The k-th sample of dataset d is due at time (k + 1) / w_d; samples are taken in order of due
time (ties to the lower dataset index). Every prefix of n samples then holds n·w_d samples of
dataset d up to rounding (within one sample per dataset), the property Megatron's greedy
`build_blending_indices` has, computed with one numpy sort instead of a per-sample loop.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import numpy as np

from mlm.datasets.cache import cached_arrays
from mlm.errors import MlmError


def normalize_weights(weights: Sequence[float]) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if len(w) == 0 or (w < 0).any() or w.sum() <= 0:
        raise MlmError(f"blend weights {list(weights)}: must be non-negative with a positive sum")
    return w / w.sum()


def build_blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index[size], dataset_sample_index[size]) for the normalised `weights`."""
    w = normalize_weights(weights)
    keys, ids, samples = [], [], []
    for d, wd in enumerate(w):
        if wd == 0:
            continue
        n = min(size, math.ceil(size * wd) + 1)
        k = np.arange(n, dtype=np.int64)
        keys.append((k + 1) / wd)
        ids.append(np.full(n, d, dtype=np.int16))
        samples.append(k)
    key = np.concatenate(keys)
    order = np.argsort(key, kind="stable")[:size]  # stable: equal keys keep dataset order
    return np.concatenate(ids)[order], np.concatenate(samples)[order]


def samples_per_dataset(weights: Sequence[float], size: int) -> list[int]:
    """How many samples each dataset gives to a blend of `size` samples."""
    dataset_index, _ = build_blending_indices(weights, size)
    return np.bincount(dataset_index, minlength=len(weights)).tolist()


class BlendedDataset:
    """`size` samples drawn from `datasets` in proportion to `weights`."""

    def __init__(
        self,
        datasets: Sequence,
        weights: Sequence[float],
        size: int,
        cache_dir: str | os.PathLike,
        description: dict,
        build: bool = True,
    ):
        if len(datasets) != len(weights):
            raise MlmError(
                f"{len(datasets)} datasets but {len(weights)} weights; give one weight per dataset"
            )
        self.datasets = list(datasets)
        self.weights = normalize_weights(weights)
        self.size = size
        desc = {"class": "BlendedDataset", "weights": self.weights.tolist(), "size": size, **description}
        arrays = cached_arrays(
            cache_dir,
            "BlendedDataset",
            desc,
            ["dataset_index", "dataset_sample_index"],
            lambda: dict(
                zip(
                    ("dataset_index", "dataset_sample_index"),
                    build_blending_indices(weights, size),
                    strict=True,
                )
            ),
            build=build,
        )
        self.dataset_index = arrays["dataset_index"]
        self.dataset_sample_index = arrays["dataset_sample_index"]
        counts = np.bincount(self.dataset_index, minlength=len(datasets))
        for d, (ds, need) in enumerate(zip(self.datasets, counts, strict=True)):
            if len(ds) < need:
                raise MlmError(f"dataset {d} has {len(ds)} samples but the blend needs {need}")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> np.ndarray:
        return self.datasets[int(self.dataset_index[i])][int(self.dataset_sample_index[i])]
