"""Pipeline schedules on a clock: simulate, measure the bubble, draw as text or PNG.

`timeline` plays the per-rank action lists of `mlm.parallel.schedules` as an event simulation:
each rank runs its actions strictly in order, and an action starts when its rank is free and the
action it depends on has ended (plus a p2p latency when that action ran on another rank):

    F(s, m) needs F(s − 1, m)           the activation from the previous virtual stage
    B(s, m) needs B(s + 1, m)           the gradient from the next virtual stage
    B(S − 1, m) needs F(S − 1, m)       the last stage turns its forward round

with S = pp·vpp virtual stages, stage s living on rank s % pp as chunk s // pp. Costs are per
chunk: a rank's whole model costs f_cost forward and b_cost backward, so one of its vpp chunks
costs f_cost / vpp and b_cost / vpp.

`idle_fraction` measures the bubble of each rank, to set beside `bubble_fraction`'s formula;
`render_text` draws the timeline as rich text (one row per rank), `save_png` with matplotlib,
and `describe_schedule` names a schedule and its predicted bubble in one line.
"""

from __future__ import annotations

import math
import os
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from rich.text import Text

from mlm.parallel.schedules import Action, bubble_fraction, check_pipeline, schedule


@dataclass(slots=True)
class Slot:
    """One action of one rank on the clock, from `start` to `end`."""

    rank: int
    start: float
    end: float
    action: Action


def _compile(
    order: list[Action], rank: int, pp: int, vpp: int, costs: tuple[float, float, float]
) -> list[tuple[int, int, float, float]]:
    """Each action of `rank` as (key, key of its dependency or -1, p2p latency after it, duration).

    A key numbers (micro, virtual stage, kind) as ((micro·S + stage)·2 + is_backward), so the
    dependency of F(s) is key − 2, of B(s) key + 2, and of B(S − 1) key − 1.
    """
    f_cost, b_cost, p2p_cost = costs
    num_stages = pp * vpp
    hop = p2p_cost if pp > 1 else 0.0  # F(s − 1) and B(s + 1) live on the neighbouring rank
    out = []
    for a in order:
        kind, chunk, micro = a.kind, a.chunk, a.micro
        if not 0 <= chunk < vpp or micro < 0 or kind not in ("F", "B"):
            raise ValueError(
                f"rank {rank}: malformed action {a!r} (kind F or B, 0 <= chunk < vpp={vpp}, micro >= 0)"
            )
        stage = chunk * pp + rank
        base = (micro * num_stages + stage) * 2
        if kind == "F":
            out.append((base, base - 2 if stage else -1, hop, f_cost))
        elif stage < num_stages - 1:
            out.append((base + 1, base + 3, hop, b_cost))
        else:
            out.append((base + 1, base, 0.0, b_cost))
    return out


def timeline(
    pp: int,
    num_micro: int,
    vpp: int = 1,
    f_cost: float = 1.0,
    b_cost: float = 2.0,
    p2p_cost: float = 0.0,
    orders: list[list[Action]] | None = None,
) -> list[list[Slot]]:
    """The slots of each rank when one step of `schedule(pp, r, num_micro, vpp)` is simulated.

    `orders` replaces the schedule with hand-made per-rank action lists (one list per rank, every
    chunk below vpp), e.g. to try a new schedule or show a broken one. RuntimeError if the ranks
    wait on each other for ever (a deadlocking order), ValueError on an action that is malformed
    or appears twice on a rank.
    """
    if orders is None:
        orders = [schedule(pp, r, num_micro, vpp) for r in range(pp)]
    if len(orders) != pp:
        raise ValueError(f"orders has {len(orders)} rank lists, expected pp={pp}")
    costs = (f_cost / vpp, b_cost / vpp, p2p_cost)
    programs = [_compile(order, r, pp, vpp, costs) for r, order in enumerate(orders)]
    end: dict[int, float] = {}
    waiting: dict[int, int] = {}  # the key a blocked rank waits for -> that rank
    free = [0.0] * pp
    pos = [0] * pp
    starts: list[list[float]] = [[] for _ in range(pp)]
    ends: list[list[float]] = [[] for _ in range(pp)]
    ready = deque(range(pp))
    while ready:  # run a rank until it blocks; a finished action wakes the rank waiting for it
        r = ready.popleft()
        program, rank_starts, rank_ends = programs[r], starts[r], ends[r]
        i, t = pos[r], free[r]
        while i < len(program):
            key, dep, wait, duration = program[i]
            if dep >= 0:
                ready_at = end.get(dep)
                if ready_at is None:
                    waiting[dep] = r
                    break
                ready_at += wait
                if ready_at > t:
                    t = ready_at
            rank_starts.append(t)
            t += duration
            rank_ends.append(t)
            end[key] = t
            i += 1
            woken = waiting.pop(key, None)
            if woken is not None:
                ready.append(woken)
        pos[r], free[r] = i, t
    if sum(pos) != len(end):  # an action ran twice and overwrote its own end time
        for r, order in enumerate(orders):
            seen: set[Action] = set()
            for a in order[: pos[r]]:
                if a in seen:
                    raise ValueError(f"rank {r}: action {a} appears twice")
                seen.add(a)
    stuck = [r for r in range(pp) if pos[r] < len(orders[r])]
    if stuck:
        detail = "; ".join(
            f"rank {r} stuck at {orders[r][pos[r]]} (action {pos[r] + 1} of {len(orders[r])})" for r in stuck
        )
        raise RuntimeError(f"the pipeline schedule deadlocks: {detail}")
    return [
        [Slot(r, s, e, a) for s, e, a in zip(starts[r], ends[r], orders[r], strict=True)] for r in range(pp)
    ]


