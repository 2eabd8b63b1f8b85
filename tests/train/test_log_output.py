"""Logs that read in a file: with stdout and stderr redirected (SLURM logs, `mlm train ... > run.log
2>&1`) the step line and every table are written whole, one line per logged step, even with
COLUMNS=80; on a terminal the console stays rich's own."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.helpers.common import ROOT, tiny_sets

ENV = {"PYTHONPATH": str(ROOT), "COLUMNS": "80", "PATH": "/usr/bin:/bin"}

STEP = re.compile(
    r"step +(\d+)/(\d+)  loss +\d+\.\d{4}  lr \d\.\d{3}e[+-]\d\d  grad +\d+\.\d{3} +[\d.]+[kMGT]? tok/s  "
    r"MFU +\d+\.\d%  mem +\d+\.\d\d GiB  ETA +\d+m\d\ds"
)


def mlm_to_file(log, *args) -> str:
    """Run `mlm ARGS > log 2>&1` (no terminal anywhere, COLUMNS=80) and return the log."""
    with open(log, "w") as f:
        r = subprocess.run(
            [sys.executable, "-m", "cli.main", *map(str, args)],
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env=ENV,
        )
    text = log.read_text()
    assert r.returncode == 0, text
    return text


def test_train_log_has_one_whole_line_per_step(tmp_path, tiny_data):
    sets = tiny_sets(tmp_path / "run", tiny_data, **{"train.train_iters": 5, "logging.hardware": "'h100'"})
    text = mlm_to_file(tmp_path / "train.log", "train", *[a for s in sets for a in ("--set", s)])
    steps = [line for line in text.splitlines() if line.startswith("step ")]
    assert len(steps) == 5, text
    for i, line in enumerate(steps, 1):
        m = STEP.fullmatch(line)  # every field on the one line, nothing after it
        assert m and m.groups() == (str(i), "5"), line
        assert len(line) > 80, line  # so that a wrap at COLUMNS=80 would have split it
    assert "…" not in text
    # the old short name is an alias of the plan files' profile, and the run records the profile
    assert 'hardware = "h100-80g"' in (tmp_path / "run" / "config.toml").read_text()


def test_plan_table_headers_and_cells_in_full(tmp_path):
    text = mlm_to_file(
        tmp_path / "plan.txt",
        "plan",
        "--preset",
        "tiny-llama",
        "--gpus",
        "8",
        "--seq-length",
        "256",
        "--global-batch",
        "64",
        "--explain",
    )
    assert "…" not in text
    lines = text.splitlines()
    headers = [line for line in lines if line.startswith("┃  # ┃")]
    assert len(headers) == 1, text  # one header row: no header wrapped onto a second line
    cells = [c.strip() for c in headers[0].strip("┃").split("┃")]
    assert cells == [
        "#",
        "mesh",
        "sp",
        "mb",
        "m",
        "recompute",
        "sharding",
        "weights",
        "grads",
        "optim",
        "activ.",
        "other",
        "total GB",
        "step s",
        "tok/s/GPU",
        "MFU",
    ]
    rows = [line for line in lines if re.match(r"│ +\d+ │ (tp\d)?(pp\d)?dp\d+ +│", line)]
    assert len(rows) == 10 and all(row.rstrip().endswith("% │") for row in rows), text  # one line a plan
    # a rejected family's reason and the --explain headline, each whole on one line
    assert any("every pipeline stage needs at least one layer" in line for line in lines), text
    assert any(
        line.startswith("dp8, micro-batch") and line.endswith("8 × h100-80g, software mlm-triton")
        for line in lines
    ), text


def console_width(stderr) -> int:
    code = "from mlm.console import console; print(console.width)"
    r = subprocess.run([sys.executable, "-c", code], stderr=stderr, stdout=subprocess.PIPE, cwd=ROOT, env=ENV)
    return int(r.stdout)


def test_terminal_keeps_its_width_file_is_unwrapped(tmp_path):
    from mlm.console import LOG_WIDTH

    with open(tmp_path / "err", "w") as f:
        assert console_width(f) == LOG_WIDTH  # COLUMNS=80 describes a terminal, not this file
    leader, follower = os.openpty()
    try:
        assert console_width(follower) == 80  # a terminal: rich's own width (here COLUMNS)
    finally:
        os.close(leader)
        os.close(follower)
