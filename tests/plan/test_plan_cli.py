"""`mlm plan` as a command: `--layout` prints the numbers the search reports for that layout (the
70B / 512-GPU example), its refusals (exit 2 invalid, 1 does not fit), the constraints that narrow
the search and their errors, and tables read whole in a file and on a 60-column terminal."""

from __future__ import annotations

import io
import re
import subprocess
import sys
import tomllib

import pytest
from rich.console import Console

from mlm.errors import MlmError
from mlm.layout import Layout
from mlm.plan import report
from mlm.plan.hardware import load_hardware
from mlm.plan.job import make_job
from mlm.plan.pinned import complete
from mlm.plan.report import shown_ranks
from mlm.plan.search import Constraints, plan, search, sharding_name, why_not
from tests.helpers.common import ROOT, assert_error, mlm

EXAMPLE = (
    "--preset llama3-70b --gpus 512 --gpus-per-node 8 --hardware h100-80g --seq-length 8192 --global-batch 1024"
).split()
GB = 1e9


@pytest.fixture(scope="module")
def job():
    return make_job(None, ["preset=llama3-70b"], 512, 8, load_hardware("h100-80g"), 8192, 1024)


@pytest.fixture(scope="module")
def result(job):
    return plan(job)


def _explained(job, text: str):
    return complete(job, Layout.parse(text))[0]


def test_layout_of_each_top_plan_reads_back_to_it(job, result):
    """Each of the search's 10 best, written as --layout, is the same candidate (uneven stage
    splits, vpp and all_gather among them); with the choices left out its mesh gives the best."""
    for c in result.ranked[:10]:
        back = _explained(job, str(c.layout))
        assert back.layout == c.layout
        assert back.memory.components == c.memory.components and back.timing == c.timing
    best = result.ranked[0].layout
    mesh = f"tp{best.tp}pp{best.pp}dp{best.dp}" + (f"cp{best.cp}" if best.cp > 1 else "")
    mesh += f"vpp{best.vpp}" if best.vpp > 1 else ""
    assert _explained(job, mesh).layout == best  # micro-batch, recompute, optimizer, attention chosen
    assert {c.layout.vpp for c in result.ranked[:10]} > {1}
    assert any(c.layout.first_stage_layers for c in result.ranked[:10])


def test_layout_prints_what_the_search_reports(job, result, tmp_path):
    """Acceptance: `--layout` of the best plan prints its step time, tokens/s, MFU and every memory
    component as the search's `--explain` does, and writes the same plan file."""
    best = result.ranked[0]
    arg = str(best.layout)
    r = mlm("plan", *EXAMPLE, "--layout", arg, "-o", tmp_path / "layout.toml")
    assert r.returncode == 0, r.stderr
    out = " ".join(r.stdout.split())
    tm, mem = best.timing, best.memory
    assert f"{tm.tokens_per_s_per_gpu:,.0f} tokens/s per GPU; MFU {tm.mfu:.1%}" in out
    assert re.search(rf"step\s+│\s+{tm.step_s:.3f} │", r.stdout)
    for k, v in mem.components.items():
        assert re.search(rf"{re.escape(k)}\s+│\s+{v / GB:.2f} │", r.stdout), k
    assert re.search(rf"total\s+│\s+{mem.total / GB:.2f} of 80 │", r.stdout)
    assert f"--layout {arg}" in out and "0 that fit" not in out

    searched = mlm("plan", *EXAMPLE, "--top", "1", "-o", "-")
    assert searched.returncode == 0, searched.stderr
    assert "mlm plan:" not in searched.stdout and "mlm plan:" in searched.stderr  # stdout: the plan only
    from_search = tomllib.loads(searched.stdout)
    from_layout = tomllib.loads((tmp_path / "layout.toml").read_text())
    assert from_layout == from_search
    assert from_layout["prediction"]["step_time_s"] == tm.step_s
    assert from_layout["prediction"]["memory_gb"]["total"] == mem.total / GB


