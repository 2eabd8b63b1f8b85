"""Console output shared by the stages: one rich console and a throughput progress bar.

On a terminal the console is rich's own (the terminal's width, colours, live progress bars). When
the stream is a file or a pipe (SLURM logs, `mlm train ... > run.log 2>&1`) a wrapped or
abbreviated line helps no one: grep, tail and less read long lines, and a step line must stay one
line. There the console is LOG_WIDTH columns wide and soft-wraps (text is never broken), whatever
COLUMNS says (COLUMNS describes a terminal, and rich would otherwise also take the width of a
terminal on stdin while writing to the file), so tables show every header and cell in full at
their natural width.
"""

from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    ProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

LOG_WIDTH = 10_000
"""Columns of a console writing to a file: wider than any line mlm prints."""


def make_console(stderr: bool = True) -> Console:
    """A console on stderr (or stdout): rich's default on a terminal, unwrapped in a file."""
    stream = sys.stderr if stderr else sys.stdout
    isatty = getattr(stream, "isatty", None)
    try:
        tty = bool(isatty and isatty())
    except ValueError:  # a closed stream
        tty = False
    if tty:
        return Console(stderr=stderr)
    return Console(stderr=stderr, width=LOG_WIDTH, soft_wrap=True)


console = make_console(stderr=True)


def human(n: float, unit: str = "") -> str:
    """1234567 -> '1.23M'."""
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{suffix}{unit}"
    return f"{n:.0f}{unit}" if float(n).is_integer() else f"{n:.2f}{unit}"


class RatesColumn(ProgressColumn):
    """docs/s, MB/s and tokens/s from the task's fields `docs` and `tokens` and its bytes."""

    def render(self, task) -> Text:
        t = task.elapsed or 0.0
        if t <= 0:
            return Text("")
        f = task.fields
        return Text(
            f"{human(f.get('docs', 0) / t)} docs/s  {task.completed / t / 1e6:.1f} MB/s  "
            f"{human(f.get('tokens', 0) / t)} tok/s",
            style="cyan",
        )


def throughput_progress(enabled: bool = True) -> Progress:
    """A progress bar over input bytes that also shows docs/s, MB/s and tokens/s."""
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.percentage:>5.1f}%"),
        RatesColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=not enabled or not sys.stderr.isatty() and not console.is_terminal,
        transient=False,
    )
