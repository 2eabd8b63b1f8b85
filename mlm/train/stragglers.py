"""Straggler detection: every `train.resilience.straggler_window` steps, which ranks are slow at their own work.

Each rank splits its training steps into **compute**, the time in its own work: every forward
and backward action of the pipeline executor, from the moment the action's inputs have arrived
until its outputs are handed to the sends (`WorkClock`, started and stopped by
`mlm.parallel.pipeline.Pipeline.run`), plus AdamW's arithmetic with the plain optimizer; and
**wait**, the rest of the step's wall time: blocked in p2p, the data-parallel gradient
reduction and the other collectives, plus the step's small host work (reading micro-batches,
clipping). A slow rank makes every other rank wait for it at the next collective, so all ranks
have the same step time; its compute is high and its wait low, theirs the reverse: compute is
what names it.

Every `window` steps all ranks all-gather their sums `[compute, wait, step, pipeline stage]`
(one float64 tensor of 4 per rank) and rank 0 divides each rank's compute per step by the median
over the ranks doing the same work: its pipeline stage's ranks (the first and last stages also
hold the embedding and output layer), or all ranks when each stage has one rank (pp = world
size). Ranks at `threshold` times that median or more are named on the console, the window's
summary goes to metrics.jsonl and TensorBoard (`straggler/*`), and one row per rank to
RUN_DIR/stragglers.tsv. With two ranks per stage the median is their mean: a rank r× slower
than its peer shows 2r / (1 + r).

Collectives inside an action (tensor and context parallelism, the expert all-to-all, the
distributed optimizer's overlapped parameter all-gathers) count as compute: a slow rank slows
its whole tensor-parallel group, which is then named together. Under the distributed optimizer
the optimizer step, which also starts and waits for the parameter all-gathers, counts as wait.

Timing: `time.perf_counter` on CPU. On CUDA, host clocks measure kernel launches, so each span
is a pair of CUDA events on the current stream, resolved once per window (no synchronize per
action or per step). The CUDA path has never run on a GPU.
"""

from __future__ import annotations

import contextlib
import socket
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from mlm.config import Config
from mlm.console import console

TSV_NAME = "stragglers.tsv"
TSV_HEADER = "step\trank\thost\tstage\tcompute_s\twait_s\tstep_s\tratio\n"
NAMED_ON_CONSOLE = 3
"""Stragglers named on the console line per window; the rest are counted ("and N more")."""


class WorkClock:
    """Sums the durations of spans of this rank's own work (`start()` / `stop()`, or `span()`),
    perf_counter on CPU, CUDA events on a GPU; `take()` returns the sum and starts a new one."""

    def __init__(self, device: torch.device, enabled: bool = True):
        self.enabled = enabled
        self.cuda = device.type == "cuda"
        self._seconds = 0.0
        self._began: float | torch.cuda.Event | None = None
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def _now(self) -> float | torch.cuda.Event:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        if self.enabled:
            self._began = self._now()

    def stop(self) -> None:
        if not self.enabled:
            return
        end, began = self._now(), self._began
        assert began is not None, "WorkClock.stop() without start()"
        if self.cuda:
            self._events.append((began, end))
        else:
            self._seconds += end - began
        self._began = None

    @contextlib.contextmanager
    def span(self, on: bool = True):
        """Time the block as own work (when `on`)."""
        if on:
            self.start()
        try:
            yield
        finally:
            if on:
                self.stop()

    def take(self) -> float:
        """Seconds of own work since the last `take` (on CUDA, waits for the last span's end)."""
        if self._events:
            self._events[-1][1].synchronize()
            self._seconds += sum(a.elapsed_time(b) for a, b in self._events) / 1000
            self._events = []
        seconds, self._seconds = self._seconds, 0.0
        return seconds


@dataclass
class RankTimes:
    """One rank's seconds per step over a window, and its compute over its peers' median."""

    rank: int
    host: str
    stage: int
    compute: float
    wait: float
    step: float
    ratio: float


@dataclass
class WindowReport:
    """The ranks' times over steps `first`..`last` (rank 0's view after the all-gather)."""

    first: int
    last: int
    threshold: float
    ranks: list[RankTimes]
    peers_by_stage: bool
    """True: each rank is compared with its pipeline stage's ranks; False: with all ranks."""

    @property
    def stragglers(self) -> list[RankTimes]:
        """The ranks at `threshold` × their peers' median compute or more, slowest first."""
        slow = [r for r in self.ranks if r.ratio >= self.threshold]
        return sorted(slow, key=lambda r: (-r.ratio, r.rank))

    @staticmethod
    def peer_median(r: RankTimes) -> float:
        """The median compute per step of `r`'s peers."""
        return r.compute / r.ratio

    def console_line(self, most: int = NAMED_ON_CONSOLE) -> str | None:
        """One line naming up to `most` stragglers ("and N more" for the rest); None when none."""
        slow = self.stragglers
        if not slow:
            return None
        whose = "its stage's median" if self.peers_by_stage else "the median"
        parts = []
        for i, r in enumerate(slow[:most]):
            what = f"{whose} compute " if i == 0 else ""
            per = " per step" if i == 0 else ""
            parts.append(
                f"rank {r.rank} ({r.host}) {r.ratio:.2f}× {what}"
                f"({r.compute:.3f} s vs {self.peer_median(r):.3f} s{per})"
            )
        more = f"; and {len(slow) - most} more" if len(slow) > most else ""
        return f"stragglers steps {self.first}-{self.last}: " + "; ".join(parts) + more + f" ({TSV_NAME})"

    def metrics(self) -> dict[str, float | int]:
        """The window's summary for metrics.jsonl and TensorBoard (`straggler/NAME`)."""
        worst = max(self.ranks, key=lambda r: (r.ratio, -r.rank))
        return {
            "max_ratio": worst.ratio,
            "slowest_rank": worst.rank,
            "count": len(self.stragglers),
            "median_compute_s": statistics.median(r.compute for r in self.ranks),
            "median_wait_s": statistics.median(r.wait for r in self.ranks),
            "median_step_s": statistics.median(r.step for r in self.ranks),
        }

    def tsv_rows(self) -> str:
        return "".join(
            f"{self.last}\t{r.rank}\t{r.host}\t{r.stage}\t{r.compute:.6f}\t{r.wait:.6f}\t{r.step:.6f}\t{r.ratio:.4f}\n"
            for r in self.ranks
        )


