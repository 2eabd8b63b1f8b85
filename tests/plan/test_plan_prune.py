"""The pruned search (`mlm.plan.candidates`: memory first, only what fits timed, layouts whose model
state alone overflows never sized, shared terms computed once) gives the exhaustive search's answer
to the bit: the same plans in the same order with the same numbers, the same rejections and the
same least-memory layout of each rejected family."""

from __future__ import annotations

import dataclasses

import pytest

from mlm.errors import MlmError
from mlm.parallel.schedules import peak_in_flight
from mlm.plan import candidates
from mlm.plan.candidates import Shared, evaluate
from mlm.plan.hardware import load_hardware
from mlm.plan.job import make_job
from mlm.plan.memory import in_flight, rank_memory, state_floor
from mlm.plan.search import _divisors, _family_layouts, context_parallel_sizes, plan, search


def _job(preset, gpus, hardware, seq, batch, hbm=None):
    hw = load_hardware(hardware)
    if hbm is not None:
        hw = dataclasses.replace(hw, hbm_bytes=hbm)
    return make_job(None, [f"preset={preset}"], gpus, 8, hw, seq, batch)


TINY_HBM = 1.0e9 + 0.05 * 1.0e9 + 2e7
"""A GPU just above the headroom (`memory.headroom_bytes`): tiny-deepseek's layouts then fit or
not by their activations and model state."""

JOBS = {
    # dense: some layouts fit, tp 1 × pp 1 does not (its least memory layout explains it); cp 1-4
    "llama3-8b on 16 A100-40G": ("llama3-8b", 16, "a100-40g", 4096, 64, None),
    # MoE: every ep that divides the experts and the stage's ranks
    "qwen3-30b-a3b on 8 A100-80G": ("qwen3-30b-a3b", 8, "a100-80g", 2048, 32, None),
    # MLA, MoE and an MTP depth on a small GPU
    "tiny-deepseek on 16 small GPUs": ("tiny-deepseek", 16, "h100-80g", None, 64, TINY_HBM),
    # nothing fits: every family's least memory layout
    "llama3-70b on 8 A100-40G": ("llama3-70b", 8, "a100-40g", 4096, 32, None),
}


def _same(pruned, every):
    """Equal results: plans, their order and every number, rejections, least-memory layouts."""
    assert [str(c.layout) for c in pruned.ranked] == [str(c.layout) for c in every.ranked]
    for a, b in zip(pruned.ranked, every.ranked, strict=True):
        assert (a.memory, a.timing) == (b.memory, b.timing), a.layout
    assert pruned.rejected == every.rejected
    assert pruned.least.keys() == every.least.keys()
    for key, a in pruned.least.items():
        b = every.least[key]
        assert (a.layout, a.memory, a.timing) == (b.layout, b.memory, b.timing), key
    assert pruned.evaluated == every.evaluated


@pytest.mark.parametrize("name", list(JOBS))
def test_pruned_search_equals_the_exhaustive_one(name):
    job = _job(*JOBS[name])
    pruned, every = search(job), search(job, exhaustive=True)
    _same(pruned, every)
    assert pruned.sized <= every.sized == every.evaluated
    # the smallest search (`mlm plan`'s "needs N GPUs") too
    _same(search(job, smallest=True), search(job, smallest=True, exhaustive=True))


def test_only_what_fits_is_timed_and_overflowing_state_is_never_sized(monkeypatch):
    """The plans that fit and each rejected family's least-memory layout are timed, nothing else;
    most of qwen3-30b-a3b's layouts on 8 GPUs are ruled out by their model state alone."""
    job = _job(*JOBS["qwen3-30b-a3b on 8 A100-80G"])
    timed = []
    step_time = candidates.step_time
    monkeypatch.setattr(
        candidates, "step_time", lambda job, lo, *a: timed.append(lo) or step_time(job, lo, *a)
    )
    result = search(job)
    assert sorted(map(str, timed)) == sorted(str(c.layout) for c in [*result.ranked, *result.least.values()])
    assert result.least and result.sized < result.evaluated / 2


def test_nothing_fits_says_what_is_needed():
    job = _job(*JOBS["llama3-70b on 8 A100-40G"])
    with pytest.raises(MlmError, match=r"does not fit on 8 × a100-40g .* it needs at least \d+ GPUs"):
        plan(job)


def _layouts(job):
    for tp in _divisors(job.gpus):
        for pp in _divisors(job.gpus // tp):
            try:
                cps = tuple(context_parallel_sizes(job.cfg, job.gpus // (tp * pp), tp))
            except MlmError:
                continue
            for lo in _family_layouts(job, tp, pp, (False, True), cps=cps):
                if job.global_batch % (lo.micro_batch * lo.dp) == 0:
                    yield lo


@pytest.mark.parametrize("name", ["tiny-deepseek on 16 small GPUs", "llama3-8b on 16 A100-40G"])
def test_shared_terms_equal_fresh_ones_and_floors_hold(name):
    """Every layout's memory and time with one search's memo equal those computed afresh (the memo's
    keys name all they depend on), and each rank's floor is at most its memory (to the bit)."""
    job = _job(*JOBS[name])
    shared, hbm = Shared(job), job.hardware.hbm_bytes
    layouts = list(_layouts(job))
    if len(layouts) > 800:  # llama3-8b: every 4th layout keeps the test short
        layouts = layouts[::4]
    for lo in layouts:
        a, b = evaluate(job, lo, shared), evaluate(job, lo)
        assert (a.memory, a.timing) == (b.memory, b.timing), lo
        for rank, stage in shared.held(lo).items():
            floor = state_floor(job.cfg, lo, stage, hbm, shared.memo)
            assert floor <= rank_memory(job.cfg, lo, rank, hbm, stage).total, (lo, rank)


def test_in_flight_equals_the_schedule():
    """`memory.in_flight` (closed form) equals walking `mlm.parallel.schedules`' schedule."""
    for pp in range(1, 13):
        for vpp in range(1, 9) if pp > 1 else (1,):
            for m in range(1, 49):
                if vpp > 1 and m % pp:
                    continue
                for rank in range(pp):
                    assert in_flight(pp, rank, m, vpp) == peak_in_flight(pp, rank, m, vpp), (pp, rank, m, vpp)
