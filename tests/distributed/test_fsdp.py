"""`parallel.fsdp` (FSDP2's `fully_shard` over dp × cp) equals one process: dp 2, dp 4, tp 2 × dp 2
with sequence parallelism, cp 2, without resharding after forward, HSDP 2 × 2; pp 2 × dp 2 (1F1B
with tied embeddings, and interleaved); a MoE model at ep 1, ep 2 and ep 2 × tp 2; and its
checkpoints move to and from the distributed optimizer and one process.

Every rank is a real gloo process (`run_ranks`). Tolerance: fp32, 1e-5 relative on losses, on
the gradient norms (which show a gradient scaled by a constant, as gloo's averaging reduce-scatter
would: AdamW hides it from the weights) and on the final weights (read back through the
checkpoint). Adam's eps is 1e-4 for the reason tests/distributed/test_parallel_training.py gives.
"""

from __future__ import annotations

import json

import pytest
import torch

from mlm.config import load_config
from mlm.errors import MlmError
from mlm.parallel.fsdp import local
from mlm.train.trainer import Trainer
from tests.helpers.common import checkpoint_weights, tiny_sets
from tests.helpers.distributed import run_ranks

RTOL = 1e-5
BASE = {
    "model.hidden_dropout": 0.0,
    "optimizer.adam_eps": 1e-4,
    "train.global_batch_size": 8,
    "train.micro_batch_size": 2,
    "train.train_iters": 3,
}
FSDP = {"parallel.fsdp": "true"}


def _sets(tmp, data, **extra) -> list[str]:
    return tiny_sets(tmp, data, **{**BASE, "checkpoint.save": f"'{tmp / 'ckpt'}'", **extra})


def _grad_norms(run_dir) -> list[float]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [x["grad_norm"] for x in lines if x.get("split") == "train"]


def _train_rank(rank, world, sets, load=None):
    """The run's losses, and under FSDP the (local, whole) elements of each parameter and the local
    elements of the first moments."""
    trainer = Trainer(load_config(None, sets), load=load)
    losses = trainer.train()
    if not trainer.model.fsdp:
        return losses, None
    shards = {n: (local(p).numel(), p.numel()) for n, p in trainer.model.named_parameters()}
    moments = sum(s["exp_avg"].to_local().numel() for s in trainer.optimizer.adamw.state.values())
    return losses, (True, shards, moments)


def _one_process(tmp, data, **extra):
    """One process's losses, gradient norms and final weights."""
    trainer = Trainer(load_config(None, _sets(tmp, data, **extra)))
    losses = trainer.train()
    return losses, _grad_norms(tmp), {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def _assert_matches(run_dir, losses, reference) -> None:
    """Losses, the logged gradient norms and the checkpoint's final weights equal one process's."""
    ref_losses, ref_norms, ref_weights = reference
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=0)
    torch.testing.assert_close(torch.tensor(_grad_norms(run_dir)), torch.tensor(ref_norms), rtol=RTOL, atol=0)
    got = checkpoint_weights(run_dir / "ckpt", ref_weights)
    for k, v in ref_weights.items():
        torch.testing.assert_close(
            got[k], v, rtol=RTOL, atol=RTOL * v.abs().max().item(), msg=lambda m, k=k: f"{k}: {m}"
        )


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_data):
    return _one_process(tmp_path_factory.mktemp("one"), tiny_data)


