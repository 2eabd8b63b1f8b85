"""Enumerate every valid layout for a job, keep those that fit in memory, rank them by throughput.

A family is a (tp, pp) pair. It is rejected as a whole when a divisibility rule fails (the rule's
own message from `mlm.parallel`), when tp crosses a node (its all-reduces would run on the
network, never competitive), or when none of its layouts fits (the reason names the smallest
need). Within a family every vpp (layers divisible by pp × vpp; micro-batches a multiple of pp),
micro-batch (a divisor of global batch / dp, up to 16), recompute (none, selective, full) and
sharding of the model state (`SHARDINGS`: none, zero1, and where `fsdp_refusals` allows, HSDP
over a node's dp × cp ranks and FSDP over all of them) is tried (each sized before it is timed,
and only what fits timed: `mlm.plan.candidates`); sequence parallelism is always on with tp > 1 (it moves the same
bytes as tp's all-reduces and stores 1/tp of the norms' activations; expert parallelism over tp
ranks needs it too). For a model with MoE layers every expert-parallel size is tried that divides
both the stage's dp × cp × tp ranks (ep folds over them) and the number of experts (each rank holds
E / ep whole experts); `ep=` pins one. Context parallelism: every cp that divides the GPUs left by
tp × pp and splits the sequence (seq_length divisible by 2·cp, times tp under sequence
parallelism: `check_cp`), with both attention implementations (p2p, all_gather); dp is what is
left, and gradients are reduced over dp × cp; each rank keeps at least MIN_CP_TOKENS tokens of a
sequence. `cp=` pins one.

`Constraints` narrow the search (`mlm plan --tp/--pp/--max-tp/--micro-batch/--recompute`): only
the families and choices they allow are enumerated, and a pinned tp is tried even when it crosses
nodes. `explain_layout` evaluates one mesh (`mlm plan --layout`) with the search restricted to it,
the choices it leaves open (micro-batch, recompute, optimizer sharding, cp attention) the fastest
that fits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from mlm.config import check_context_parallel_kinds, fsdp_refusals
from mlm.errors import MlmError
from mlm.layout import Layout
from mlm.model import kinds
from mlm.parallel.mesh import Mesh, check_context_parallel, check_tensor_parallel
from mlm.parallel.schedules import check_pipeline, stage_layer_counts
from mlm.plan.candidates import Candidate, Shared, family
from mlm.plan.job import Job

RECOMPUTE = ("none", "selective", "full")
SHARDINGS = {
    "adam": ("none",),
    "distributed": ("zero1",),
    "fsdp": ("hsdp", "fsdp"),
    "auto": ("none", "zero1", "hsdp", "fsdp"),
}
"""`search`'s `optimizer` → the shardings it tries, the least memory last: none (replicated), zero1
(the distributed optimizer), hsdp (FSDP over the dp × cp ranks of one node, replicated across
nodes), fsdp (over all dp × cp ranks)."""
MAX_MICRO_BATCH = 16
CP_COMM_TYPES = ("p2p", "all_gather")
MIN_CP_TOKENS = 1024
"""The search tries cp > 1 only while each rank keeps at least this many tokens of a sequence:
below it the ring's transfers outgrow the attention they hide behind and the GEMMs shrink (at
seq 8192 the best cp 16 plans of llama3-8b on 64 GPUs and llama3-70b on 512 are 1.8× and 1.1×
slower than their best, cp 32 2.7× and 1.4×; `--cp` pins any size)."""


@dataclass(frozen=True)
class Constraints:
    """What the search may choose beyond `search`'s own `optimizer`, `ep` and `cp` (None: any)."""

    tp: int | None = None
    """only this tensor-parallel size (tried even when it crosses nodes)"""
    pp: int | None = None
    """only this pipeline-parallel size"""
    max_tp: int | None = None
    """tensor-parallel sizes up to this"""
    vpp: int | None = None
    """only this number of virtual stages per pipeline rank"""
    micro_batch: int | None = None
    """only this micro-batch (any divisor of global batch / dp, even above MAX_MICRO_BATCH)"""
    recompute: tuple[str, ...] = RECOMPUTE
    """the recompute modes to try (none, selective, full)"""
    cp_comm_type: str | None = None
    """only this attention under context parallelism (p2p, all_gather)"""
    fsdp: bool | None = None
    """only FSDP layouts (True: over all dp × cp ranks unless `fsdp_shard`), none (False)"""
    fsdp_shard: int | None = None
    """with fsdp: only this shard group (HSDP's `hsdp<N>`)"""

    def allows(self, tp: int, pp: int) -> bool:
        return self.tp in (None, tp) and self.pp in (None, pp) and (self.max_tp is None or tp <= self.max_tp)


