"""BlendedDataset and the blend builder: exact proportions, determinism, resumable sampler."""

from __future__ import annotations

import numpy as np
import pytest

from mlm.datasets.blended import build_blending_indices
from mlm.datasets.builder import build_split_datasets, parse_blend
from mlm.datasets.gpt import GPTDatasetConfig
from mlm.datasets.sampler import PretrainingSampler
from mlm.errors import MlmError
from tests.helpers.sample_data import make_dataset


@pytest.mark.parametrize("weights", [[0.5, 0.5], [0.7, 0.2, 0.1], [0.013, 0.987], [3, 1, 0, 6]])
def test_blend_proportions_within_one_sample_per_thousand(weights):
    size = 200_000
    dataset_index, sample_index = build_blending_indices(weights, size)
    w = np.asarray(weights, float) / sum(weights)
    for n in (1000, 12_345, size):  # every prefix, not only the whole
        counts = np.bincount(dataset_index[:n], minlength=len(w))
        assert np.all(np.abs(counts - n * w) <= max(1.0, n / 1000)), (n, counts, n * w)
    for d in range(len(w)):  # each dataset's samples are taken in order 0, 1, 2, ...
        mine = sample_index[dataset_index == d]
        np.testing.assert_array_equal(mine, np.arange(len(mine)))


def test_blended_splits_deterministic_and_cached(tmp_path):
    for name, seed in (("a", 1), ("b", 2)):
        make_dataset(tmp_path, np.random.default_rng(seed).integers(1, 100, size=300), seed=seed, name=name)
    blend = parse_blend(["0.3", str(tmp_path / "a"), "0.7", str(tmp_path / "b")])
    cfg = GPTDatasetConfig(seq_length=8, seed=4, split="90,10,0", cache_dir=str(tmp_path / "cache"))
    counts = {"train": 1000, "valid": 50}
    first = build_split_datasets(blend, cfg, counts)
    again = build_split_datasets(blend, cfg, counts, build=False)
    assert set(first) == {"train", "valid"} and len(first["train"]) == 1000
    assert np.bincount(first["train"].dataset_index).tolist() == [300, 700]
    for i in range(0, 1000, 97):
        np.testing.assert_array_equal(first["train"][i], again["train"][i])
        assert len(first["train"][i]) == 9


def test_parse_blend_errors():
    assert parse_blend(["x"]) == [(1.0, "x")]
    with pytest.raises(MlmError, match="weight-prefix pairs"):
        parse_blend(["0.3", "a", "b"])
    with pytest.raises(MlmError, match="should be a weight"):
        parse_blend(["a", "b"])


def test_sampler_resumes_where_it_stopped():
    def take(sampler, n):
        it = iter(sampler)
        return [next(it).tolist() for _ in range(n)]

    s = PretrainingSampler(total_samples=100, consumed_samples=0, micro_batch_size=2, dp_rank=1, dp_size=3)
    assert take(s, 2) == [[2, 3], [8, 9]]
    resumed = PretrainingSampler(100, s.state_dict()["consumed_samples"], 2, dp_rank=1, dp_size=3)
    assert take(resumed, 1) == [[14, 15]]
    ranks = [list(PretrainingSampler(24, 0, 2, r, 3)) for r in range(3)]
    seen = sorted(int(i) for batches in ranks for b in batches for i in b)
    assert seen == list(range(24))
