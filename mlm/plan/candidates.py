"""A layout's predicted memory and step time (`Candidate`), and a family's candidates found with
as little work as the answer allows.

Memory first, time only what fits: a family's (tp, pp) layouts (`mlm.plan.search`) are sized in
order, a layout's ranks stopping at the first over the GPU, and a layout is timed only when its
memory fits. Before sizing, each layout's floor (`mlm.plan.memory.state_floor`: the weights,
gradients and optimizer state of a report rank plus the headroom, per stage split, ep, optimizer
sharding and cp) is compared with the GPU: every other component only adds to it, so a floor above
the GPU rules out every micro-batch and recompute of that mesh and sharding unseen (llama3-70b on
512 H100s: 5,763 of 14,604 layouts are never sized; the 3,214 that fit are timed). Where none of
a family fits, the layout needing the least memory still explains why (`search.why_not`): the
family is sized again from the lowest floor up, stopping at the first floor above the least found
(the rest can only need more), ties going to the first in order as in the exhaustive search, and
only that layout is timed.

The terms many layouts share (a rank's stage, its model state, a layer's bytes and seconds at a
micro-batch) are computed once per search (`Shared`, `mlm.plan.memo`); `exhaustive` evaluates
every layout afresh instead, the reference the pruned search is tested against
(tests/plan/test_plan_prune.py) and timed beside it (bench/plan_speed.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from mlm.layout import Layout
from mlm.plan.job import Job
from mlm.plan.memory import (
    MemoryReport,
    Stage,
    floor_key,
    memory,
    rank_stage,
    report_ranks,
    state_floor,
)
from mlm.plan.timing import Timing, step_time


@dataclass
class Candidate:
    layout: Layout
    memory: MemoryReport
    timing: Timing

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.memory.hbm


class Shared:
    """What the layouts of one search share: each pipeline rank's `Stage` (per tp, pp, vpp, stage
    split, ep and rank) and, unless `memoize` is False, the memory and time models' terms (`memo`)."""

    def __init__(self, job: Job, memoize: bool = True):
        self.job, self.stages = job, {}
        self.memo: dict | None = {} if memoize else None

    @staticmethod
    def stage_key(lo: Layout) -> tuple:
        """What a layout's stages depend on: tp, pp, vpp, the stage split and ep."""
        return lo.tp, lo.pp, lo.vpp, lo.first_stage_layers, lo.last_stage_layers, lo.ep

    def held(self, lo: Layout) -> dict[int, Stage]:
        """{pp rank: its stage} for the ranks whose memory and time stand for all (`report_ranks`)."""
        key = self.stage_key(lo)
        if key not in self.stages:
            cfg, memo = self.job.cfg, self.memo
            self.stages[key] = {r: rank_stage(cfg, *key[:3], r, *key[3:], memo) for r in report_ranks(lo.pp)}
        return self.stages[key]


def evaluate(job: Job, layout: Layout, shared: Shared | None = None) -> Candidate:
    """Memory and time of one layout (assumed valid); every term afresh without `shared`."""
    shared = shared or Shared(job, memoize=False)
    held = shared.held(layout)
    mem = memory(job.cfg, layout, job.hardware.hbm_bytes, held, shared.memo)
    return Candidate(layout, mem, step_time(job, layout, list(held.values()), shared.memo))


@dataclass
class Family:
    """One family's candidates (`family`)."""

    fitting: list[Candidate]
    """The layouts that fit, in the order given, each timed."""
    least: Candidate | None
    """Where none fits, the first layout needing the least memory (timed too); else None."""
    layouts: int
    sized: int
    """Layouts whose memory was computed (the others' floor is above the GPU)."""


def family(job: Job, layouts: Iterable[Layout], shared: Shared, exhaustive: bool = False) -> Family:
    """The candidates of one family's `layouts` (see the module doc): those that fit, or the least
    memory one; `exhaustive`: evaluate each layout whole, with no floor and no shared terms."""
    if exhaustive:
        return _every(job, layouts, shared)
    cfg, hbm, memo = job.cfg, job.hardware.hbm_bytes, shared.memo
    floors: dict[tuple, float] = {}  # the floor of each mesh, stage split, ep, sharding (`floor_key`) and cp
    seen: list[tuple[Layout, dict[int, Stage], float]] = []
    fitting: list[Candidate] = []
    for lo in layouts:
        held = shared.held(lo)
        key = (shared.stage_key(lo), floor_key(lo), lo.cp)
        floor = floors.get(key)
        if floor is None:
            floor = floors[key] = max(state_floor(cfg, lo, st, hbm, memo) for st in held.values())
        seen.append((lo, held, floor))
        if floor > hbm:
            continue
        mem = memory(cfg, lo, hbm, held, memo, cap=hbm)
        if mem.total <= hbm:
            fitting.append(Candidate(lo, mem, step_time(job, lo, list(held.values()), memo)))
    sized = sum(1 for *_, floor in seen if floor <= hbm)
    if fitting or not seen:
        return Family(fitting, None, len(seen), sized)
    # none fits: the first layout needing the least memory, sized from the lowest floor up; one
    # whose floor exceeds the least so far (and every one after it) can only need more
    least: tuple[float, int, Layout, dict[int, Stage], MemoryReport] | None = None
    for i in sorted(range(len(seen)), key=lambda i: seen[i][2]):
        lo, held, floor = seen[i]
        if least is not None and floor > least[0]:
            break
        sized += floor > hbm
        mem = memory(cfg, lo, hbm, held, memo, cap=None if least is None else least[0])
        if least is None or (mem.total, i) < least[:2]:
            least = (mem.total, i, lo, held, mem)
    _, _, lo, held, mem = least
    return Family([], Candidate(lo, mem, step_time(job, lo, list(held.values()), memo)), len(seen), sized)


def _every(job: Job, layouts: Iterable[Layout], shared: Shared) -> Family:
    fitting: list[Candidate] = []
    least: Candidate | None = None
    n = 0
    for lo in layouts:
        c = evaluate(job, lo, shared)
        n += 1
        if c.fits:
            fitting.append(c)
        elif least is None or c.memory.total < least.memory.total:
            least = c
    return Family(fitting, None if fitting else least, n, n)