def check_constraints(job: Job, k: Constraints) -> None:
    """MlmError naming the `mlm plan` option, the rule and the fix for a value no layout can have."""
    N, cfg, gb = job.gpus, job.cfg, job.global_batch
    for opt, v in (("--tp", k.tp), ("--pp", k.pp), ("--max-tp", k.max_tp), ("--micro-batch", k.micro_batch)):
        if v is not None and v < 1:
            raise MlmError(f"{opt} {v}: must be at least 1")
    if k.tp is not None:
        if N % k.tp:
            raise MlmError(f"--tp {k.tp} does not divide --gpus {N}; choose one of {_divisors(N)}")
        check_tensor_parallel(cfg.model, cfg.model.padded_vocab_size(k.tp), k.tp)
        if k.max_tp is not None and k.tp > k.max_tp:
            raise MlmError(f"--tp {k.tp} is above --max-tp {k.max_tp}; give one of them")
    if k.pp is not None:
        if N % k.pp:
            raise MlmError(f"--pp {k.pp} does not divide --gpus {N}; choose one of {_divisors(N)}")
        stage_split(cfg.model.num_layers, k.pp, k.vpp or 1)
    if k.micro_batch is not None and gb % k.micro_batch:
        raise MlmError(
            f"--micro-batch {k.micro_batch} does not divide the global batch {gb}: each dp rank runs "
            f"whole micro-batches; choose a divisor of {gb} / dp, e.g. one of "
            f"{', '.join(map(str, _divisors(gb)[:8]))}"
        )
    bad = [r for r in k.recompute if r not in RECOMPUTE]
    if bad or not k.recompute:
        raise MlmError(
            f"--recompute {','.join(k.recompute)!r}: each must be one of {', '.join(RECOMPUTE)} "
            "(a comma list tries those, e.g. --recompute none,selective)"
        )


@dataclass
class SearchResult:
    ranked: list[Candidate]
    """Layouts that fit, fastest first."""
    rejected: dict[tuple[int, int], str] = field(default_factory=dict)
    """(tp, pp) → why no layout of that family is in `ranked`."""
    evaluated: int = 0
    """Layouts considered."""
    sized: int = 0
    """Layouts whose memory was computed: the others' model state alone overflows the GPU
    (`mlm.plan.candidates`); only those that fit are timed."""
    least: dict[tuple[int, int], Candidate] = field(default_factory=dict)
    """(tp, pp) → the family's layout needing the least memory, where none fits."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _gb(x: float) -> str:
    return f"{x / 1e9:.1f} GB"


def _first_line(e: MlmError) -> str:
    return str(e).split(";")[0]


def uneven_split(num_layers: int, stages: int) -> tuple[int, int] | None:
    """(first, last) layers for `stages` virtual stages when they do not divide `num_layers`: the
    most k <= num_layers // stages on the first and last stage (which also hold the embedding and
    the output layer) such that the others share the rest evenly with at least k each. Failing
    that (an odd number of layers left for the two ends, as DeepSeek-V3's prime 61 leaves for any
    even number of stages), the fewest layers m on each other stage such that the first and last
    share the rest, the last taking one fewer (it also holds the output layer and any MTP depths):
    61 over 16 stages is 3, 14 × 4, 2; over 2 stages 31, 30. None if there is none."""
    if stages < 2:
        return None
    if stages == 2:
        return ((num_layers + 1) // 2, num_layers // 2) if num_layers % 2 else None
    for k in range(num_layers // stages, 0, -1):
        rest = num_layers - 2 * k
        if rest % (stages - 2) == 0 and rest // (stages - 2) >= k:
            return k, k
    for m in range(-(-num_layers // stages), num_layers):
        ends = num_layers - (stages - 2) * m
        if ends < 2:
            return None
        if ends <= 2 * m:
            return (ends + 1) // 2, ends // 2
    return None


def stage_split(num_layers: int, pp: int, vpp: int) -> tuple[int | None, int | None]:
    """(first, last) stage layers for pp × vpp stages (None, None: an even split); MlmError if none."""
    if num_layers % (pp * vpp) == 0:
        return None, None
    split = uneven_split(num_layers, pp * vpp)
    if split is None:
        stage_layer_counts(num_layers, pp, vpp)  # raises the rule's own message
    return split


def has_moe(cfg) -> bool:
    """Whether a layer's MLP is spread by expert parallelism (its kind's spec says)."""
    return any(kinds.mlp(k).expert_parallel for k in cfg.model.mlp_kinds())


def check_ep(cfg, ep: int) -> None:
    """MlmError unless `ep` can split the model's experts (whatever the mesh)."""
    E = cfg.model.moe.num_experts
    if ep < 1:
        raise MlmError(f"ep={ep}: must be at least 1")
    if ep > 1 and not has_moe(cfg):
        raise MlmError(
            f"ep={ep}: the model has no MoE layers (model.mlp_kind={cfg.model.mlp_kind!r}); "
            "expert parallelism needs experts: use ep=1"
        )
    if ep > 1 and E % ep:
        raise MlmError(
            f"ep={ep} does not divide model.moe.num_experts={E}: each expert-parallel rank holds "
            f"E / ep whole experts; choose one of {', '.join(map(str, _divisors(E)))}"
        )


