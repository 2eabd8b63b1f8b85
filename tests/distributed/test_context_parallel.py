"""Context parallelism equals one process: each sequence split over cp ranks (2·cp chunks, rank r
holding chunks r and 2cp − 1 − r), attention over the whole sequence through the cp ranks.
Training at cp 2, cp 2 × tp 2 with sequence parallelism, cp 2 × pp 2, cp 2 × dp 2 with the
distributed optimizer and cp 4, for each attention implementation (all_gather, p2p), against
one process over 3 steps: losses and final weights (read back through the checkpoint, which has
no cp axis). Plus the clear errors.

Every rank is a real gloo process. Tolerance: fp32, 1e-5 relative (test_parallel_training's).
"""

from __future__ import annotations

import pytest
import torch

from mlm.config import ModelConfig, load_config
from mlm.datasets.documents import DocumentLayout
from mlm.errors import MlmError
from mlm.model import build_model
from mlm.parallel.context import check_context_parallel, zigzag_indices
from mlm.train.dry_run import dry_run
from mlm.train.trainer import Trainer
from tests.helpers.distributed import run_ranks
from tests.helpers.parallel import MOE, assert_matches, logged, reference_run, run_sets, train_rank

RUN = {"model.num_layers": 4, "train.train_iters": 3}
COMM = ["all_gather", "p2p"]


