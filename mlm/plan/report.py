"""What `mlm plan` prints and writes: the ranked table, rejected families, `--explain` for one
layout, the plan-file dict, and the `--png` drawing (memory bars + the best plan's schedule).

Every table is a `Grid`: rich's table where its natural width fits (always in a file, whose
console is `mlm.console.LOG_WIDTH` wide), otherwise one block per row of `column: value` pairs, so
that no header or cell is ever abbreviated or cut, however narrow the terminal."""

from __future__ import annotations

import textwrap

from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from mlm.console import LOG_WIDTH, human
from mlm.layout import Layout
from mlm.model import kinds
from mlm.parallel.schedule_view import describe_schedule, render_text, save_png, timeline
from mlm.plan.candidates import Candidate
from mlm.plan.job import Job
from mlm.plan.memory import (
    act_bytes,
    cp_buffer_bytes,
    korthikanti_layer_bytes,
    local_tokens,
    micro,
    parameter_counts,
)
from mlm.plan.search import SearchResult, sharding_name

GB = 1e9
MESH_CHOICES = ("mesh", "sp", "recompute", "sharding")
"""The ranked table's left-justified columns (words); the others are numbers."""
MEMORY_ORDER = (
    "weights",
    "gradients",
    "optimizer",
    "activations",
    "weight casts",
    "logits (transient)",
    "attention workspace (transient)",
    "gathered parameters (transient)",
    "unsharded gradients (accumulating)",
    "communication buffers",
    "headroom",
)


class Grid:
    """A table shown whole: rich's Table at its natural width where that fits the console, else
    stacked, one block per row of `column: value` pairs packed into lines (a pair is never split
    unless it alone is wider than the console; then it wraps, whole)."""

    def __init__(self, title: str, columns: tuple[str, ...], right: tuple[str, ...] = ()):
        self.title, self.columns, self.right = title, columns, right
        self.rows: list[tuple[tuple[str, ...], bool]] = []

    def add_row(self, *cells: str, bold: bool = False) -> None:
        assert len(cells) == len(self.columns), (cells, self.columns)
        self.rows.append((cells, bold))

    def table(self) -> Table:
        t = Table(title=self.title, title_justify="left")
        for col in self.columns:
            t.add_column(col, justify="right" if col in self.right else "left", no_wrap=True)
        for cells, bold in self.rows:
            t.add_row(*cells, style="bold" if bold else None)
        return t

    def stacked(self, width: int) -> Text:
        out = Text(self.title)
        for cells, bold in self.rows:
            lines = [""]
            for pair in (f"{c}: {v}" for c, v in zip(self.columns, cells, strict=True)):
                if lines[-1] and len(lines[-1]) + 3 + len(pair) > width:
                    lines.append("    ")
                if len(lines[-1]) + len(pair) > width:  # alone too wide: wrapped at spaces, indented
                    lines[-1:] = textwrap.wrap(
                        pair,
                        width,
                        initial_indent=lines[-1],
                        subsequent_indent="        ",
                        break_long_words=False,
                    )
                    lines.append("    ")
                else:
                    lines[-1] += ("   " if lines[-1].strip() else "") + pair
            out.append("\n" + "\n".join(x for x in lines if x.strip()), style="bold" if bold else "")
        return out

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        table = self.table()
        natural = Measurement.get(console, options.update(max_width=LOG_WIDTH), table).maximum
        if natural <= options.max_width:
            yield table
        else:
            yield self.stacked(options.max_width)


def model_line(job: Job) -> str:
    """'model: total 671.03G, active 37.55G (+ MTP 11.61G, 688.10M active) parameters, 61 layers
    + 1 MTP depth, 291.85 GFLOP per token at seq 4096' (the counts from the planner's parameters)."""
    m = job.cfg.model
    mtp = f" + {m.mtp_num_layers} MTP depth{'s' if m.mtp_num_layers > 1 else ''}" if m.mtp_num_layers else ""
    return (
        f"model: {parameter_counts(job.cfg).describe(human)} parameters, {m.num_layers} layers{mtp}, "
        f"{job.flops_per_token / 1e9:,.2f} GFLOP per token at seq {job.seq}"
    )


RANKED_COLUMNS = (
    "#",
    "mesh",
    "sp",
    "mb",
    "m",
    "recompute",
    "sharding",
    "weights",
    "grads",
    "optim",
    "activ.",
    "other",
    "total GB",
    "step s",
    "tok/s/GPU",
    "MFU",
)


