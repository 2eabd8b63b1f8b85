"""Resharding a checkpoint for another mesh (`mlm.convert.reshard`): the global tensors survive a
chain of meshes bit for bit, arrays are chunked for the target's tensor-parallel slices, the
vocabulary rows are re-padded, and the logits of every copy are identical."""

from __future__ import annotations

import errno
import os
import shutil

import pytest
import torch
import zarr

from mlm.checkpoint import ShardedTensor, load_checkpoint, read_manifest, resolve_checkpoint
from mlm.config import load_config
from mlm.convert.reshard import reshard
from mlm.errors import MlmError
from mlm.train.trainer import Trainer
from tests.helpers.common import mlm, tiny_sets

VOCAB = 512
MODEL = {  # GQA that splits over tp 4; the vocabulary pads to 600 rows at tp 1, 800 at tp 2 and 4
    "model.make_vocab_size_divisible_by": 200,
    "model.num_layers": 4,
    "model.num_attention_heads": 8,
    "model.num_query_groups": 4,
}


def _global(ckpt) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, whole, with the vocabulary rows cut to the real vocabulary."""
    it_dir = resolve_checkpoint(ckpt)
    out = {}
    for key, info in read_manifest(it_dir)["tensors"].items():
        group, name = key.split("/", 1)
        t = torch.empty(info["shape"], dtype=getattr(torch, info["dtype"]))
        load_checkpoint(it_dir, {group: [ShardedTensor.full(name, t)]}, strict=False)
        out[key] = t[:VOCAB] if name.endswith(("embed.weight", "output.weight")) else t
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_data):
    tmp = tmp_path_factory.mktemp("reshard")
    sets = tiny_sets(
        tmp, tiny_data, **MODEL, **{"train.train_iters": 2, "checkpoint.save": f"'{tmp / 'ckpt'}'"}
    )
    Trainer(load_config(None, sets)).train()
    return tmp / "ckpt", sets


def _logits(sets, ckpt, tmp_path) -> torch.Tensor:
    trainer = Trainer(load_config(None, [*sets, f"run_dir='{tmp_path / 'run'}'"]), load=str(ckpt))
    return trainer.pipeline.logits(torch.arange(24).view(2, 12) * 5 % VOCAB)[..., :VOCAB]


def test_a_chain_of_meshes_keeps_every_tensor_and_the_logits(trained, tmp_path):
    ckpt, sets = trained
    reference, ref_logits = _global(ckpt), _logits(sets, ckpt, tmp_path)
    src = ckpt
    for i, (tp, pp) in enumerate([(2, 2), (1, 1), (4, 1), (2, 2)]):
        out = tmp_path / f"step{i}-tp{tp}pp{pp}"
        assert reshard(src, out, tp, pp) == 0.0  # verified: the same logits, bit for bit
        got = _global(out)
        assert got.keys() == reference.keys()
        for k, v in reference.items():
            assert torch.equal(got[k], v), k
        manifest = read_manifest(resolve_checkpoint(out))
        assert manifest["mesh"]["tp"] == tp and manifest["config"]["parallel"]["pp"] == pp
        assert manifest["consumed_samples"] == read_manifest(resolve_checkpoint(ckpt))["consumed_samples"]
        src = out
    assert torch.equal(_logits(sets, src, tmp_path), ref_logits)  # and through the trainer's own load
    # the last copy is laid out for tp 2: q split by rows, out by columns, the vocabulary padded to 800
    it = resolve_checkpoint(src)
    assert (
        zarr.open_array(str(it / "model" / "layers.0.attn.q.weight")).chunks[0] * 2
        == reference["model/layers.0.attn.q.weight"].shape[0]
    )
    out_w = zarr.open_array(str(it / "model" / "layers.0.attn.out.weight"))
    assert out_w.chunks[1] * 2 == out_w.shape[1] and out_w.chunks[0] == out_w.shape[0]
    assert zarr.open_array(str(it / "optim" / "exp_avg.embed.weight")).shape[0] == 800


def test_dtype_and_consolidate(trained, tmp_path):
    ckpt, _ = trained
    out = tmp_path / "bf16"
    assert 0 < reshard(ckpt, out, 2, 1, dtype="bf16", consolidate=True) < 5e-2  # verified within bf16's
    it = resolve_checkpoint(out)
    manifest = read_manifest(it)
    assert manifest["tensors"]["model/layers.0.attn.q.weight"]["dtype"] == "bfloat16"
    assert manifest["tensors"]["optim/exp_avg.layers.0.attn.q.weight"]["dtype"] == "float32"
    q = zarr.open_array(str(it / "model" / "layers.0.attn.q.weight"))
    assert q.chunks == q.shape  # one unsharded copy
    ref = _global(ckpt)["model/layers.0.attn.q.weight"]
    assert torch.equal(_global(out)["model/layers.0.attn.q.weight"], ref.bfloat16())


def test_bad_targets(trained, tmp_path):
    ckpt, _ = trained
    with pytest.raises(MlmError, match="already exists; pass a new output path"):
        reshard(ckpt, tmp_path, 1, 1)
    with pytest.raises(MlmError, match=r"num_attention_heads=\d+ is not divisible by parallel.tp=3"):
        reshard(ckpt, tmp_path / "a", 3, 1)
    with pytest.raises(MlmError, match=r"pp\(8\) stages but model.num_layers=4"):
        reshard(ckpt, tmp_path / "b", 1, 8)
    with pytest.raises(MlmError, match="--dtype fp8: choose one of fp32, bf16, fp16"):
        reshard(ckpt, tmp_path / "c", 1, 1, dtype="fp8")
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing left behind


def test_dp_checksums_and_a_full_disk(trained, tmp_path, monkeypatch):
    ckpt, _ = trained
    # dp: recorded for the target mesh, checked against the batch (global 4 = micro 2 × dp 2)
    reshard(ckpt, tmp_path / "dp2", 1, 1, dp=2, verify=False)
    assert read_manifest(resolve_checkpoint(tmp_path / "dp2"))["mesh"]["dp"] == 2
    with pytest.raises(MlmError, match=r"global_batch_size=4 is not divisible by .*=2 × dp=4"):
        reshard(ckpt, tmp_path / "dp4", 1, 1, dp=4)
    # a damaged chunk in the source is refused (--no-verify copies it as it is)
    src = tmp_path / "damaged"
    shutil.copytree(resolve_checkpoint(tmp_path / "dp2"), src / "iter_0000002")
    chunk = src / "iter_0000002" / "optim" / "exp_avg.layers.1.mlp.up.weight" / "c" / "0" / "0"
    chunk.write_bytes(chunk.read_bytes()[::-1])
    with pytest.raises(MlmError, match=r"exp_avg.layers.1.mlp.up.weight: chunk c/0/0 fails its checksum"):
        reshard(src / "iter_0000002", tmp_path / "bad", 2, 1)
    reshard(src / "iter_0000002", tmp_path / "unchecked", 2, 1, verify=False)
    # the disk fills up half-way: one message, and no output (nor its temporary folder) is left
    writes = {"n": 0}
    real = os.copy_file_range  # how the kernel copies re-chunked byte ranges (store.write_pieces)

    def fill_up(*args):
        writes["n"] += 1
        if writes["n"] == 20:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(*args)

    monkeypatch.setattr(os, "copy_file_range", fill_up)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(
        MlmError, match=r"no space left on the device while writing .*full \(No space left on "
    ):
        reshard(ckpt, tmp_path / "full", 2, 1)
    assert writes["n"] == 20 and sorted(p.name for p in tmp_path.iterdir()) == before


def test_cli(trained, tmp_path):
    ckpt, _ = trained
    r = mlm("convert", "reshard", ckpt, tmp_path / "tp2pp2", "--tp", "2", "--pp", "2")
    assert r.returncode == 0, r.stderr
    assert (
        "resharded" in r.stderr
        and "for tp2pp2" in r.stderr
        and "checksums and logits verified: max |diff| 0" in r.stderr
    )
    assert read_manifest(resolve_checkpoint(tmp_path / "tp2pp2"))["mesh"]["tp"] == 2
    # the same mesh as a layout; its run choices change no tensor: a note names them
    r = mlm(
        "convert",
        "reshard",
        tmp_path / "tp2pp2",
        tmp_path / "back",
        "--layout",
        "dp1spmb2rcfull",
        "--no-verify",
    )
    assert r.returncode == 0, r.stderr
    err = " ".join(r.stderr.split())
    assert (
        "for dp1:" in err
        and "note: --layout dp1spmb2rcfull: a reshard applies its mesh, dp1; the rest" in err
    )
    assert read_manifest(resolve_checkpoint(tmp_path / "back"))["mesh"]["tp"] == 1
    r = mlm("convert", "reshard", ckpt, tmp_path / "nothing")
    assert r.returncode == 2 and "say what to change" in r.stderr and not (tmp_path / "nothing").exists()
    r = mlm("convert", "reshard", ckpt, tmp_path / "x", "--weights-only")
    assert r.returncode == 2 and "No such option: --weights-only" in r.stderr
