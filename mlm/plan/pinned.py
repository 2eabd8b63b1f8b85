"""`mlm plan --layout`: one layout given as text (`mlm.layout`), its open choices completed.

    c, result = complete(job, Layout.parse("tp8pp4vpp2cp2mb1rcsel"))

The search restricted to the layout's mesh (`mlm.plan.search.explain_layout`) chooses what the
text leaves open: dp (what --gpus leaves), micro-batch, recompute, sharding (none, zero1, fsdp,
hsdp<N>), cp's attention, and sequence parallelism (on at tp > 1, the only setting the planner
models). A
layout that gives the global batch or the stage split must give the job's and the search's.
"""

from __future__ import annotations

from mlm.errors import MlmError
from mlm.layout import Layout
from mlm.plan.candidates import Candidate
from mlm.plan.job import Job
from mlm.plan.search import SearchResult, explain_layout


def complete(job: Job, lo: Layout, optimizer: str = "auto") -> tuple[Candidate, SearchResult]:
    """The fastest candidate of `lo`'s mesh with its given choices that fits (where none fits, the
    one needing the least memory) and the restricted search; `optimizer` (adam, distributed, auto)
    as `mlm plan --optimizer`. MlmError (the rule's message) on an invalid or contradictory layout."""
    if lo.global_batch is not None and lo.global_batch != job.global_batch:
        raise MlmError(
            f"--layout {lo}: gb{lo.global_batch} but the job's global batch is {job.global_batch} "
            "(--global-batch, --tokens or train.global_batch_size); give it once"
        )
    if lo.sequence_parallel is False and lo.tp > 1:
        raise MlmError(
            f"--layout {lo}: mlm plan models tp > 1 with sequence parallelism only (it moves the same "
            "bytes as tp's all-reduces and keeps 1/tp of the norms' activations); drop nosp"
        )
    if lo.distributed_optimizer is False and not lo.fsdp and (lo.dp is None or lo.dp_cp > 1):
        if optimizer == "distributed":
            raise MlmError(
                f"--layout {lo}: nozero1 replicates the optimizer, --optimizer distributed shards it; drop one"
            )
        optimizer = "adam"
    c, result = explain_layout(job, lo, optimizer)
    got = c.layout
    if (lo.first_stage_layers, lo.last_stage_layers) not in (
        (None, None),
        (got.first_stage_layers, got.last_stage_layers),
    ):
        even = got.first_stage_layers is None
        split = "an even split" if even else f"first{got.first_stage_layers}last{got.last_stage_layers}"
        raise MlmError(
            f"--layout {lo}: mlm plan splits {job.cfg.model.num_layers} layers over pp {lo.pp} × vpp "
            f"{lo.vpp} stages as {split}; drop first<N>/last<N> or write those"
        )
    return c, result
