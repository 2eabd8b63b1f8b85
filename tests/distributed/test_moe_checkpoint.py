"""MoE checkpoints across expert-parallel sizes: a tiny MoE trained at ep 2 × pp 2 (4 ranks, the
distributed optimizer) saves at step 2 of 4; `mlm convert --ep` rewrites that checkpoint for
ep 1 × pp 1 and for ep 4 × pp 1 (experts chunked by the target's ep slices, every tensor kept
bit for bit), and each resumes with the losses of steps 3-4 of the uninterrupted run: in one
process with the plain optimizer, on 4 ranks at ep 4 with the distributed optimizer. Loaded at
another ep without conversion and saved again at once, a checkpoint keeps every weight and Adam
moment bit for bit: the ep 2 checkpoint in one process (plain optimizer), the ep 4 one at ep 2 ×
dp 4 (pp 1), where the distributed optimizer shards the experts' moments over edp 2 by flat
ranges.

Tolerance: fp32, 1e-5 relative, as in test_moe_parallel (reductions sum in another order).
"""

from __future__ import annotations

import json

import pytest
import torch
import zarr

from mlm.checkpoint import ShardedTensor, load_checkpoint, read_manifest, resolve_checkpoint
from mlm.config import load_config
from mlm.convert.reshard import reshard
from mlm.errors import MlmError
from mlm.train.trainer import Trainer
from tests.helpers.common import mlm
from tests.helpers.distributed import run_ranks
from tests.helpers.parallel import MOE as MOE_MODEL
from tests.helpers.parallel import RTOL, run_sets

MOE = {  # test_moe_parallel's model, 4 steps
    **MOE_MODEL,
    "train.train_iters": 4,
    "logging.hardware": "h100-80g",  # MFU against a profile's peak: no CPU matmul measured per rank
}
DISTOPT = {"parallel.distributed_optimizer": "true", "parallel.bucket_size_mb": 0.02}
NO_SAVE = {"checkpoint.save": "''"}  # resumed runs
EXPERT = "layers.1.mlp.experts.up.weight"  # [E=4, 48, 64]


def _train(rank, world, sets, load=None) -> list[float]:
    if world > 1:
        torch.set_num_threads(1)  # 4 ranks on 2 cores: one thread each
    return Trainer(load_config(None, sets), load=load).train()


def _resume_then_load_and_save(rank, world, resume, load, save_to) -> list[float]:
    """A resumed run's losses, each (sets, checkpoint); then `load` loaded under its own sets
    and saved again at once to `save_to`."""
    losses = _train(rank, world, *resume)
    trainer = Trainer(load_config(None, load[0]), load=load[1])
    trainer.save(save_to)
    return losses


