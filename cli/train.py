"""`mlm train`: train from a run config (TOML) plus `--set` overrides.

    mlm train --config run.toml [--plan plan.toml | --layout tp2pp2dp2spmb2] [--set k=v ...]
    mlm train --config run.toml --layout tp2pp4vpp2dp2 --dry-run [--png schedule.png]

The items apply in order: the config, the plan or the layout (docs/layout.md), then `--set`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def train(
    config: Path | None = typer.Option(None, "--config", "-c", help="Run config TOML (see docs/train.md)."),
    overrides: list[str] = typer.Option(
        [],
        "--set",
        help="section.key=value, e.g. train.train_iters=200; `mlm config show` lists every setting, "
        "its value and what it does.",
    ),
    load: str | None = typer.Option(
        None, "--load", help="Resume from a checkpoint dir (its latest) or iter_ dir."
    ),
    auto_resume: bool = typer.Option(
        False, "--auto-resume", help="Resume from checkpoint.save's latest when there is one (requeued jobs)."
    ),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Check the mesh, model and batch; show stages and the pipeline schedule."
    ),
    world_size: int | None = typer.Option(
        None,
        "--world-size",
        help="--dry-run: ranks to check for (default: WORLD_SIZE, else the --layout's tp × pp × dp × cp, "
        "else tp × pp × cp).",
    ),
    png: Path | None = typer.Option(None, "--png", help="--dry-run: also draw the pipeline schedule here."),
    plan: Path | None = typer.Option(
        None,
        "--plan",
        help="Plan file from `mlm plan -o` (mesh, batching, recompute); --set applies after it.",
    ),
    layout: Annotated[
        str | None,
        typer.Option(
            "--layout",
            help="The mesh and its choices as one text (docs/layout.md), e.g. tp2pp2dp2sp; what it "
            "leaves out is the config's; --set applies after it.",
        ),
    ] = None,
) -> None:
    """Train a model on datasets from `mlm data build`; checkpoints, metrics.jsonl, TensorBoard.
    `mlm config show [--config RUN.toml]` prints every setting of the run, with what it does."""
    from mlm.train.watchdog import Watchdog

    # first: in a job of several processes an error anywhere (the config included) is then
    # printed once, by rank 0, and stops every rank (mlm/train/watchdog.py)
    watchdog = Watchdog.for_job()
    try:
        _train(watchdog, config, overrides, load, auto_resume, dry_run, world_size, png, plan, layout)
    except typer.Exit:  # preempted (the trainer has said so on rank 0)
        watchdog.finish()
        raise
    except BaseException as e:
        if watchdog.store is None:  # one process: cli.main prints it
            raise
        watchdog.fail(e)
    watchdog.finish()


def _train(watchdog, config, overrides, load, auto_resume, dry_run, world_size, png, plan, layout) -> None:
    import os

    from mlm.config import load_config
    from mlm.errors import MlmError
    from mlm.layout import Layout

    planned: list[str] = []
    given = Layout.parse(layout) if layout is not None else None
    if given is not None and plan is not None:
        raise MlmError(
            f"--plan {plan} and --layout {layout} both give the mesh and the batching; give one "
            "(--set applies after either)"
        )
    if plan is not None:
        from mlm.planfile import read_plan, train_overrides, world_size_note

        spec = read_plan(plan)
        planned = train_overrides(spec)
        note = world_size_note(spec, int(os.environ.get("WORLD_SIZE", world_size or 1)))
        if note and watchdog.rank == 0:
            from mlm.console import console

            console.print(f"[bold yellow]warning:[/] {plan}: {note}", highlight=False)
    if given is not None:
        planned = given.overrides()
    cfg = load_config(config, planned + list(overrides))
    world = int(os.environ.get("WORLD_SIZE", 1))
    if dry_run:
        p = cfg.parallel
        ranks = given.gpus if given is not None and given.dp is not None else p.tp * p.pp * p.cp
        world = world_size or int(os.environ.get("WORLD_SIZE", ranks))
    if given is not None:
        given.with_world(world)  # a dp it gives must be what the world size leaves
    if dry_run:
        from mlm.console import make_console
        from mlm.train.dry_run import dry_run as report

        make_console(stderr=False).print(report(cfg, world, str(png) if png else None))  # the report: stdout
        return
    from mlm.train.trainer import PREEMPTED_EXIT_CODE, Preempted, Trainer, resume_path

    try:
        Trainer(cfg, load=resume_path(cfg, load, auto_resume), watchdog=watchdog).train()
    except Preempted:  # the trainer has said so on rank 0
        raise typer.Exit(PREEMPTED_EXIT_CODE) from None


def slurm(
    config: Path | None = typer.Option(None, "--config", "-c", help="Run config TOML."),
    overrides: list[str] = typer.Option([], "--set", help="section.key=value (repeatable)."),
    nodes: int = typer.Option(1, help="Nodes."),
    gpus_per_node: int = typer.Option(8, help="GPUs (= tasks) per node."),
    time: str = typer.Option("24:00:00", help="Time limit (HH:MM:SS)."),
    job_name: str = typer.Option("mlm", help="SLURM job name."),
    partition: str | None = typer.Option(None, help="SLURM partition."),
    account: str | None = typer.Option(None, help="SLURM account."),
    max_requeues: int = typer.Option(
        3,
        help="Requeue after a hang or a crash while fewer than this many requeues followed a failure "
        "(time-limit requeues do not count).",
    ),
) -> None:
    """Print an sbatch script that runs `mlm train` under srun, requeued on preemption, hangs and crashes;
    the run is first checked at nodes × gpus-per-node ranks, as `mlm train --dry-run` checks it."""
    from mlm.config import load_config
    from mlm.errors import MlmError
    from mlm.train.dry_run import dry_run
    from mlm.train.slurm import sbatch_script

    cfg = load_config(config, overrides)
    world = nodes * gpus_per_node
    try:  # fail here, not in the queue: the dry run's checks (mesh, model, batch, schedule) at the job's size
        dry_run(cfg, world)
    except MlmError as e:
        raise MlmError(
            f"{e} (world size {world} = --nodes {nodes} × --gpus-per-node {gpus_per_node})"
        ) from None
    print(
        sbatch_script(
            str(config) if config else None,
            overrides,
            nodes,
            gpus_per_node,
            time,
            job_name,
            partition,
            account,
            max_requeues=max_requeues,
        ),
        end="",
    )
