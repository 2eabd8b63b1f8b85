"""What one layout measured against the reference, and the verdict: `compare` and the result types.

`compare` turns what a layout's run measured (`Measured`: per-step losses, the eval loss after the
last step, final weights) into relative differences from the reference layout's and checks them
against a `Tolerance`; `ParityResult` holds every layout's and
is what `OUT/parity.json` and the report are made from.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from mlm.errors import MlmError
from mlm.layout import Layout
from mlm.train.parity.tolerances import LR_REL, Tolerance


@dataclass
class Measured:
    """What one layout's run left behind."""

    losses: list[float]
    """Training loss per step (metrics.jsonl, split "train")."""
    eval_loss: float | None
    """Validation loss after the last step (split "valid"); None where data.split has no validation."""
    weights: dict
    """Model tensor name → final weights in their global shape."""
    lrs: list[float] = field(default_factory=list)
    """Learning rate per step."""
    grad_norms: list[float] = field(default_factory=list)
    """Gradient norm (before clipping) per step."""


@dataclass
class LayoutResult:
    name: str
    """The layout as given (its canonical text: `tp2`, `cp2ag`)."""
    layout: Layout
    """As it ran: complete, the choices it left open taken from the run config."""
    losses: list[float]
    loss_rel: list[float]
    """|loss − loss_ref| / |loss_ref| per step."""
    eval_loss: float | None
    eval_rel: float | None
    """|eval − eval_ref| / |eval_ref| after the last step (None without a validation split)."""
    weight_rel: dict[str, float]
    """‖w − w_ref‖ / ‖w_ref‖ per model tensor (absolute norm where ‖w_ref‖ = 0)."""
    passed: bool
    grad_norms: list[float] = field(default_factory=list)
    grad_rel: list[float] = field(default_factory=list)
    """|‖g‖ − ‖g_ref‖| / ‖g_ref‖ per step."""
    lrs: list[float] = field(default_factory=list)
    lr_rel: list[float] = field(default_factory=list)
    """|lr − lr_ref| / lr_ref per step."""
    seconds: float = 0.0
    run_dir: str = ""
    checkpoint: str = ""
    log: str = ""

    @property
    def max_loss_rel(self) -> float:
        return max(self.loss_rel, default=0.0)

    @property
    def worst_step(self) -> int:
        return 1 + max(range(len(self.loss_rel)), key=self.loss_rel.__getitem__) if self.loss_rel else 0

    @property
    def max_grad_rel(self) -> float:
        return max(self.grad_rel, default=0.0)

    @property
    def max_lr_rel(self) -> float:
        return max(self.lr_rel, default=0.0)

    @property
    def max_weight_rel(self) -> float:
        return max(self.weight_rel.values(), default=0.0)

    @property
    def worst_tensor(self) -> str:
        return max(self.weight_rel, key=self.weight_rel.__getitem__) if self.weight_rel else ""

    def to_json(self) -> dict:
        return {
            "name": self.name,
            **dataclasses.asdict(self.layout),
            "world_size": self.layout.gpus,
            "passed": self.passed,
            "losses": self.losses,
            "loss_rel": self.loss_rel,
            "max_loss_rel": self.max_loss_rel,
            "worst_step": self.worst_step,
            "grad_norms": self.grad_norms,
            "grad_rel": self.grad_rel,
            "max_grad_rel": self.max_grad_rel,
            "lrs": self.lrs,
            "lr_rel": self.lr_rel,
            "max_lr_rel": self.max_lr_rel,
            "eval_loss": self.eval_loss,
            "eval_rel": self.eval_rel,
            "max_weight_rel": self.max_weight_rel,
            "worst_tensor": self.worst_tensor,
            "weight_rel": self.weight_rel,
            "seconds": self.seconds,
            "run_dir": self.run_dir,
            "checkpoint": self.checkpoint,
            "log": self.log,
        }


def compare(name: str, layout: Layout, got: Measured, ref: Measured, tol: Tolerance) -> LayoutResult:
    """Layout `name` (as it ran: `layout`) against the reference: per-step relative loss
    differences, the relative eval-loss difference and per-tensor relative weight differences;
    passed when every one is within `tol`."""
    import torch

    if len(got.losses) != len(ref.losses):
        raise MlmError(
            f"layout {name!r} logged {len(got.losses)} steps, the reference {len(ref.losses)}; "
            "see its run_dir/metrics.jsonl"
        )
    if (got.eval_loss is None) != (ref.eval_loss is None):
        raise MlmError(
            f"layout {name!r} logged {'no' if got.eval_loss is None else 'an'} eval loss, the "
            f"reference {'none' if ref.eval_loss is None else 'one'}; see its run_dir/metrics.jsonl"
        )
    if missing := sorted(ref.weights.keys() ^ got.weights.keys()):
        raise MlmError(f"layout {name!r}: tensors {', '.join(missing[:5])} are not in both checkpoints")
    loss_rel = [_rel(a, b) for a, b in zip(got.losses, ref.losses, strict=True)]
    grad_rel = [_rel(a, b) for a, b in zip(got.grad_norms, ref.grad_norms, strict=True)]
    lr_rel = [_rel(a, b) for a, b in zip(got.lrs, ref.lrs, strict=True)]
    eval_rel = None if ref.eval_loss is None else _rel(got.eval_loss, ref.eval_loss)
    weight_rel = {}
    for key, w_ref in ref.weights.items():
        ref64 = w_ref.double()
        norm = float(torch.linalg.vector_norm(ref64))
        weight_rel[key] = float(torch.linalg.vector_norm(got.weights[key].double() - ref64)) / (norm or 1.0)
    within = [(loss_rel, tol.loss_rel), (grad_rel, tol.grad_rel), (lr_rel, LR_REL)]
    within += [(weight_rel.values(), tol.weight_rel), ([] if eval_rel is None else [eval_rel], tol.eval_rel)]
    ok = all(r <= bound for values, bound in within for r in values)
    measured = [*got.losses, *got.grad_norms, *got.lrs, *([] if eval_rel is None else [got.eval_loss])]
    ok = ok and all(math.isfinite(x) for x in [*measured, *(r for values, _ in within for r in values)])
    return LayoutResult(
        name, layout, list(got.losses), loss_rel, got.eval_loss, eval_rel, weight_rel, ok,
        list(got.grad_norms), grad_rel, list(got.lrs), lr_rel,
    )  # fmt: skip


def _rel(a: float, b: float) -> float:
    """|a − b| / |b|, or |a − b| where b is 0."""
    return abs(a - b) / abs(b) if b else abs(a - b)


@dataclass
class ParityResult:
    precision: str
    tolerance: Tolerance
    steps: int
    layouts: list[LayoutResult]
    warnings: list[str] = field(default_factory=list)
    out: str = ""

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.layouts)

    def to_json(self) -> dict:
        return {
            "passed": self.passed,
            "precision": self.precision,
            "tolerance": dataclasses.asdict(self.tolerance),
            "steps": self.steps,
            "reference": self.layouts[0].name if self.layouts else None,
            "warnings": self.warnings,
            "out": self.out,
            "layouts": [r.to_json() for r in self.layouts],
        }
