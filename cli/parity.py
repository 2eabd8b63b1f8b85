"""`mlm parity`: one run on several parallel layouts (and in megatron-core); losses, gradient norms,
learning rates, eval loss and weights compared with the first layout.

    mlm parity --config pipelines/tiny/train.toml --layouts tp1,tp2,dp2,tp2dp2 --steps 5
    mlm parity --config pipelines/tiny/train.toml --against megatron --steps 5

See docs/parity.md for the report and the tolerances.
"""

from __future__ import annotations

from pathlib import Path

import typer

from mlm.layout import TERMS_HELP


def parity(
    config: Path | None = typer.Option(None, "--config", "-c", help="Run config TOML (see docs/train.md)."),
    overrides: list[str] = typer.Option([], "--set", help="section.key=value, e.g. train.precision=bf16."),
    layouts: str | None = typer.Option(
        None,
        "--layouts",
        help="Comma-separated layouts, the first is the reference: tp1,tp2,dp2,tp2dp2zero1 (tp1 with "
        f"--against). In a layout, {TERMS_HELP}.",
    ),
    against: str | None = typer.Option(
        None,
        "--against",
        help="megatron: train the same run in megatron-core too (one process), compared as a layout.",
    ),
    steps: int = typer.Option(5, "--steps", help="Training steps per layout."),
    out: Path | None = typer.Option(
        None, "--out", help="New output folder (default runs/parity-YYYYmmdd-HHMMSS)."
    ),
) -> None:
    """Loss, gradient-norm, lr, eval-loss and weight parity across layouts (and against megatron-core) from one
    seed checkpoint; exit 1 on a FAIL."""
    from mlm.errors import MlmError
    from mlm.train.parity import parse_layouts, render, run_parity

    if layouts is None and against is None:
        raise MlmError("give --layouts (e.g. --layouts tp1,tp2,dp2), --against megatron, or both")
    result = run_parity(config, overrides, parse_layouts(layouts or "tp1"), steps, out, against)
    render(result)  # the report on stdout, unwrapped in a file
    if not result.passed:
        raise typer.Exit(1)