def test_layout_says_what_it_chose():
    r = mlm("plan", *EXAMPLE, "--layout", "tp8pp4vpp2cp2")
    assert r.returncode == 0, r.stderr
    out = " ".join(r.stdout.split())
    assert "--layout tp8pp4vpp2cp2 on 512 × h100-80g:" in out
    for chosen in (
        "dp 8 (from --gpus 512)",
        "sequence parallelism on (tp > 1)",
        "micro-batch ",
        "recompute ",
    ):
        assert chosen in out, out
    assert re.search(r"--layout tp8pp4vpp2dp8cp2(p2p|ag)spzero1mb\d+rc(none|sel|full)", out), out


@pytest.mark.parametrize(
    "text,fragments",
    [
        ("tp16pp4", ["model.num_query_groups=8 is not divisible by parallel.tp=16"]),
        ("tp8pp4dp8", ["tp(8) × pp(4) × dp(8) × cp(1) = 256 ≠ --gpus 512"]),
        ("tp8pp3", ["tp(8) × pp(3) × cp(1) = 24 does not divide world size 512"]),
        ("tp8pp4mb3", ["global batch 1024 is not divisible by micro-batch 3 × dp 16"]),
        (
            "tp8pp4vpp40",
            ["160 stages but model.num_layers=80: every pipeline stage needs at least one layer"],
        ),
        (
            "tp8pp4vpp2mb32",
            ["(2 = global_batch_size / (micro_batch_size × dp)) to be a multiple of parallel.pp=4"],
        ),
        ("tp8pp4ep2", ["ep=2: the model has no MoE layers"]),
        ("tp8pp4x", ["layout 'tp8pp4x': unknown term 'x'", "mb<N> (micro-batch), rcnone, rcsel, rcfull"]),
        ("tp8rcfullrcsel", ["layout 'tp8rcfullrcsel': recompute is given twice"]),
        ("tp8pp4zero1", ["zero1 shards the optimizer, --optimizer adam replicates it"]),
    ],
)
def test_invalid_layout_is_the_rules_error(job, text, fragments):
    with pytest.raises(MlmError) as e:
        complete(job, Layout.parse(text), "adam" if "zero1" in text else "auto")
    for f in fragments:
        assert f in str(e.value)


def test_invalid_layout_exits_2_does_not_fit_exits_1(job, tmp_path):
    assert_error(
        mlm("plan", *EXAMPLE, "--layout", "tp16pp4"),
        "model.num_query_groups=8 is not divisible by parallel.tp=16",
    )
    assert_error(
        mlm("plan", *EXAMPLE, "--layout", "tp8", "--tp", "8"), "--layout tp8 with --tp: the layout gives"
    )
    r = mlm("plan", *EXAMPLE, "--layout", "tp1pp4", "-o", tmp_path / "p.toml")
    assert r.returncode == 1, r.stdout + r.stderr
    err = " ".join(r.stderr.split())
    least = _explained(job, "tp1pp4")  # no layout of the mesh fits: the one needing least memory
    assert not least.fits and f"does not fit: --layout tp1pp4 {why_not(least)}" in err, err
    assert least.memory.total > 80e9 and f"{least.memory.total / GB:.1f} GB > 80.0 GB" in err
    assert "none of " in r.stdout and "memory per GPU" in r.stdout and "weights" in r.stdout
    assert not (tmp_path / "p.toml").exists()


def test_micro_batch_and_recompute_terms():
    assert Layout.parse("tp2mb4rcsel").recompute == "selective"
    assert Layout.parse("tp2mb4rcsel").micro_batch == 4


@pytest.mark.parametrize(
    "k,holds",
    [
        (Constraints(tp=8), lambda lo: lo.tp == 8),
        (Constraints(pp=4), lambda lo: lo.pp == 4),
        (Constraints(max_tp=2), lambda lo: lo.tp <= 2),
        (Constraints(micro_batch=2), lambda lo: lo.micro_batch == 2),
        (Constraints(recompute=("none", "selective")), lambda lo: lo.recompute != "full"),
    ],
)
def test_constraints_narrow_the_search(job, result, k, holds):
    narrowed = search(job, k=k)
    assert narrowed.ranked and all(holds(c.layout) for c in narrowed.ranked)
    allowed = [c for c in result.ranked if holds(c.layout)]
    assert len(narrowed.ranked) == len(allowed) < len(result.ranked)  # exactly the allowed ones
    assert narrowed.ranked[0].timing == allowed[0].timing


