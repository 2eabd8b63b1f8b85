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
) -> None:
    """Train a model on datasets from `mlm data build`; checkpoints, metrics.jsonl, TensorBoard."""
    from mlm.config import load_config
    from mlm.train.trainer import Trainer

    cfg = load_config(config, overrides)
    Trainer(cfg, load=load or cfg.checkpoint.load or None).train()
