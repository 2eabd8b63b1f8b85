"""Layer kinds and layer patterns: the registry finds every built-in kind by its folder, no code
outside the kinds (and the format converters) compares a kind name, and Megatron's hybrid layer
pattern reads every preset's layers back unchanged, with errors that name the layer and symbol."""

from __future__ import annotations

import ast

import pytest

from mlm.config import MLAConfig, ModelConfig, MoEConfig, load_config
from mlm.errors import MlmError
from mlm.model import kinds
from mlm.model.kinds.pattern import format_pattern, parse
from mlm.plan.memory import parameter_counts
from mlm.presets import PRESETS
from tests.helpers.common import ROOT

KINDS_HOME = ROOT / "mlm" / "model" / "kinds"
CONVERTERS = [ROOT / "mlm" / "convert"]
"""Format converters map foreign names to kinds and may name them."""


def _kind_names() -> set[str]:
    return {name for role in kinds.ROLES for name in kinds.registered(role)}


def kind_comparisons(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, text) of every comparison (==, !=, in, not in, is) against a string constant that is
    a kind name, in Python `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        for operand in [node.left, *node.comparators]:
            items = operand.elts if isinstance(operand, ast.Tuple | ast.List | ast.Set) else [operand]
            for item in items:
                if isinstance(item, ast.Constant) and item.value in names:
                    found.append((node.lineno, ast.unparse(node)))
    return found


def test_the_scanner_finds_a_kind_comparison():
    code = 'if spec.mlp == "moe" or kind in ("gqa", "x"):\n    pass\nif other == "mlp":\n    pass\n'
    assert [line for line, _ in kind_comparisons(code, {"moe", "gqa"})] == [1, 1]


def test_no_code_outside_the_kinds_compares_a_kind_name():
    names = _kind_names()
    assert {"gqa", "mla", "dense", "moe", "rmsnorm", "layernorm"} <= names
    offenders = []
    for folder in ("mlm", "cli", "kernels"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.is_relative_to(KINDS_HOME) or any(path.is_relative_to(c) for c in CONVERTERS):
                continue
            for line, text in kind_comparisons(path.read_text(), names):
                offenders.append(f"{path.relative_to(ROOT)}:{line}: {text}")
    assert not offenders, "kind names compared outside the kinds (ask the kind's spec):\n" + "\n".join(
        offenders
    )


def test_built_in_kinds_are_found_by_their_folders():
    """Every folder's spec is imported by the first lookup (no import list to keep), and the
    built-in kinds are the ones those folders register."""
    import sys

    home = "mlm.model.kinds."
    kinds.registered("mixer")
    folders = {p.parent.name for p in KINDS_HOME.glob("*/spec.py")}
    assert {f"{home}{f}.spec" for f in folders} <= sys.modules.keys()
    registered = {
        type(spec).__module__.removeprefix(home).split(".")[0]
        for role in kinds.ROLES
        for spec in kinds.registered(role).values()
        if type(spec).__module__.startswith(home)
    }
    assert {"gqa", "mla", "dense", "moe", "norms"} <= registered <= folders
    by_symbol = {s: spec.name for s, spec in kinds.symbols().items()}
    assert by_symbol.items() >= {"*": "gqa", "+": "mla", "-": "dense", "E": "moe"}.items()


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_is_its_pattern(preset):
    """A preset's layers printed as a pattern, read back with `model.layer_pattern` instead of
    the fields that chose them, are the same layers with the same parameters."""
    cfg = load_config(None, [f"preset={preset}"])
    m = cfg.model
    sets = [
        f"preset={preset}",
        f"model.layer_pattern='{m.pattern()}'",
        "model.attention_kind=gqa",
        "model.mlp_kind=dense",
        "model.mlp_kind_freq=1",
        "model.first_k_dense=0",
    ]
    again = load_config(None, sets)
    assert again.model.layer_specs() == m.layer_specs()
    assert parameter_counts(again) == parameter_counts(cfg)
    assert again.model.pattern() == m.pattern()


def test_pattern_pairs_a_mixer_with_the_mlp_after_it():
    layers, mtp = parse("*-*E+E/+E")
    assert layers == [("gqa", "dense"), ("gqa", "moe"), ("mla", "moe")] and mtp == 1
    layers, _ = parse("--*")  # MLP-only layers, a mixer-only layer
    assert layers == [(None, "dense"), (None, "dense"), ("gqa", None)]
    for text in ("*-*E", "--*", "*-**-", "+E/+E/+E"):
        assert format_pattern(*parse(text)) == text


def test_pattern_errors_name_the_layer_and_symbol():
    with pytest.raises(
        MlmError, match=r"symbol 'Z' at position 3 \(after layer 1\) is not a layer kind; the symbols are"
    ):
        parse("*-*Z")
    with pytest.raises(
        MlmError, match=r"'\|' \(Megatron's pipeline segments\) is not read; .*first_stage_layers"
    ):
        parse("*-|*-")
    with pytest.raises(
        MlmError, match=r"MTP depth '\*-' after '/' at position 5 must be one layer like the last"
    ):
        parse("*-*E/*-")
    with pytest.raises(MlmError, match=r"has 2 layers .* but model.num_layers=3; set model.num_layers=2"):
        ModelConfig(num_layers=3, layer_pattern="*-*-")
    with pytest.raises(MlmError, match=r"with model.mlp_kind='moe': the pattern gives every layer's kinds"):
        ModelConfig(num_layers=2, layer_pattern="*-*-", mlp_kind="moe")
    with pytest.raises(MlmError, match=r"has 1 MTP depths \('/'\) but model.mtp_num_layers=0"):
        ModelConfig(num_layers=1, layer_pattern="*-/*-")
    with pytest.raises(MlmError, match=r"model.mlp_kind=moe needs experts"):  # the kind's own check
        ModelConfig(num_layers=1, layer_pattern="*E")


def test_a_hybrid_of_mixers_and_mlps():
    """gqa and MLA layers mixed with dense and MoE MLPs, MLP-only and mixer-only layers: the
    model builds from the pattern, its planner count is the built model's."""
    from mlm.model import parameter_counts as built_counts

    cfg = ModelConfig(
        num_layers=5,
        layer_pattern="*-+E*--+",
        hidden_size=32,
        num_attention_heads=4,
        moe=MoEConfig(num_experts=4, router_topk=2),
        mla=MLAConfig(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8),
    )
    assert cfg.mixer_kinds() == ("gqa", "mla") and cfg.mlp_kinds() == ("dense", "moe")
    assert [str(s) for s in cfg.layer_specs()][-2:] == ["dense (rmsnorm)", "mla (rmsnorm)"]
    run = load_config(None, [])
    run.model = cfg
    assert parameter_counts(run) == built_counts(cfg)