def test_smallest_takes_the_least_memory_recompute_allowed(job):
    """Given in any order, the recompute modes are tried least memory last (what `smallest` and
    the GPUs-needed estimate use)."""
    least = search(job, k=Constraints(recompute=("selective", "none")), smallest=True)
    assert least.ranked and {c.layout.recompute for c in least.ranked} == {"selective"}


def test_a_pinned_tp_crosses_nodes():
    """On nodes of 4, the search rejects tp 8 unasked; pinned, tp 8 is evaluated (and fits)."""
    job4 = make_job(None, ["preset=llama3-70b"], 512, 4, load_hardware("h100-80g"), 8192, 1024)
    assert "crosses nodes" in search(job4, k=Constraints(pp=8), smallest=True).rejected[(8, 8)]
    pinned = search(job4, k=Constraints(tp=8, pp=8), smallest=True)
    assert pinned.ranked and all(c.layout.tp == 8 for c in pinned.ranked) and not pinned.rejected


@pytest.mark.parametrize(
    "k,fragment",
    [
        (Constraints(tp=3), "--tp 3 does not divide --gpus 512; choose one of"),
        (Constraints(tp=16), "model.num_query_groups=8 is not divisible by parallel.tp=16"),
        (Constraints(tp=0), "--tp 0: must be at least 1"),
        (Constraints(pp=3), "--pp 3 does not divide --gpus 512"),
        (Constraints(pp=32), "model.num_layers=80 is not divisible by pp(32) stages"),
        (Constraints(max_tp=0), "--max-tp 0: must be at least 1"),
        (Constraints(tp=8, max_tp=4), "--tp 8 is above --max-tp 4"),
        (Constraints(micro_batch=3), "--micro-batch 3 does not divide the global batch 1024"),
        (
            Constraints(recompute=("partial",)),
            "--recompute 'partial': each must be one of none, selective, full",
        ),
    ],
)
def test_bad_constraint_names_value_rule_and_fix(job, k, fragment):
    with pytest.raises(MlmError) as e:
        search(job, k=k)
    assert fragment in str(e.value)


def test_constraint_options_on_the_command_line():
    r = mlm(
        "plan",
        *EXAMPLE,
        "--max-tp",
        "4",
        "--recompute",
        "none,selective",
        "--micro-batch",
        "1",
        "--top",
        "20",
    )
    assert r.returncode == 0, r.stderr
    rows = [line.split("│")[1:-1] for line in r.stdout.splitlines() if re.match(r"│ +\d+ │ [a-z]", line)]
    # the best 20, then the best of each sharding they leave out (none, fsdp, hsdp)
    assert [int(r[0]) for r in rows[:20]] == list(range(1, 21)) and len(rows) <= 23
    for row in rows:
        cells = [c.strip() for c in row]
        assert Layout.parse(cells[1]).tp <= 4 and cells[3] == "1" and cells[5] in ("none", "selective")
    assert_error(mlm("plan", *EXAMPLE, "--recompute", "none,some"), "--recompute 'none,some'")


def _cells(job, result, top):
    """The ranked table's cells as the search's numbers give them."""
    rows = []
    for i in shown_ranks(result.ranked, top):  # the best `top`, then the best of each other sharding
        c = result.ranked[i - 1]
        lo, mem = c.layout, c.memory.components
        other = sum(
            v for k, v in mem.items() if k not in ("weights", "gradients", "optimizer", "activations")
        )
        rows.append(
            [str(i), str(lo.mesh()), "on" if lo.sequence_parallel else "off", str(lo.micro_batch)]
            + [str(lo.num_micro), lo.recompute, sharding_name(lo)]
            + [f"{mem[k] / GB:.1f}" for k in ("weights", "gradients", "optimizer", "activations")]
            + [f"{other / GB:.1f}", f"{c.memory.total / GB:.1f}", f"{c.timing.step_s:.2f}"]
            + [f"{c.timing.tokens_per_s_per_gpu:,.0f}", f"{c.timing.mfu:.1%}"]
        )
    return rows