def test_zigzag_split_balances_the_causal_work():
    assert zigzag_indices(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert zigzag_indices(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    held = sorted(i for r in range(4) for i in zigzag_indices(32, 4, r).tolist())
    assert held == list(range(32))
    # causal work (keys at or before each query) is the same on every rank
    work = [sum(p + 1 for p in zigzag_indices(32, 4, r).tolist()) for r in range(4)]
    assert len(set(work)) == 1


@pytest.fixture(scope="module")
def cp_reference(tmp_path_factory, tiny_data):
    return reference_run(tmp_path_factory.mktemp("reference"), tiny_data, **RUN)


@pytest.mark.parametrize("comm", COMM)
@pytest.mark.parametrize(
    "world,parallel",
    [
        (2, {"parallel.cp": 2}),
        (4, {"parallel.cp": 2, "parallel.tp": 2, "parallel.sequence_parallel": "true"}),
        (4, {"parallel.cp": 2, "parallel.pp": 2}),
        (4, {"parallel.cp": 2, "parallel.distributed_optimizer": "true", "parallel.bucket_size_mb": 0.05}),
        (4, {"parallel.cp": 4}),
    ],
    ids=["cp2", "cp2xtp2-sp", "cp2xpp2", "cp2xdp2-distopt", "cp4"],
)
def test_context_parallel_matches_one_process(tmp_path, tiny_data, cp_reference, world, parallel, comm):
    sets = run_sets(tmp_path, tiny_data, "mesh", **RUN, **parallel, **{"parallel.cp_comm_type": comm})
    assert_matches(tmp_path, run_ranks(world, train_rank, sets), *cp_reference)


def test_bad_splits_are_refused(tmp_path, tiny_data):
    with pytest.raises(MlmError, match=r"data.seq_length=30 is not divisible by 2 × parallel.cp = 4"):
        check_context_parallel(30, 2)
    with pytest.raises(MlmError, match=r"leaves 12 tokens per rank, not divisible by tp=8"):
        check_context_parallel(24, 2, 8)
    with pytest.raises(MlmError, match=r"tp\(1\) × pp\(1\) × cp\(2\) = 2 does not divide world size 1"):
        Trainer(load_config(None, run_sets(tmp_path, tiny_data, "bad", **{"parallel.cp": 2})))
    cfg = load_config(None, run_sets(tmp_path, tiny_data, "bad", **{"parallel.cp": 4, "data.seq_length": 36}))
    with pytest.raises(MlmError, match=r"data.seq_length=36 is not divisible by 2 × parallel.cp = 8"):
        dry_run(cfg, world_size=4)


@pytest.fixture(scope="module")
def moe_cp_reference(tmp_path_factory, tiny_data):
    tmp = tmp_path_factory.mktemp("reference")
    losses, weights = reference_run(tmp, tiny_data, **MOE)
    return losses, weights, logged(tmp / "one", "aux.")


@pytest.mark.parametrize(
    "world,parallel",
    [
        (2, {"parallel.cp": 2}),
        (2, {"parallel.cp": 2, "parallel.ep": 2}),
        (4, {"parallel.cp": 2, "parallel.tp": 2, "parallel.sequence_parallel": "true", "parallel.ep": 4}),
    ],
    ids=["cp2", "cp2xep2", "cp2xtp2-sp-ep4"],
)
def test_moe_under_context_parallelism_matches_one_process(
    tmp_path, tiny_data, moe_cp_reference, world, parallel
):
    """MoE layers route each rank's share of the sequences; the balancing losses count tokens over
    the whole sequence (summed over cp, and tp under sequence parallelism); experts fold over cp."""
    sets = run_sets(tmp_path, tiny_data, "mesh", **MOE, **parallel)
    losses, weights, aux = moe_cp_reference
    assert_matches(tmp_path, run_ranks(world, train_rank, sets), losses, weights)
    got = logged(tmp_path / "mesh", "aux.")
    assert set(got) == set(aux)
    for name, values in aux.items():
        assert got[name] == pytest.approx(values, rel=1e-5), name


def test_packed_documents_attend_only_within_themselves():
    """One process: two documents packed in one sequence (eod closes the first) give the second
    document the logits it has alone, with positions restarting after the eod."""
    model = build_model(ModelConfig(num_layers=2, vocab_size=100)).eval()
    eod = 0
    first, second = torch.randint(1, 100, (1, 7)), torch.randint(1, 100, (1, 9))
    packed = torch.cat([first, torch.tensor([[eod]]), second], 1)
    documents, positions = DocumentLayout(eod, True, True)(packed)
    assert documents.tolist() == [[0] * 8 + [1] * 9] and positions[0, 8:].tolist() == list(range(9))
    with torch.no_grad():
        got = model(packed, positions, documents=documents)[:, 8:]
        alone = model(second)
    torch.testing.assert_close(got, alone, rtol=1e-5, atol=1e-5)


def _attention_rank(rank, world, cp, groups, comm):
    import torch
    import torch.distributed as dist

    from mlm.model.attention import document_attention
    from mlm.parallel.context import allgather_attention
    from mlm.parallel.ring_attention import ring_attention

    gen = torch.Generator().manual_seed(0)
    B, T, H, G, K = 2, 32, 4, groups, 16
    q, k, v = (torch.randn(B, T, n, K, generator=gen) for n in (H, G, G))
    documents = torch.cumsum(torch.rand(B, T, generator=gen) < 0.15, 1)  # ~5 documents per row
    grad = torch.randn(B, T, H, K, generator=gen)
    ref = [x.clone().requires_grad_() for x in (q, k, v)]
    out = document_attention(*ref, documents)
    out.backward(grad)
    idx = zigzag_indices(T, cp, rank)
    mine = [x[:, idx].clone().requires_grad_() for x in (q, k, v)]
    attend = ring_attention if comm == "p2p" else allgather_attention
    got = attend(*mine, dist.group.WORLD, cp, rank, documents_BT=documents[:, idx])
    got.backward(grad[:, idx])
    errors = [float((got - out[:, idx]).abs().max())]
    errors += [float((m.grad - r.grad[:, idx]).abs().max()) for m, r in zip(mine, ref, strict=True)]
    return errors


@pytest.mark.parametrize("comm", COMM)
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("groups", [4, 2], ids=["mha", "gqa"])
def test_attention_with_packed_documents_equals_one_process(cp, groups, comm):
    """Output and the q, k, v gradients of each rank's zigzag share, fp32, 1e-5 (documents of
    ~7 tokens: many ring blocks hold keys of no query's document)."""
    for errors in run_ranks(cp, _attention_rank, cp, groups, comm):
        assert max(errors) < 1e-5, errors


@pytest.mark.parametrize("comm", COMM)
def test_training_with_packed_documents_at_cp2_matches_one_process(tmp_path, tiny_data, comm):
    docs = {"data.reset_position_ids": "true", "data.reset_attention_mask": "true", **RUN}
    ref = reference_run(tmp_path / "ref", tiny_data, **docs)
    sets = run_sets(tmp_path, tiny_data, "mesh", **docs, **{"parallel.cp": 2, "parallel.cp_comm_type": comm})
    assert_matches(tmp_path, run_ranks(2, train_rank, sets), *ref)


def _resume(rank, world, sets, resume_from):
    return Trainer(load_config(None, sets), load=resume_from).train()


def test_checkpoints_have_no_cp_axis(tmp_path, tiny_data):
    """A cp 2 checkpoint (step 2 of 4) resumes in one process, and a one-process checkpoint at
    cp 2, each continuing as the uninterrupted run of the other layout (1e-5)."""
    run = {**RUN, "train.train_iters": 4, "checkpoint.save_interval": 2}
    cp2 = {"parallel.cp": 2}
    straight_cp2 = run_ranks(2, train_rank, run_sets(tmp_path, tiny_data, "a", **run, **cp2))[0]
    straight_one = Trainer(load_config(None, run_sets(tmp_path, tiny_data, "b", **run))).train()
    at_one = Trainer(
        load_config(None, run_sets(tmp_path, tiny_data, "c", **run)),
        load=str(tmp_path / "a" / "ckpt" / "iter_0000002"),
    ).train()
    at_cp2 = run_ranks(
        2,
        _resume,
        run_sets(tmp_path, tiny_data, "d", **run, **cp2),
        str(tmp_path / "b" / "ckpt" / "iter_0000002"),
    )[0]
    for resumed, straight in ((at_one, straight_cp2), (at_cp2, straight_one)):
        torch.testing.assert_close(torch.tensor(resumed), torch.tensor(straight[2:]), rtol=1e-5, atol=0)