def shown_ranks(ranked: list[Candidate], top: int) -> list[int]:
    """The ranks (from 1) the table shows: the best `top`, then the best of each sharding (none,
    zero1, fsdp, hsdp<N>) that they leave out, so that every kind the search tried is compared."""
    shown = list(range(1, min(top, len(ranked)) + 1))
    kinds = {sharding_name(ranked[i - 1].layout).rstrip("0123456789") for i in shown}
    for i, c in enumerate(ranked, 1):
        kind = sharding_name(c.layout).rstrip("0123456789")
        if kind not in kinds:
            kinds.add(kind)
            shown.append(i)
    return shown


def ranked_table(job: Job, result: SearchResult, top: int) -> Grid:
    shown = shown_ranks(result.ranked, top)
    more = len(shown) - min(top, len(result.ranked))
    title = (
        f"mlm plan: {job.gpus} × {job.hardware.name}, software {job.software.name}, "
        f"{result.evaluated} layouts ({result.sized} sized), "
        f"{len(result.ranked)} fit; best {min(top, len(result.ranked))}"
        f"{f' and the best of {more} more sharding(s)' if more else ''}\n{model_line(job)}"
    )
    t = Grid(title, RANKED_COLUMNS, right=tuple(c for c in RANKED_COLUMNS if c not in MESH_CHOICES))
    for i in shown:
        c = result.ranked[i - 1]
        lo, mem = c.layout, c.memory.components
        other = sum(
            v for k, v in mem.items() if k not in ("weights", "gradients", "optimizer", "activations")
        )
        t.add_row(
            str(i),
            str(lo.mesh()),
            "on" if lo.sequence_parallel else "off",
            str(lo.micro_batch),
            str(lo.num_micro),
            lo.recompute,
            sharding_name(lo),
            *(f"{mem[k] / GB:.1f}" for k in ("weights", "gradients", "optimizer", "activations")),
            f"{other / GB:.1f}",
            f"{c.memory.total / GB:.1f}",
            f"{c.timing.step_s:.2f}",
            f"{c.timing.tokens_per_s_per_gpu:,.0f}",
            f"{c.timing.mfu:.1%}",
        )
    return t


def rejected_table(result: SearchResult) -> Grid:
    t = Grid("rejected families (tp, pp)", ("tp", "pp", "why"), right=("tp", "pp"))
    for (tp, pp), why in sorted(result.rejected.items()):
        t.add_row(str(tp), str(pp), why)
    return t


