"""GPTDataset: Megatron's sample construction, split, shuffling and index cache."""

from __future__ import annotations

import numpy as np
import pytest

from mlm.datasets.gpt import (
    GPTDataset,
    GPTDatasetConfig,
    build_gpt_indices,
    build_sample_index,
    parse_split,
    split_ranges,
)
from mlm.errors import MlmError
from tests.helpers.sample_data import make_dataset, megatron_sample_index_loop


@pytest.mark.parametrize("seq_length", [1, 7, 64, 1000])
def test_sample_index_matches_megatron_loop(seq_length):
    rng = np.random.default_rng(seq_length)
    sizes = rng.integers(1, 300, size=500).astype(np.int32)
    sizes[::37] = seq_length  # documents that end exactly on a sample boundary
    document_index = rng.permutation(np.tile(np.arange(500, dtype=np.int32), 2))
    ours = build_sample_index(sizes, document_index, seq_length)
    np.testing.assert_array_equal(ours, megatron_sample_index_loop(sizes, document_index, seq_length))


def test_split_ranges_follow_megatron_rounding():
    assert parse_split("969,30,1") == pytest.approx([0.969, 0.03, 0.001])
    assert split_ranges(parse_split("969,30,1"), 1000) == [(0, 969), (969, 999), (999, 1000)]
    assert split_ranges(parse_split("98,2"), 10) == [(0, 10), (10, 10), (10, 10)]
    assert split_ranges(parse_split("1,1,1"), 10) == [(0, 4), (4, 7), (7, 10)]  # rounding error goes to train
    with pytest.raises(MlmError, match="split='a,b'"):
        parse_split("a,b")


def test_every_token_of_one_epoch_in_the_predicted_sample(tmp_path):
    ds = make_dataset(tmp_path, np.random.default_rng(1).integers(1, 200, size=300))
    cfg = GPTDatasetConfig(seq_length=32, seed=5, split="90,10,0", cache_dir=str(tmp_path / "cache"))
    gpt = GPTDataset(ds, "train", None, cfg)
    begin, end = split_ranges(parse_split("90,10,0"), len(ds))[0]
    assert sorted(gpt.document_index.tolist()) == list(range(begin, end))  # one epoch: each document once
    stream = np.concatenate([ds[int(d)] for d in gpt.document_index]).astype(np.int64)
    assert len(gpt) == (len(stream) - 1) // 32
    assert sorted(gpt.shuffle_index.tolist()) == list(range(len(gpt)))
    for i in range(len(gpt)):
        sample = gpt[i]
        assert len(sample) == 33
        j = int(gpt.shuffle_index[i])  # sample j of the unshuffled stream holds tokens j*L .. j*L + L
        np.testing.assert_array_equal(sample, stream[j * 32 : j * 32 + 33])


def test_multiple_epochs_and_separate_final_epoch(tmp_path):
    ds = make_dataset(tmp_path, [50] * 20)  # 1000 tokens: 99 samples of 10 per epoch
    sizes, docs = np.asarray(ds.sequence_lengths), np.arange(20, dtype=np.int32)
    idx = build_gpt_indices(sizes, docs, 10, num_samples=110, seed=3)  # just into a 2nd epoch
    assert len(idx["document_index"]) == 40
    first, last = idx["document_index"][:20], idx["document_index"][20:]
    assert sorted(first.tolist()) == sorted(last.tolist()) == list(range(20))  # final epoch kept apart
    n_first = (1000 - 1) // 10
    assert sorted(idx["shuffle_index"][:n_first].tolist()) == list(range(n_first))
    idx = build_gpt_indices(sizes, docs, 10, num_samples=190, seed=3)  # most of a 2nd epoch: mixed
    assert len(idx["sample_index"]) - 1 >= 190
    gpt = GPTDataset(ds, "train", 250, GPTDatasetConfig(10, split="1", cache_dir=str(tmp_path / "c")))
    assert len(gpt) >= 250 and all(len(gpt[i]) == 11 for i in range(250))


def test_same_seed_same_order_and_cache_reloads(tmp_path):
    ds = make_dataset(tmp_path, np.random.default_rng(2).integers(1, 100, size=200))
    cfg = GPTDatasetConfig(seq_length=16, seed=9, split="1", cache_dir=str(tmp_path / "cache"))
    a = GPTDataset(ds, "train", 500, cfg)
    files = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert len(files) == 4 and any(f.endswith("-description.json") for f in files)
    b = GPTDataset(ds, "train", 500, cfg, build=False)  # another rank: loads, never builds
    for name in ("document_index", "sample_index", "shuffle_index"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert isinstance(b.shuffle_index, np.memmap)
    other = GPTDataset(
        ds, "train", 500, GPTDatasetConfig(16, seed=10, split="1", cache_dir=str(tmp_path / "cache"))
    )
    assert [a[i].tolist() for i in range(5)] != [other[i].tolist() for i in range(5)]
    with pytest.raises(MlmError, match="not found in .*mlm data index"):
        GPTDataset(ds, "train", 501, cfg, build=False)


def test_too_small_split_is_a_clear_error(tmp_path):
    ds = make_dataset(tmp_path, [5, 5])
    with pytest.raises(MlmError, match="fewer than seq_length"):
        GPTDataset(ds, "train", 10, GPTDatasetConfig(64, split="1", cache_dir=str(tmp_path / "c")))
    with pytest.raises(MlmError, match="leaves no documents for valid"):
        GPTDataset(ds, "valid", 10, GPTDatasetConfig(4, split="1", cache_dir=str(tmp_path / "c")))
