"""`mlm train` launched by torchrun itself, as users run it: two "nodes" on localhost meeting
through a c10d rendezvous (tp 2 × dp 2, distributed optimizer), and a SIGTERM to torchrun that
stops every rank after the current step, saves, and resumes with --auto-resume.

pytest never runs under torchrun: each torchrun is a child process in its own session, writing
to a log file; torch elastic starts each worker as a session leader of its own, so cleanup kills
the workers' groups as well as torchrun's. Every connection is to 127.0.0.1: the rendezvous
endpoint, --local-addr, and gloo on the loopback interface (the workers listen on 127.0.0.1
only; torchrun's TCPStore listens on all interfaces, which torch gives no option to change).

Tolerance as in test_parallel_training (whose BASE overrides these runs share): fp32, 1e-5
relative on losses against one process in this test; a resume on the same mesh is bitwise.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mlm.config import load_config
from mlm.train.trainer import PREEMPTED_EXIT_CODE, Trainer
from tests.helpers.common import ROOT, tiny_sets
from tests.helpers.distributed import free_port
from tests.helpers.parallel import BASE, RTOL

TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
pytestmark = pytest.mark.skipif(TORCHRUN is None, reason="torchrun is not installed")

TIMEOUT = 240  # seconds for one torchrun job; measured 20-30 s for the 4-rank job on 2 cores
ENV = {
    **os.environ,
    "PYTHONPATH": str(ROOT),
    "OMP_NUM_THREADS": "1",  # 4 ranks on 2 cores: one thread each
    "GLOO_SOCKET_IFNAME": "lo",  # gloo's pairs on loopback, whatever the host name resolves to
    "COLUMNS": "200",  # one step line per line
}


def _torchrun(
    log: Path, launch: list[str], sets: list[str], *extra: str, fault: str = ""
) -> subprocess.Popen:
    """torchrun running `mlm train` (through tests/helpers/fault_worker.py when a `fault` is injected)."""
    program = (
        ["-m", "cli.main", "train"] if not fault else [str(ROOT / "tests" / "helpers" / "fault_worker.py")]
    )
    args = [TORCHRUN, *launch, *program, *[a for s in sets for a in ("--set", s)], *extra]
    with open(log, "w") as out:
        return subprocess.Popen(
            args,
            cwd=ROOT,
            env={**ENV, "MLM_TEST_FAULT": fault},
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _workers(pid: int) -> list[int]:
    """torchrun's child processes (Linux /proc), read before torchrun goes away."""
    found = []
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError):
            found += [int(c) for c in children.read_text().split()]
    return found


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL each worker's session and torchrun's own group."""
    for pgid in [*_workers(proc.pid), proc.pid]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
    proc.wait()


@contextlib.contextmanager
def _reaped():
    """A list to add torchrun processes to; any still running on the way out are killed."""
    procs: list[subprocess.Popen] = []
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                _kill(p)


def _finish(proc: subprocess.Popen, log: Path, timeout: float = TIMEOUT) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(proc)
        raise AssertionError(f"torchrun still running after {timeout} s:\n{log.read_text()}") from None


def _wait_for(text: str, proc: subprocess.Popen, log: Path, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in log.read_text():
            return
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    raise AssertionError(f"{text!r} not in torchrun's output (exit code {proc.poll()}):\n{log.read_text()}")


def _train_records(run_dir: Path) -> list[dict]:
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["split"] == "train"]


def _one_process(run_dir: Path, data: str, **extra) -> list[float]:
    return Trainer(load_config(None, tiny_sets(run_dir, data, **{**BASE, **extra}))).train()


def _assert_close(got: list[float], want: list[float]) -> None:
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=RTOL, atol=0)


def test_two_nodes_on_localhost_c10d_rendezvous_match_one_process(tmp_path, tiny_data):
    run_dir = tmp_path / "run"
    sets = tiny_sets(
        run_dir, tiny_data, **{**BASE, "parallel.tp": 2, "parallel.distributed_optimizer": "true"}
    )
    port = free_port()
    logs = [tmp_path / f"node{n}.log" for n in range(2)]
    with _reaped() as procs:
        for n, log in enumerate(logs):
            launch = [
                "--nnodes=2",
                "--nproc-per-node=2",
                f"--node-rank={n}",  # torchrun ignores it with c10d (ranks follow arrival); kept as users write it
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                f"--rdzv-id=mlm-test-{port}",
                "--local-addr=127.0.0.1",
            ]
            procs.append(_torchrun(log, launch, sets))
        codes = [_finish(p, log) for p, log in zip(procs, logs, strict=True)]
    output = "".join(log.read_text() for log in logs)
    assert codes == [0, 0], output
    assert "mesh tp=2 pp=1 dp=2 cp=1 (world 4)" in output
    records = _train_records(run_dir)  # written by global rank 0, on whichever node it landed
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    _assert_close([r["loss"] for r in records], _one_process(tmp_path / "one", tiny_data))


def test_sigterm_to_torchrun_saves_and_auto_resume_finishes_the_same_run(tmp_path, tiny_data):
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    sets = tiny_sets(run_dir, tiny_data, **{**BASE, "train.train_iters": 40, "checkpoint.save": f"'{ckpt}'"})
    launch = ["--standalone", "--nproc-per-node=2"]  # dp = 2
    with _reaped() as procs:
        first = _torchrun(tmp_path / "first.log", launch, sets)
        procs.append(first)
        _wait_for("step  3/", first, tmp_path / "first.log")
        first.send_signal(signal.SIGTERM)  # torchrun forwards it to both workers
        code = _finish(first, tmp_path / "first.log")
        output = (tmp_path / "first.log").read_text()
        # Every worker exits with PREEMPTED_EXIT_CODE (3), but torchrun (2.13) does not pass it on:
        # its handler raises SignalException, the agent forwards SIGTERM to each worker's session,
        # waits for them (up to --shutdown-timeout, 30 s), then re-raises, and torchrun dies of
        # that uncaught exception: exit code 1, whatever the workers returned. (Workers that exit 3
        # on their own give 1 too, via ChildFailedError.) A requeue wrapper around torchrun must
        # look at the checkpoint, not at the exit code.
        assert code == 1, output
        assert "SignalException" in output and "Unable to shutdown" not in output  # no SIGKILL needed
        latest = (ckpt / "latest").read_text().strip()
        stopped_at = int(latest.removeprefix("iter_"))
        assert 3 <= stopped_at < 40, output
        assert (ckpt / latest / "manifest.json").is_file()
        assert (
            f"stopped by SIGTERM after step {stopped_at}; saved {ckpt / latest}; exit code {PREEMPTED_EXIT_CODE}"
            in output
        )

        second = _torchrun(tmp_path / "second.log", launch, sets, "--auto-resume")
        procs.append(second)
        code = _finish(second, tmp_path / "second.log")
    output = (tmp_path / "second.log").read_text()
    assert code == 0, output
    assert f"iter_{stopped_at:07d} at step {stopped_at}" in output
    records = _train_records(run_dir)  # appended by both runs: each step exactly once, in order
    assert [r["step"] for r in records] == list(range(1, 41))
    assert (ckpt / "latest").read_text().strip() == "iter_0000040"
    _assert_close(
        [r["loss"] for r in records], _one_process(tmp_path / "one", tiny_data, **{"train.train_iters": 40})
    )


def test_a_worker_killed_under_max_restarts_is_restarted_and_the_run_ends_the_same(tmp_path, tiny_data):
    """Rank 1 dies of SIGKILL in step 12 of torchrun's first attempt; torchrun (--max-restarts 1)
    restarts both workers, which resume from iter_0000010 (--auto-resume) and finish. Every step
    logged twice (before the kill and after the restart) has the same loss bit for bit, and the
    run's losses are those of one process (RTOL)."""
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    extra = {"train.train_iters": 20, "checkpoint.save": f"'{ckpt}'", "checkpoint.save_interval": 5}
    sets = tiny_sets(run_dir, tiny_data, **{**BASE, **extra})
    launch = ["--standalone", "--nproc-per-node=2", "--max-restarts=1"]
    log = tmp_path / "job.log"
    with _reaped() as procs:
        procs.append(_torchrun(log, launch, sets, "--auto-resume", fault="kill,1,12"))
        code = _finish(procs[0], log)
    output = log.read_text()
    assert code == 0, output
    assert "failed (exitcode: -9) local_rank: 1" in output, output  # torchrun saw the SIGKILL
    assert f"resumed {ckpt / 'iter_0000010'} at step 10" in output, output  # and restarted
    by_step: dict[int, list[float]] = {}
    for r in _train_records(run_dir):
        by_step.setdefault(r["step"], []).append(r["loss"])
    assert sorted(by_step) == list(range(1, 21))
    assert any(len(v) == 2 for v in by_step.values()), by_step  # steps 11 (and 12) ran twice
    assert all(len(set(v)) == 1 for v in by_step.values()), by_step
    want = _one_process(tmp_path / "one", tiny_data, **{"train.train_iters": 20})
    _assert_close([by_step[s][-1] for s in range(1, 21)], want)


def test_the_issues_config_error_under_torchrun_is_printed_once_and_every_worker_exits_2(tmp_path):
    """`torchrun --nproc-per-node 3 -m cli.main train --config pipelines/tiny/train.toml --set
    parallel.tp=3`: mlm's line once (rank 0's), every worker's exit code 2 in torchrun's own report,
    which follows it; torchrun itself exits 1 whatever its workers returned (ChildFailedError)."""
    log = tmp_path / "job.log"
    with _reaped() as procs:
        procs.append(
            _torchrun(
                log,
                ["--standalone", "--nproc-per-node=3"],
                [],
                "--config",
                "pipelines/tiny/train.toml",
                "--set",
                "parallel.tp=3",
            )
        )
        code = _finish(procs[0], log)
    output = log.read_text()
    assert code == 1, output
    assert output.count("is not divisible by parallel.tp=3") == 1, output
    assert "error: model.num_attention_heads=4 is not divisible by parallel.tp=3" in output, output
    assert output.count("exitcode  : 2") + output.count("(exitcode: 2)") >= 3, output
    assert "exitcode  : 1" not in output and "exitcode  : -" not in output, output
