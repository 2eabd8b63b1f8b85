"""What the tests of training on a mesh share: the settings of a tiny run (`run_sets`, `BASE`), one rank's
training (`train_rank`, for `run_ranks`), one process's losses and weights (`reference_run`), the
check that a mesh's run matches them to `RTOL` (`assert_matches`), a small MoE (`MOE`) and the
logged metrics of a run (`logged`)."""

from __future__ import annotations

import json

import torch

from mlm.config import load_config
from mlm.train.trainer import Trainer
from tests.helpers.common import checkpoint_weights, tiny_sets

RTOL = 1e-5
BASE = {
    "model.hidden_dropout": 0.0,
    "optimizer.adam_eps": 1e-4,
    "train.global_batch_size": 8,
    "train.micro_batch_size": 2,
    "train.train_iters": 5,
}


def run_sets(tmp_path, data, name, **extra) -> list[str]:
    return tiny_sets(
        tmp_path / name, data, **{**BASE, "checkpoint.save": f"'{tmp_path / name / 'ckpt'}'", **extra}
    )


def train_rank(rank, world, sets, load=None):
    return Trainer(load_config(None, sets), load=load).train()


def reference_run(tmp, data, **model) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process's losses and final weights for a model given as extra settings."""
    trainer = Trainer(load_config(None, run_sets(tmp, data, "one", **model)))
    losses = trainer.train()
    return losses, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def assert_matches(tmp_path, per_rank, ref_losses, ref_weights):
    assert all(losses == per_rank[0] for losses in per_rank)  # every rank logs the same dp-mean loss
    torch.testing.assert_close(torch.tensor(per_rank[0]), torch.tensor(ref_losses), rtol=RTOL, atol=0)
    got = checkpoint_weights(tmp_path / "mesh" / "ckpt", ref_weights)
    for k, v in ref_weights.items():
        torch.testing.assert_close(
            got[k], v, rtol=RTOL, atol=RTOL * v.abs().max().item(), msg=lambda m, k=k: f"{k}: {m}"
        )


MOE = {
    "model.num_layers": 4,
    "model.mlp_kind": "moe",
    "model.first_k_dense": 1,
    "model.moe.num_experts": 4,
    "model.moe.ffn_hidden_size": 48,
    "model.moe.router_topk": 2,
    "model.moe.aux_loss_coeff": 1e-2,
    "model.moe.seq_aux_loss_coeff": 1e-2,
    "model.moe.z_loss_coeff": 1e-3,
    "model.moe.shared_expert_ffn_hidden_size": 32,
    "model.moe.shared_expert_gate": "true",
    "train.train_iters": 3,
}


def logged(run_dir, prefix: str) -> dict[str, list[float]]:
    """Every logged training metric starting with `prefix`, per name, from RUN_DIR/metrics.jsonl."""
    out: dict[str, list[float]] = {}
    for line in open(run_dir / "metrics.jsonl"):
        r = json.loads(line)
        if r["split"] == "train":
            for k, v in r.items():
                if k.startswith(prefix):
                    out.setdefault(k, []).append(v)
    return out
