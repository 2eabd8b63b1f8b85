"""The `mlm parity` report: a summary table (one row per layout, megatron-core's last), the per-step
learning rate, gradient norm and losses and the eval loss after the last step, the tolerance and the
verdict, printed from a `ParityResult` with rich.
"""

from __future__ import annotations

from pathlib import Path

from mlm.train.parity.results import ParityResult
from mlm.train.parity.tolerances import LR_REL


def render(result: ParityResult, console=None) -> None:
    """The report: a summary table (one row per layout), the per-step losses and the eval loss, the
    tolerance. Without a validation split the eval cells are "-"."""
    from rich.table import Table

    from mlm.console import make_console

    console = console or make_console(stderr=False)  # stdout; unwrapped in a file
    tol, ref = result.tolerance, result.layouts[0].name
    summary = Table(title=f"mlm parity: {result.steps} steps, {result.precision}, against {ref}")
    # each the largest over the steps, or over the tensors
    for name in ("layout", "world", "|Δloss|/loss", "|Δ‖g‖|/‖g‖", "|Δlr|/lr", "|Δeval|/eval", "‖Δw‖/‖w‖"):
        summary.add_column(name, no_wrap=True, justify="left" if name == "layout" else "right")
    summary.add_column("in tensor", overflow="fold")
    summary.add_column("result", no_wrap=True)
    for i, r in enumerate(result.layouts):
        summary.add_row(
            r.name,
            str(r.layout.gpus),
            f"{r.max_loss_rel:.2e}",
            f"{r.max_grad_rel:.2e}",
            f"{r.max_lr_rel:.0e}" if r.max_lr_rel else "0",
            "-" if r.eval_rel is None else f"{r.eval_rel:.2e}",
            f"{r.max_weight_rel:.2e}",
            r.worst_tensor if i else "",
            "ref" if i == 0 else "[green]PASS[/]" if r.passed else "[red]FAIL[/]",
        )
    first = result.layouts[0]
    steps = Table(title=f"per step: {ref}'s lr, gradient norm and loss; |Δloss|/loss of the others")
    logged = ("lr", "‖g‖") if first.lrs else ()  # as logged in metrics.jsonl
    for name in ("step", *logged, f"{ref} loss", *(r.name for r in result.layouts[1:])):
        steps.add_column(name, justify="right")
    for i in range(result.steps):
        cells = [f"{first.lrs[i]:.4e}", f"{first.grad_norms[i]:.4f}"] if logged else []
        cells += [f"{first.losses[i]:.6f}", *(f"{r.loss_rel[i]:.1e}" for r in result.layouts[1:])]
        steps.add_row(str(i + 1), *cells)
    if first.eval_loss is not None:
        others = [f"{r.eval_rel:.1e}" for r in result.layouts[1:]]
        steps.add_row("eval", *("" for _ in logged), f"{first.eval_loss:.6f}", *others)
    console.print(summary)
    console.print(steps)
    console.print(
        f"tolerance for {result.precision}: |Δloss|/loss ≤ {tol.loss_rel:.0e} and |Δ‖g‖|/‖g‖ ≤ {tol.grad_rel:.0e} "
        f"at every step, |Δlr|/lr ≤ {LR_REL:.0e}, |Δeval|/eval ≤ {tol.eval_rel:.0e} after the last, "
        f"‖Δw‖/‖w‖ ≤ {tol.weight_rel:.0e} for every tensor ({tol.why}; see docs/parity.md)",
        highlight=False,
    )
    for w in result.warnings:
        console.print(f"[bold yellow]warning:[/] {w}", highlight=False)
    failed = [r.name for r in result.layouts if not r.passed]
    verdict = f"[red]FAIL[/]: {', '.join(failed)}" if failed else "[green]PASS[/]"
    console.print(f"{verdict}; details in {Path(result.out) / 'parity.json'}", highlight=False)
