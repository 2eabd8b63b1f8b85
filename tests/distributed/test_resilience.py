"""The job-level answers to failures (mlm/train/watchdog.py), on real processes as srun starts
them: one process per rank with SLURM_PROCID / SLURM_NTASKS / SLURM_JOB_NODELIST set, meeting
through torch.distributed's env:// rendezvous on 127.0.0.1. Each process's exit code is what
srun passes on.

- a configuration error (the issue's repro: tp=3 with 4 heads) is printed once, by rank 0, and
  every rank exits 2;
- a rank that raises stops every rank promptly (the process group's own timeout is torch's
  default 30 min there: only the watchdog can end the job within the test's 2 minutes), with
  its traceback printed once and exit code 1 everywhere;
- a rank asleep inside a step: every rank dumps its stacks to RUN_DIR/hang/rank{N}.txt, rank 0
  names the sleeper as the rank not waiting with the others, and every rank exits 4;
- one process without a launcher detects its own hang the same way.
The fault is injected by tests/helpers/fault_worker.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mlm.errors import MlmError
from mlm.train.watchdog import (
    BAD_INPUT_EXIT_CODE,
    EVENT,
    FAILED_EXIT_CODE,
    HANG,
    HANG_EXIT_CODE,
    LEFT,
    Watchdog,
    exit_code,
    hang_summary,
    rank_ranges,
)
from tests.helpers.common import ROOT, tiny_sets
from tests.helpers.distributed import free_port

WORKER = ROOT / "tests" / "helpers" / "fault_worker.py"
TIMEOUT = 120  # seconds for a whole job; these take 10-25 s on 2 cores
BASE = {"train.global_batch_size": 6, "train.micro_batch_size": 2, "train.train_iters": 8}


def _srun(n: int, args: list[str], fault: str = "", log_dir: Path | None = None) -> tuple[list[int], str]:
    """Start `n` ranks of tests/helpers/fault_worker.py as srun would; their exit codes and their
    output (stdout and stderr of every rank, in rank order)."""
    port = free_port()
    procs = []
    for rank in range(n):
        env = {
            **{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")},
            "SLURM_PROCID": str(rank),
            "SLURM_NTASKS": str(n),
            "SLURM_LOCALID": str(rank),
            "SLURM_JOB_NODELIST": "127.0.0.1",
            "MASTER_PORT": str(port),
            "GLOO_SOCKET_IFNAME": "lo",
            "OMP_NUM_THREADS": "1",
            "COLUMNS": "200",
            "MLM_TEST_FAULT": fault,
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), *args],
                cwd=ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=TIMEOUT)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [p.returncode for p in procs], "".join(outputs)


def _sets(tmp_path: Path, data: str, **extra) -> list[str]:
    return [a for s in tiny_sets(tmp_path / "run", data, **{**BASE, **extra}) for a in ("--set", s)]


def test_config_error_is_printed_once_by_rank_0_and_every_rank_exits_2(tmp_path, tiny_data):
    codes, out = _srun(3, ["--config", "pipelines/tiny/train.toml", "--set", "parallel.tp=3"])
    assert codes == [BAD_INPUT_EXIT_CODE] * 3, out
    line = "error: model.num_attention_heads=4 is not divisible by parallel.tp=3"
    assert out.count(line) == 1, out
    assert "Traceback" not in out, out
    assert out.strip().count("\n") == 0, out  # the one line is all


def test_an_exception_on_one_rank_stops_every_rank_promptly(tmp_path, tiny_data):
    codes, out = _srun(
        3, _sets(tmp_path, tiny_data, **{"train.resilience.hang_timeout": 0}), fault="raise,2,3"
    )
    assert codes == [FAILED_EXIT_CODE] * 3, out
    assert out.count("RuntimeError: injected fault on rank 2 in step 3") == 2, (
        out
    )  # traceback + rank 0's line
    assert out.count("Traceback") == 1, out
    assert "error: rank 2 failed (RuntimeError: injected fault on rank 2 in step 3); every rank stops" in out


def test_a_rank_asleep_in_a_step_is_found_dumped_and_every_rank_exits_4(tmp_path, tiny_data):
    codes, out = _srun(
        3, _sets(tmp_path, tiny_data, **{"train.resilience.hang_timeout": 4}), fault="sleep,1,3"
    )
    assert codes == [HANG_EXIT_CODE] * 3, out
    hang = tmp_path / "run" / "hang"
    dumps = {r: (hang / f"rank{r}.txt").read_text() for r in range(3)}
    assert "main thread: not waiting: 'time.sleep(600)' at tests/helpers/fault_worker.py" in dumps[1], dumps[
        1
    ]
    assert "in train_step" in dumps[1] and "Thread mlm-watchdog" in dumps[1]
    for r in (0, 2):
        assert "main thread: waiting in " in dumps[r], dumps[r]  # a collective, or work.wait() on one
        assert "step 3, phase " in dumps[r]
    assert out.count("hang: no progress for ") == 1, out
    assert f"every rank's stacks in {hang}/rank<N>.txt" in out
    assert "  rank 1: forward-backward, running 'time.sleep(600)'" in out
    assert "not waiting with the others: rank(s) 1\n" in out, out
    assert f"exit code {HANG_EXIT_CODE}" in out


def test_one_process_detects_its_own_hang(tmp_path, tiny_data):
    env = {**os.environ, "MLM_TEST_FAULT": "sleep,0,2", "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    for k in ("RANK", "WORLD_SIZE", "SLURM_NTASKS", "SLURM_PROCID"):
        env.pop(k, None)
    run = subprocess.run(
        [sys.executable, str(WORKER), *_sets(tmp_path, tiny_data, **{"train.resilience.hang_timeout": 2})],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    out = run.stdout + run.stderr
    assert run.returncode == HANG_EXIT_CODE, out
    assert "not waiting with the others: rank(s) 0" in out
    assert "'time.sleep(600)'" in (tmp_path / "run" / "hang" / "rank0.txt").read_text()


def test_summary_names_the_ranks_apart_from_the_others():
    event = {"rank": 5, "seconds": 61.2}
    where = "torch.distributed all_reduce, called at mlm/train/trainer.py:1 (_dp_average)"
    statuses = [
        {"rank": r, "step": 7, "phase": "loss and metrics", "waiting": True, "where": where} for r in range(8)
    ]
    statuses[5] = {
        **statuses[5],
        "phase": "forward-backward",
        "where": "torch.distributed recv, called at x:2 (f)",
    }
    text = hang_summary(event, statuses, Path("/r/hang"), world_size=9)
    assert "no progress for 61 s (train.resilience.hang_timeout) at step 7, first seen on rank 5" in text
    assert "  ranks 0-4, 6-7: loss and metrics, waiting in torch.distributed all_reduce" in text
    assert "  no report from rank(s) 8" in text
    assert "waiting apart from the others: rank(s) 5" in text
    same = hang_summary(event, [statuses[0]], None, world_size=1)
    assert "every rank waits in the same place" in same and "stacks in" not in same


@pytest.mark.parametrize(
    ("ranks", "text"), [([], ""), ([3], "3"), ([0, 1, 2, 5, 7, 8], "0-2, 5, 7-8"), ([4, 2, 3], "2-4")]
)
def test_rank_ranges(ranks, text):
    assert rank_ranges(ranks) == text


def test_exit_codes():
    assert exit_code(MlmError("x")) == BAD_INPUT_EXIT_CODE == 2
    assert exit_code(KeyboardInterrupt()) == 130
    assert exit_code(RuntimeError("x")) == FAILED_EXIT_CODE == 1
    assert HANG_EXIT_CODE == 4


class _Exited(SystemExit):
    """`Watchdog._exit` in a test: ends the thread that calls it (a watching thread quietly)."""


def _no_exit(watchdog, monkeypatch) -> list[int]:
    """`watchdog._exit` records the code and ends the calling thread instead of the process."""
    codes: list[int] = []

    def record(code):
        codes.append(code)
        raise _Exited(code)

    monkeypatch.setattr(watchdog, "_exit", record)
    return codes


def test_an_error_after_a_hang_was_declared_reports_the_hang(tmp_path, monkeypatch):
    """Rank 0's main thread raises (e.g. a peer's connection closed) after rank 1 declared a hang,
    before rank 0's watching thread saw it: rank 0 still dumps, prints the summary, exits 4."""
    store = dist.HashStore()
    store.set(EVENT, json.dumps({"what": "hang", "rank": 1, "code": HANG_EXIT_CODE, "seconds": 9.0}))
    status = {"rank": 1, "step": 3, "phase": "forward-backward", "waiting": False, "where": "x"}
    store.set(f"{HANG}1", json.dumps(status))
    store.add(LEFT, 1)  # rank 1 has left
    watchdog = Watchdog(store, rank=0, world_size=2, poll_s=0.01)
    watchdog.run_dir, watchdog.hang_timeout = tmp_path, 5.0  # as watch_hangs, without the thread
    said: list[str] = []
    monkeypatch.setattr(watchdog, "_say", said.append)
    codes = _no_exit(watchdog, monkeypatch)
    try:  # an error raised inside a collective (here: no process group)
        dist.all_reduce(torch.zeros(1))
    except ValueError as e:
        error = e
    with pytest.raises(_Exited):
        watchdog.fail(error)
    assert codes == [HANG_EXIT_CODE]
    assert (tmp_path / "hang" / "rank0.txt").is_file()
    assert len(said) == 1 and said[0].startswith("[bold red]hang:[/] no progress for 9 s"), said
    assert "  rank 1: forward-backward, running x" in said[0]
    # where rank 0 raised (in the collective), not where fail() reads its own stack
    assert "  rank 0: setup, waiting in torch.distributed " in said[0], said[0]
    assert "ValueError: Default process group has not been initialized" in said[0]
    assert "not waiting with the others: rank(s) 1\n" in said[0]


