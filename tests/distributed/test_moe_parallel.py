"""MoE training under expert parallelism equals one process: ep 2 (folded over dp 2), ep 2 × dp 2
with the distributed optimizer, ep 2 × tp 2 with sequence parallelism (× dp 2), ep 2 × pp 2 and
ep 4 on 4 ranks, each with the all-to-all and the all-gather dispatcher; 3 steps, dropless, with
every balancing loss on (aux, sequence aux, z-loss: they reach the gradients from every stage)
and shared experts with their gate. Losses, final weights (read back through the checkpoint,
experts on their global axis), the logged balancing losses and the global gradient norm (each
expert counted once) are compared.

Every rank is a real gloo process. Tolerance: fp32, 1e-5 relative (test_parallel_training's:
reductions sum in another order), Adam's eps 1e-4 for the reason given there.
"""

from __future__ import annotations

import pytest

from mlm.config import load_config
from mlm.train.trainer import Trainer
from tests.helpers.distributed import run_ranks
from tests.helpers.parallel import MOE, RTOL, assert_matches, logged, reference_run, run_sets, train_rank

DISTOPT = {"parallel.distributed_optimizer": "true", "parallel.bucket_size_mb": 0.02}


@pytest.fixture(scope="module")
def moe_reference(tmp_path_factory, tiny_data):
    tmp = tmp_path_factory.mktemp("reference")
    losses, weights = reference_run(tmp, tiny_data, **MOE)
    return losses, weights, {**logged(tmp / "one", "aux."), **logged(tmp / "one", "grad_norm")}


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
@pytest.mark.parametrize(
    "world,parallel",
    [
        (2, {"parallel.ep": 2}),
        (4, {"parallel.ep": 2, **DISTOPT}),
        (4, {"parallel.ep": 2, "parallel.tp": 2, "parallel.sequence_parallel": "true"}),
        (4, {"parallel.ep": 2, "parallel.pp": 2}),
        (4, {"parallel.ep": 4}),
    ],
    ids=["ep2", "ep2xdp2-distopt", "ep2xtp2-sp", "ep2xpp2", "ep4"],
)
def test_expert_parallel_matches_one_process(tmp_path, tiny_data, moe_reference, world, parallel, dispatcher):
    sets = run_sets(
        tmp_path, tiny_data, "mesh", **MOE, **parallel, **{"model.moe.token_dispatcher": dispatcher}
    )
    losses, weights, aux = moe_reference
    assert_matches(tmp_path, run_ranks(world, train_rank, sets), losses, weights)
    assert set(aux) - {"grad_norm"} == {
        f"aux.{kind}.{i}" for kind in ("load_balancing", "seq_load_balancing", "z_loss") for i in (1, 2, 3)
    }
    got = {**logged(tmp_path / "mesh", "aux."), **logged(tmp_path / "mesh", "grad_norm")}
    assert max(aux["grad_norm"]) > 1.0  # clipping at 1.0 acted: a wrong norm would move the weights
    for name, values in aux.items():  # the balancing losses and the global gradient norm
        assert got[name] == pytest.approx(values, rel=RTOL), name


def test_one_process_logs_the_expert_load(tmp_path, tiny_data):
    trainer = Trainer(load_config(None, run_sets(tmp_path, tiny_data, "one", **MOE)))
    trainer.train()
    load = logged(tmp_path / "one", "moe.")
    assert set(load) == {f"moe.{m}.{i}" for m in ("load_max_mean", "dropped") for i in (1, 2, 3)}
    assert all(1.0 <= v <= 4.0 for v in load["moe.load_max_mean.1"])  # at most E times the mean
    assert load["moe.dropped.1"] == [0.0, 0.0, 0.0]  # dropless
