"""train.compile: each transformer layer under torch.compile trains as eager does.

One process: compiled equals eager (plain, with full activation recompute, with the Triton
kernels under the interpreter), the layers' parameter names unchanged and real graphs captured;
a forward pre-hook on a compiled layer runs on every call, registered before or after the first.
Two gloo ranks: tp 2 (the tensor-parallel collectives inside the layers) and dp 2 (the gradient
hooks of the data-parallel reduction), compiled, equal one eager process.

Tolerance: fp32, 1e-5 relative on losses and on the final weights. Inductor fuses the
elementwise ops and may reorder a reduction, so the results are not bitwise (measured on this
tiny Llama, 3 SGD steps outside the trainer: weights within 1.2e-7 of eager's, losses equal).
Dropout is off: compiled dropout draws its masks from inductor's random numbers, not eager's.

Compiling costs far more than the steps: the cold compile of a tiny layer's forward and backward
is about 30 s on 2 cores; inductor's on-disk caches (/tmp/torchinductor_$USER) make later runs
take a few seconds. The layers of one model share one compiled graph. The file took 133 s (cold
cache) and 169 s (warm, load average 6) on a 2-core machine shared with other test runs.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from torch._dynamo.utils import counters

from mlm.build import compile_layers
from mlm.checkpoint import ShardedTensor, load_checkpoint
from mlm.config import load_config
from mlm.model import build_model
from mlm.train.trainer import Trainer
from tests.helpers.common import tiny_sets
from tests.helpers.distributed import run_ranks

RTOL = 1e-5
BASE = {
    "model.hidden_dropout": 0.0,
    "optimizer.adam_eps": 1e-4,  # see tests/distributed/test_parallel_training.py: keeps Adam's update smooth
    "train.global_batch_size": 4,
    "train.micro_batch_size": 2,
    "train.train_iters": 3,
}
COMPILE = {"train.compile": "true"}


def _sets(tmp_path, data, name, **extra) -> list[str]:
    return tiny_sets(
        tmp_path / name, data, **{**BASE, "checkpoint.save": f"'{tmp_path / name / 'ckpt'}'", **extra}
    )


def _run(tmp_path, data, name, **extra):
    trainer = Trainer(load_config(None, _sets(tmp_path, data, name, **extra)))
    losses = trainer.train()
    return trainer, losses, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def _checkpoint_weights(ckpt_dir, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weights of a checkpoint in their global layout, keyed as `like`."""
    out = {k: torch.empty_like(v) for k, v in like.items()}
    load_checkpoint(ckpt_dir, {"model": [ShardedTensor.full(k, v) for k, v in out.items()]})
    return out


def _assert_same(losses, state, ref_losses, ref_state):
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=0)
    assert list(state) == list(ref_state)  # same parameter names: checkpoints are unaffected
    for k, v in ref_state.items():
        torch.testing.assert_close(
            state[k], v, rtol=RTOL, atol=RTOL * v.abs().max().item(), msg=lambda m, k=k: f"{k}: {m}"
        )


@pytest.fixture(scope="module")
def eager(tmp_path_factory, tiny_data):
    """One eager process's losses and final weights."""
    _, losses, state = _run(tmp_path_factory.mktemp("eager"), tiny_data, "one")
    return losses, state


@pytest.mark.parametrize("extra", [{}, {"model.recompute": "full"}], ids=["plain", "recompute-full"])
def test_compiled_layers_train_as_eager(tmp_path, tiny_data, eager, extra):
    counters.clear()
    trainer, losses, state = _run(tmp_path, tiny_data, "compiled", **COMPILE, **extra)
    assert all(layer._compiled_call_impl is not None for layer in trainer.model.layers.values())
    # the layers really ran compiled: one graph shared by both layers, nothing left eager
    assert counters["stats"]["unique_graphs"] >= 1
    assert not counters["graph_break"], dict(counters["graph_break"])
    _assert_same(losses, state, *eager)


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs triton under its interpreter (TRITON_INTERPRET=1, set by conftest without a GPU)",
)
def test_compiled_layers_with_triton_kernels_train_as_eager(tmp_path, tiny_data, eager):
    """model.kernels=triton: the kernels' autograd Functions inside compiled layers (under the
    interpreter their launches stay out of the graphs)."""
    _, losses, state = _run(tmp_path, tiny_data, "triton", **COMPILE, **{"model.kernels": "triton"})
    _assert_same(losses, state, *eager)


def test_forward_pre_hook_runs_on_every_call_of_a_compiled_layer():
    """A forward pre-hook (e.g. waiting for a parameter all-gather) runs on each call, whether
    registered before the first compiled call or after it (forward only: the hook runs in it)."""
    cfg = load_config(
        overrides=[
            "preset=tiny-llama",
            "model.num_layers=2",
            "model.hidden_size=64",
            "model.ffn_hidden_size=128",
            "model.vocab_size=512",
        ]
    ).model
    model = build_model(cfg).train()
    compile_layers(model)
    calls = {"before": 0, "after": 0}

    def hook(name):
        def count(module, args):
            calls[name] += 1

        return count

    model.layers["0"].register_forward_pre_hook(hook("before"))
    x = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(x)
        model.layers["0"].register_forward_pre_hook(hook("after"))
        for _ in range(2):
            model(x)
    assert calls == {"before": 3, "after": 2}


def _train_rank(rank, world, sets):
    return Trainer(load_config(None, sets)).train()


# dp 2 with the distributed optimizer: its parameter all-gathers are waited for in forward
# pre-hooks on the compiled layers (left out of the graphs)
@pytest.mark.parametrize(
    "parallel", [{"parallel.tp": 2}, {"parallel.distributed_optimizer": "true"}], ids=["tp2", "dp2-distopt"]
)
def test_compiled_mesh_matches_one_eager_process(tmp_path, tiny_data, eager, parallel):
    sets = _sets(tmp_path, tiny_data, "mesh", **COMPILE, **parallel)
    per_rank = run_ranks(2, _train_rank, sets)
    assert per_rank[0] == per_rank[1]
    ref_losses, ref_state = eager
    _assert_same(
        per_rank[0], _checkpoint_weights(tmp_path / "mesh" / "ckpt", ref_state), ref_losses, ref_state
    )