def explain(job: Job, c: Candidate) -> Group:
    """Every term of one layout's memory and time, with the equations' inputs; the heading ends
    with the layout as `mlm plan --layout` reads it back."""
    cfg, lo, mem, tm = job.cfg, c.layout, c.memory, c.timing
    m = cfg.model
    head = Text(
        f"{lo.mesh()}{' sp' if lo.sequence_parallel else ''}, micro-batch {lo.micro_batch} × "
        f"{lo.num_micro} per step per dp rank (global {lo.global_batch}, seq {cfg.data.seq_length}), "
        f"{lo.recompute} recompute, {_sharding_words(lo)}, {cfg.train.precision}; {job.gpus} × {job.hardware.name}, software {job.software.name}",
        style="bold",
    )
    head.append(f"\n--layout {lo}", style="bold")
    if lo.ep > 1:
        moe = m.moe
        head.append(
            f"\nexperts: {moe.num_experts} over ep {lo.ep} ({moe.num_experts // lo.ep} per rank), gradients "
            f"reduced over edp {lo.edp}; {moe.token_dispatcher} dispatcher, top-{moe.router_topk}, "
            "balanced routing assumed",
            style="bold",
        )
    if lo.cp > 1:
        head.append("\n" + context_parallel_line(job, lo), style="bold")
    if m.mtp_num_layers:
        head.append(
            f"\nMTP: {m.mtp_num_layers} depth(s) on the last pipeline rank, each a layer of the last "
            "layer's kind (never recomputed), eh_proj and another pass of the output layer"
            + ("; the rank also holds an embedding copy for their inputs" if lo.pp > 1 else ""),
            style="bold",
        )
    mt = Grid(
        f"memory per GPU (pipeline rank {mem.pp_rank}, {mem.in_flight} micro-batch chunks in flight)",
        ("component", "GB"),
        right=("GB",),
    )
    for k in MEMORY_ORDER:
        if k in mem.components:
            mt.add_row(k, f"{mem.components[k] / GB:.2f}")
    mt.add_row("total", f"{mem.total / GB:.2f} of {mem.hbm / GB:.0f}", bold=True)
    moe_layer = "expert outputs" in mem.per_layer
    lt = Grid(
        f"activations per {'MoE ' if moe_layer else ''}layer and micro-batch (mlm's layers)",
        ("part", "MB"),
        right=("MB",),
    )
    for k, v in mem.per_layer.items():
        lt.add_row(k, f"{v / 1e6:.1f}")
    mode = (
        "full"
        if lo.recompute == "full"
        else ("selective+sp" if lo.recompute == "selective" and lo.sequence_parallel else None)
    )
    if mode is None:
        mode = "tp+sp" if lo.sequence_parallel else ("tp" if lo.tp > 1 else "none")
    paper = korthikanti_layer_bytes(  # over the rank's s / cp tokens under context parallelism
        local_tokens(cfg, lo), lo.micro_batch, m.hidden_size, m.num_attention_heads, lo.tp, mode
    )
    lt.add_row(
        "total",
        f"{sum(mem.per_layer.values()) / 1e6:.1f}  ({'a dense GPT layer, ' if moe_layer else ''}"
        f"Korthikanti et al. {mode}: {paper / 1e6:.1f})",
        bold=True,
    )
    tt = Grid("time per step", ("term", "s"), right=("s",))
    for k, v in tm.terms.items():
        tt.add_row(k, f"{v:.3f}")
    tt.add_row("step", f"{tm.step_s:.3f}", bold=True)
    rates = Text(
        f"GEMM efficiency {tm.gemm_efficiency:.1%} of "
        f"{job.hardware.peak('fp8' if cfg.train.fp8.format else cfg.train.precision) / 1e12:.0f} "
        f"TFLOP/s; {tm.tokens_per_s_per_gpu:,.0f} tokens/s per GPU; MFU {tm.mfu:.1%}"
    )
    parts = [head, mt, lt, tt, rates]
    if lo.pp > 1:
        parts.append(Text(describe_schedule(lo.pp, lo.num_micro, lo.vpp)))
        parts.append(render_text(timeline(lo.pp, lo.num_micro, lo.vpp)))
    return Group(*parts)


def context_parallel_line(job: Job, lo: Layout) -> str:
    """How a cp layout splits each sequence and what its attention moves per layer."""
    cfg = job.cfg
    S, s, cp = cfg.data.seq_length, local_tokens(cfg, lo), lo.cp
    A = act_bytes(cfg)
    mb = micro(cfg, lo)
    kv = max(kinds.mixer(k).cp_kv_elements(cfg.model, mb, s) for k in cfg.model.mixer_kinds()) * A
    link = "NVLink" if lo.tp * cp <= job.gpus_per_node else "the network"
    split = (
        f"context parallel: each {S}-token sequence in {2 * cp} chunks of {S // (2 * cp)}; cp rank r "
        f"holds chunks r and {2 * cp - 1}−r ({s} tokens); gradients over dp × cp = {lo.dp_cp}; "
    )
    if lo.cp_comm_type == "all_gather":
        moved = (cp - 1) * kv
        return split + (
            f"attention all_gather over {link}: per layer and micro-batch {moved / 1e6:,.1f} MB of K and V "
            f"gathered forward, as much reduce-scattered backward, not overlapped; the whole sequence's K "
            f"and V and a {s}×{S} mask "
            + ("saved in every layer" if lo.recompute == "none" else "built again by each recomputed layer")
        )
    return split + (
        f"attention p2p ring over {link}: per layer and micro-batch {cp - 1} steps of {kv / 1e6:,.1f} MB "
        f"(K and V) forward, backward the same plus fp32 dK/dV ({kv * 4 / A / 1e6:,.1f} MB a step, "
        f"{cp} sends), each step overlapped with that step's attention compute (time = max(transfer, "
        f"compute) per step); buffers {cp_buffer_bytes(cfg, lo) / 1e6:,.1f} MB"
    )


def calibration_table(before: list, after: list, c: float, b: float) -> Grid:
    """Measured step against the prediction before and after calibration, per run."""
    t = Grid(
        f"calibration: compute × {c:.3f}, communication × {b:.3f}",
        ("run", "mesh", "measured s", "predicted before", "after"),
        right=("measured s", "predicted before", "after"),
    )
    for r0, r1 in zip(before, after, strict=True):
        t.add_row(
            str(r0.path),
            str(r0.layout.mesh()),
            f"{r0.measured_s + r0.fixed_s:.4g}",
            f"{r0.compute_s + r0.comm_s + r0.fixed_s:.4g}",
            f"{r1.compute_s + r1.comm_s + r1.fixed_s:.4g}",
        )
    return t


