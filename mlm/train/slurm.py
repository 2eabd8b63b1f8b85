"""A ready sbatch script for `mlm train`: one task per GPU under srun, requeued on preemption.

SLURM sends SIGUSR1 to the tasks `signal_s` seconds before the time limit; `mlm train` finishes
its step, saves, and exits with code 3, on which the script requeues the job; the requeued job
continues through `--auto-resume`.
"""

from __future__ import annotations

import shlex

from mlm.train.trainer import PREEMPTED_EXIT_CODE


def sbatch_script(
    config: str | None,
    overrides: list[str],
    nodes: int,
    gpus_per_node: int,
    time: str,
    job_name: str = "mlm",
    partition: str | None = None,
    account: str | None = None,
    cpus_per_task: int = 8,
    signal_s: int = 180,
) -> str:
    args = ["mlm", "train"]
    if config:
        args += ["--config", config]
    for o in overrides:
        args += ["--set", o]
    args.append("--auto-resume")
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --nodes={nodes}",
        f"#SBATCH --ntasks-per-node={gpus_per_node}",
        f"#SBATCH --gpus-per-node={gpus_per_node}",
        f"#SBATCH --cpus-per-task={cpus_per_task}",
        f"#SBATCH --time={time}",
        "#SBATCH --requeue",
        f"#SBATCH --signal=USR1@{signal_s}",
        "#SBATCH --output=%x-%j.out",
    ]
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    if account:
        lines.append(f"#SBATCH --account={account}")
    lines += [
        "",
        f"# {nodes} node(s) × {gpus_per_node} GPU(s) = {nodes * gpus_per_node} ranks; mlm reads SLURM_PROCID,",
        "# SLURM_NTASKS, SLURM_LOCALID and the master host from SLURM_JOB_NODELIST.",
        "export MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))",
        "export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK}",
        "",
        "srun --kill-on-bad-exit=1 " + shlex.join(args),
        "rc=$?",
        f"if [ $rc -eq {PREEMPTED_EXIT_CODE} ]; then",
        '    echo "preempted: checkpoint saved, requeueing $SLURM_JOB_ID"',
        '    scontrol requeue "$SLURM_JOB_ID"',
        "fi",
        "exit $rc",
    ]
    return "\n".join(lines) + "\n"
