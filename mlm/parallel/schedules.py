"""Pipeline schedules as data: the ordered forward/backward actions of each pipeline rank.

A schedule is a list of `Action`s per rank; `mlm.parallel.pipeline` executes it (with p2p between
stages), `mlm.parallel.schedule_view` draws it and measures its bubble, and the planner reads
its formulas. Rank r's model chunk c is virtual stage c·pp + r (Megatron's interleaving: layers go
round the ring of ranks vpp times).

    no_pipelining(m)            F0 B0 F1 B1 …  (gradient accumulation, pp = 1)
    one_f_one_b(pp, r, m)       warm-up: pp − r − 1 forwards; steady state: one forward, one
                                backward; cool-down: the remaining backwards (Narayanan et al. 2021)
    interleaved(pp, r, m, vpp)  the same with vpp chunks per rank, micro-batches taken in groups
                                of pp per chunk (Megatron's interleaved 1F1B)

Bubble (idle fraction of a step, equal F and B costs per stage): (pp − 1) / (m + pp − 1) for
1F1B, (pp − 1) / (vpp·m + pp − 1) interleaved.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlm.errors import MlmError


@dataclass(frozen=True)
class Action:
    kind: str  # "F" forward or "B" backward
    chunk: int  # model chunk on this rank (0 unless interleaved)
    micro: int  # micro-batch index within the step

    def __str__(self) -> str:
        return f"{self.kind}{self.micro}" + (f".{self.chunk}" if self.chunk else "")


def micro_batches_per_step(global_batch: int, micro_batch: int, dp: int, pp: int, vpp: int) -> int:
    """Micro-batches each dp rank runs per step; MlmError unless the batch splits over dp and the
    pipeline schedule can run that many."""
    if global_batch % (micro_batch * dp):
        raise MlmError(
            f"train.global_batch_size={global_batch} is not divisible by train.micro_batch_size="
            f"{micro_batch} × dp={dp}; make it a multiple of {micro_batch * dp}"
        )
    num_micro = global_batch // (micro_batch * dp)
    check_pipeline(pp, vpp, num_micro)
    return num_micro


def check_pipeline(pp: int, vpp: int, num_micro: int) -> None:
    """MlmError unless `num_micro` micro-batches can be scheduled on pp × vpp stages."""
    if vpp > 1 and pp == 1:
        raise MlmError(
            f"parallel.vpp={vpp} needs pipeline parallelism: set parallel.pp >= 2 or parallel.vpp=1"
        )
    if vpp > 1 and num_micro % pp:
        raise MlmError(
            f"the interleaved schedule (parallel.vpp={vpp}) needs the number of micro-batches per step "
            f"({num_micro} = global_batch_size / (micro_batch_size × dp)) to be a multiple of "
            f"parallel.pp={pp} (Megatron's rule); change train.global_batch_size or train.micro_batch_size"
        )


def no_pipelining(num_micro: int) -> list[Action]:
    return [Action(kind, 0, i) for i in range(num_micro) for kind in "FB"]


def one_f_one_b(pp: int, rank: int, num_micro: int) -> list[Action]:
    warmup = min(pp - rank - 1, num_micro)
    order = [Action("F", 0, i) for i in range(warmup)]
    for i in range(num_micro - warmup):
        order += [Action("F", 0, warmup + i), Action("B", 0, i)]
    return order + [Action("B", 0, i) for i in range(num_micro - warmup, num_micro)]


def _interleaved_action(kind: str, k: int, pp: int, vpp: int) -> Action:
    """The k-th forward (or backward) of an interleaved rank: micro-batches go in groups of pp
    through chunk 0, 1, …, vpp − 1 (backwards: vpp − 1, …, 0)."""
    group, within = divmod(k, pp * vpp)
    chunk = within // pp
    micro = group * pp + within % pp
    return Action(kind, chunk if kind == "F" else vpp - 1 - chunk, micro)


def interleaved(pp: int, rank: int, num_micro: int, vpp: int) -> list[Action]:
    check_pipeline(pp, vpp, num_micro)
    total = num_micro * vpp
    if num_micro == pp:  # Megatron: every forward first when there are only pp micro-batches
        warmup = total
    else:
        warmup = min((pp - rank - 1) * 2 + (vpp - 1) * pp, total)
    order = [_interleaved_action("F", k, pp, vpp) for k in range(warmup)]
    for k in range(total - warmup):
        order += [_interleaved_action("F", warmup + k, pp, vpp), _interleaved_action("B", k, pp, vpp)]
    return order + [_interleaved_action("B", k, pp, vpp) for k in range(total - warmup, total)]


def schedule(pp: int, rank: int, num_micro: int, vpp: int = 1) -> list[Action]:
    """The actions of pipeline rank `rank` for one training step of `num_micro` micro-batches."""
    check_pipeline(pp, vpp, num_micro)
    if pp == 1:
        return no_pipelining(num_micro)
    if vpp == 1:
        return one_f_one_b(pp, rank, num_micro)
    return interleaved(pp, rank, num_micro, vpp)


def forward_only(num_micro: int, vpp: int = 1) -> list[Action]:
    """Evaluation: each micro-batch through every chunk in turn, no backwards (the same order on
    every rank; any number of micro-batches)."""
    return [Action("F", c, i) for i in range(num_micro) for c in range(vpp)]


def bubble_fraction(pp: int, num_micro: int, vpp: int = 1) -> float:
    """The idle fraction of a step predicted for 1F1B (vpp = 1) or interleaved 1F1B."""
    return (pp - 1) / (vpp * num_micro + pp - 1)


def stage_layer_counts(
    num_layers: int, pp: int, vpp: int = 1, first: int | None = None, last: int | None = None
) -> list[int]:
    """Layers on each of the pp × vpp virtual stages (in pipeline order): an even split, or `first`
    / `last` layers on the first / last stage and an even split of the rest over the others."""
    S = pp * vpp
    what = f"pp({pp}) × vpp({vpp}) = {S} stages" if vpp > 1 else f"pp({pp}) stages"
    if S > num_layers:
        raise MlmError(
            f"{what} but model.num_layers={num_layers}: every pipeline stage needs at least one layer; "
            f"choose pp × vpp <= {num_layers}"
        )
    if first is None and last is None:
        if num_layers % S:
            raise MlmError(
                f"model.num_layers={num_layers} is not divisible by {what}; choose sizes that divide it, "
                "or set parallel.first_stage_layers / parallel.last_stage_layers for an uneven split"
            )
        return [num_layers // S] * S
    ends = [n for n in (first, last) if n is not None]
    rest, middle = num_layers - sum(ends), S - len(ends)
    given = ", ".join(
        f"parallel.{k}_stage_layers={n}" for k, n in (("first", first), ("last", last)) if n is not None
    )
    if middle == 0 and rest != 0 or middle > 0 and (rest < middle or rest % middle):
        raise MlmError(
            f"{given} leave {rest} of model.num_layers={num_layers} layers for the other {middle} of {what}"
            + ("" if middle else " (there are none)")
            + f"; each must get the same whole number (>= 1): change {given.split('=')[0]}"
        )
    even = rest // middle if middle else 0
    counts = [even] * S
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return counts


def peak_in_flight(pp: int, rank: int, num_micro: int, vpp: int = 1) -> int:
    """The most (chunk, micro-batch) forwards whose activations pipeline rank `rank` holds at once
    in one step of `schedule(pp, rank, num_micro, vpp)` (what `Pipeline.peak_in_flight` measures)."""
    held = peak = 0
    for a in schedule(pp, rank, num_micro, vpp):
        held += 1 if a.kind == "F" else -1
        peak = max(peak, held)
    return peak