def _key(name: str) -> str:
    """'logits (transient)' → 'logits_transient' (a bare TOML key)."""
    return "_".join(name.replace("(", "").replace(")", "").split())


def plan_dict(job: Job, c: Candidate, preset: str, overrides: list[str]) -> dict:
    lo, cfg = c.layout, job.cfg
    return {
        "model": {"preset": preset, "overrides": list(overrides)},
        "cluster": {"gpus": job.gpus, "gpus_per_node": job.gpus_per_node, "hardware": job.hardware.name},
        "mesh": {
            "layout": str(lo),
            "tp": lo.tp,
            "pp": lo.pp,
            "vpp": lo.vpp,
            "dp": lo.dp,
            "cp": lo.cp,
            "cp_comm_type": lo.cp_comm_type,
            "ep": lo.ep,
            "sequence_parallel": lo.sequence_parallel,
            "first_stage_layers": lo.first_stage_layers,
            "last_stage_layers": lo.last_stage_layers,
        },
        "batching": {
            "micro_batch_size": lo.micro_batch,
            "global_batch_size": lo.global_batch,
            "accumulation": lo.num_micro,
            "seq_length": cfg.data.seq_length,
        },
        "choices": {
            "recompute": lo.recompute,
            "distributed_optimizer": lo.distributed_optimizer,
            "fsdp": bool(lo.fsdp),
            "fsdp_shard_size": lo.fsdp_shard,  # unset: over all dp × cp ranks
            "precision": cfg.train.precision,
            "param_dtype": cfg.train.param_dtype,
        },
        "prediction": {
            "software": job.software.name,
            "step_time_s": c.timing.step_s,
            "tokens_per_s_per_gpu": c.timing.tokens_per_s_per_gpu,
            "mfu": c.timing.mfu,
            "memory_gb": {_key(k): v / GB for k, v in c.memory.components.items()}
            | {"total": c.memory.total / GB, "hbm": c.memory.hbm / GB},
            "time_s": {_key(k): v for k, v in c.timing.terms.items()},
        },
    }


def _sharding_words(lo: Layout) -> str:
    if lo.fsdp:
        group = f"groups of {lo.fsdp_shard} dp × cp ranks (HSDP)" if lo.fsdp_shard else "dp × cp (FSDP)"
        return f"parameters, gradients and optimizer sharded over {group}"
    return f"{'distributed' if lo.distributed_optimizer else 'replicated'} optimizer"


def save_memory_png(job: Job, ranked: list[Candidate], path: str, top: int) -> None:
    """Stacked memory bars (one per component) of the top layouts against the GPU's memory; written
    under a temporary name and renamed into place. The best plan's pipeline schedule is drawn by
    `mlm.parallel.schedule_view.save_png` beside it."""
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = ranked[:top]
    fig, ax = plt.subplots(figsize=(max(8, 1.4 * len(shown)), 5), dpi=100, layout="constrained")
    try:
        bottoms = [0.0] * len(shown)
        for k in MEMORY_ORDER:
            vals = [c.memory.components.get(k, 0.0) / GB for c in shown]
            ax.bar(range(len(shown)), vals, bottom=bottoms, label=k)
            bottoms = [b + v for b, v in zip(bottoms, vals, strict=True)]
        ax.axhline(job.hardware.hbm_bytes / GB, color="red", linestyle="--", label="HBM")
        labels = [f"#{i + 1}\n{c.layout.mesh()}" for i, c in enumerate(shown)]
        ax.set_xticks(range(len(shown)), labels, fontsize=7)
        ax.set_ylabel("GB per GPU")
        ax.set_title(f"memory per GPU, {job.gpus} × {job.hardware.name}")
        ax.legend(fontsize=7)
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "wb") as f:
            fig.savefig(f, format="png")
        os.replace(tmp, path)
    finally:
        plt.close(fig)


def save_schedule_png(c: Candidate, path: str) -> None:
    lo = c.layout
    save_png(
        timeline(lo.pp, lo.num_micro, lo.vpp), path, title=describe_schedule(lo.pp, lo.num_micro, lo.vpp)
    )