def _makespan(tl: list[list[Slot]]) -> float:
    """Last end minus first start over all ranks (the first start is 0 in a `timeline`)."""
    if not any(tl):
        return 0.0
    return max(rank[-1].end for rank in tl if rank) - min(rank[0].start for rank in tl if rank)


def idle_fraction(tl: list[list[Slot]]) -> list[float]:
    """Per rank, the fraction of the step (first start to last end over all ranks) it sits idle."""
    span = _makespan(tl)
    if span <= 0:
        return [0.0] * len(tl)
    return [1.0 - sum(s.end - s.start for s in rank) / span for rank in tl]


def _shape(tl: list[list[Slot]]) -> tuple[int, int, int]:
    """(pp, num_micro, vpp) of a timeline, read off its actions."""
    actions = [s.action for rank in tl for s in rank]
    num_micro = max((a.micro for a in actions), default=-1) + 1
    vpp = max((a.chunk for a in actions), default=0) + 1
    return len(tl), num_micro, vpp


def _formula(pp: int, vpp: int) -> str:
    return "(pp−1)/(m+pp−1)" if vpp == 1 else "(pp−1)/(vpp·m+pp−1)"


def describe_schedule(pp: int, num_micro: int, vpp: int = 1) -> str:
    """One line naming the schedule and its predicted bubble."""
    check_pipeline(pp, vpp, num_micro)
    if pp == 1:
        return f"no pipelining (gradient accumulation), m={num_micro}"
    bubble = f"bubble {_formula(pp, vpp)} = {bubble_fraction(pp, num_micro, vpp):.1%}"
    if vpp == 1:
        return f"1F1B, pp={pp}, m={num_micro}: {bubble}"
    return f"interleaved 1F1B, pp={pp}, vpp={vpp}, m={num_micro}: {bubble}"


# Chunks 0 and 1 differ even in a 16-colour terminal; chunks 2 and 3 need 256 colours.
_F_STYLES = ["bold white on blue", "bold white on magenta", "bold black on cyan", "bold white on purple4"]
_B_STYLES = [
    "bold black on green",
    "bold black on bright_green",
    "bold white on dark_green",
    "bold black on sea_green3",
]
_IDLE_STYLE = "dim"


def _style(a: Action) -> str:
    styles = _F_STYLES if a.kind == "F" else _B_STYLES
    return styles[a.chunk % len(styles)]