def summarize(
    first: int, last: int, sums: list[list[float]], hosts: list[str], steps: int, threshold: float
) -> WindowReport:
    """The report of a window of `steps` steps from every rank's sums `[compute, wait, step, stage]`
    (index = rank): each rank's compute per step over the median of its pipeline stage's ranks,
    or of all ranks when every stage has one rank."""
    stages = [int(s[3]) for s in sums]
    by_stage = len(set(stages)) < len(sums)
    ranks = []
    for rank, (compute, wait, step, _) in enumerate(sums):
        peers = [s[0] for s in sums if not by_stage or int(s[3]) == stages[rank]]
        median = statistics.median(peers)
        ratio = compute / median if median > 0 else 1.0
        ranks.append(
            RankTimes(rank, hosts[rank], stages[rank], compute / steps, wait / steps, step / steps, ratio)
        )
    return WindowReport(first, last, threshold, ranks, by_stage and len(set(stages)) > 1)


class StragglerDetector:
    """Per-rank compute and wait over windows of `window` steps, compared across ranks on rank 0.

    Every rank calls `step()` after each training step with the same iteration numbers: the
    window's all-gather is a collective. `window` = 0 disables everything (no collective)."""

    def __init__(self, cfg: Config, clock: WorkClock, stage: int, device: torch.device, report: bool):
        """`cfg`: train.resilience.straggler_window and _threshold, run_dir; `stage`: this rank's pipeline
        rank; `report`: whether this rank (rank 0) writes the reports."""
        r = cfg.train.resilience
        self.window, self.threshold = r.straggler_window, r.straggler_threshold
        self.clock, self.stage, self.device, self.report = clock, stage, device, report
        self.tsv = Path(cfg.run_dir) / TSV_NAME
        self._first: int | None = None
        self._steps = 0
        self._step_seconds = 0.0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.hosts = [socket.gethostname()]
        if self.window and self.world > 1:
            self.hosts = [""] * self.world
            dist.all_gather_object(self.hosts, socket.gethostname())
        clock.take()  # spans timed before train() (a train_step called directly) are in no window

    def step(self, iteration: int, seconds: float, log=None) -> WindowReport | None:
        """Count one training step of `seconds` (its whole wall time) ending at `iteration`; at
        every `window`-th iteration gather and report. Returns the report on rank 0 at a window's
        end, else None. `log`: a `MetricsLogger` for metrics.jsonl and TensorBoard."""
        if not self.window:
            return None
        if self._first is None:
            self._first = iteration
        self._steps += 1
        self._step_seconds += seconds
        if iteration % self.window:
            return None
        compute = self.clock.take()
        mine = torch.tensor(
            [compute, self._step_seconds - compute, self._step_seconds, float(self.stage)],
            dtype=torch.float64,
            device=self.device,
        )
        parts = [mine]
        if self.world > 1:
            parts = [torch.empty_like(mine) for _ in range(self.world)]
            dist.all_gather(parts, mine)
        first, steps = self._first, self._steps
        self._first, self._steps, self._step_seconds = None, 0, 0.0
        if not self.report:
            return None
        sums = [p.tolist() for p in parts]
        out = summarize(first, iteration, sums, self.hosts, steps, self.threshold)
        self._write(out, log)
        return out

    def restart(self) -> None:
        """Drop the window under way, its own work included (a rollback: the steps after the
        checkpoint run again and would count twice). Every rank rolls back at the same step, so
        the windows stay aligned."""
        self.clock.take()
        self._first, self._steps, self._step_seconds = None, 0, 0.0

    def _write(self, out: WindowReport, log) -> None:
        line = out.console_line()
        if line:
            console.print(f"[bold yellow]{line}[/]", highlight=False)
        if log is not None:
            log.log(out.last, out.metrics(), prefix="straggler")
        self.tsv.parent.mkdir(parents=True, exist_ok=True)
        with open(self.tsv, "a", encoding="utf-8") as f:
            if f.tell() == 0:
                f.write(TSV_HEADER)
            f.write(out.tsv_rows())
