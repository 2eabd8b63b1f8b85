"""Checkpoints: round trips per dtype, sharded saves from real gloo ranks, `latest`, keep-last,
crash safety (a save killed with SIGKILL), error messages and the RNG state as JSON."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import google_crc32c
import numpy as np
import pytest
import torch
import torch.distributed as dist
import zarr
from hypothesis import given, settings
from hypothesis import strategies as st

from mlm.checkpoint import (
    ShardedTensor,
    list_checkpoints,
    load_checkpoint,
    read_manifest,
    resolve_checkpoint,
    rng_state_from_json,
    rng_state_to_json,
    save_checkpoint,
    store,
)
from mlm.errors import MlmError
from tests.helpers.common import ROOT
from tests.helpers.distributed import run_ranks


def full(tensors: dict[str, torch.Tensor]) -> list[ShardedTensor]:
    return [ShardedTensor.full(k, v) for k, v in tensors.items()]


def save(root: Path, iteration: int, tensors: dict[str, torch.Tensor], **kw) -> Path:
    return save_checkpoint(root, iteration, {"model": full(tensors)}, {"consumed_samples": iteration}, **kw)


def load(path: Path, like: dict[str, torch.Tensor], **kw) -> dict[str, torch.Tensor]:
    out = {k: torch.full_like(v, -1) for k, v in like.items()}
    load_checkpoint(path, {"model": full(out)}, **kw)
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype in (torch.bfloat16, torch.float16) else t


def test_round_trip_each_dtype(tmp_path):
    model = {
        "w32": torch.randn(5, 3),
        "wbf": torch.randn(4, 7).bfloat16(),
        "w16": torch.randn(3).half(),
        "ids": torch.arange(10),
        "step": torch.tensor(7),
        "scale": torch.tensor(1.5, dtype=torch.bfloat16),
        "wt": torch.randn(3, 5).t(),  # not contiguous
    }
    optim = {"exp_avg.w32": torch.randn(5, 3)}
    it_dir = save_checkpoint(tmp_path, 100, {"model": full(model), "optim": full(optim)}, {"seed": 1234})
    assert it_dir == tmp_path / "iter_0000100"

    got, got_optim = {k: torch.zeros_like(v) for k, v in model.items()}, {"exp_avg.w32": torch.zeros(5, 3)}
    manifest = load_checkpoint(tmp_path, {"model": full(got), "optim": full(got_optim)})
    for k, v in model.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(bits(got[k]), bits(v)), k  # bitwise, bf16 included
    assert torch.equal(got_optim["exp_avg.w32"], optim["exp_avg.w32"])

    assert (manifest["format"], manifest["format_version"], manifest["iteration"]) == (
        "mlm-checkpoint",
        1,
        100,
    )
    assert manifest["seed"] == 1234

    def crc(path: str) -> str:  # of the chunk file's bytes, as the manifest records it
        return f"{google_crc32c.value((it_dir / path).read_bytes()):08x}"

    tensors = manifest["tensors"]
    assert tensors["model/wbf"] == {
        "shape": [4, 7],
        "dtype": "bfloat16",
        "chunks": [4, 7],
        "crc32c": {"c/0/0": crc("model/wbf/c/0/0")},
    }
    assert tensors["model/step"] == {
        "shape": [],
        "dtype": "int64",
        "chunks": [],
        "crc32c": {"c": crc("model/step/c")},
    }
    assert tensors["optim/exp_avg.w32"]["crc32c"] == {"c/0/0": crc("optim/exp_avg.w32/c/0/0")}
    arr = zarr.open_array(str(it_dir / "model" / "wbf"), mode="r")
    assert (arr.dtype, arr.attrs["dtype"], arr.chunks, arr.compressors) == (np.uint16, "bfloat16", (4, 7), ())
    assert zarr.open_array(str(it_dir / "model" / "w32"), mode="r").attrs["dtype"] == "float32"


def _rank_main(rank: int, world_size: int, root: str) -> None:
    """One of 2 gloo ranks: each holds half of `w` (rows), `b` and `step` are replicated."""
    w = torch.arange(48.0).reshape(8, 6)[4 * rank : 4 * rank + 4].clone()
    model = [
        ShardedTensor("w", w, (8, 6), (4 * rank, 0)),
        ShardedTensor("b", torch.ones(6), (6,), (0,), writer=rank == 0),
        ShardedTensor("step", torch.tensor(3), (), (), writer=rank == 0),
    ]
    save_checkpoint(root, 3, {"model": model}, {"world_size": 2}, rank=rank, barrier=dist.barrier)


def test_sharded_save_by_two_ranks_loads_under_any_split(tmp_path):
    run_ranks(2, _rank_main, str(tmp_path))
    expected = torch.arange(48.0).reshape(8, 6)
    assert zarr.open_array(str(tmp_path / "iter_0000003" / "model" / "w"), mode="r").chunks == (4, 6)

    # each rank's chunk checksums reach the manifest (and nothing else is left beside it)
    manifest = read_manifest(tmp_path / "iter_0000003")
    assert list(manifest["tensors"]["model/w"]["crc32c"]) == ["c/0/0", "c/1/0"]
    assert sorted(p.name for p in (tmp_path / "iter_0000003").iterdir()) == ["manifest.json", "model"]
    got = load(tmp_path, {"w": torch.zeros(8, 6), "b": torch.zeros(6), "step": torch.tensor(0)})
    assert torch.equal(got["w"], expected) and torch.equal(got["b"], torch.ones(6)) and got["step"] == 3

    rows, cols = torch.zeros(4, 6), torch.zeros(8, 3)  # other splits read from the global layout
    load_checkpoint(tmp_path, {"model": [ShardedTensor("w", rows, (8, 6), (2, 0))]}, strict=False)
    load_checkpoint(tmp_path, {"model": [ShardedTensor("w", cols, (8, 6), (0, 3))]}, strict=False)
    assert torch.equal(rows, expected[2:6]) and torch.equal(cols, expected[:, 3:])


def test_uneven_shards_and_misaligned_chunks(tmp_path):
    x = torch.randn(8, 6)
    shards = [ShardedTensor("w", x[:5], (8, 6), (0, 0)), ShardedTensor("w", x[5:], (8, 6), (5, 0))]
    save_checkpoint(tmp_path, 1, {"model": shards}, {})
    assert torch.equal(load(tmp_path, {"w": x})["w"], x)

    shards = [ShardedTensor("w", x[a:b], (8, 6), (a, 0)) for a, b in [(0, 4), (4, 6), (6, 8)]]
    with pytest.raises(MlmError, match="slice 4:6 of dim 0 does not align with the chunk size 4"):
        save_checkpoint(tmp_path, 2, {"model": shards}, {})
    shards[0].chunk = (2, 6)  # a chunk that divides every shard boundary
    save_checkpoint(tmp_path, 2, {"model": shards}, {})
    assert torch.equal(load(tmp_path, {"w": x})["w"], x)


def test_arrays_are_plain_zarr_both_ways(tmp_path):
    """zarr-python reads what mlm writes (edge chunks padded, bf16 as uint16), and mlm reads an
    array zarr-python wrote, at any slice."""
    x = torch.randn(7, 10)
    shards = [ShardedTensor("w", x[:4], (7, 10), (0, 0)), ShardedTensor("w", x[4:], (7, 10), (4, 0))]
    shards[0].chunk = (4, 3)  # edge chunks on both dims
    it_dir = save_checkpoint(tmp_path / "a", 1, {"model": [*shards, *full({"h": x.bfloat16()})]}, {})
    arr = zarr.open_array(str(it_dir / "model" / "w"), mode="r")
    assert arr.chunks == (4, 3) and np.array_equal(arr[:], x.numpy())
    assert np.array_equal(
        zarr.open_array(str(it_dir / "model" / "h"))[:], x.bfloat16().view(torch.uint16).numpy()
    )

    z = zarr.create_array(
        store=str(tmp_path / "z"),
        shape=(7, 10),
        chunks=(3, 4),
        dtype="float32",
        compressors=None,
        fill_value=0,
        attributes={"dtype": "float32"},
    )
    z[:] = x.numpy()
    got = store.read_slice(store.open_array(tmp_path / "z", "z"), (2, 3), (5, 6), "z")
    assert torch.equal(got, x[2:7, 3:9])
    zarr.create_array(store=str(tmp_path / "gz"), shape=(4,), chunks=(2,), dtype="float32")  # compressed
    with pytest.raises(MlmError, match="describes a zarr array mlm does not read .* rewrite the array"):
        store.open_array(tmp_path / "gz", "gz")


def test_damaged_chunks_are_caught(tmp_path):
    x = torch.randn(8, 6)
    it_dir = save(tmp_path, 1, {"w": x})
    chunk = it_dir / "model" / "w" / "c" / "0" / "0"
    data = bytearray(chunk.read_bytes())
    data[5] ^= 1  # one flipped bit
    chunk.write_bytes(bytes(data))
    with pytest.raises(
        MlmError, match=r"tensor model/w: chunk c/0/0 fails its checksum \(CRC-32C [0-9a-f]{8}, "
    ) as err:
        load(tmp_path, {"w": x})
    assert f"the file {chunk} is damaged" in str(err.value)  # the path, to restore or inspect
    assert not torch.equal(load(tmp_path, {"w": x}, verify=False)["w"], x)  # the bit, unchecked
    chunk.write_bytes(bytes(data[:-4]))
    with pytest.raises(
        MlmError, match="chunk file .*c/0/0 has 188 bytes, not 192; the checkpoint is damaged"
    ):
        load(tmp_path, {"w": x}, verify=False)
    chunk.unlink()
    with pytest.raises(
        MlmError, match=r"holds 0 chunk files; shape \[8, 6\] in chunks of \[8, 6\] needs 1; the"
    ):
        load(tmp_path, {"w": x})


def test_latest_keep_last_and_resolve(tmp_path):
    for it in range(1, 5):
        save(tmp_path, it, {"w": torch.full((2,), float(it))}, keep_last=2)
    assert [d.name for d in list_checkpoints(tmp_path)] == ["iter_0000003", "iter_0000004"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000003", "iter_0000004", "latest"]
    assert (tmp_path / "latest").read_text() == "iter_0000004\n"
    assert resolve_checkpoint(tmp_path) == tmp_path / "iter_0000004"
    assert resolve_checkpoint(tmp_path / "iter_0000003") == tmp_path / "iter_0000003"
    assert load(tmp_path / "iter_0000003", {"w": torch.zeros(2)})["w"].tolist() == [3.0, 3.0]

    save(tmp_path, 4, {"w": torch.full((2,), 40.0)})  # re-saving the latest iteration replaces it
    assert load(tmp_path, {"w": torch.zeros(2)})["w"].tolist() == [40.0, 40.0]
    assert read_manifest(resolve_checkpoint(tmp_path))["consumed_samples"] == 4


def test_incomplete_checkpoints(tmp_path):
    with pytest.raises(MlmError, match="no `latest` file; found no complete iter_\\* checkpoint"):
        resolve_checkpoint(tmp_path)
    save(tmp_path, 1, {"w": torch.ones(3)})
    (tmp_path / "iter_0000002" / "model").mkdir(parents=True)  # a save that died before its manifest
    assert resolve_checkpoint(tmp_path) == tmp_path / "iter_0000001"
    assert list_checkpoints(tmp_path) == [tmp_path / "iter_0000001"]
    with pytest.raises(
        MlmError, match="iter_0000002: incomplete checkpoint \\(a save was interrupted\\); use"
    ):
        load(tmp_path / "iter_0000002", {"w": torch.zeros(3)})

    (tmp_path / "latest").write_text("iter_0000002\n")
    with pytest.raises(MlmError, match="names iter_0000002, which is missing or incomplete.*iter_0000001"):
        resolve_checkpoint(tmp_path)
    save(tmp_path, 2, {"w": torch.full((3,), 2.0)})
    assert load(tmp_path, {"w": torch.zeros(3)})["w"].tolist() == [2.0] * 3


def test_every_file_and_directory_is_fsynced_before_the_manifest(tmp_path, monkeypatch):
    """A power loss after `latest` must not find chunks that never reached the disk: each chunk
    file, each zarr.json and every directory of the checkpoint is fsynced before the manifest is
    written (os.fsync calls recorded by the path of their descriptor)."""
    import os

    synced, real = [], os.fsync

    def record(fd):
        synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
        real(fd)

    monkeypatch.setattr(os, "fsync", record)
    it_dir = save(tmp_path, 1, {"w": torch.randn(8, 6), "b": torch.randn(5)})
    manifest_at = next(i for i, p in enumerate(synced) if p.name.startswith("manifest.json"))
    before = set(synced[:manifest_at])
    files = {p for p in it_dir.rglob("*") if p.is_file() and p.name != "manifest.json"}
    dirs = {p for p in it_dir.rglob("*") if p.is_dir()} | {it_dir}
    assert files and files <= before, sorted(map(str, files - before))
    assert dirs <= before, sorted(map(str, dirs - before))
    assert tmp_path in synced[manifest_at:]  # `latest`'s directory entry too


def test_leftovers_of_interrupted_saves_and_pruning_are_removed_at_the_next_save(tmp_path):
    save(tmp_path, 1, {"w": torch.ones(3)})
    died = tmp_path / "iter_0000002" / "model" / "w"  # a save killed before its manifest
    died.mkdir(parents=True)
    (died / "zarr.json").write_text("{}")
    pruned = tmp_path / "iter_0000000"  # pruning killed after the manifest's removal
    (pruned / "model").mkdir(parents=True)
    (tmp_path / "iter_notes").mkdir()  # not a checkpoint's name: left alone
    save(tmp_path, 3, {"w": torch.full((3,), 3.0)})
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "iter_0000001",
        "iter_0000003",
        "iter_notes",
        "latest",
    ]


KILLED_SAVE = """
import sys, time, torch
from mlm.checkpoint import ShardedTensor, save_checkpoint, store

