"""Launch detection: torchrun's variables, SLURM's, and SLURM's compressed node lists; the sbatch
script `mlm slurm` writes, run with fake srun and scontrol."""

from __future__ import annotations

import os

import pytest

from mlm.parallel.launch import detect, expand_nodelist


def test_expand_nodelist():
    assert expand_nodelist("gpu[01-03,07],login") == ["gpu01", "gpu02", "gpu03", "gpu07", "login"]
    assert expand_nodelist("node7") == ["node7"]
    assert expand_nodelist("a[8-10]") == ["a8", "a9", "a10"]


def test_detect_torchrun_slurm_single():
    assert detect({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}).launcher == "torchrun"
    env = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "1",
        "SLURM_JOB_NODELIST": "n[3-4]",
        "SLURM_JOB_ID": "123456",
    }
    launch = detect(env)
    assert (launch.rank, launch.world_size, launch.local_rank, launch.launcher) == (5, 8, 1, "slurm")
    assert env["MASTER_ADDR"] == "n3" and env["MASTER_PORT"] == str(20000 + 123456 % 20000)
    assert env["RANK"] == "5" and env["WORLD_SIZE"] == "8" and env["LOCAL_RANK"] == "1"
    assert detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}).launcher == "single"


def test_sbatch_script_is_valid_bash_with_requeue(tmp_path):
    import subprocess

    from mlm.train.slurm import sbatch_script

    script = sbatch_script(
        "run.toml", ["train.train_iters=10"], nodes=2, gpus_per_node=4, time="01:00:00", partition="gpu"
    )
    for line in (
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=4",
        "#SBATCH --requeue",
        "#SBATCH --signal=USR1@",
        "#SBATCH --partition=gpu",
        "mlm train --config run.toml --set train.train_iters=10 --auto-resume",
        'scontrol requeue "$SLURM_JOB_ID"',
    ):
        assert line in script, line
    (tmp_path / "job.sh").write_text(script)
    assert subprocess.run(["bash", "-n", str(tmp_path / "job.sh")]).returncode == 0


@pytest.mark.parametrize(
    ("rc", "restarts", "failures", "requeued"),
    [
        (0, 0, 0, False),  # done
        (3, 0, 0, True),  # preempted, checkpoint saved
        (3, 5, 0, True),  # preemption requeues however often it came
        (2, 0, 0, False),  # bad input: the same input fails again
        (4, 0, 0, True),  # a hang
        (1, 2, 2, True),  # a crash, below the limit
        (137, 0, 0, True),  # a rank killed (srun: 128 + SIGKILL)
        (4, 3, 3, False),  # at the limit
        (4, 5, 0, True),  # five requeues at the time limit before: they do not count
    ],
)
def test_sbatch_script_requeues_by_exit_code(tmp_path, rc, restarts, failures, requeued):
    """The script itself, run with a fake `srun` (exits with `rc`) and `scontrol` (records its
    arguments) first on PATH, after `restarts` requeues of which `failures` followed a failure
    (the count the script keeps beside its output, JOB_NAME-JOB_ID.requeues)."""
    import subprocess

    from mlm.train.slurm import sbatch_script

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(f"#!/bin/bash\nexit {rc}\n")
    (bin_dir / "scontrol").write_text(f'#!/bin/bash\necho "$@" >> {tmp_path}/scontrol.log\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    (tmp_path / "job.sh").write_text(sbatch_script("run.toml", [], 1, 8, "01:00:00", max_requeues=3))
    count = tmp_path / "mlm-77.requeues"
    if failures:
        count.write_text(f"{failures}\n")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "77"}
    env.update(SLURM_JOB_NAME="mlm", SLURM_RESTART_COUNT=str(restarts))
    run = subprocess.run(["bash", "job.sh"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == rc, run.stderr
    log = tmp_path / "scontrol.log"
    assert (log.read_text() if log.exists() else "") == ("requeue 77\n" if requeued else ""), run.stdout
    after_failure = rc not in (0, 2, 3)
    want = failures + (after_failure and requeued)
    assert (int(count.read_text()) if count.exists() else 0) == want, run.stdout


def test_slurm_command_checks_the_run_at_the_job_size(monkeypatch, capsys):
    """`mlm slurm` refuses what `mlm train --dry-run` refuses at nodes × gpus-per-node ranks (the
    mesh, the batch, the schedule), before it writes a script."""
    from tests.helpers.common import assert_error, cli

    tiny = ["--config", "pipelines/tiny/train.toml"]
    r = cli(monkeypatch, capsys, "slurm", "--nodes", "3", "--gpus-per-node", "2", "--set", "parallel.tp=4")
    assert_error(r, "does not divide world size 6")
    assert r.stdout == ""
    r = cli(monkeypatch, capsys, "slurm", *tiny, "--nodes", "4", "--gpus-per-node", "8")
    assert_error(
        r,
        "train.global_batch_size=16 is not divisible by train.micro_batch_size=8 × dp=32",
        "(world size 32 = --nodes 4 × --gpus-per-node 8)",
    )
    assert r.stdout == ""  # no script
    dry = cli(monkeypatch, capsys, "train", "--dry-run", *tiny, "--world-size", "32")
    assert_error(dry, "train.global_batch_size=16 is not divisible by train.micro_batch_size=8 × dp=32")
    r = cli(monkeypatch, capsys, "slurm", *tiny, "--nodes", "1", "--gpus-per-node", "2")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("#!/bin/bash") and "--nodes=1" in r.stdout
