"""Layer specs and module kinds: a new MLP kind defined in this file only (squared ReLU, with an
auxiliary loss: its module and its spec), selected for some layers by config, trains at tp 2 and
pp 2 as one process does — with no edit to `mlm.parallel` — and the config fields that choose
kinds per layer.

Every rank is a real gloo process; the kind registers itself when this module is imported, which
each rank does to find `train_rank`. Tolerance: fp32, 1e-5 relative on losses and final weights
(as tests/distributed/test_parallel_training.py: reductions sum in another order).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mlm.config import ModelConfig, describe_layers, load_config
from mlm.errors import MlmError
from mlm.model import build_model
from mlm.model.kinds import register
from mlm.model.kinds.dense.spec import mlp_params
from mlm.model.kinds.spec import Flops, MLPSpec, PartWork
from mlm.model.layers import TP_INPUT
from mlm.train.trainer import Trainer
from tests.helpers.distributed import run_ranks
from tests.helpers.parallel import RTOL, assert_matches, reference_run, run_sets, train_rank

AUX_COEF = 1e-3


class SquaredReLU(nn.Module):
    """down(relu(up x)²) (Primer, Nemotron) plus an auxiliary loss AUX_COEF · mean(h²) on its
    hidden activations, which reaches the total loss through `aux_losses` on any stage."""

    tp_plan = {TP_INPUT: "enter", "up": "column", "down": "row"}
    residual_projections = ("down",)

    def __init__(self, cfg: ModelConfig, layer: int = 0, ops=None):
        super().__init__()
        self.up = nn.Linear(cfg.hidden_size, cfg.ffn_size, bias=False)
        self.down = nn.Linear(cfg.ffn_size, cfg.hidden_size, bias=False)
        self.aux_losses = None  # the model's, set when GPT is built

    def forward(self, x_BTD):
        h_BTF = F.relu(self.up(x_BTD)).square()
        out = self.down(h_BTF)
        if self.training and self.aux_losses is not None:
            # on the output, which every tp rank holds whole (not under sequence parallelism,
            # where each rank's mean would cover its sequence shard only)
            out = self.aux_losses.attach(out, AUX_COEF * out.float().square().mean(), "sqrelu_test")
        return out


@register
class SquaredReLUSpec(MLPSpec):
    """What the rest of mlm asks of the kind: its parameters, FLOPs, saved bytes and work."""

    name, symbol, module = "sqrelu_test", "Q", SquaredReLU

    def params(self, m, prefix, tp, ep):
        return [p for p in mlp_params(m, prefix, m.ffn_size, tp) if ".gate." not in p.name]

    def flops(self, m):
        return Flops(tp=6 * 2 * m.hidden_size * m.ffn_size)

    def saved(self, m, mb):  # the input, up's output (relu's), the square's input and output
        return {"linear inputs": mb.e * m.hidden_size * mb.A, "mlp": 3 * mb.e * m.ffn_size / mb.tp * mb.A}

    def work(self, m, mb, sw, times):
        part = PartWork(gemms=2)
        part.work.add((4, 8, 2, 4), m.ffn_size / mb.tp, mb.e, mb.A, times.norm_act)
        return part


MIXED = {"model.num_layers": 4, "model.mlp_kind": "sqrelu_test", "model.mlp_kind_freq": "[0, 1, 0, 1]"}
MIXED_RUN = {**MIXED, "train.train_iters": 3}


def test_layer_specs_from_config_fields():
    base = dict(num_layers=6)
    assert {s.mlp for s in ModelConfig(**base).layer_specs()} == {"dense"}
    every_2nd = ModelConfig(**base, mlp_kind="sqrelu_test", mlp_kind_freq=2).layer_specs()
    assert [s.mlp for s in every_2nd] == ["sqrelu_test", "dense"] * 3  # Megatron: i % freq == 0
    first_k = ModelConfig(**base, mlp_kind="sqrelu_test", first_k_dense=2).layer_specs()
    assert [s.mlp for s in first_k] == ["dense"] * 2 + ["sqrelu_test"] * 4  # HF's first_k_dense_replace
    pattern = ModelConfig(**base, mlp_kind="sqrelu_test", mlp_kind_freq=[1, 0, 0, 0, 0, 1]).layer_specs()
    assert describe_layers(pattern) == (
        "0: gqa + sqrelu_test (rmsnorm); 1-4: gqa + dense (rmsnorm); 5: gqa + sqrelu_test (rmsnorm)"
    )
    with pytest.raises(MlmError, match=r"mlp_kind_freq=\[1, 0\]: a list needs one 0 or 1 per layer \(6"):
        ModelConfig(**base, mlp_kind_freq=[1, 0])
    with pytest.raises(MlmError, match="mlp_kind_freq=0: must be at least 1"):
        ModelConfig(**base, mlp_kind_freq=0)
    with pytest.raises(
        MlmError, match=r"model.mlp_kind='nope' is not a registered mlp kind; registered: .*dense"
    ):
        ModelConfig(**base, mlp_kind="nope")


def test_head_dim_is_settable():
    """kv_channels (HF's head_dim) apart from hidden / heads: the projections follow it."""
    cfg = ModelConfig(hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=32)
    model = build_model(cfg)
    attn = model.layers["0"].attn
    assert (attn.q.weight.shape, attn.k.weight.shape, attn.out.weight.shape) == (
        (128, 64),
        (64, 64),
        (64, 128),
    )
    assert model(torch.randint(0, 100, (2, 5))).shape == (2, 5, cfg.padded_vocab_size())
    with pytest.raises(MlmError, match="kv_channels=0: must be positive"):
        ModelConfig(kv_channels=0)


def test_config_show_prints_the_layers():
    out = subprocess.run(
        [sys.executable, "-m", "cli.main", "config", "show", "tiny-llama", "--set", "model.first_k_dense=4"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "# layers: 0-3: gqa + dense (rmsnorm)" in out
    assert "mlp_kind_freq = 1" in out and "first_k_dense = 4" in out


def test_aux_loss_reaches_the_gradients():
    """One process: the gradients of loss + Σ aux equal autograd's of the sum written out."""
    cfg = ModelConfig(num_layers=2, mlp_kind="sqrelu_test", vocab_size=100)
    tokens = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    grads = []
    for attach in (True, False):
        model = build_model(cfg, seed=3).train()
        if not attach:  # the same sum, by hand: the aux losses as plain terms of the loss
            terms = []
            for layer in model.layers.values():
                layer.mlp.aux_losses = None
                layer.mlp.register_forward_hook(
                    lambda m, i, out, terms=terms: terms.append(AUX_COEF * out.float().square().mean())
                )
        loss = model.head_loss(model.hidden_states(tokens[:, :-1]), tokens[:, 1:])
        total = loss if attach else loss + sum(terms)
        total.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert model.aux_losses.pop() == {}  # the by-hand run attached nothing
    for n, g in grads[1].items():
        torch.testing.assert_close(grads[0][n], g, rtol=1e-6, atol=1e-9, msg=n)
    assert grads[0]["layers.0.mlp.up.weight"].abs().sum() > 0


def _train_with_the_new_kind(rank, world, sets):
    """A rank's training; defined here so that the rank imports this module, registering the kind."""
    return train_rank(rank, world, sets)


def logged_aux(run_dir) -> list[float]:
    """The auxiliary loss of every logged training step, from RUN_DIR/metrics.jsonl."""
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    return [r["aux.sqrelu_test"] for r in records if r["split"] == "train"]


@pytest.fixture(scope="module")
def mixed_reference(tmp_path_factory, tiny_data):
    tmp = tmp_path_factory.mktemp("reference")
    return (*reference_run(tmp, tiny_data, **MIXED_RUN), logged_aux(tmp / "one"))


@pytest.mark.parametrize(
    "world,parallel",
    [(2, {"parallel.tp": 2}), (2, {"parallel.pp": 2})],
    ids=["tp2", "pp2"],
)
def test_new_mlp_kind_trains_in_parallel_as_one_process(
    tmp_path, tiny_data, mixed_reference, world, parallel
):
    """Layers 1 and 3 squared ReLU (with its auxiliary loss), 0 and 2 dense; 3 steps. The logged
    auxiliary loss (summed over pipeline stages) equals one process's too."""
    sets = run_sets(tmp_path, tiny_data, "mesh", **MIXED_RUN, **parallel)
    losses, weights, aux = mixed_reference
    assert_matches(tmp_path, run_ranks(world, _train_with_the_new_kind, sets), losses, weights)
    assert len(aux) == 3 and min(aux) > 0
    assert logged_aux(tmp_path / "mesh") == pytest.approx(aux, rel=RTOL)


def test_the_config_selects_the_new_kind(tmp_path, tiny_data):
    trainer = Trainer(load_config(None, run_sets(tmp_path, tiny_data, "one", **MIXED_RUN)))
    kinds = [type(layer.mlp).__name__ for layer in trainer.model.layers.values()]
    assert kinds == ["MLP", "SquaredReLU", "MLP", "SquaredReLU"]


def test_exports_refuse_kinds_their_formats_lack():
    from mlm.convert.hf import config_to_hf
    from mlm.convert.trtllm.config import architecture

    cfg = ModelConfig(num_layers=2, mlp_kind="sqrelu_test", mlp_kind_freq=[0, 1])
    with pytest.raises(MlmError, match=r"layer kinds \[\('gqa', 'dense'\), \('gqa', 'sqrelu_test'\)\]"):
        config_to_hf(cfg, "llama")
    with pytest.raises(MlmError, match="layer kinds .* have no TensorRT-LLM architecture"):
        architecture(cfg)