def render_text(tl: list[list[Slot]], width: int | None = None) -> Text:
    """The timeline as rich text: a row per rank, a legend line and a bubble summary line.

    Time goes in cells of the shortest action's duration, widened so a row fits `width` cells
    (default 120). A cell shows the action running at its middle: the last digit of the
    micro-batch on a blue-ish (forward) or green-ish (backward) background, one shade per chunk;
    '·' is idle.
    """
    width = 120 if width is None else max(1, width)
    pp, num_micro, vpp = _shape(tl)
    span = _makespan(tl)
    durations = [s.end - s.start for rank in tl for s in rank if s.end > s.start]
    cell = min(durations, default=1.0)
    cells = max(1, math.ceil(span / cell - 1e-9)) if span > 0 else 0
    if cells > width:
        cell, cells = span / width, width
    label = len(str(max(pp - 1, 0)))
    out = Text()
    for r, rank in enumerate(tl):
        out.append(f"rank {r:>{label}} │", style="bold")
        i = 0
        for c in range(cells):
            t = (c + 0.5) * cell
            while i < len(rank) and rank[i].end <= t:
                i += 1
            if i < len(rank) and rank[i].start <= t:
                a = rank[i].action
                out.append(str(a.micro % 10), style=_style(a))
            else:
                out.append("·", style=_IDLE_STYLE)
        out.append("\n")
    out.append(" " * (label + 6) + "legend: ")
    for kind, name in (("F", "forward"), ("B", "backward")):
        for chunk in range(vpp):
            out.append(" 0 ", style=_style(Action(kind, chunk, 0)))
            out.append(f" {name}" + (f" chunk {chunk}" if vpp > 1 else "") + "  ")
    out.append("·", style=_IDLE_STYLE)
    out.append(f" idle   digit = micro-batch mod 10, one cell = {cell:.3g} time\n")
    idle = idle_fraction(tl)
    lo, hi = min(idle, default=0.0), max(idle, default=0.0)
    measured = f"{lo:.1%}" if f"{lo:.1%}" == f"{hi:.1%}" else f"{lo:.1%}–{hi:.1%}"
    formula = bubble_fraction(pp, num_micro, vpp) if pp and num_micro else 0.0
    out.append(
        f"bubble: measured {measured} per rank, formula {_formula(pp, vpp)} = {formula:.1%}",
        style="bold",
    )
    return out


def _shade(cmap_name: str, chunk: int, vpp: int) -> tuple[float, float, float, float]:
    import matplotlib

    cmap = matplotlib.colormaps[cmap_name]
    return cmap(0.85 - 0.35 * chunk / (vpp - 1)) if vpp > 1 else cmap(0.7)


def save_png(tl: list[list[Slot]], path: str | os.PathLike[str], title: str = "") -> None:
    """Draw the timeline with matplotlib (rank 0 at the top) and write it to `path` as a PNG.

    The file appears whole or not at all: it is written under a temporary name beside `path`
    and renamed into place.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    pp, num_micro, vpp = _shape(tl)
    span = _makespan(tl) or 1.0
    fig_w, dpi = 14.0, 100
    row = min(0.45, 14.0 / max(pp, 1))  # inches per rank, at most about 16 inches in all
    fig, ax = plt.subplots(figsize=(fig_w, 1.6 + row * max(pp, 1)), dpi=dpi, layout="constrained")
    try:
        # Pixels per time unit along x, to decide whether a micro-batch number fits in its box.
        px_per_unit = fig_w * dpi * 0.8 / span
        colors = {
            (kind, c): _shade("Blues" if kind == "F" else "Greens", c, vpp)
            for kind in "FB"
            for c in range(vpp)
        }
        for r, rank in enumerate(tl):
            y = pp - 1 - r
            groups: dict[tuple[str, int], list[tuple[float, float]]] = {}
            for s in rank:
                groups.setdefault((s.action.kind, s.action.chunk), []).append((s.start, s.end - s.start))
            for key, bars in groups.items():
                ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=colors[key], edgecolor="white", linewidth=0.5)
            for s in rank:
                text = str(s.action.micro)
                if (s.end - s.start) * px_per_unit >= 7 * len(text) + 4:
                    red, green, blue, _ = colors[(s.action.kind, s.action.chunk)]
                    ink = "white" if 0.299 * red + 0.587 * green + 0.114 * blue < 0.5 else "black"
                    ax.text((s.start + s.end) / 2, y, text, ha="center", va="center", fontsize=8, color=ink)
        ax.set_yticks(range(pp), [f"rank {r}" for r in reversed(range(pp))])
        ax.set_ylim(-0.6, pp - 0.4)
        ax.set_xlim(0, span)
        ax.set_xlabel("time (forward of one stage = 1)")
        idle = idle_fraction(tl)
        shape = f"pp={pp}" + (f", vpp={vpp}" if vpp > 1 else "") + f", m={num_micro}"
        ax.set_title(title or f"pipeline schedule {shape}: bubble {max(idle, default=0.0):.1%}")
        handles = [
            Patch(color=colors[(kind, c)], label=f"{name}" + (f" chunk {c}" if vpp > 1 else ""))
            for kind, name in (("F", "forward"), ("B", "backward"))
            for c in range(vpp)
        ]
        fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 4))
        target = Path(path)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                fig.savefig(f, format="png")
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    finally:
        plt.close(fig)