def test_a_lost_store_ends_the_rank_even_if_its_report_fails(monkeypatch):
    """The watching thread loses the store (rank 0 died) and cannot even print: the rank still
    ends (else its main thread, failing later, would wait for the thread forever)."""

    class Gone:
        def check(self, keys):
            raise RuntimeError("Connection reset by peer")

    watchdog = Watchdog(Gone(), rank=1, world_size=2, poll_s=0.01)

    def broken(text):
        raise OSError("stdout closed")

    monkeypatch.setattr(watchdog, "_say", broken)
    codes = _no_exit(watchdog, monkeypatch)
    monkeypatch.setattr(threading, "excepthook", lambda args: None)  # the thread ends by _Exited
    watchdog._start_thread()
    thread = watchdog._thread
    thread.join(5)
    assert not thread.is_alive() and codes == [FAILED_EXIT_CODE]


@pytest.mark.parametrize("value", ["-1", "inf", "1e12"])
def test_hang_timeout_is_checked(value):
    """Negative, infinite (an OverflowError when the trainer built the process group's timeout,
    hang_timeout + 300 s, before the check) or beyond 1e9 s (a timedelta holds 8.6e13 s) is
    refused by the config."""
    from mlm.config import load_config

    with pytest.raises(
        MlmError, match=rf"train.resilience.hang_timeout={float(value)}: must be 0 \(off\) or"
    ):
        load_config(None, [f"train.resilience.hang_timeout={value}"])
