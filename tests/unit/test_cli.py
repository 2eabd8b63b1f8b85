"""The `mlm data` commands end to end, and a CLI that starts without torch."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np

from mlm.datasets.indexed import IndexedDataset
from tests.helpers.common import ROOT, cli, mlm


def test_help_and_version_do_not_import_torch():
    code = (
        "import sys\n"
        "from cli.main import app\n"
        "for args in (['--help'], ['data', '--help'], ['data', 'build', '--help'], ['--version']):\n"
        "    try:\n"
        "        app(args)\n"
        "    except SystemExit as e:\n"
        "        assert e.code == 0, (args, e.code)\n"
        "print('torch' in sys.modules)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "False"
    assert "mlm 0." in r.stdout


BUILT = {"data", "plan", "train", "slurm", "parity", "config", "convert", "export", "serve", "generate"}


def test_only_built_stages_appear():
    """`mlm --help` lists exactly the commands cli/main.py registers, and those are the built ones:
    a new command, a missing one or a stage that is not built (no `eval` here) fails."""
    from cli.main import app

    out = mlm("--help").stdout
    section = out.split("\nCommands:\n", 1)[1]
    listed = [m.group(1) for m in re.finditer(r"^  (\S+)  ", section, re.MULTILINE)]
    assert len(listed) == len(set(listed)), listed
    registered = {c.name for c in app.registered_commands} | {g.name for g in app.registered_groups}
    assert set(listed) == registered == BUILT, (listed, registered)
    assert "eval" not in listed and "  eval " not in out


def test_help_names_the_layout_terms_and_the_settings(monkeypatch, capsys):
    """`mlm parity --help` lists the layout grammar (mlm.layout's own text) and `mlm train --help`
    says where every setting is listed."""
    from mlm.layout import TERMS_HELP

    def bare(text: str) -> str:  # the help is rewrapped, at spaces and hyphens
        return "".join(text.split())

    r = cli(monkeypatch, capsys, "parity", "--help")
    assert r.returncode == 0 and bare(TERMS_HELP) in bare(r.stdout), r.stdout
    r = cli(monkeypatch, capsys, "train", "--help")
    assert r.returncode == 0 and "`mlmconfigshow" in bare(r.stdout), r.stdout


def test_listings_print_their_table_to_stdout():
    """`mlm config list | grep moe` finds every MoE preset: the table is the command's output (stdout),
    not a log line (stderr), and names each preset's layer kinds."""
    from mlm.config import load_config
    from mlm.presets import PRESETS

    r = mlm("config", "list")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    grep_moe = {line.split("│")[1].strip() for line in r.stdout.splitlines() if "moe" in line}
    moe = {name for name in PRESETS if load_config(overrides=[f"preset={name}"]).model.moe.num_experts}
    assert {"mixtral-8x7b", "tiny-moe", "deepseek-v3"} <= moe
    assert grep_moe == moe, (grep_moe, moe)


def test_data_stage_end_to_end(tmp_path):
    r = mlm("data", "corpus", "stdlib", tmp_path / "corpus.jsonl")
    assert r.returncode == 0, r.stderr
    lines = (tmp_path / "corpus.jsonl").read_text().splitlines()
    paths = [json.loads(line)["path"] for line in lines]
    assert paths == sorted(paths) and len(paths) > 100
    assert not any("/test/" in p or p.startswith(("test/", "site-packages")) for p in paths)

    r = mlm(
        "data",
        "tokenizer",
        "train",
        "-i",
        tmp_path / "corpus.jsonl",
        "-o",
        tmp_path / "tok.model",
        "--vocab-size",
        "1000",
        "--max-sentences",
        "20000",
        "--no-progress",
    )
    assert r.returncode == 0, r.stderr
    r = mlm(
        "data",
        "build",
        "-i",
        tmp_path / "corpus.jsonl",
        "-o",
        tmp_path / "ds",
        "-t",
        tmp_path / "tok.model",
        "--append-eod",
        "--no-progress",
    )
    assert r.returncode == 0, r.stderr
    ds = IndexedDataset(tmp_path / "ds")
    assert ds.num_documents == len(lines)

    r = mlm("data", "inspect", tmp_path / "ds", "--docs", "1")
    assert r.returncode == 0, r.stderr
    assert "tokens/doc p50" in r.stdout and "document 0" in r.stdout  # the report, not a log

    r = mlm("data", "merge", "-i", tmp_path / "ds", "-i", tmp_path / "ds", "-o", tmp_path / "twice")
    assert r.returncode == 0, r.stderr
    twice = IndexedDataset(tmp_path / "twice")
    assert twice.num_documents == 2 * ds.num_documents and twice.num_tokens == 2 * ds.num_tokens
    np.testing.assert_array_equal(twice.document(ds.num_documents + 5), ds.document(5))

    r = mlm(
        "data",
        "index",
        "0.4",
        tmp_path / "ds",
        "0.6",
        tmp_path / "twice",
        "--seq-length",
        "128",
        "--train-samples",
        "2000",
        "--valid-samples",
        "10",
        "--split",
        "95,5,0",
    )
    assert r.returncode == 0, r.stderr
    cached = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert sum(n.endswith("-description.json") for n in cached) == 6  # per split: 2 GPTDatasets + 1 blend


def test_merge_refuses_other_tokenizer(tmp_path, sp_model, hf_tokenizer_json, corpus_jsonl):
    for name, tok in (("a", sp_model), ("b", hf_tokenizer_json)):
        mlm(
            "data",
            "build",
            "-i",
            corpus_jsonl,
            "-o",
            tmp_path / name,
            "-t",
            tok,
            "--no-progress",
            "--dtype",
            "uint16",
        )
    r = mlm("data", "merge", "-i", tmp_path / "a", "-i", tmp_path / "b", "-o", tmp_path / "ab")
    assert r.returncode == 2 and "share a tokenizer" in " ".join(r.stderr.split())
