"""`mlm train`: train from a run config (TOML) plus `--set` overrides."""

from __future__ import annotations

from pathlib import Path

import typer


def train(
    config: Path | None = typer.Option(None, "--config", "-c", help="Run config TOML (see docs/train.md)."),
    overrides: list[str] = typer.Option([], "--set", help="section.key=value, e.g. train.train_iters=200."),
    load: str | None = typer.Option(
        None, "--load", help="Resume from a checkpoint dir (its latest) or iter_ dir."
    ),
    auto_resume: bool = typer.Option(
        False, "--auto-resume", help="Resume from checkpoint.save's latest when there is one (requeued jobs)."
    ),
) -> None:
    """Train a model on datasets from `mlm data build`; checkpoints, metrics.jsonl, TensorBoard."""
    from mlm.config import load_config
    from mlm.console import console
    from mlm.train.trainer import PREEMPTED_EXIT_CODE, Preempted, Trainer, resume_path

    cfg = load_config(config, overrides)
    try:
        Trainer(cfg, load=resume_path(cfg, load, auto_resume)).train()
    except Preempted as e:
        console.print(f"[bold yellow]{e}[/]; exit code {PREEMPTED_EXIT_CODE}", highlight=False)
        raise typer.Exit(PREEMPTED_EXIT_CODE) from None
