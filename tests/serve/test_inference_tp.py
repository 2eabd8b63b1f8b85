"""Tensor-parallel serving (mlm.inference.lockstep): the engine at tp=2 against tp=1.

Rank 0 runs the engine with continuous batching (requests of different lengths arriving at
different steps, a prompt prefilled over two steps); rank 1 follows its broadcast steps. The
greedy tokens must equal the one-process engine's on the same checkpoint, token for token, and
every step's logits within TOL; every cache block goes back, and both ranks leave their loop at
the stop message. Three models in one `run_ranks` call: a Llama-style GQA model whose 2 query groups
split over the 2 ranks (untied output), a GPT-2-style one (tied embeddings, biases, learned
positions), and a mixture of experts (a dense first layer, then 4 experts, top-2, and a gated
shared expert; trained with a capacity factor, served dropless): its experts are whole on both
ranks, which route the same tokens, while attention and the shared expert split over tp.
"""

from __future__ import annotations

import pytest
import torch

from mlm.config import ModelConfig
from mlm.errors import MlmError
from mlm.inference.engine import Engine, build_runner
from mlm.inference.loader import load_model
from mlm.inference.lockstep import serving_mesh
from mlm.model.kinds.moe.module import MoE
from tests.helpers.distributed import run_ranks
from tests.helpers.inference import ENGINE, GPT2, LLAMA, MOE, drive_engine, model_checkpoint

TOL = 1e-5  # fp32 logits: max |tp2 − tp1| / max |tp1|


def _tp_rank(rank: int, world_size: int, ckpts: list[str]) -> list[dict]:
    mesh = serving_mesh(ModelConfig(**LLAMA), None, torch.device("cpu"))  # tp = WORLD_SIZE
    assert (mesh.tp, mesh.tp_rank) == (world_size, rank)
    out = []
    for ckpt in ckpts:
        model, _, _ = load_model(ckpt, device="cpu", mesh=mesh)
        if rank == 0:
            engine = Engine(model, None, ENGINE, mesh)
            tokens, logits = drive_engine(engine)
            engine.stop()  # the stop message
            cache = engine.cache
            lists = [x.tolist() for x in logits]  # plain data: a worker's tensors die with it
            out.append(dict(tokens=tokens, logits=lists, used=cache.allocator.num_used))
        else:
            runner = build_runner(model, ENGINE, mesh)
            cache = runner.cache
            out.append(dict(steps=runner.follow()))  # returns at the stop message
        out[-1]["cache"] = tuple(cache.k_LNSGK.shape)
        moes = [m for m in model.modules() if isinstance(m, MoE)]
        out[-1]["experts"] = [(tuple(m.experts.up.weight.shape), m.options.capacity_factor) for m in moes]
    return out


def test_tp2_engine_equals_tp1(tmp_path):
    models = (("llama", LLAMA), ("gpt2", GPT2), ("moe", MOE))
    ckpts = [model_checkpoint(tmp_path / name, kw) for name, kw in models]
    ranks = run_ranks(2, _tp_rank, ckpts)
    for i, ckpt in enumerate(ckpts):
        model, _, _ = load_model(ckpt, device="cpu")
        tokens, logits = drive_engine(Engine(model, None, ENGINE))
        lead, follower = ranks[0][i], ranks[1][i]
        assert lead["tokens"] == tokens
        assert len(lead["logits"]) == len(logits) == follower["steps"]
        assert any(x.shape[0] == 0 for x in logits)  # the first chunk of the long prompt
        for got, ref in zip(lead["logits"], logits, strict=True):
            assert len(got) == ref.shape[0]
            if got:
                assert float((torch.tensor(got) - ref).abs().max() / ref.abs().max()) <= TOL
        assert lead["used"] == 0
        G = model.cfg.query_groups
        assert lead["cache"][3] == follower["cache"][3] == G // 2  # each rank: its own heads
        assert lead["cache"][:3] == follower["cache"][:3]  # the same blocks
        if models[i][0] == "moe":  # every expert whole on both ranks, dropless
            assert lead["experts"] == follower["experts"] == [((4, 48, 64), None)] * 2


def test_serving_mesh_refusals(monkeypatch):
    cfg = ModelConfig(**LLAMA)
    with pytest.raises(MlmError, match=r"--tp 2 with 1 process.*torchrun --nproc-per-node 2"):
        serving_mesh(cfg, 2, torch.device("cpu"))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")  # as torchrun --nproc-per-node 4 would
    with pytest.raises(MlmError, match=r"--tp 2 with 4 process.*pp > 1 or dp > 1"):
        serving_mesh(cfg, 2, torch.device("cpu"))
    mqa = ModelConfig(**{**LLAMA, "num_query_groups": 1})
    with pytest.raises(MlmError, match="num_query_groups=1 is not divisible by parallel.tp=4"):
        serving_mesh(mqa, None, torch.device("cpu"))