def _global(ckpt) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, whole."""
    it_dir = resolve_checkpoint(ckpt)
    out = {}
    for key, info in read_manifest(it_dir)["tensors"].items():
        group, name = key.split("/", 1)
        t = torch.empty(info["shape"], dtype=getattr(torch, info["dtype"]))
        load_checkpoint(it_dir, {group: [ShardedTensor.full(name, t)]}, strict=False)
        out[key] = t
    return out


@pytest.fixture(scope="module")
def source(tmp_path_factory, tiny_data):
    """The uninterrupted ep 2 × pp 2 run: its losses and its checkpoint at step 2."""
    tmp = tmp_path_factory.mktemp("moe_ckpt")
    ep2pp2 = {"parallel.ep": 2, "parallel.pp": 2, "checkpoint.save_interval": 2, **DISTOPT}
    losses = run_ranks(4, _train, run_sets(tmp, tiny_data, "src", **MOE, **ep2pp2))[0]
    ckpt = tmp / "src" / "ckpt" / "iter_0000002"
    assert read_manifest(ckpt)["mesh"] == {"tp": 1, "pp": 2, "dp": 2, "cp": 1, "ep": 2, "world_size": 4}
    return ckpt, losses, _global(ckpt)


def _check_same(ckpt, reference: dict[str, torch.Tensor]) -> None:
    """Every weight and moment of `ckpt` as in `reference`, bit for bit (loss agreement alone would
    miss a small error in the moments: 10% off the experts' exp_avg moves step 4's loss by 1.6e-5)."""
    got = _global(ckpt)
    assert got.keys() == reference.keys()
    for k, v in reference.items():
        assert torch.equal(got[k], v), k


def _check_layout(out, ep: int, pp: int, reference: dict[str, torch.Tensor]) -> None:
    """Every tensor as in the source; experts and their moments chunked per ep rank."""
    it_dir = resolve_checkpoint(out)
    manifest = read_manifest(it_dir)
    assert manifest["mesh"]["ep"] == ep and manifest["mesh"]["pp"] == pp
    assert manifest["config"]["parallel"]["ep"] == ep and manifest["config"]["parallel"]["pp"] == pp
    _check_same(out, reference)
    for path in (f"model/{EXPERT}", f"optim/exp_avg.{EXPERT}", f"optim/exp_avg_sq.{EXPERT}"):
        assert zarr.open_array(str(it_dir / path)).chunks == (4 // ep, 48, 64), path


def test_convert_to_ep1_pp1_resumes_in_one_process(source, tiny_data, tmp_path):
    ckpt, straight, reference = source
    out = tmp_path / "ep1"
    assert reshard(ckpt, out, tp=1, pp=1, dp=1, ep=1) == 0.0  # verified: the same logits, bit for bit
    _check_layout(out, 1, 1, reference)
    at_ep1 = run_sets(tmp_path, tiny_data, "resume", **MOE, **NO_SAVE)
    again = tmp_path / "again"  # the unconverted ep 2 checkpoint, loaded here and saved again
    resumed = run_ranks(1, _resume_then_load_and_save, (at_ep1, str(out)), (at_ep1, str(ckpt)), str(again))[0]
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(straight[2:]), rtol=RTOL, atol=0)
    _check_same(again, reference)


def test_convert_to_ep4_resumes_on_4_ranks_and_loads_at_ep2_edp2(source, tiny_data, tmp_path):
    ckpt, straight, reference = source
    out = tmp_path / "ep4"
    r = mlm("convert", "reshard", ckpt, out, "--ep", "4", "--pp", "1", "--dp", "4", "--no-progress")
    assert r.returncode == 0, r.stderr
    assert "for dp4ep4" in r.stderr and "logits verified: max |diff| 0" in r.stderr
    _check_layout(out, 4, 1, reference)
    at_ep4 = run_sets(tmp_path, tiny_data, "ep4run", **MOE, **DISTOPT, **NO_SAVE, **{"parallel.ep": 4})
    at_ep2 = run_sets(tmp_path, tiny_data, "ep2run", **MOE, **DISTOPT, **{"parallel.ep": 2})  # edp 2
    again = tmp_path / "again"
    resumed = run_ranks(4, _resume_then_load_and_save, (at_ep4, str(out)), (at_ep2, str(out)), str(again))[0]
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(straight[2:]), rtol=RTOL, atol=0)
    _check_same(again, reference)


def test_an_ep_that_does_not_divide_the_experts_is_refused(source, tmp_path):
    ckpt, _, _ = source
    r = mlm("convert", "reshard", ckpt, tmp_path / "ep3", "--ep", "3")
    assert r.returncode == 2
    assert (
        "--ep 3: model.moe.num_experts=4 is not divisible by ep=3" in r.stderr
        and "choose an ep that divides 4 (1, 2, 4)" in r.stderr
    ), r.stderr
    assert not (tmp_path / "ep3").exists()
    with pytest.raises(MlmError, match=r"--ep 4 must divide dp\(2\) × tp\(1\) = 2.*pass a --dp"):
        reshard(ckpt, tmp_path / "ep4", 1, 1, ep=4)  # dp stays the source's 2
    # a dense model takes --ep 1 only (its manifest is all the check reads)
    dense = tmp_path / "dense" / "iter_0000002"
    dense.mkdir(parents=True)
    manifest = read_manifest(ckpt)
    manifest["config"]["model"]["mlp_kind"] = "dense"
    (dense / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(MlmError, match=r"--ep 2: .* holds a dense model .*leave out --ep, or pass --ep 1"):
        reshard(dense, tmp_path / "dense2", 1, 1, ep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dense"]  # nothing left behind
