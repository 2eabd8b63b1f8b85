"""Straggler detection (`mlm.train.stragglers`): the window arithmetic without processes, a
disabled detector that never calls a collective, and real gloo ranks where one rank is slowed by
a fixed delay in its forward and must be named, alone, with the ratio the delay gives.

The ranks run one thread each (3 ranks on 2 shared cores; with torch's default 2 threads each
the ranks' compute per step was measured at 1-2 s instead of 0.015-0.03 s). The delay, 0.1 s
per micro-batch (0.2 s per step), is large against the ranks' step-to-step noise, and the test
threshold, 2, is far above the unslowed ranks' ratios (measured 0.79-1.0) and far below the
slowed rank's (measured 6.8-14.8).
"""

from __future__ import annotations

import json
import statistics
import time

import pytest
import torch

from mlm.config import load_config
from mlm.train import stragglers
from mlm.train.stragglers import TSV_HEADER, StragglerDetector, WorkClock, summarize
from mlm.train.trainer import Trainer
from tests.helpers.common import tiny_sets
from tests.helpers.distributed import run_ranks


def _sums(computes: list[float], stages: list[int] | None = None, steps: int = 10) -> list[list[float]]:
    """Window sums [compute, wait, step, stage] for ranks whose steps all take 1 s."""
    stages = stages or [0] * len(computes)
    return [[c * steps, (1 - c) * steps, 1.0 * steps, s] for c, s in zip(computes, stages, strict=True)]


def test_summarize_median_threshold_and_more():
    computes = [0.2, 0.2, 0.21, 0.304, 0.5, 0.2, 0.26, 0.239]
    hosts = [f"node{r // 4}" for r in range(8)]
    out = summarize(21, 40, _sums(computes), hosts, steps=10, threshold=1.2)
    median = statistics.median(computes)  # 0.21 + 0.239 over 2 = 0.2245
    assert [r.ratio for r in out.ranks] == pytest.approx([c / median for c in computes], rel=1e-12)
    assert [r.compute for r in out.ranks] == pytest.approx(computes, rel=1e-12)
    assert [r.wait for r in out.ranks] == pytest.approx([1 - c for c in computes], rel=1e-12)
    # at 1.2 x 0.2245 = 0.2694 or more: 0.5 and 0.304, not 0.26
    assert [r.rank for r in out.stragglers] == [4, 3]
    assert out.console_line() == (
        "stragglers steps 21-40: rank 4 (node1) 2.23× the median compute (0.500 s vs 0.225 s per step); "
        "rank 3 (node0) 1.35× (0.304 s vs 0.225 s) (stragglers.tsv)"
    )
    assert out.console_line(most=1).endswith("per step); and 1 more (stragglers.tsv)")
    m = out.metrics()
    assert m["slowest_rank"] == 4 and m["count"] == 2
    assert m["max_ratio"] == pytest.approx(0.5 / median, rel=1e-12)
    assert m["median_compute_s"] == pytest.approx(median, rel=1e-12)
    assert m["median_wait_s"] == pytest.approx(1 - median, rel=1e-12)
    rows = out.tsv_rows().splitlines()
    assert len(rows) == 8 and rows[4].split("\t") == [
        "40",
        "4",
        "node1",
        "0",
        "0.500000",
        "0.500000",
        "1.000000",
        "2.2272",
    ]
    # nobody at the threshold: no line
    assert summarize(1, 10, _sums([0.2, 0.21, 0.2]), ["h"] * 3, 10, 1.2).console_line() is None


def test_summarize_compares_ranks_of_the_same_pipeline_stage():
    # pp = 2, dp = 3: the last stage (ranks 1, 3, 5) holds the output layer and computes more
    computes = [0.2, 0.3, 0.2, 0.3, 0.2, 0.45]
    out = summarize(1, 10, _sums(computes, stages=[0, 1, 0, 1, 0, 1]), ["h"] * 6, 10, 1.2)
    assert [r.ratio for r in out.ranks] == pytest.approx([1, 1, 1, 1, 1, 1.5], rel=1e-12)
    assert [r.rank for r in out.stragglers] == [5]
    assert "its stage's median compute (0.450 s vs 0.300 s per step)" in out.console_line()
    # one rank per stage (pp = world size): all ranks are peers
    out = summarize(1, 10, _sums([0.2, 0.3, 0.2], stages=[0, 1, 2]), ["h"] * 3, 10, 1.2)
    assert [r.rank for r in out.stragglers] == [1] and "the median compute" in out.console_line()


def test_window_zero_does_nothing(tmp_path, tiny_data, monkeypatch):
    def no_collective(*args, **kw):
        raise AssertionError("a collective with train.resilience.straggler_window=0")

    monkeypatch.setattr(stragglers.dist, "all_gather", no_collective)
    monkeypatch.setattr(stragglers.dist, "all_gather_object", no_collective)
    cfg = load_config(None, tiny_sets(tmp_path, tiny_data, **{"train.resilience.straggler_window": 0}))
    clock = WorkClock(torch.device("cpu"), enabled=False)
    with clock.span():
        time.sleep(0.01)
    assert clock.take() == 0.0
    detector = StragglerDetector(cfg, clock, 0, torch.device("cpu"), report=True)
    assert all(detector.step(i, 0.1) is None for i in range(1, 41))
    trainer = Trainer(cfg)
    trainer.train()
    assert not (tmp_path / "stragglers.tsv").exists()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records and all(r["split"] != "straggler" for r in records)


