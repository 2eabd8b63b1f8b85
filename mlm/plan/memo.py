"""One search's memo: the memory and time models' terms that many layouts share, computed once.

A search (`mlm.plan.candidates.Shared`) passes one dict to `memory`, `rank_memory` and
`step_time`; each caches a term under a key naming every value it depends on:

    ("layer params", layer, tp, ep)                 a layer's parameters (`rank_stage`)
    ("state", stage, dp·cp, edp, distributed)       a rank's gradient buffers (`state_parts`),
    ("model state", …), ("floor", …, hbm)           its model state and `state_floor`
    ("layer memory", micro)                         a layer's activations and buffers
    ("extras", micro, stage.shape)                  the activations outside the layers
    ("layer times", micro)                          a layer's seconds and bytes (`step_time`)
    ("stage time", micro, stage)                    a rank's seconds per micro-batch

`micro` is `memory.micro_key`: the layout's fields a micro-batch's terms read (micro-batch, tp,
sequence parallelism, cp and its attention, ep, recompute), whatever the pipeline, dp or optimizer;
a `Stage` hashes by identity (the search builds each rank's once). Without a memo (None: `evaluate`
of one layout, the exhaustive search) every term is computed afresh, and tests/plan/test_plan_prune.py
checks the keys: both give the same numbers to the bit.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TypeVar

T = TypeVar("T")


def cached(memo: dict | None, key: Hashable, fn: Callable[..., T], *args) -> T:
    """`fn(*args)`, kept in `memo` under `key` (computed afresh when `memo` is None)."""
    if memo is None:
        return fn(*args)
    if key not in memo:
        memo[key] = fn(*args)
    return memo[key]
