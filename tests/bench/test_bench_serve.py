"""bench/serve.py runs end to end on a small load (the tiny shape, 3 requests, 5 tokens, 3 streaming
HTTP clients) and its checks hold: mlm's engine gives HF's one-at-a-time greedy tokens, every HTTP
stream ends with [DONE] after one event per token. Its speed figures are not asserted (they live in
bench/RESULTS.md)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers.common import ROOT

pytest.importorskip("transformers")
pytest.importorskip("httpx")


def bench(script: str, *args: str) -> str:
    """The standard output of `bench/SCRIPT ARGS`, which must exit 0."""
    return subprocess.run(
        [sys.executable, f"bench/{script}", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=True,
    ).stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_serve_small_run_checks_pass():
    args = ["--shape", "tiny", "--requests", "3", "--new-tokens", "5"]
    out = bench("serve.py", *args, "--http-clients", "3", "--http-requests", "5")
    assert "same greedy tokens, mlm vs HF one at a time:     3/3 requests" in out, out
    assert "HTTP: 5 streaming /v1/completions requests" in out, out
    assert "streams not ending in [DONE]: 0 []; with a token count other than 5: 0" in out, out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_serve_step_runs_each_comparison():
    """bench/serve_step.py on the tiny shape: the host-memory and packed-weights comparisons print
    (the decode-groups one needs a context of 1,900 tokens and says it is skipped)."""
    out = bench("serve_step.py", "--shape", "tiny", "--steps", "2")
    assert "packed weights: decode, 16 seqs" in out and "off / on" in out, out
    assert "host memory: prefill" in out, out
    assert "decode groups: the model's context is too short" in out, out
