"""Refit a hardware profile to measured steps: `mlm plan --calibrate RUN/metrics.jsonl`.

Each run directory of `mlm train` holds `metrics.jsonl` (step_time_s per logged step) and
`config.toml` (the resolved run config: model, mesh, batch). The time model splits a predicted
step into a compute-bound part C (1 / GEMM efficiency) and a communication-bound part M
(1 / bandwidth), so a measured step is fitted as

    measured ≈ c · C + b · M

From one run only c is fitted (b = 1: one number cannot separate the two); from two or more
runs (best: one compute-heavy, one communication-heavy layout) c and b by least squares. The
calibrated profile divides `gemm_max` by c (at most 1) and both bandwidths by b; save it with
`--save-profile` and plan with `--hardware PROFILE.toml`. The measured step is the median of the
logged steps after the first (which includes start-up).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from mlm.config import load_config
from mlm.errors import MlmError
from mlm.hardware import Hardware
from mlm.layout import Layout
from mlm.plan.candidates import evaluate
from mlm.plan.job import Job
from mlm.plan.search import check_layout
from mlm.plan.software import Software


@dataclass
class Run:
    path: Path
    layout: Layout
    measured_s: float
    """The measured step, less the prediction's fixed part (memory-bound work, launches, data
    loading and the optimizer step, which neither GEMM efficiency nor bandwidth scales)."""
    compute_s: float
    comm_s: float
    fixed_s: float


def measured_step(metrics: Path) -> float:
    """Median step_time_s of the logged training steps after the first."""
    if not metrics.is_file():
        raise MlmError(f"--calibrate {metrics}: file not found (expected RUN_DIR/metrics.jsonl of mlm train)")
    times = []
    for n, line in enumerate(metrics.read_text().splitlines(), 1):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            raise MlmError(f"{metrics}:{n}: not JSON") from None
        if rec.get("split") == "train" and "step_time_s" in rec:
            times.append(float(rec["step_time_s"]))
    if not times:
        raise MlmError(f"{metrics}: no training steps with step_time_s; is it mlm train's metrics.jsonl?")
    return statistics.median(times[1:] if len(times) > 1 else times)


def load_run(
    metrics: str | Path, gpus: int, gpus_per_node: int, hw: Hardware, software: Software | None = None
) -> Run:
    """The run beside `metrics` (its config.toml), predicted with `hw` (and `software`: mlm's own
    by default) on `gpus` ranks."""
    metrics = Path(metrics)
    config = metrics.parent / "config.toml"
    if not config.is_file():
        raise MlmError(
            f"{config} not found: --calibrate needs the config.toml mlm train writes beside metrics.jsonl"
        )
    cfg = load_config(config)
    try:
        layout = Layout.from_config(cfg, gpus)
    except MlmError as e:
        raise MlmError(f"{config} on --gpus {gpus} (the run's world size): {e}") from None
    job = Job(cfg, gpus, gpus_per_node, hw, software)
    check_layout(job, layout)
    c = evaluate(job, layout)
    tm = c.timing
    return Run(metrics, layout, measured_step(metrics) - tm.fixed_s, tm.compute_s, tm.comm_s, tm.fixed_s)


def fit(runs: list[Run]) -> tuple[float, float]:
    """(c, b): the factors on compute and communication time that best explain the runs."""
    if len(runs) >= 2:
        cc = sum(r.compute_s**2 for r in runs)
        mm = sum(r.comm_s**2 for r in runs)
        cm = sum(r.compute_s * r.comm_s for r in runs)
        cy = sum(r.compute_s * r.measured_s for r in runs)
        my = sum(r.comm_s * r.measured_s for r in runs)
        det = cc * mm - cm * cm
        if det > 1e-12 * cc * mm:
            c, b = (cy * mm - my * cm) / det, (my * cc - cy * cm) / det
            if c > 0 and b > 0:
                return c, b
    r = runs[0] if len(runs) == 1 else None
    if r is not None and r.measured_s > r.comm_s and r.compute_s > 0:
        return (r.measured_s - r.comm_s) / r.compute_s, 1.0
    scale = sum(x.measured_s for x in runs) / sum(x.compute_s + x.comm_s for x in runs)
    return scale, scale


def calibrate(hw: Hardware, runs: list[Run]) -> tuple[Hardware, float, float]:
    """The profile refitted to `runs`, and the fitted (c, b)."""
    c, b = fit(runs)
    new = dataclasses.replace(
        hw,
        name=f"{hw.name}-calibrated",
        gemm_max=min(1.0, hw.gemm_max / c),
        intra_bandwidth=hw.intra_bandwidth / b,
        inter_bandwidth=hw.inter_bandwidth / b,
    )
    return new, c, b