@pytest.mark.parametrize(
    "world,parallel",
    [
        (2, {}),
        (4, {}),
        (4, {"parallel.tp": 2, "parallel.sequence_parallel": "true"}),
        (2, {"parallel.cp": 2}),
        (2, {"parallel.fsdp_reshard_after_forward": "false"}),
        (4, {"parallel.fsdp_shard_size": 2}),
        (2, {"parallel.fsdp_shard_size": 1}),
    ],
    ids=["dp2", "dp4", "tp2-sp-dp2", "cp2", "dp2-keep-gathered", "hsdp-2x2", "hsdp-2x1"],
)
def test_fsdp_matches_one_process(tmp_path, tiny_data, reference, world, parallel):
    per_rank = run_ranks(world, _train_rank, _sets(tmp_path, tiny_data, **FSDP, **parallel))
    losses = per_rank[0][0]
    assert all(r[0] == losses for r in per_rank)
    _assert_matches(tmp_path, losses, reference)
    # the W ranks of a tensor-parallel slice's shard group (dp × cp, or HSDP's fsdp_shard_size;
    # tp rank 0's: every tp-th rank) each hold their rows of it, ceil(n / W) at most, and as much
    # of its moments
    tp = int(parallel.get("parallel.tp", 1))
    W = int(parallel.get("parallel.fsdp_shard_size", world // tp))
    fsdp, shards, moments = per_rank[0][1]
    assert fsdp
    group = per_rank[: W * tp : tp]
    assert sum(r[1][1][k][0] for r in group for k in shards) == sum(n for _, n in shards.values())
    assert all(local <= -(-n // W) for local, n in shards.values())
    assert moments == sum(local for local, _ in shards.values())


PIPELINE = {"model.num_layers": 4}


@pytest.fixture(scope="module")
def pipeline_reference(tmp_path_factory, tiny_data):
    """One process's run of the 4-layer model with tied embeddings, and of the untied one."""
    return {
        tied: _one_process(
            tmp_path_factory.mktemp(f"pp-one-{tied}"), tiny_data, **PIPELINE, **{"model.tie_embeddings": tied}
        )
        for tied in ("true", "false")
    }


@pytest.mark.parametrize(
    "tied,parallel",
    [
        ("true", {"parallel.pp": 2}),
        ("false", {"parallel.pp": 2, "parallel.vpp": 2}),
    ],
    ids=["pp2-dp2-1f1b-tied", "pp2-vpp2-dp2-interleaved"],
)
def test_fsdp_under_pipeline_parallelism_matches_one_process(
    tmp_path, tiny_data, pipeline_reference, tied, parallel
):
    """Each pipeline stage's parameters sharded over its dp ranks: 1F1B with the tied embedding's
    first- and last-stage copies (their sharded gradients summed), and interleaved 1F1B (two model
    chunks per rank in one FSDP root)."""
    sets = _sets(tmp_path, tiny_data, **FSDP, **PIPELINE, **{"model.tie_embeddings": tied}, **parallel)
    per_rank = run_ranks(4, _train_rank, sets)
    _assert_matches(tmp_path, per_rank[-1][0], pipeline_reference[tied])  # the loss: the last stage's
    assert all(r[1][0] for r in per_rank)  # every stage sharded


MOE = {
    "model.num_layers": 3,
    "model.mlp_kind": "moe",
    "model.first_k_dense": 1,
    "model.moe.num_experts": 4,
    "model.moe.ffn_hidden_size": 48,
    "model.moe.router_topk": 2,
    "model.moe.aux_loss_coeff": 1e-2,
    "model.moe.shared_expert_ffn_hidden_size": 32,
    "model.moe.router_enable_expert_bias": "true",
    "model.moe.router_score_function": "'sigmoid'",
}


@pytest.fixture(scope="module")
def moe_reference(tmp_path_factory, tiny_data):
    return _one_process(tmp_path_factory.mktemp("moe-one"), tiny_data, **MOE)


@pytest.mark.parametrize(
    "world,parallel",
    [
        (2, {}),
        (4, {"parallel.ep": 2}),
        (4, {"parallel.ep": 2, "parallel.tp": 2, "parallel.sequence_parallel": "true"}),
        (2, {"parallel.ep": 2}),
    ],
    ids=["moe-dp2", "ep2-dp4", "ep2-tp2-sp-dp2", "ep2-dp2"],
)
def test_fsdp_on_a_moe_model_matches_one_process(tmp_path, tiny_data, moe_reference, world, parallel):
    """MoE layers with a shared expert, the aux loss and aux-loss-free balancing (the expert bias
    stays whole: FSDP ignores it). At ep 1 the experts shard over dp like any weight; under ep
    they are their own FSDP unit over the ranks holding the same experts (edp = 2 here: dp 4 / ep
    2, or dp 2 × tp 2 / ep 2; and edp = 1 at dp 2 / ep 2), while the rest of the layer shards over
    dp."""
    per_rank = run_ranks(world, _train_rank, _sets(tmp_path, tiny_data, **FSDP, **MOE, **parallel))
    _assert_matches(tmp_path, per_rank[0][0], moe_reference)
    _, shards, _ = per_rank[0][1]
    experts = [local for k, (local, n) in shards.items() if ".experts." in k]
    whole = [n for k, (local, n) in shards.items() if ".experts." in k]
    edp = world // int(parallel.get("parallel.ep", 1))  # the ranks the experts shard over
    assert experts and sum(experts) * edp == sum(whole)


def test_a_checkpoint_moves_between_fsdp_the_distributed_optimizer_and_one_process(tmp_path, tiny_data):
    """fsdp dp 4 saves after 2 of 4 steps; fsdp dp 4 resumes it bit for bit; fsdp at tp 2 × dp 2
    (each shard's rows of a column slice), the distributed optimizer at tp 2 × dp 2 and one process
    resume it with the uninterrupted run's next losses, and fsdp dp 2 resumes the distributed
    optimizer's checkpoint of step 2 likewise."""
    four = {"train.train_iters": 4, "checkpoint.save_interval": 2}
    whole = run_ranks(4, _train_rank, _sets(tmp_path / "whole", tiny_data, **FSDP, **four))[0][0]
    step2 = tmp_path / "whole" / "ckpt" / "iter_0000002"
    same = run_ranks(4, _train_rank, _sets(tmp_path / "same", tiny_data, **FSDP, **four), str(step2))
    assert same[0][0] == whole[2:]
    tp2 = {"parallel.tp": 2, "parallel.sequence_parallel": "true", **FSDP, **four}
    sliced = run_ranks(4, _train_rank, _sets(tmp_path / "tp2", tiny_data, **tp2), str(step2))[0][0]
    torch.testing.assert_close(torch.tensor(sliced), torch.tensor(whole[2:]), rtol=RTOL, atol=0)
    zero1 = {"parallel.tp": 2, "parallel.distributed_optimizer": "true", **four}
    resumed = run_ranks(4, _train_rank, _sets(tmp_path / "zero1", tiny_data, **zero1), str(step2))[0][0]
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(whole[2:]), rtol=RTOL, atol=0)
    one = Trainer(load_config(None, _sets(tmp_path / "one", tiny_data, **four)), load=str(step2)).train()
    torch.testing.assert_close(torch.tensor(one), torch.tensor(whole[2:]), rtol=RTOL, atol=0)
    back = tmp_path / "zero1" / "ckpt" / "iter_0000004"  # the distributed optimizer's, resumed under fsdp
    six = {"train.train_iters": 6, "checkpoint.resume_changes": "['train.train_iters']"}  # longer, on purpose
    again = run_ranks(
        2, _train_rank, _sets(tmp_path / "back", tiny_data, **{**FSDP, **four, **six}), str(back)
    )
    cont = run_ranks(4, _train_rank, _sets(tmp_path / "cont", tiny_data, **{**zero1, **six}), str(back))
    assert len(again[0][0]) == 2
    torch.testing.assert_close(torch.tensor(again[0][0]), torch.tensor(cont[0][0]), rtol=RTOL, atol=0)


@pytest.mark.parametrize(
    "extra,named",
    [
        ({"model.mtp_num_layers": 1}, "model.mtp_num_layers=1"),
        ({"train.compile": "true"}, "train.compile=true"),
    ],
)
def test_what_fsdp_is_not_built_with_is_refused(tmp_path, tiny_data, extra, named):
    with pytest.raises(MlmError, match=f"parallel.fsdp with {named}"):
        Trainer(load_config(None, _sets(tmp_path, tiny_data, **FSDP, **extra)))
    with pytest.raises(MlmError, match="FSDP already shards the optimizer state"):
        load_config(None, _sets(tmp_path, tiny_data, **FSDP, **{"parallel.distributed_optimizer": "true"}))
    with pytest.raises(MlmError, match="fsdp_shard_size=2: needs parallel.fsdp=true"):
        load_config(None, _sets(tmp_path, tiny_data, **{"parallel.fsdp_shard_size": 2}))


def test_a_shard_size_that_does_not_divide_dp_cp_is_named(tmp_path, tiny_data):
    from mlm.parallel.fsdp import fsdp_mesh
    from mlm.parallel.mesh import Mesh

    with pytest.raises(
        MlmError, match=r"fsdp_shard_size=3 does not divide dp × cp = 4; choose one of 1, 2, 4"
    ):
        fsdp_mesh(Mesh(world_size=4, rank=0, dp=4), "cpu", 3)