def model(value):
    return {"model": [ShardedTensor.full(f"w{i}", torch.full((64, 64), value)) for i in range(4)]}

save_checkpoint(sys.argv[1], 1, model(1.0), {})
real_write = store.write_slice

def write_then_hang(arr, local, offset):
    real_write(arr, local, offset)  # one tensor reaches the disk, then the save is killed
    print("writing", flush=True)
    time.sleep(60)

store.write_slice = write_then_hang
save_checkpoint(sys.argv[1], 2, model(2.0), {})
"""


def test_sigkill_during_save_keeps_the_previous_checkpoint(tmp_path):
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_SAVE, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline() == "writing\n"
    finally:
        child.kill()  # SIGKILL
        child.wait(timeout=30)
    assert (tmp_path / "latest").read_text() == "iter_0000001\n"
    assert (tmp_path / "iter_0000002" / "model" / "w0").is_dir()
    assert resolve_checkpoint(tmp_path) == tmp_path / "iter_0000001"
    like = {f"w{i}": torch.zeros(64, 64) for i in range(4)}
    assert all(bool((v == 1.0).all()) for v in load(tmp_path, like).values())

    save(tmp_path, 2, {k: torch.full((64, 64), 2.0) for k in like})
    assert all(bool((v == 2.0).all()) for v in load(tmp_path, like).values())


def test_errors(tmp_path):
    it_dir = save(tmp_path, 5, {"w": torch.zeros(5, 3), "b": torch.zeros(3)})
    with pytest.raises(
        MlmError, match=r"tensor model/w: checkpoint has shape \(5, 3\), the model expects \(5, 4\)"
    ):
        load(tmp_path, {"w": torch.zeros(5, 4), "b": torch.zeros(3)})
    with pytest.raises(MlmError, match="tensor model/nope is not in the checkpoint; it has 2 here"):
        load(tmp_path, {"w": torch.zeros(5, 3), "b": torch.zeros(3), "nope": torch.zeros(1)})
    with pytest.raises(MlmError, match="1 tensor\\(s\\) in model/ that the model does not have: b"):
        load(tmp_path, {"w": torch.zeros(5, 3)})
    load(tmp_path, {"w": torch.zeros(5, 3)}, strict=False)

    manifest = json.loads((it_dir / "manifest.json").read_text())
    (it_dir / "manifest.json").write_text(json.dumps({**manifest, "format_version": 99}))
    with pytest.raises(
        MlmError, match=r"manifest.json: checkpoint format_version 99; this mlm reads version 1"
    ):
        load(tmp_path, {"w": torch.zeros(5, 3), "b": torch.zeros(3)})
    with pytest.raises(ValueError, match="does not fit in global shape"):
        ShardedTensor("w", torch.zeros(4, 3), (8, 3), (6, 0))


def test_padded_rows_load_across_paddings(tmp_path):
    """The vocabulary padding depends on tp: a tensor marked `padded_rows` loads the rows both
    paddings have and zeros the others, on every shard."""
    w = torch.cat([torch.randn(5, 3), torch.zeros(3, 3)])  # 5 real rows padded to 8
    save(tmp_path, 1, {"embed": w})
    wider = torch.full((12, 3), -1.0)
    load_checkpoint(tmp_path, {"model": [ShardedTensor("embed", wider, (12, 3), (0, 0), padded_rows=True)]})
    torch.testing.assert_close(wider, torch.cat([w, torch.zeros(4, 3)]))
    lower, upper = torch.full((3, 3), -1.0), torch.full((3, 3), -1.0)  # 6 rows in two shards
    load_checkpoint(
        tmp_path,
        {
            "model": [
                ShardedTensor("embed", lower, (6, 3), (0, 0), padded_rows=True),
                ShardedTensor("embed", upper, (6, 3), (3, 0), padded_rows=True),
            ]
        },
        strict=False,
    )
    torch.testing.assert_close(torch.cat([lower, upper]), w[:6])
    with pytest.raises(MlmError, match=r"checkpoint has shape \(8, 3\), the model expects \(12, 3\)"):
        load(tmp_path, {"embed": torch.zeros(12, 3)})  # not marked: a real shape mismatch


def test_rng_state_json_round_trip():
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    random.gauss(0, 1), np.random.standard_normal()  # leave cached gaussians in both
    state = json.loads(json.dumps(rng_state_to_json()))
    first = random.random(), np.random.rand(), torch.rand(3)
    random.random(), np.random.rand(5), torch.rand(7)
    rng_state_from_json(state)
    again = random.random(), np.random.rand(), torch.rand(3)
    assert first[:2] == again[:2] and torch.equal(first[2], again[2])


@settings(max_examples=50, deadline=None)
@given(st.binary(max_size=300), st.binary(max_size=3000))
def test_crc32c_combine(a, b):
    combined = store.crc32c_combine(google_crc32c.value(a), google_crc32c.value(b), len(b))
    assert combined == google_crc32c.value(a + b)


@pytest.mark.parametrize(
    "stored_rows, chunk", [(4, (6, 5, 3)), (6, (4, 5, 3)), (4, (12, 5, 3)), (12, (3, 5, 3)), (6, (4, 1, 3))]
)
def test_rechunking_copies_files_and_combines_checksums(tmp_path, stored_rows, chunk):
    """`plan_rechunk` + `write_pieces` write the same array with another chunking (zarr reads it
    back), check the stored chunks, and give the checksums a write with that chunking computes."""
    x = torch.randn(12, 5, 3)
    src = store.create_array(tmp_path / "src", (12, 5, 3), (stored_rows, 5, 3), torch.float32)
    sums = store.write_slice(src, x, (0, 0, 0))
    assert store.can_rechunk(src, chunk)
    plan = store.plan_rechunk(src, chunk, "src", sums)
    got = store.write_pieces(tmp_path / "dst", (12, 5, 3), chunk, torch.float32, plan)
    assert store.open_array(tmp_path / "dst", "dst").chunks == chunk
    assert np.array_equal(zarr.open_array(str(tmp_path / "dst"))[:], x.numpy())
    again = store.create_array(tmp_path / "again", (12, 5, 3), chunk, torch.float32)
    assert got == store.write_slice(again, x, (0, 0, 0))
    with pytest.raises(MlmError, match="chunk c/0/0/0 fails its checksum"):
        store.plan_rechunk(src, chunk, "src", {**sums, "c/0/0/0": "00000000"})
    cols = store.create_array(tmp_path / "cols", (12, 5, 3), (12, 5, 1), torch.float32)
    assert not store.can_rechunk(cols, (6, 5, 3)) and not store.can_rechunk(src, (5, 5, 3))
