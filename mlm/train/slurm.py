"""A ready sbatch script for `mlm train`: one task per GPU under srun, requeued on preemption
and on failures that a restart can mend.

SLURM sends SIGUSR1 to the tasks `signal_s` seconds before the time limit; `mlm train` finishes
its step, saves, and exits with code 3, on which the script requeues the job (always: a long
run goes on from one time limit to the next). A hang (exit 4), a crash or a lost node (any other
non-zero code) requeues it while the requeues after a failure, counted in
JOB_NAME-JOB_ID.requeues beside the job's output, are below `max_requeues`; bad input (exit 2)
never does, since the same input fails again. The requeued job continues from the latest checkpoint through
`--auto-resume`.
"""

from __future__ import annotations

import shlex

from mlm.train.trainer import PREEMPTED_EXIT_CODE
from mlm.train.watchdog import BAD_INPUT_EXIT_CODE, HANG_EXIT_CODE


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
    max_requeues: int = 3,
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
        "# requeues after a failure, counted beside the output (time-limit requeues do not count)",
        'count="${SLURM_JOB_NAME}-${SLURM_JOB_ID}.requeues"',
        'requeues=$(cat "$count" 2>/dev/null || echo 0)',
        "case $rc in",
        "    0) ;;",
        f"    {PREEMPTED_EXIT_CODE})",
        '        echo "preempted: checkpoint saved, requeueing $SLURM_JOB_ID"',
        '        scontrol requeue "$SLURM_JOB_ID" ;;',
        f"    {BAD_INPUT_EXIT_CODE})",
        '        echo "mlm train refused its configuration or input (exit 2): not requeued" ;;',
        "    *)",
        f"        if [ $requeues -lt {max_requeues} ]; then",
        '            echo $((requeues + 1)) > "$count"',
        f"            echo \"mlm train failed with exit code $rc ({HANG_EXIT_CODE}: a hang, stacks in the run dir's hang/):"
        f' requeue $((requeues + 1)) of {max_requeues}, resuming from the latest checkpoint"',
        '            scontrol requeue "$SLURM_JOB_ID"',
        "        else",
        '            echo "mlm train failed with exit code $rc after $requeues requeues for failures: not requeued again"',
        "        fi ;;",
        "esac",
        "exit $rc",
    ]
    return "\n".join(lines) + "\n"
