"""Configs written before the nested tables (issue 41) load unchanged: a run config and a checkpoint
manifest written by mlm at commit a73a947 (tests/data/config-2026-11) give the values that day's
loader gave, through `mlm.config.legacy.RENAMES`; an old key given to `--set` names its new spelling."""

from __future__ import annotations

import json

import pytest

from mlm.checkpoint.manager import checkpoint_config
from mlm.config import config_from_dict, flat_keys, load_config, to_toml
from mlm.config.legacy import RENAMES, upgrade
from mlm.errors import MlmError
from tests.helpers.common import ROOT

FIXTURE = ROOT / "tests" / "data" / "config-2026-11"


def _expected() -> dict[str, object]:
    """The recorded values, each under its key of today."""
    return {RENAMES.get(k, k): v for k, v in json.loads((FIXTURE / "expected.json").read_text()).items()}


def test_the_fixture_uses_the_old_keys():
    """The fixture proves the mapping: it holds old keys, set to other values than the defaults."""
    recorded = json.loads((FIXTURE / "expected.json").read_text())
    assert set(RENAMES) <= set(recorded)
    assert recorded["model.rope_base"] == 500000.0 and recorded["train.fp8_recipe"] == "tensorwise"
    assert recorded["train.fault_action"] == "rollback" and recorded["train.skip_iterations"] == [100]


def test_an_old_run_config_loads_with_the_same_values(capsys):
    cfg = load_config(FIXTURE / "config.toml")
    assert flat_keys(cfg.to_dict()) == _expected()
    assert cfg.model.rope.scaling_factor == 8.0 and cfg.train.fp8.amax_history_len == 16
    assert cfg.train.resilience.straggler_window == 5
    err = capsys.readouterr().err
    assert (
        "config.toml: old config keys read as their new spellings (model.rope_base → model.rope.base" in err
    )


def test_an_old_checkpoint_manifest_loads_with_the_same_values():
    manifest = json.loads((FIXTURE / "manifest.json").read_text())
    assert flat_keys(config_from_dict(manifest["config"]).to_dict()) == _expected()
    # as a checkpoint is read (its depth checked against the tensors it lists)
    cfg = checkpoint_config(manifest, FIXTURE)
    assert flat_keys(cfg.to_dict()) == _expected()


def test_an_old_config_resumes_as_itself():
    """Resuming compares the checkpoint's saved settings with the run's: an old manifest against
    today's spelling of the same run changes nothing."""
    from mlm.train.resume import resume_changes

    saved = config_from_dict(json.loads((FIXTURE / "manifest.json").read_text())["config"])
    now = load_config(FIXTURE / "config.toml")
    assert resume_changes(saved, now, 2, 2, 2) == ([], [])


def test_round_trip_through_toml(tmp_path):
    """Today's TOML (nested [model.rope], [train.fp8], [train.resilience]) reads back the same."""
    cfg = load_config(FIXTURE / "config.toml")
    text = to_toml(cfg)
    for table in ("[model.rope]", "[train.fp8]", "[train.resilience]"):
        assert f"\n{table}\n" in text
    assert "base = 500000.0" in text and "RoPE base frequency" in text
    (tmp_path / "config.toml").write_text(text)
    assert load_config(tmp_path / "config.toml") == cfg


@pytest.mark.parametrize(
    "given,message",
    [
        (
            "train.fp8_recipe=delayed",
            "--set train.fp8_recipe: this key is now train.fp8.recipe; use --set train.fp8.recipe=delayed",
        ),
        (
            "train.fp8=hybrid",
            "--set train.fp8: this key is now train.fp8.format; use --set train.fp8.format=hybrid",
        ),
        (
            "model.rope_base=1e6",
            "--set model.rope_base: this key is now model.rope.base; use --set model.rope.base=1e6",
        ),
        (
            "train.skip_iterations=[3]",
            "--set train.skip_iterations: this key is now train.resilience.skip_iterations; "
            "use --set train.resilience.skip_iterations=[3]",
        ),
    ],
)
def test_a_stale_key_in_set_names_its_new_spelling(given, message):
    with pytest.raises(MlmError) as e:
        load_config(None, ["preset=tiny-llama", given])
    assert str(e.value) == message


def test_a_key_given_both_ways_is_refused():
    data = {"train": {"fp8_recipe": "delayed", "fp8": {"recipe": "tensorwise"}}}
    with pytest.raises(MlmError, match="train.fp8_recipe and train.fp8.recipe are both given"):
        upgrade(data, "run.toml")
    assert data == {"train": {"fp8_recipe": "delayed", "fp8": {"recipe": "tensorwise"}}}  # not changed