def expert_parallel_sizes(cfg, stage_ranks: int, ep: int | None = None) -> list[int]:
    """The ep values to try on a stage of `stage_ranks` (dp × cp × tp) ranks: divisors of it that
    divide the number of experts ([1] for a dense model; [ep] when pinned)."""
    if ep is not None:
        return [ep]
    if not has_moe(cfg):
        return [1]
    E = cfg.model.moe.num_experts
    return [d for d in _divisors(stage_ranks) if E % d == 0]


def check_layout(job: Job, layout: Layout) -> None:
    """MlmError unless `layout` is a mesh mlm can train this job on."""
    cfg = job.cfg
    if layout.gpus != job.gpus:
        raise MlmError(
            f"tp({layout.tp}) × pp({layout.pp}) × dp({layout.dp}) × cp({layout.cp}) = {layout.gpus} "
            f"≠ --gpus {job.gpus}"
        )
    check_tensor_parallel(cfg.model, cfg.model.padded_vocab_size(layout.tp), layout.tp)
    check_ep(cfg, layout.ep)
    check_cp(cfg, layout.cp, layout.tp if layout.sequence_parallel else 1)
    if layout.cp_comm_type not in CP_COMM_TYPES:
        raise MlmError(f"cp_comm_type={layout.cp_comm_type!r}: must be one of {', '.join(CP_COMM_TYPES)}")
    Mesh.shape_for(cfg.parallel.__class__(tp=layout.tp, pp=layout.pp, cp=layout.cp, ep=layout.ep), job.gpus)
    if layout.ep > 1 and layout.tp > 1 and not layout.sequence_parallel:
        raise MlmError(
            f"ep={layout.ep} with tp={layout.tp}: the tp ranks are expert-parallel ranks too and must "
            "hold different tokens; turn sequence parallelism on"
        )
    stage_layer_counts(
        cfg.model.num_layers, layout.pp, layout.vpp, layout.first_stage_layers, layout.last_stage_layers
    )
    if layout.global_batch % (layout.micro_batch * layout.dp):
        raise MlmError(
            f"global batch {layout.global_batch} is not divisible by micro-batch {layout.micro_batch} × "
            f"dp {layout.dp}; choose a global batch that is a multiple of {layout.micro_batch * layout.dp}"
        )
    check_pipeline(layout.pp, layout.vpp, layout.num_micro)


def check_cp(cfg, cp: int, sequence_shards: int = 1) -> None:
    """MlmError unless sequences of data.seq_length split over `cp` ranks (2·cp chunks), each rank's
    tokens then over `sequence_shards` tp ranks (`mlm.parallel.mesh.check_context_parallel`)."""
    if cp < 1:
        raise MlmError(f"cp={cp}: must be at least 1")
    check_context_parallel(cfg.data.seq_length, cp, sequence_shards)
    if cp > 1:
        check_context_parallel_kinds(cfg.model, cp)
    if cp > 1 and cfg.model.attention_dropout > 0:
        raise MlmError(
            f"model.attention_dropout={cfg.model.attention_dropout} with parallel.cp={cp}: attention "
            "dropout is not built under context parallelism; set it to 0"
        )


