"""`mlm parity`: one run on several parallel layouts; losses, eval loss, weights compared with the first.

    mlm parity --config pipelines/tiny/train.toml --layouts tp1,tp2,dp2,tp2dp2 --steps 5

See docs/parity.md for the report and the tolerances.
"""

from __future__ import annotations

from pathlib import Path

import typer


def parity(
    config: Path | None = typer.Option(None, "--config", "-c", help="Run config TOML (see docs/train.md)."),
    overrides: list[str] = typer.Option([], "--set", help="section.key=value, e.g. train.precision=bf16."),
    layouts: str = typer.Option(
        ..., "--layouts", help="Comma-separated layouts, the first is the reference: tp1,tp2,dp2,tp2dp2zero1."
    ),
    steps: int = typer.Option(5, "--steps", help="Training steps per layout."),
    out: Path | None = typer.Option(
        None, "--out", help="New output folder (default runs/parity-YYYYmmdd-HHMMSS)."
    ),
) -> None:
    """Loss, eval-loss and weight parity across layouts from one seed checkpoint; exit 1 on a FAIL."""
    from mlm.train.parity import parse_layouts, render, run_parity

    result = run_parity(config, overrides, parse_layouts(layouts), steps, out)
    render(result)  # the report on stdout, unwrapped in a file
    if not result.passed:
        raise typer.Exit(1)
