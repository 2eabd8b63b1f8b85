"""`mlm parity --against megatron`: the same run in mlm (tp1, and tp2) and in megatron-core 0.16.1's
own GPTModel, DDP, Adam and OptimizerParamScheduler (`mlm.train.parity.megatron`, one process on CPU
with the patches of `mlm.train.parity.megatron_cpu`), from one seed checkpoint on the same batches.
Skipped where megatron-core is not installed.

Tolerance: the fp32 row of `mlm.train.parity.TOLERANCES` (|Δloss|/loss ≤ 1e-5, |Δ‖g‖|/‖g‖ ≤ 1e-3,
lr to 1e-12, eval loss to 1e-6, weights to 1e-3); measured on this tiny model over 3 steps: losses
1.5e-7, gradient norms 9.2e-8, eval loss 9.2e-8, weights 3.1e-7. About 17 s a test on 2 cores (2
torchrun launches, the export and the import)."""

import json

import pytest
from typer.testing import CliRunner

from cli.main import app
from mlm.train.parity import TOLERANCES
from tests.helpers.common import tiny_sets
from tests.helpers.megatron_helpers import megatron  # noqa: F401 (the fixture)


@pytest.mark.usefixtures("megatron")
def test_megatron_core_trains_the_run_as_mlm_does(tmp_path, tiny_data):
    out = tmp_path / "parity"
    sets = tiny_sets(tmp_path / "unused", tiny_data, **{"model.hidden_dropout": 0.0, "train.device": "cpu"})
    args = [a for s in sets for a in ("--set", s)]
    r = CliRunner().invoke(app, ["parity", *args, "--against", "megatron", "--steps", "3", "--out", str(out)])
    assert r.exit_code == 0, r.output + repr(r.exception)
    report = json.loads((out / "parity.json").read_text())
    tp1, theirs = report["layouts"]
    assert report["passed"] and theirs["name"] == "megatron" and theirs["world_size"] == 1
    assert theirs["lrs"] == tp1["lrs"] and tp1["lrs"][0] == 0.0  # Megatron's first step at lr_warmup_init
    assert 0 < theirs["max_loss_rel"] <= TOLERANCES["fp32"].loss_rel  # two programs: not bitwise
    assert theirs["max_grad_rel"] <= TOLERANCES["fp32"].grad_rel and theirs["eval_rel"] <= 1e-6
    assert theirs["max_weight_rel"] <= TOLERANCES["fp32"].weight_rel
    steps = json.loads((out / "megatron" / "steps.json").read_text())
    assert steps["loss"] == theirs["losses"] and steps["grad_norm"] == theirs["grad_norms"]
    # Megatron-LM's own save of the final weights, and the seed as it loaded it
    assert (out / "megatron" / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "3"
    assert (out / "megatron" / "seed" / "iter_0000000" / "common.pt").is_file()
    text = " ".join(r.output.split())
    assert "mlm parity 1 layout and megatron-core × 3 steps, fp32, reference tp1" in text
    assert (
        'optimizer.warmup_offset=0, optimizer.weight_decay_exempt="1d", model.train_padded_vocab=true' in text
    )
    assert "megatron: 3 steps in" in text and "│ megatron │ 1 │" in text and "PASS; details in" in text


@pytest.mark.usefixtures("megatron")
def test_a_moe_model_trains_as_in_megatron_core(tmp_path, tiny_data):
    """The tiny MoE of tests/distributed/test_moe_parallel.py (4 layers, the first dense, 4 experts, top-2, a
    gated shared expert, aux, sequence-aux and z losses) against megatron-core's MoE layers: its
    router, token dispatcher and auxiliary losses, scaled by its own schedule. Measured over 5 steps
    on the tiny pipeline's data: losses 1.2e-7, gradient norms 4.3e-7, weights 1.6e-6."""
    from tests.helpers.parallel import MOE

    out = tmp_path / "parity"
    extra = {**MOE, "model.hidden_dropout": 0.0, "train.device": "cpu"}
    args = [a for s in tiny_sets(tmp_path / "unused", tiny_data, **extra) for a in ("--set", s)]
    r = CliRunner().invoke(app, ["parity", *args, "--against", "megatron", "--steps", "2", "--out", str(out)])
    assert r.exit_code == 0, r.output + repr(r.exception)
    report = json.loads((out / "parity.json").read_text())
    tp1, theirs = report["layouts"]
    assert report["passed"] and theirs["lrs"] == tp1["lrs"]
    assert any(k.startswith("layers.1.mlp.experts") for k in theirs["weight_rel"])  # the experts compared
