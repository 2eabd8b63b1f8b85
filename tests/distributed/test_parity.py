"""`mlm parity`: layout parsing, the comparison and its verdict, and a real run of tp1, tp2, pp2
and dp2 from one seed checkpoint (4 torchrun launches, ~10 s each on 2 cores; the README shows
four layouts up to 4 ranks), of FSDP and HSDP layouts, and of a tiny MoE at ep2 and ep2 with FSDP
against tp1.

The real run is fp32 without dropout, so every layout must pass the fp32 tolerance, the eval loss
after the last step included; a failing comparison is tested on numbers made to differ (one loss
1% off, an eval loss 1e-5 off, one weight tensor moved).
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from typer.testing import CliRunner

from cli.main import app
from mlm.config import load_config
from mlm.errors import MlmError
from mlm.layout import Layout
from mlm.train import parity
from mlm.train.parity import TOLERANCES, Measured, ParityResult, compare, parse_layouts, resolve, runner
from tests.helpers.common import tiny_sets


def _layout(text: str) -> Layout:
    """One `--layouts` entry as parity reads it."""
    [lay] = parse_layouts(text)
    return lay


def test_layouts_parse_to_the_parallel_config():
    lay = _layout("tp2pp2vpp2dp2sp")
    assert (lay.tp, lay.pp, lay.vpp, lay.dp, lay.sequence_parallel) == (2, 2, 2, 2, True)
    assert runner.world(lay) == 8
    assert lay.distributed_optimizer is None  # not given: the config's
    cfg = load_config(None, lay.overrides()).parallel
    assert (cfg.tp, cfg.pp, cfg.vpp, cfg.sequence_parallel, cfg.distributed_optimizer) == (
        2,
        2,
        2,
        True,
        False,
    )
    assert _layout("dp2zero1") == Layout.parse("zero1dp2") and _layout("dp2zero1").distributed_optimizer
    assert _layout("pp2").pp == 2 and _layout("vpp2").vpp == 2  # vpp without pp: the config says no
    assert [str(lay) for lay in parse_layouts("tp1,tp2, dp2")] == ["tp1", "tp2", "dp2"]
    assert runner.world(_layout("tp1")) == 1  # every size 1: one process
    # ep folds over the stage's dp × tp ranks: without dp<N>, the fewest it folds over
    assert (_layout("ep2").ep, runner.world(_layout("ep2"))) == (2, 2)
    assert runner.world(_layout("tp2spep2")) == 2  # ep over the tp ranks
    assert (runner.world(_layout("tp2ep4")), runner.world(_layout("ep2dp4"))) == (4, 4)
    assert load_config(None, _layout("ep2").overrides()).parallel.ep == 2
    # cp adds ranks; p2p / ag choose its attention, no term leaves the config's
    assert runner.world(_layout("cp2")) == 2 and runner.world(_layout("tp2cp2sp")) == 4
    assert _layout("cp2").cp_comm_type is None and _layout("cp2ag").cp_comm_type == "all_gather"
    assert _layout("cp2p2p").cp_comm_type == "p2p" and _layout("cp2pp2p2p").pp == 2
    assert runner.world(_layout("cp2ep2")) == 2  # ep folds over the cp ranks
    assert (_layout("ep4cp2").dp, runner.world(_layout("ep4cp2"))) == (None, 4)
    cfg = load_config(None, _layout("cp2ag").overrides()).parallel
    assert (cfg.cp, cfg.cp_comm_type) == (2, "all_gather")
    cfg = load_config(None, [*_layout("cp2").overrides(), 'parallel.cp_comm_type="all_gather"'])
    assert cfg.parallel.cp_comm_type == "all_gather"
    # the micro-batch and recompute terms set the config's too
    cfg = load_config(None, _layout("tp2mb1rcfull").overrides())
    assert (cfg.train.micro_batch_size, cfg.model.recompute) == (1, "full")


@pytest.mark.parametrize(
    "text,message",
    [
        (
            "tp2x",
            "layout 'tp2x': unknown term 'x'; use tp<N>, pp<N>, vpp<N>, dp<N>, cp<N>, ep<N>, sp, zero1, fsdp, hsdp<N>",
        ),
        ("ag", "layout 'ag': ag chooses context parallelism's attention (parallel.cp_comm_type) and needs"),
        ("tp2p2p", "needs cp<N> with N ≥ 2, e.g. cp2p2p"),
        ("cp2agp2p", "layout 'cp2agp2p': p2p and ag both choose parallel.cp_comm_type; give one"),
        ("ep", "layout 'ep': 'ep' needs a size of at least 1, e.g. ep2"),
        ("tp2foodp2", "unknown term 'foo'"),
        ("tp", "layout 'tp': 'tp' needs a size of at least 1, e.g. tp2"),
        ("dp0", "'dp0' needs a size of at least 1"),
        ("tp2tp4", "layout 'tp2tp4': tp is given twice"),
        ("spsp", "sp is given twice"),
        ("tp1,,tp2", "empty layout in --layouts"),
        ("tp1,tp2,tp1", "--layouts lists tp1 more than once"),
    ],
)
def test_bad_layouts_are_named(text, message):
    with pytest.raises(MlmError) as e:
        parse_layouts(text)
    assert message in str(e.value)


ONE, TP2, DP2 = (Layout.parse(t).with_world(w) for t, w in (("tp1", 1), ("tp2", 2), ("dp2", 2)))


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(8, 4, generator=g),
        "layers.0.mlp.up.weight": torch.randn(4, 4, generator=g),
    }


def test_a_loss_one_percent_off_fails_and_the_report_says_where(capsys):
    tol = TOLERANCES["fp32"]
    ref = Measured([8.0, 7.5, 7.0], 6.5, _weights(0))
    same = compare("tp1", ONE, ref, ref, tol)
    near = compare("tp2", TP2, Measured([8.0, 7.5 * (1 + 1e-7), 7.0], 6.5, _weights(0)), ref, tol)
    off = compare("dp2", DP2, Measured([8.0, 7.5 * 1.01, 7.0], 6.5, _weights(0)), ref, tol)
    assert same.passed and near.passed and not off.passed
    assert off.max_loss_rel == pytest.approx(0.01) and off.worst_step == 2 and off.eval_rel == 0.0
    result = ParityResult("fp32", tol, 3, [same, near, off])
    assert not result.passed
    parity.render(result)
    out = " ".join(capsys.readouterr().out.split())
    assert "FAIL: dp2" in out and "1.00e-02" in out and "tolerance for fp32: |Δloss|/loss ≤ 1e-05" in out
    assert "│ eval │ 6.500000 │ 0.0e+00 │ 0.0e+00 │" in out


def test_an_eval_loss_off_fails_where_the_training_losses_agree(capsys):
    tol = TOLERANCES["fp32"]
    assert tol.eval_rel == 1e-6
    ref = Measured([8.0, 7.5], 6.5, _weights(0))
    near = compare("tp2", TP2, Measured([8.0, 7.5], 6.5 * (1 + 5e-7), _weights(0)), ref, tol)
    off = compare("dp2", DP2, Measured([8.0, 7.5], 6.5 * (1 + 1e-5), _weights(0)), ref, tol)
    assert near.passed and not off.passed and off.max_loss_rel == 0.0
    assert off.eval_rel == pytest.approx(1e-5) and off.to_json()["eval_loss"] == pytest.approx(6.500065)
    parity.render(ParityResult("fp32", tol, 2, [compare("tp1", ONE, ref, ref, tol), near, off]))
    out = " ".join(capsys.readouterr().out.split())
    assert "|Δeval|/eval" in out and "1.00e-05" in out and "FAIL: dp2;" in out
    assert "|Δeval|/eval ≤ 1e-06 after the last" in out
    # without a validation split neither side has an eval loss: nothing to compare, "-" in the table
    bare = Measured([8.0, 7.5], None, _weights(0))
    r = compare("tp2", TP2, bare, bare, tol)
    assert r.passed and r.eval_rel is None
    with pytest.raises(MlmError, match="logged no eval loss, the reference one"):
        compare("tp2", TP2, bare, ref, tol)


def test_the_command_exits_1_when_a_layout_fails(monkeypatch):
    tol, w = TOLERANCES["fp32"], _weights(0)
    ref = Measured([8.0], 7.9, w)
    results = [
        compare("tp1", ONE, ref, ref, tol),
        compare("tp2", TP2, Measured([8.1], 7.9, w), ref, tol),
    ]
    monkeypatch.setattr(parity, "run_parity", lambda *a: ParityResult("fp32", tol, 1, results, out="x"))
    r = CliRunner().invoke(app, ["parity", "--layouts", "tp1,tp2", "--steps", "1"])
    assert r.exit_code == 1 and "FAIL: tp2" in r.output


def test_a_weight_tensor_off_fails_and_is_named():
    tol = TOLERANCES["fp32"]
    ref_w = _weights(0)
    moved = {**ref_w, "layers.0.mlp.up.weight": ref_w["layers.0.mlp.up.weight"] * (1 + 1e-3)}
    ref = Measured([8.0], 7.9, ref_w)
    r = compare("tp2", TP2, Measured([8.0], 7.9, moved), ref, tol)
    assert not r.passed and r.worst_tensor == "layers.0.mlp.up.weight"
    assert r.max_weight_rel == pytest.approx(1e-3, rel=1e-4) and r.weight_rel["embed.weight"] == 0.0
    with pytest.raises(MlmError, match="logged 2 steps, the reference 1"):
        compare("tp2", TP2, Measured([8.0, 7.0], 7.9, ref_w), ref, tol)


def test_a_gradient_norm_or_learning_rate_off_fails(capsys):
    tol, w = TOLERANCES["fp32"], _weights(0)
    ref = Measured([8.0, 7.5], 7.0, w, lrs=[0.0, 1e-3], grad_norms=[2.0, 1.5])
    near = compare(
        "tp2", TP2, Measured([8.0, 7.5], 7.0, w, [0.0, 1e-3 * (1 + 1e-13)], [2.0, 1.5 * 1.00001]), ref, tol
    )
    grad = compare("dp2", DP2, Measured([8.0, 7.5], 7.0, w, [0.0, 1e-3], [2.0, 1.5 * 1.01]), ref, tol)
    lr = compare("megatron", ONE, Measured([8.0, 7.5], 7.0, w, [0.0, 1.01e-3], [2.0, 1.5]), ref, tol)
    assert near.passed and not grad.passed and not lr.passed and grad.max_loss_rel == lr.max_loss_rel == 0.0
    assert grad.max_grad_rel == pytest.approx(0.01) and lr.max_lr_rel == pytest.approx(0.01)
    assert lr.to_json()["lrs"] == [0.0, 1.01e-3] and grad.to_json()["grad_rel"][0] == 0.0
    parity.render(ParityResult("fp32", tol, 2, [compare("tp1", ONE, ref, ref, tol), near, grad, lr]))
    out = " ".join(capsys.readouterr().out.split())
    assert "FAIL: dp2, megatron;" in out and "|Δ‖g‖|/‖g‖ ≤ 1e-03 at every step, |Δlr|/lr ≤ 1e-12" in out
    assert "│ 2 │ 1.0000e-03 │ 1.5000 │ 7.500000 │" in out  # the reference's lr, gradient norm and loss


def test_against_megatron_names_what_it_cannot_compare(tmp_path, tiny_data, monkeypatch):
    from mlm.train.parity import megatron

    monkeypatch.setattr(megatron, "available", lambda: True)
    sets = run_sets(tmp_path, tiny_data, **{"train.precision": "bf16", "model.activation": "gelu_tanh"})
    with pytest.raises(MlmError) as e:
        parity.run_parity(None, sets, parse_layouts("tp1"), 2, tmp_path / "out", "megatron")
    assert str(e.value).startswith("--against megatron cannot compare this run: model.activation=gelu_tanh")
    assert "train.precision=bf16: the reference trains in fp32 only" in str(e.value)
    with pytest.raises(MlmError, match="--against 'titan': the one reference framework is megatron"):
        parity.run_parity(None, sets, parse_layouts("tp1"), 2, tmp_path / "out", "titan")
    monkeypatch.setattr(megatron, "available", lambda: False)
    with pytest.raises(MlmError, match="needs megatron-core, which is not installed here; pip install"):
        parity.run_parity(
            None, run_sets(tmp_path, tiny_data), parse_layouts("tp1"), 2, tmp_path / "out", "megatron"
        )
    assert not (tmp_path / "out").exists()
    r = CliRunner().invoke(app, ["parity", "--steps", "1"])
    assert r.exit_code == 1 and "give --layouts (e.g. --layouts tp1,tp2,dp2), --against megatron" in str(
        r.exception
    )


def run_sets(tmp_path, data, **extra) -> list[str]:
    return tiny_sets(
        tmp_path / "unused", data, **{"model.hidden_dropout": 0.0, "train.device": "cpu", **extra}
    )


def _args(sets: list[str]) -> list[str]:
    return [a for s in sets for a in ("--set", s)]


def test_tp_pp_and_dp_layouts_match_one_process(tmp_path, tiny_data):
    out = tmp_path / "parity"
    args = ["parity", *_args(run_sets(tmp_path, tiny_data)), "--layouts", "tp1,tp2,pp2,dp2", "--steps", "2"]
    r = CliRunner().invoke(app, [*args, "--out", str(out)])
    assert r.exit_code == 0, r.output + repr(r.exception)
    report = json.loads((out / "parity.json").read_text())
    assert report["passed"] and report["precision"] == "fp32" and report["reference"] == "tp1"
    assert report["tolerance"]["loss_rel"] == TOLERANCES["fp32"].loss_rel
    assert [x["name"] for x in report["layouts"]] == ["tp1", "tp2", "pp2", "dp2"]
    assert [x["world_size"] for x in report["layouts"]] == [1, 2, 2, 2]
    assert report["tolerance"]["eval_rel"] == TOLERANCES["fp32"].eval_rel == 1e-6
    for x in report["layouts"]:
        assert len(x["losses"]) == 2 and x["passed"], x
        records = [json.loads(line) for line in open(out / x["name"] / "run" / "metrics.jsonl")]
        assert [rec["loss"] for rec in records if rec["split"] == "train"] == x["losses"]
        # one evaluation, after the last step, over the same global batches on every layout
        assert [(rec["step"], rec["loss"]) for rec in records if rec["split"] == "valid"] == [
            (2, x["eval_loss"])
        ]
        assert x["eval_rel"] <= TOLERANCES["fp32"].eval_rel
        assert x["max_weight_rel"] <= TOLERANCES["fp32"].weight_rel
    assert report["layouts"][0]["max_weight_rel"] == report["layouts"][0]["eval_rel"] == 0.0  # ref vs itself
    assert (out / "seed" / "iter_0000000" / "manifest.json").is_file()
    text = " ".join(r.output.split())
    assert "mlm parity: 2 steps, fp32, against tp1" in text and "PASS; details in" in text
    assert "tp1: 2 steps in" in text and ", reference" in text and ", PASS pp2: 2 steps in" in text
    assert f"eval loss {report['layouts'][0]['eval_loss']:.6f}, reference" in text
    assert "│ eval │" in text and "|Δeval|/eval ≤ 1e-06 after the last" in text
    assert "warning" not in text
    # the same OUT again: refused, nothing touched
    again = CliRunner().invoke(app, [*args, "--out", str(out)])
    assert again.exit_code == 1 and "already exists and is not empty; pass a new --out" in str(
        again.exception
    )


def test_fsdp_layouts_match_one_process(tmp_path, tiny_data):
    """FSDP (`fsdp`) under interleaved pipeline parallelism, and HSDP (`hsdp<N>`), as parity layouts
    (tp 2 with sequence parallelism: tests/distributed/test_fsdp.py)."""
    out = tmp_path / "parity"
    sets = run_sets(tmp_path, tiny_data, **{"train.global_batch_size": 8, "model.num_layers": 4})
    layouts = "tp1,pp2vpp2dp2fsdp,dp4hsdp2"
    r = CliRunner().invoke(
        app, ["parity", *_args(sets), "--layouts", layouts, "--steps", "2", "--out", str(out)]
    )
    assert r.exit_code == 0, r.output + repr(r.exception)
    report = json.loads((out / "parity.json").read_text())
    assert report["passed"] and [x["name"] for x in report["layouts"]] == layouts.split(",")
    for x in report["layouts"][1:]:
        run = load_config(out / x["name"] / "run" / "config.toml", [])
        assert run.parallel.fsdp and run.parallel.fsdp_shard_size == (2 if "hsdp" in x["name"] else None)
        assert x["max_weight_rel"] <= TOLERANCES["fp32"].weight_rel


@pytest.mark.parametrize(
    "layouts,message",
    [
        ("tp1,vpp2", "layout 'vpp2': parallel.vpp=2 needs pipeline parallelism"),
        ("tp1,dp4", "layout 'dp4': train.global_batch_size=4 is not divisible by"),
        (
            "tp1,tp2",  # vocab 1100: 1152 rows at tp1, 1280 at tp2; with 64, 1152 at both
            "layout 'tp2': the vocabulary pads to 1280 rows at tp=2 but to 1152 in the one-process seed "
            "checkpoint, so the seed cannot load; use --set model.make_vocab_size_divisible_by=64",
        ),
    ],
)
def test_a_layout_that_cannot_run_is_refused_before_anything_runs(tmp_path, tiny_data, layouts, message):
    sets = run_sets(tmp_path, tiny_data, **{"model.vocab_size": 1100})
    with pytest.raises(MlmError) as e:
        parity.run_parity(None, sets, parse_layouts(layouts), 2, tmp_path / "out")
    assert message in str(e.value)
    assert not (tmp_path / "out").exists()


def test_a_moe_model_at_ep2_matches_one_process(tmp_path, tiny_data):
    from tests.helpers.parallel import MOE

    out = tmp_path / "parity"
    sets = run_sets(tmp_path, tiny_data, **MOE)
    r = CliRunner().invoke(
        app, ["parity", *_args(sets), "--layouts", "tp1,ep2,ep2fsdp", "--steps", "2", "--out", str(out)]
    )
    assert r.exit_code == 0, r.output + repr(r.exception)
    report = json.loads((out / "parity.json").read_text())
    assert report["passed"] and [(x["name"], x["ep"], x["dp"]) for x in report["layouts"]] == [
        ("tp1", 1, 1),
        ("ep2", 2, 2),
        ("ep2fsdp", 2, 2),  # the dense weights sharded over dp 2; the experts whole (edp 1)
    ]
    ep2 = report["layouts"][1]
    assert "layers.1.mlp.experts.up.weight" in ep2["weight_rel"]  # experts compared on their global axis
    assert (
        ep2["max_loss_rel"] <= TOLERANCES["fp32"].loss_rel and ep2["eval_rel"] <= TOLERANCES["fp32"].eval_rel
    )


def test_cp2_of_either_attention_matches_one_process(tmp_path, tiny_data):
    """cp 2 (the config's p2p, and all_gather with FSDP over the cp ranks) against one process, with Adam's eps at 1e-4 (as
    test_parallel_training compares): at the default 1e-8 Adam turns the rounding of near-zero
    gradient elements into lr-sized steps, which under cp grows fast at this lr of 1e-2 (measured
    over 5 steps: |Δloss|/loss 9.5e-7, 3.4e-5, 2.2e-4 at steps 3–5 for either cp attention, 2.2e-6
    for tp2; the eval loss after step 2 already 1.4e-6, over the 1e-6 tolerance). At eps 1e-4 cp2
    agrees to 8e-8 in the losses and 3.9e-7 in the weights over 5 steps, as tp2 does."""
    out = tmp_path / "parity"
    sets = run_sets(tmp_path, tiny_data, **{"optimizer.adam_eps": 1e-4})
    r = CliRunner().invoke(
        app, ["parity", *_args(sets), "--layouts", "tp1,cp2,cp2agfsdp", "--steps", "2", "--out", str(out)]
    )
    assert r.exit_code == 0, r.output + repr(r.exception)
    report = json.loads((out / "parity.json").read_text())
    got = [(x["name"], x["world_size"], x["cp"], x["cp_comm_type"]) for x in report["layouts"]]
    # no term: the config's attention (p2p by default), named in the report
    assert report["passed"] and got == [
        ("tp1", 1, 1, "p2p"),
        ("cp2", 2, 2, "p2p"),
        ("cp2agfsdp", 2, 2, "all_gather"),  # and FSDP over the cp ranks
    ]
    for x in report["layouts"][1:]:
        assert (
            x["max_loss_rel"] <= TOLERANCES["fp32"].loss_rel and x["eval_rel"] <= TOLERANCES["fp32"].eval_rel
        )


@pytest.mark.parametrize(
    "sets,layouts,message",
    [
        (
            {"data.seq_length": 30},
            "tp1,cp2",
            "layout 'cp2': data.seq_length=30 is not divisible by 2 × parallel.cp = 4",
        ),
        (
            {"model.attention_dropout": 0.1},
            "tp1,cp2",
            "layout 'cp2': model.attention_dropout=0.1 with parallel.cp=2: attention dropout is not built",
        ),
    ],
)
def test_a_context_parallel_layout_that_cannot_run_is_refused(tmp_path, tiny_data, sets, layouts, message):
    with pytest.raises(MlmError) as e:
        parity.run_parity(
            None, run_sets(tmp_path, tiny_data, **sets), parse_layouts(layouts), 2, tmp_path / "out"
        )
    assert message in str(e.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "moe,layouts,message",
    [
        (
            None,
            "tp1,ep2",
            "layout 'ep2': parallel.ep=2: the model has no MoE layers (its MLPs: dense)",
        ),
        (
            {"model.moe.num_experts": 3},
            "tp1,ep2",
            "layout 'ep2': model.moe.num_experts=3 is not divisible by parallel.ep=2",
        ),
        ({}, "tp1,tp2ep2", "layout 'tp2ep2': parallel.ep=2 with tp=2: the tp ranks are expert-parallel"),
        ({}, "tp1,ep2dp3", "layout 'dp3ep2': ep(2) must divide dp(3) × cp(1) × tp(1) = 3"),
    ],
)
def test_an_expert_parallel_layout_that_cannot_run_is_refused(tmp_path, tiny_data, moe, layouts, message):
    from tests.helpers.parallel import MOE

    sets = run_sets(tmp_path, tiny_data, **({} if moe is None else {**MOE, **moe}))
    with pytest.raises(MlmError) as e:
        parity.run_parity(None, sets, parse_layouts(layouts), 2, tmp_path / "out")
    assert message in str(e.value)
    assert not (tmp_path / "out").exists()


def test_a_failing_layout_reports_its_output_tail(tmp_path, tiny_data, monkeypatch):
    def failing(*args):
        return [
            sys.executable,
            "-c",
            "import sys; print('error: rank 1 is unwell', file=sys.stderr); sys.exit(5)",
        ]

    monkeypatch.setattr(runner, "train_command", failing)
    with pytest.raises(MlmError) as e:
        parity.run_parity(None, run_sets(tmp_path, tiny_data), parse_layouts("tp1,tp2"), 2, tmp_path / "out")
    assert "layout 'tp1': `mlm train` under torchrun exited with code 5" in str(e.value)
    assert "error: rank 1 is unwell" in str(e.value)
    assert not (tmp_path / "out" / "parity.json").exists()


def test_dropout_is_warned_about(tmp_path, tiny_data):
    cfg = load_config(None, run_sets(tmp_path, tiny_data, **{"model.attention_dropout": 0.1}))
    (warning,) = runner._warnings(cfg)
    assert warning.startswith("model.attention_dropout=0.1: each layout draws its own dropout masks")


def test_one_evaluation_after_the_last_step_where_there_is_a_validation_split(tmp_path, tiny_data):
    cfg = resolve(None, run_sets(tmp_path, tiny_data, **{"train.eval_interval": 1}), 3, tmp_path)
    assert (cfg.train.eval_interval, cfg.train.eval_iters) == (3, 3)  # eval_iters 4 capped at K
    cfg = resolve(None, run_sets(tmp_path, tiny_data, **{"train.eval_iters": 2}), 3, tmp_path)
    assert (cfg.train.eval_interval, cfg.train.eval_iters) == (3, 2)
    assert runner._warnings(cfg) == []
    cfg = resolve(None, run_sets(tmp_path, tiny_data, **{"data.split": "'100,0,0'"}), 3, tmp_path)
    assert cfg.train.eval_interval == 0
    (warning,) = runner._warnings(cfg)
    assert warning.startswith("data.split='100,0,0' has no validation share, so no eval loss is compared")


def test_hybrid_layouts_match_one_process(tmp_path, tiny_data):
    """A hybrid of Mamba-2, Gated DeltaNet and attention layers under tp 2 with sequence
    parallelism and FSDP over dp 2, as parity layouts."""
    out = tmp_path / "parity"
    hybrid = {
        "model.num_layers": 4,
        "model.layer_pattern": "'M-*-G-M-'",
        "model.mamba.head_dim": 8,
        "model.mamba.state_dim": 16,
        "model.mamba.num_groups": 2,
        "model.mamba.chunk_size": 16,
        "model.gdn.num_key_heads": 2,
        "model.gdn.num_value_heads": 4,
        "model.gdn.key_head_dim": 8,
        "model.gdn.value_head_dim": 8,
        "model.gdn.chunk_size": 16,
        "data.reset_attention_mask": "true",
    }
    sets = run_sets(tmp_path, tiny_data, **hybrid)
    layouts = "tp1,tp2sp,dp2fsdp"  # pp 2: tests/unit/test_mamba.py, tests/unit/test_gdn.py
    r = CliRunner().invoke(
        app, ["parity", *_args(sets), "--layouts", layouts, "--steps", "2", "--out", str(out)]
    )
    assert r.exit_code == 0, r.output + repr(r.exception)
    report = json.loads((out / "parity.json").read_text())
    assert report["passed"] and [x["name"] for x in report["layouts"]] == layouts.split(",")
    assert "layers.2.attn.in_v.weight" in report["layouts"][1]["weight_rel"]  # the gdn layer, compared whole