def context_parallel_sizes(cfg, ranks: int, tp: int, cp: int | None = None) -> list[int]:
    """The cp values to try for `ranks` = GPUs / (tp × pp): divisors whose split of the sequence
    is valid with sequence parallelism over `tp` and leaves each rank `MIN_CP_TOKENS` or more
    ([cp] when pinned; its MlmError if invalid)."""
    if cp is not None:
        check_cp(cfg, cp, tp)
        return [cp]
    out = []
    for c in _divisors(ranks):
        if c > 1 and cfg.data.seq_length // c < MIN_CP_TOKENS:
            break
        try:
            check_cp(cfg, c, tp)
        except MlmError:
            continue
        out.append(c)
    return out


def shardings(
    job: Job,
    pp: int,
    tp: int,
    ranks: int,
    optimizers: tuple[str, ...],
    k: Constraints = Constraints(),
) -> list[tuple[bool, bool, int | None]]:
    """(distributed optimizer, fsdp, HSDP shard) for each of `optimizers` (`SHARDINGS`' names) that a
    mesh of `ranks` = dp × cp ranks can take: one rank shards nothing; FSDP only where
    `fsdp_refusals` names nothing (and, in the whole search, at pp 1), HSDP over the dp × cp ranks of
    one node (gpus_per_node / tp: the shard group stays on NVLink) where that divides `ranks` and is
    less."""
    if ranks == 1:
        return [(False, False, None)]
    cfg = job.cfg
    fsdp_ok = not fsdp_refusals(cfg.model, cfg.train) and k.fsdp is not False
    if pp > 1 and k.fsdp is None and "none" in optimizers:
        # the whole search (auto) tries FSDP without pipeline stages only: with them it would double
        # llama3-70b's search (27,243 layouts, not 15,255) for plans zero1 beats in every job of
        # docs/plan-model.md; --optimizer fsdp and --layout try it at any pp
        fsdp_ok = False
    out = []
    for name in optimizers:
        if name in ("none", "zero1") and not k.fsdp:
            out.append((name == "zero1", False, None))
        elif name == "fsdp" and fsdp_ok and k.fsdp_shard is None:
            out.append((False, True, None))
        elif name == "hsdp" and fsdp_ok:
            S = k.fsdp_shard or job.gpus_per_node // tp
            if k.fsdp_shard or (not k.fsdp and 1 < S < ranks and ranks % S == 0):  # fsdp pins all ranks
                out.append((False, True, S))
    return out


def _family_layouts(
    job: Job,
    tp: int,
    pp: int,
    optimizers: tuple[str, ...],
    smallest: bool = False,
    ep: int | None = None,
    cps: tuple[int, ...] = (1,),
    k: Constraints = Constraints(),
):
    for cp in cps:
        comms = CP_COMM_TYPES[:1] if cp == 1 else (k.cp_comm_type,) if k.cp_comm_type else CP_COMM_TYPES
        for comm in comms:
            yield from _cp_layouts(job, tp, pp, cp, comm, optimizers, smallest, ep, k)


