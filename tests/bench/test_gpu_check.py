"""`just gpu-check --dry-run` (bench/gpu_check.py): every section of the GPU check runs on CPU with
tiny shapes and the report holds each one, so the script cannot rot between GPU leases; the
budget skips a section with a line instead of running past the lease; the goals read the figures
a GPU run writes. (The dry run's figures measure nothing; only that each section ran and its
checks held: the gpu-marked tests pass on CPU where their path exists there, the distributed
optimizer under a process group of one equals it without, the engine gives HF's tokens.)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.common import ROOT

pytest.importorskip("transformers")
SECTIONS = ("env", "tests", "mfu", "kernels", "serve", "nccl", "memory")


def gpu_check(*args: str) -> subprocess.CompletedProcess:
    just = shutil.which("just", path=str(Path(sys.executable).parent)) or shutil.which("just")
    cmd = [just, "gpu-check", *args] if just else ["bash", "bench/gpu_check.sh", *args]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_dry_run_runs_every_section(tmp_path):
    r = gpu_check("--dry-run", "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = (tmp_path / "gpu_check.md").read_text()
    figures = json.loads((tmp_path / "gpu_check.json").read_text())
    assert figures["dry_run"] and "Dry run on CPU" in report
    sections = figures["sections"]
    assert list(sections) == list(SECTIONS)
    for name in SECTIONS:
        assert sections[name]["status"] == "ok", (name, sections[name])
        assert f"## {name}\n\nStatus: ok." in report
    tests = sections["tests"]["figures"]["gpu-marked"]
    assert tests["failed"] == 0 and tests["passed"] >= 10 and tests["exit"] == 0, tests
    nccl = sections["nccl"]["figures"]
    assert nccl["distributed_optimizer_losses"]["max_diff"] == 0
    assert set(nccl["collectives"].values()) == {"ok"}
    serve = sections["serve"]["figures"]
    assert serve["same_tokens"]["mlm vs HF one at a time"] == serve["requests"]
    mfu = sections["mfu"]["figures"]
    assert set(mfu["models"]) == {"mlm", "HF"} and mfu["param_dtype"] == "bf16"
    kernels = {(row["kernel"], row["impl"]) for row in sections["kernels"]["figures"]["rows"]}
    assert {("rmsnorm", "compile"), ("linear_cross_entropy", "mlm"), ("swiglu", "liger")} <= kernels
    assert sections["memory"]["figures"]["predicted_bytes"] > 0


def test_budget_skips_sections_with_a_line(tmp_path):
    r = gpu_check("--dry-run", "--out", str(tmp_path), "--budget", "1", "--only", "env", "memory")
    assert r.returncode == 0, r.stdout + r.stderr
    sections = json.loads((tmp_path / "gpu_check.json").read_text())["sections"]
    assert list(sections) == ["env", "memory"]
    assert all(s["status"].startswith("skipped: ") for s in sections.values()), sections
    assert "| memory | skipped: " in (tmp_path / "gpu_check.md").read_text()


def test_goals_read_a_gpu_runs_figures():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from gpu_check import goal_lines
    finally:
        sys.path.remove(str(ROOT / "bench"))
    results = {
        "mfu": {"figures": {"models": {"mlm": {"mfu": 0.47}}, "mlm_vs_hf": 1.31}},
        "kernels": {
            "figures": {
                "rows": [
                    {"kernel": "rmsnorm", "impl": "mlm", "vs_compile": 1.4, "of_bandwidth": 0.83},
                    {"kernel": "linear_cross_entropy", "impl": "mlm", "vs_compile": 1.1},
                    {"kernel": "rope", "impl": "mlm", "skipped": "CPU"},
                ]
            }
        },
        "serve": {"figures": {"mlm_vs_hf_padded": 2.0, "mlm_cuda_graphs_vs_hf_padded": 2.5}},
    }
    assert goal_lines(results) == [
        "- MFU of mlm: 47.0% (goal >= 45%)",
        "- mlm / HF train step: 1.31x (goal >= 1.2x)",
        "- kernel rmsnorm: 1.40x torch.compile (goal >= 1.0x), 83% of bandwidth (goal >= 80%)",
        "- serving mlm / HF padded batch: 2.00x (goal >= 1.5x)",
        "- serving mlm_cuda_graphs / HF padded batch: 2.50x (goal >= 1.5x)",
    ]
