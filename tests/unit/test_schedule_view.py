"""The schedule simulator against the bubble formulas, the schedules' invariants, and its drawings."""

from __future__ import annotations

import pytest

from mlm.parallel.schedule_view import (
    Slot,
    describe_schedule,
    idle_fraction,
    render_text,
    save_png,
    timeline,
)
from mlm.parallel.schedules import Action, bubble_fraction, schedule

ONE_F_ONE_B = [(2, 4), (4, 8), (4, 16), (8, 8)]
INTERLEAVED = [(2, 4, 2), (4, 8, 2), (4, 8, 4), (2, 8, 3)]
COSTS = [(1.0, 2.0), (1.0, 1.0)]  # (f_cost, b_cost): the default, and the formula's equal costs


@pytest.mark.parametrize("f_cost, b_cost", COSTS)
@pytest.mark.parametrize("pp, m", ONE_F_ONE_B)
def test_1f1b_idle_matches_formula_on_every_rank(pp: int, m: int, f_cost: float, b_cost: float) -> None:
    idle = idle_fraction(timeline(pp, m, f_cost=f_cost, b_cost=b_cost))
    assert len(idle) == pp
    for fraction in idle:
        assert fraction == pytest.approx(bubble_fraction(pp, m), abs=1e-9)


# The interleaved schedule matches (pp − 1)/(vpp·m + pp − 1) exactly too, with B twice F as well as
# with equal costs: every rank idles for pp − 1 chunk forwards and pp − 1 chunk backwards,
# (pp − 1)·(f + b)/vpp, against m·(f + b) of work. (A sweep of pp ≤ 8, vpp ≤ 4, m ≤ 32 and
# b/f in {1/2, 1, 2, 3} found no case off the formula, so the tolerance stays at 1e-9.)
@pytest.mark.parametrize("f_cost, b_cost", COSTS)
@pytest.mark.parametrize("pp, m, vpp", INTERLEAVED)
def test_interleaved_idle_matches_formula_on_every_rank(
    pp: int, m: int, vpp: int, f_cost: float, b_cost: float
) -> None:
    idle = idle_fraction(timeline(pp, m, vpp, f_cost=f_cost, b_cost=b_cost))
    assert len(idle) == pp
    for fraction in idle:
        assert fraction == pytest.approx(bubble_fraction(pp, m, vpp), abs=1e-9)


def test_no_pipelining_has_no_bubble() -> None:
    assert idle_fraction(timeline(1, 4)) == [0.0]


def test_p2p_latency_adds_to_the_bubble() -> None:
    idle = idle_fraction(timeline(4, 8, p2p_cost=0.25))
    assert all(fraction > bubble_fraction(4, 8) + 0.01 for fraction in idle)


@pytest.mark.parametrize("pp, m", ONE_F_ONE_B + [(4, 2), (8, 32)])
def test_1f1b_keeps_at_most_pp_minus_rank_forwards_in_flight(pp: int, m: int) -> None:
    for rank, slots in enumerate(timeline(pp, m)):
        in_flight = peak = 0
        for slot in sorted(slots, key=lambda s: s.start):
            in_flight += 1 if slot.action.kind == "F" else -1
            peak = max(peak, in_flight)
        assert in_flight == 0
        assert peak <= pp - rank
        assert peak == min(pp - rank, m)  # the warm-up forwards plus the steady state's one


def _check_dependencies(tl: list[list[Slot]], pp: int, m: int, vpp: int, p2p_cost: float) -> None:
    """Every action once, on its rank, in schedule order, no overlap, and no start before its input."""
    num_stages = pp * vpp
    by_key: dict[tuple[str, int, int], Slot] = {}
    for rank, slots in enumerate(tl):
        assert [s.action for s in slots] == schedule(pp, rank, m, vpp)
        for before, after in zip(slots, slots[1:], strict=False):
            assert before.end <= after.start + 1e-12
        for s in slots:
            assert s.rank == rank and s.end > s.start >= 0
            by_key[(s.action.kind, s.action.chunk * pp + rank, s.action.micro)] = s
    assert set(by_key) == {(k, st, mi) for k in "FB" for st in range(num_stages) for mi in range(m)}
    for (kind, stage, micro), s in by_key.items():
        if kind == "F":
            dep = by_key.get(("F", stage - 1, micro)) if stage > 0 else None
        elif stage < num_stages - 1:
            dep = by_key[("B", stage + 1, micro)]
        else:
            dep = by_key[("F", stage, micro)]
        if dep is not None:
            latency = p2p_cost if dep.rank != s.rank else 0.0
            assert s.start >= dep.end + latency - 1e-9, (s, dep)