def _cp_layouts(
    job: Job,
    tp: int,
    pp: int,
    cp: int,
    comm: str,
    optimizers: tuple[str, ...],
    smallest: bool,
    ep: int | None,
    k: Constraints,
):
    L, gb = job.cfg.model.num_layers, job.global_batch
    dp = job.gpus // (tp * pp * cp)
    eps = expert_parallel_sizes(job.cfg, dp * cp * tp, ep)
    vpps = [1] + [v for v in range(2, 9) if L // (pp * v) >= 2] if pp > 1 else [1]
    if k.micro_batch is not None:
        mbs = [k.micro_batch] if (gb // dp) % k.micro_batch == 0 else []
    else:
        mbs = [d for d in _divisors(gb // dp) if d <= (1 if smallest else MAX_MICRO_BATCH)]
    rcs = [r for r in RECOMPUTE if r in k.recompute]  # least memory last
    options = shardings(job, pp, tp, dp * cp, optimizers, k)
    options = options[-1:] if smallest else options  # the least memory last
    for vpp in [k.vpp] if k.vpp is not None else vpps:
        try:
            first, last = stage_split(L, pp, vpp)
        except MlmError:
            continue
        for mb in mbs:
            m = gb // (mb * dp)
            if vpp > 1 and m % pp:
                continue
            for rc in rcs[-1:] if smallest else rcs:
                for e in eps:
                    for dist, fsdp, shard in options:
                        yield Layout(
                            tp, pp, dp, mb, gb, vpp, tp > 1, rc, dist, first, last, cp, e, comm, fsdp, shard
                        )


def search(
    job: Job,
    optimizer: str = "auto",
    smallest: bool = False,
    ep: int | None = None,
    cp: int | None = None,
    k: Constraints = Constraints(),
    exhaustive: bool = False,
) -> SearchResult:
    """Every valid layout of `job`; `optimizer`: adam (replicated), distributed, fsdp (FSDP or
    HSDP), or auto (all of them: `SHARDINGS`).
    `smallest`: only the least memory of each mesh (micro-batch 1, full recompute, the optimizer
    sharded if allowed, as far as `k` allows), enough to tell whether anything fits. `ep`, `cp`:
    only this expert-parallel / context-parallel size (default: every valid one); `k`: the rest.
    `exhaustive`: size and time every layout afresh (the reference for the pruned search,
    `mlm.plan.candidates`; the same result, slower)."""
    cfg, N, g = job.cfg, job.gpus, job.gpus_per_node
    check_constraints(job, k)
    if ep is not None:
        check_ep(cfg, ep)
    if cp is not None:
        check_cp(cfg, cp)
        if N % cp:
            raise MlmError(f"cp={cp} does not divide --gpus {N}; choose one of {_divisors(N)}")
    optimizers = SHARDINGS[optimizer]
    shared = Shared(job, memoize=not exhaustive)
    result = SearchResult([])
    for tp in _divisors(N):
        if tp > cfg.model.num_attention_heads:
            break
        for pp in _divisors(N // tp):
            if not k.allows(tp, pp):
                continue
            key = (tp, pp)
            try:
                Mesh.shape_for(cfg.parallel.__class__(tp=tp, pp=pp, cp=cp or 1, ep=ep or 1), N)
                check_tensor_parallel(cfg.model, cfg.model.padded_vocab_size(tp), tp)
                stage_split(cfg.model.num_layers, pp, 1)
                cps = context_parallel_sizes(cfg, N // (tp * pp), tp, cp)
            except MlmError as e:
                result.rejected[key] = _first_line(e)
                continue
            if tp > g and k.tp is None:
                result.rejected[key] = f"tp={tp} crosses nodes (gpus_per_node={g})"
                continue
            whole = tuple(c for c in cps if job.global_batch % (N // (tp * pp * c)) == 0)
            if not whole:
                dps = ", ".join(f"dp={N // (tp * pp * c)}" + (f" (cp={c})" if c > 1 else "") for c in cps)
                result.rejected[key] = f"global batch {job.global_batch} is not divisible by {dps}"
                continue
            layouts = _family_layouts(job, tp, pp, optimizers, smallest, ep, whole, k)
            found = family(job, layouts, shared, exhaustive)
            result.evaluated += found.layouts
            result.sized += found.sized
            if found.fitting:
                result.ranked += found.fitting
            elif found.least is not None:
                result.rejected[key] = why_not(found.least)
                result.least[key] = found.least
            else:
                result.rejected[key] = "no micro-batch schedule fits the global batch"
    result.ranked.sort(key=lambda c: (-c.timing.tokens_per_s_per_gpu, c.memory.total))
    return result


def why_not(c: Candidate) -> str:
    """'needs 91.2 GB > 80.0 GB (activations 61.0 GB; …)' for the smallest layout of a family."""
    comps = sorted(c.memory.components.items(), key=lambda kv: -kv[1])[:2]
    big = ", ".join(f"{k} {_gb(v)}" for k, v in comps)
    lo = c.layout
    how = f"mb={lo.micro_batch}, {lo.recompute} recompute" + (
        ", dist. optimizer" if lo.distributed_optimizer else f", {sharding_name(lo)}" if lo.fsdp else ""
    )
    if lo.cp > 1:
        how += f", cp={lo.cp} {lo.cp_comm_type}"
    if lo.ep > 1:
        how += f", ep={lo.ep}"
    return f"needs {_gb(c.memory.total)} > {_gb(c.memory.hbm)} at best ({how}): {big}"


def sharding_name(lo: Layout) -> str:
    """How `lo` shards the model state: none, zero1, fsdp or hsdp<N> (the layout's term)."""
    if lo.fsdp:
        return f"hsdp{lo.fsdp_shard}" if lo.fsdp_shard else "fsdp"
    return "zero1" if lo.distributed_optimizer else "none"


def plan(
    job: Job,
    optimizer: str = "auto",
    ep: int | None = None,
    cp: int | None = None,
    k: Constraints = Constraints(),
) -> SearchResult:
    """`search`, or an MlmError saying what would be needed when nothing fits."""
    result = search(job, optimizer, ep=ep, cp=cp, k=k)
    if result.ranked:
        return result
    need = _gpus_needed(job, optimizer, ep, cp, k)
    reasons = "; ".join(f"tp={tp} pp={pp}: {r}" for (tp, pp), r in list(result.rejected.items())[:4])
    more = (
        f"it needs at least {need} GPUs ({need // job.gpus_per_node} nodes of {job.gpus_per_node})"
        if need
        else "it does not fit on 64× as many GPUs either; shorten the sequence or use GPUs with more memory"
    )
    raise MlmError(
        f"the model does not fit on {job.gpus} × {job.hardware.name} "
        f"({_gb(job.hardware.hbm_bytes)} each) with any mesh: {reasons}; {more}"
    )


def explain_layout(job: Job, lo: Layout, optimizer: str = "auto") -> tuple[Candidate, SearchResult]:
    """The layout `lo` (a parsed `mlm plan --layout`, its open fields None): dp open is what
    --gpus leaves; sequence parallelism is on with tp > 1; the choices left open (micro-batch,
    recompute, optimizer sharding, cp attention) are the fastest that fit, from the search
    restricted to the mesh. Returns that candidate, or where none fits the one needing the least
    memory, and the restricted search; MlmError (the rule's own message) when the mesh is invalid."""
    L, gb = job.cfg.model.num_layers, job.global_batch
    tp, pp, vpp, cp, ep = lo.tp, lo.pp, lo.vpp, lo.cp, lo.ep
    if lo.distributed_optimizer:
        if optimizer in ("adam", "fsdp"):
            other = "replicates it" if optimizer == "adam" else "shards it with the parameters (FSDP)"
            raise MlmError(
                f"--layout {lo}: zero1 shards the optimizer, --optimizer {optimizer} {other}; drop one"
            )
        optimizer = "distributed"
    if lo.fsdp:
        if optimizer in ("adam", "distributed"):
            raise MlmError(
                f"--layout {lo}: {sharding_name(lo)} is FSDP, --optimizer {optimizer} is not; drop one"
            )
        refused = fsdp_refusals(job.cfg.model, job.cfg.train)
        if refused:
            raise MlmError(
                f"--layout {lo}: FSDP is not built with {', '.join(refused)} yet; drop {sharding_name(lo)}"
            )
        optimizer = "fsdp"
    parallel = job.cfg.parallel.__class__(tp=tp, pp=pp, cp=cp, ep=ep)
    dp = lo.dp if lo.dp is not None else Mesh.shape_for(parallel, job.gpus)["dp"]
    first, last = stage_split(L, pp, vpp)
    mb, rc = lo.micro_batch, lo.recompute
    comm = lo.cp_comm_type if cp > 1 else None
    probe = Layout(tp, pp, dp, mb or 1, gb, vpp, tp > 1, rc or "full", False, first, last, cp, ep)
    probe = replace(probe, fsdp=bool(lo.fsdp), fsdp_shard=lo.fsdp_shard)  # MlmError: hsdp<N> ∤ dp × cp
    check_layout(job, replace(probe, cp_comm_type=comm or "p2p"))
    k = Constraints(tp, pp, None, vpp, mb, (rc,) if rc else RECOMPUTE, comm, lo.fsdp, lo.fsdp_shard)
    result = search(job, optimizer, ep=ep, cp=cp, k=k)
    assert result.ranked or (tp, pp) in result.least, result.rejected  # a valid mesh has layouts
    return (result.ranked[0] if result.ranked else result.least[(tp, pp)]), result


def _gpus_needed(
    job: Job, optimizer: str, ep: int | None = None, cp: int | None = None, k: Constraints = Constraints()
) -> int | None:
    """The smallest multiple of gpus_per_node (and of a pinned cp × tp × pp) on which some layout fits
    (doubling, then bisecting), the global batch raised to a multiple of the GPU count where
    needed; None beyond 64×."""

    def fits(n: int) -> bool:
        cfg = job.cfg
        if job.global_batch % n:
            cfg = replace(cfg, train=replace(cfg.train, global_batch_size=math.lcm(job.global_batch, n)))
        return bool(search(replace(job, gpus=n, cfg=cfg), optimizer, smallest=True, ep=ep, cp=cp, k=k).ranked)

    g = math.lcm(job.gpus_per_node, (cp or 1) * (k.tp or 1) * (k.pp or 1))
    lo, hi = max(job.gpus, g) // g, max(job.gpus, g) // g * 2
    while not fits(hi * g):
        lo, hi = hi, hi * 2
        if hi * g > 64 * job.gpus:
            return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid * g) else (mid, hi)
    return hi * g