def test_file_output_is_whole_at_columns_60(job, result, tmp_path):
    """`mlm plan ... > plan.txt` with COLUMNS=60: one header line with every column, one line a
    plan with every cell as the search computed it, the rejected reasons whole, no '…'."""
    import subprocess
    import sys

    from tests.helpers.common import ROOT

    with open(tmp_path / "plan.txt", "w") as f:
        r = subprocess.run(
            [sys.executable, "-m", "cli.main", "plan", *EXAMPLE, "--explain"],
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env={"PYTHONPATH": str(ROOT), "COLUMNS": "60", "PATH": "/usr/bin:/bin"},
        )
    assert r.returncode == 0, r.stderr
    text = (tmp_path / "plan.txt").read_text()
    assert "…" not in text
    lines = text.splitlines()
    header = [line for line in lines if re.match(r"┃ +# ┃", line)]
    assert len(header) == 1 and [c.strip() for c in header[0].strip("┃").split("┃")] == list(
        report.RANKED_COLUMNS
    )
    rows = [
        [c.strip() for c in line.strip("│").split("│")] for line in lines if re.match(r"│ +\d+ │ [a-z]", line)
    ]
    assert rows == _cells(job, result, 10)
    for why in result.rejected.values():
        assert any(why in line for line in lines), why


def test_narrow_terminal_stacks_every_table(job, result):
    """At 60 columns the ranked and rejected tables do not fit: they are stacked, every header and
    cell whole (a long reason wraps at spaces onto indented lines), no '…'; the memory table fits
    and stays a table; at 200 columns the ranked table is rich's table."""
    buf = io.StringIO()
    con = Console(file=buf, width=60, force_terminal=True, color_system=None)
    con.print(report.ranked_table(job, result, 10))
    con.print(report.rejected_table(result))
    con.print(report.explain(job, result.ranked[0]))
    text = buf.getvalue()
    assert "…" not in text
    assert not re.search(r"┃ +(#|tp) ┃", text) and "┃ component " in text  # stacked; what fits stays a table
    assert max(len(line) for line in text.splitlines() if not line.startswith("rank ")) <= 60
    flat = " ".join(text.split())
    for row in _cells(job, result, 10):
        for col, cell in zip(report.RANKED_COLUMNS, row, strict=True):
            assert f"{col}: {cell}" in flat, (col, cell)
    for (tp, pp), why in result.rejected.items():
        assert f"tp: {tp} pp: {pp} why: {' '.join(why.split())}" in flat, why
    for k, v in result.ranked[0].memory.components.items():
        assert re.search(rf"│ {re.escape(k)}\s+│\s+{v / GB:.2f} │", text), k
    wide = Console(file=io.StringIO(), width=200, force_terminal=True, color_system=None)
    wide.print(report.ranked_table(job, result, 10))
    assert re.search(r"┃ +# ┃", wide.file.getvalue()) and "…" not in wide.file.getvalue()


@pytest.mark.parametrize(
    "job",
    [
        ["--preset", "tiny-llama", "--gpus", "4", "--gpus-per-node", "4"],
        ["--preset", "tiny-deepseek", "--gpus", "16", "--global-batch", "64", "--explain"],  # MLA, MoE, MTP
    ],
)
def test_plan_does_not_import_torch(tmp_path, job):
    """`mlm plan` runs where torch is not installed (a login node): planning a model and writing
    its plan imports no torch."""
    code = (
        "import sys\nfrom cli.main import app\n"
        f"args = ['plan', *{job!r}, '-o', {str(tmp_path / 'p.toml')!r}]\n"
        "try:\n    app(args)\nexcept SystemExit:\n    pass\n"
        "print('torch' in sys.modules)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert (tmp_path / "p.toml").is_file(), r.stdout + r.stderr
    assert r.stdout.strip().splitlines()[-1] == "False", r.stdout