def test_one_process_reports_each_window(tmp_path, tiny_data):
    """World 1: a row and a record per window, the columns adding up, compute a share of the step."""
    Trainer(
        load_config(None, tiny_sets(tmp_path, tiny_data, **{"train.resilience.straggler_window": 2}))
    ).train()
    rows = _rows(tmp_path / "stragglers.tsv")
    assert [(r["step"], r["rank"], r["stage"], r["ratio"]) for r in rows] == [
        (s, 0, 0, 1.0) for s in (2, 4, 6)
    ]
    for r in rows:
        assert 0 < r["compute_s"] < r["step_s"] and r["compute_s"] + r["wait_s"] == pytest.approx(
            r["step_s"], abs=2e-6
        )
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    windows = [r for r in records if r["split"] == "straggler"]
    assert [(w["step"], w["count"], w["slowest_rank"], w["max_ratio"]) for w in windows] == [
        (s, 0, 0, 1.0) for s in (2, 4, 6)
    ]


def test_config_refuses_bad_values(tmp_path, tiny_data):
    from mlm.errors import MlmError

    with pytest.raises(MlmError, match=r"train.resilience.straggler_threshold=1.0: must be above 1"):
        load_config(None, tiny_sets(tmp_path, tiny_data, **{"train.resilience.straggler_threshold": 1.0}))
    with pytest.raises(MlmError, match=r"train.resilience.straggler_window=-1: must be 0 \(off\)"):
        load_config(None, tiny_sets(tmp_path, tiny_data, **{"train.resilience.straggler_window": -1}))


# ---------------------------------------------------------------- real ranks

DELAY = 0.1  # seconds of sleep per micro-batch forward on the slow rank
MICRO = 2  # micro-batches per step on each rank
WINDOW = 3


def _train_slowed(rank, world, sets, slow):
    torch.set_num_threads(1)  # 3 ranks on 2 cores: no intra-op threads spinning against each other
    trainer = Trainer(load_config(None, sets))
    if rank == slow:  # a fixed delay in this rank's own work: every micro-batch's forward
        inner = trainer.model.hidden_states

        def hidden_states(*args, **kw):
            time.sleep(DELAY)
            return inner(*args, **kw)

        trainer.model.hidden_states = hidden_states
    lines = []
    stragglers.console.print = lambda text, **kw: lines.append(text)
    trainer.train()
    return lines


def _rows(path) -> list[dict]:
    text = path.read_text()
    assert text.startswith(TSV_HEADER) and text.count("step\t") == 1  # the header once
    names = TSV_HEADER.split()
    rows = [dict(zip(names, line.split("\t"), strict=True)) for line in text.splitlines()[1:]]
    return [{k: v if k == "host" else float(v) for k, v in r.items()} for r in rows]


def test_slowed_rank_is_named_with_its_ratio(tmp_path, tiny_data):
    """dp = 3, rank 1 sleeps DELAY in each of its MICRO forwards: every window names rank 1 and
    no other; its compute per step is the median's plus the delay (the delay is compute, not
    wait), the others wait for it what it computes more, and its ratio is (median + delay) /
    median; the tsv, metrics.jsonl and the console agree."""
    world, slow, steps = 3, 1, 2 * WINDOW
    sets = tiny_sets(
        tmp_path,
        tiny_data,
        **{
            "train.global_batch_size": world * MICRO * 2,
            "train.train_iters": steps,
            "train.resilience.straggler_window": WINDOW,
            "train.resilience.straggler_threshold": 2.0,
        },
    )
    lines = run_ranks(world, _train_slowed, sets, slow)
    delay = DELAY * MICRO  # per step
    rows = _rows(tmp_path / "stragglers.tsv")
    assert [(r["step"], r["rank"]) for r in rows] == [(s, r) for s in (3, 6) for r in range(world)]
    metrics = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    windows = [m for m in metrics if m["split"] == "straggler"]
    assert [w["step"] for w in windows] == [3, 6]
    for end, w in zip((3, 6), windows, strict=True):
        mine = [r for r in rows if r["step"] == end]
        others = [r for r in mine if r["rank"] != slow]
        median = statistics.median(r["compute_s"] for r in mine)  # an unslowed rank's
        for r in mine:  # the columns add up, the ratio is compute over the median
            assert r["compute_s"] + r["wait_s"] == pytest.approx(r["step_s"], abs=2e-6)
            assert r["ratio"] == pytest.approx(r["compute_s"] / median, rel=1e-3)
        s = mine[slow]
        # the delay is in the slow rank's compute (a sleep never ends early), and its own work
        # besides is the others' within a quarter of the delay (measured: within 0.015 s of 0.2 s)
        assert s["compute_s"] >= delay
        assert s["compute_s"] - median == pytest.approx(delay, abs=0.25 * delay)
        assert s["ratio"] == pytest.approx((median + delay) / median, abs=0.25 * delay / median)
        # the ranks meet every step (the gradient all-reduce), so the others wait what it computes
        # more than they do: 10% of the delay covers the skew of the steps' ends between ranks
        for o in others:
            assert o["wait_s"] - s["wait_s"] == pytest.approx(
                s["compute_s"] - o["compute_s"], abs=0.1 * delay
            )
        assert w["slowest_rank"] == slow and w["count"] == 1
        assert w["max_ratio"] == pytest.approx(s["ratio"], rel=1e-3)
        assert w["median_compute_s"] == pytest.approx(median, abs=1e-6)
    assert lines[1:] == [[]] * (world - 1)  # only rank 0 reports
    named = [x for x in lines[0] if "stragglers" in x]
    assert len(named) == 2 and all(
        f"rank {slow} (" in x and "rank 0" not in x and "rank 2" not in x for x in named
    )
    assert "stragglers steps 1-3: rank 1" in named[0] and "stragglers steps 4-6: rank 1" in named[1]