@pytest.mark.parametrize("p2p_cost", [0.0, 0.3])
@pytest.mark.parametrize(
    "pp, m, vpp", [(p, m, 1) for p, m in ONE_F_ONE_B] + INTERLEAVED + [(1, 3, 1), (4, 2, 1)]
)
def test_dependencies_respected(pp: int, m: int, vpp: int, p2p_cost: float) -> None:
    _check_dependencies(timeline(pp, m, vpp, f_cost=1.0, b_cost=2.0, p2p_cost=p2p_cost), pp, m, vpp, p2p_cost)


def test_slot_durations_are_per_chunk() -> None:
    tl = timeline(2, 4, 2, f_cost=1.0, b_cost=3.0)
    for slots in tl:
        for s in slots:
            assert s.end - s.start == pytest.approx(0.5 if s.action.kind == "F" else 1.5)


@pytest.mark.parametrize(
    "orders, stuck",
    [
        # rank 0 wants the gradient of micro-batch 0 before it has sent its activation
        ([[Action("B", 0, 0), Action("F", 0, 0)], [Action("F", 0, 0), Action("B", 0, 0)]], ["B0", "F0"]),
        # every rank insists on a backward first: the last stage cannot turn a forward it never ran
        ([[Action("B", 0, 0), Action("F", 0, 0)], [Action("B", 0, 0), Action("F", 0, 0)]], ["B0", "B0"]),
    ],
)
def test_deadlocking_order_raises(orders: list[list[Action]], stuck: list[str]) -> None:
    with pytest.raises(RuntimeError, match="deadlock") as info:
        timeline(2, 1, orders=orders)
    for rank, action in enumerate(stuck):
        assert f"rank {rank} stuck at {action}" in str(info.value)


def test_orders_override_the_schedule() -> None:
    # GPipe: all forwards, then all backwards; a valid order, with more forwards in flight
    orders = [[Action(k, 0, i) for k in "FB" for i in range(4)] for _ in range(2)]
    tl = timeline(2, 4, orders=orders)
    assert [s.action for s in tl[0]] == orders[0]
    assert idle_fraction(tl) == pytest.approx([bubble_fraction(2, 4)] * 2)


def test_malformed_orders_raise() -> None:
    with pytest.raises(ValueError, match="chunk"):
        timeline(2, 1, orders=[[Action("F", 1, 0)], []])
    with pytest.raises(ValueError, match="twice"):
        timeline(1, 1, orders=[[Action("F", 0, 0), Action("F", 0, 0)]])
    with pytest.raises(ValueError, match="pp=2"):
        timeline(2, 1, orders=[[]])


def test_large_schedule_runs() -> None:
    tl = timeline(64, 512, 4)
    assert sum(len(slots) for slots in tl) == 64 * 512 * 4 * 2
    assert idle_fraction(tl)[0] == pytest.approx(bubble_fraction(64, 512, 4), abs=1e-9)


@pytest.mark.parametrize("pp, m, vpp", [(4, 8, 1), (2, 4, 2), (1, 3, 1), (8, 64, 2)])
def test_render_text(pp: int, m: int, vpp: int) -> None:
    text = render_text(timeline(pp, m, vpp), width=80)
    lines = text.plain.splitlines()
    rows = [line for line in lines if line.startswith("rank")]
    assert len(rows) == pp and len(lines) == pp + 2
    assert "legend" in lines[pp]
    assert f"= {bubble_fraction(pp, m, vpp):.1%}" in lines[-1]
    assert f"measured {bubble_fraction(pp, m, vpp):.1%} per rank" in lines[-1]
    cells = {len(row.split("│", 1)[1]) for row in rows}
    assert len(cells) == 1 and cells.pop() <= 80
    styles = {str(span.style) for span in text.spans}
    assert any("on blue" in style for style in styles) and any("on green" in style for style in styles)


def test_render_text_shows_micro_digits() -> None:
    row = render_text(timeline(2, 4)).plain.splitlines()[0]
    # one cell per forward (the shortest action), two per backward
    assert row.split("│", 1)[1] == "01··00211322·33"


def test_save_png(tmp_path) -> None:
    path = tmp_path / "schedule.png"
    save_png(timeline(4, 8, 2), path, title="interleaved")
    assert path.read_bytes().startswith(b"\x89PNG")
    assert [p.name for p in tmp_path.iterdir()] == ["schedule.png"]
    save_png(timeline(2, 4), str(path))  # overwrites in place
    assert path.read_bytes().startswith(b"\x89PNG")
    assert [p.name for p in tmp_path.iterdir()] == ["schedule.png"]


def test_describe_schedule() -> None:
    assert describe_schedule(4, 8) == "1F1B, pp=4, m=8: bubble (pp−1)/(m+pp−1) = 27.3%"
    assert (
        describe_schedule(2, 4, 2) == "interleaved 1F1B, pp=2, vpp=2, m=4: bubble (pp−1)/(vpp·m+pp−1) = 11.1%"
    )
    assert describe_schedule(1, 4) == "no pipelining (gradient accumulation), m=4"
