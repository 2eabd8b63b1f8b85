"""`mlm parity`: does the same training run give the same losses and weights on every parallel
layout, and in megatron-core?

From one seed checkpoint (written once, in this process, at step 0) and one data order, each
layout (`tp2`, `tp2dp2`, `pp2vpp2`, ...) runs K steps of `mlm train` under torchrun and one
evaluation after the last; its per-step losses and eval loss (from `metrics.jsonl`) and final
weights (from its checkpoint, read whole) are compared with the first layout's, against a
tolerance that depends on `train.precision`. See docs/parity.md.

    from mlm.train.parity import parse_layouts, render, run_parity
    result = run_parity("run.toml", [], parse_layouts("tp1,tp2,dp2"), steps=5, out="runs/parity")
    render(result)              # the report; result.passed is False when a layout is out of tolerance

A layout is an `mlm.layout.Layout` in its text form (`tp2pp2dp2sp`, docs/layout.md). With
`against="megatron"`, megatron-core trains the run too and is compared like a layout. The package,
one responsibility a module: `tolerances` (the bounds per precision), `results` (the comparison and
its verdict), `runner` (the layouts checked, seed checkpoint, torchrun per layout), `report`
(the tables), `megatron` (megatron-core's side) and `megatron_cpu` (its patches for CPU).
"""

from mlm.train.parity.report import render
from mlm.train.parity.results import LayoutResult, Measured, ParityResult, compare
from mlm.train.parity.runner import parse_layouts, resolve, run_parity, train_command
from mlm.train.parity.tolerances import TOLERANCES, Tolerance

__all__ = [
    "TOLERANCES",
    "LayoutResult",
    "Measured",
    "ParityResult",
    "Tolerance",
    "compare",
    "parse_layouts",
    "render",
    "resolve",
    "run_parity",
    "train_command",
]
