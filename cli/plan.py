"""`mlm plan`: the mesh and batching for a model on N GPUs, from a memory and time model.

mlm plan --preset llama3-70b --gpus 512 --hardware h100-80g --global-batch 1024 -o plan.toml
mlm plan --preset llama3-70b --gpus 512 --explain --png plan.png
mlm plan --preset mixtral-8x7b --gpus 64 --global-batch 512 --ep 8
mlm plan --preset llama3-8b --gpus 64 --seq-length 131072 --global-batch 64 --cp 8
mlm plan --preset llama3-70b --gpus 512 --max-tp 4 --recompute none,selective --micro-batch 1
mlm plan --preset llama3-70b --gpus 512 --layout tp8pp4vpp2cp2p2pspzero1mb1rcsel -o plan.toml
mlm plan --config run.toml --gpus 8 --calibrate runs/x/metrics.jsonl --save-profile mine.toml
mlm plan --preset llama3-70b --gpus 512 --software megatron-core   # predicted for Megatron-core's kernels

The report goes to stdout (to stderr with `-o -`, whose plan then has stdout to itself); in a file
every table is whole, on a terminal too narrow for one it is stacked (`mlm.plan.report.Grid`).
`--layout` exits 2 on an invalid mesh (the rule's message) and 1 when the layout does not fit.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated

import typer

LAYOUT_HELP = (
    "Explain one layout instead of searching, in the text of docs/layout.md, e.g. tp8pp4vpp2cp2mb1rcsel; "
    "missing sizes are 1 but dp (what --gpus leaves), sp is on with tp > 1, and the choices not given "
    "(micro-batch, recompute, zero1, p2p/ag) are the fastest that fit."
)


def plan(
    gpus: int = typer.Option(..., "--gpus", help="GPUs to plan for (a multiple of --gpus-per-node)."),
    config: Path | None = typer.Option(None, "--config", "-c", help="Run config TOML (model, seq, batch)."),
    preset: str | None = typer.Option(None, "--preset", help="Model preset (see `mlm config list`)."),
    overrides: list[str] = typer.Option([], "--set", help="section.key=value, e.g. model.num_layers=40."),
    gpus_per_node: int = typer.Option(8, "--gpus-per-node", help="GPUs per node (the NVLink domain)."),
    hardware: str = typer.Option(
        "h100-80g", "--hardware", help="a100-40g, a100-80g, h100-80g, h200, b200, or a profile TOML."
    ),
    seq_length: int | None = typer.Option(
        None, "--seq-length", help="Tokens per sample (default: the preset's)."
    ),
    global_batch: int | None = typer.Option(None, "--global-batch", help="Samples per step."),
    tokens: int | None = typer.Option(None, "--tokens", help="Tokens per step (instead of --global-batch)."),
    precision: str = typer.Option("bf16", "--precision", help="bf16, fp16 or fp32."),
    optimizer: str = typer.Option(
        "auto",
        "--optimizer",
        help="adam (replicated), distributed (ZeRO-1 over dp), fsdp (FSDP or HSDP) or auto (try all).",
    ),
    ep: int | None = typer.Option(
        None, "--ep", help="Expert-parallel size to use (MoE models; default: search every valid one)."
    ),
    cp: int | None = typer.Option(
        None,
        "--cp",
        help="Context-parallel size to use (default: search every one that splits the sequence).",
    ),
    top: int = typer.Option(10, "--top", help="Plans to show."),
    pick: int = typer.Option(1, "--pick", help="Which ranked plan to explain and write (1 = the best)."),
    explain: bool = typer.Option(False, "--explain", help="Every memory and time term of the picked plan."),
    output: str | None = typer.Option(
        None, "--output", "-o", help="Write the picked plan here ('-': stdout)."
    ),
    png: Path | None = typer.Option(
        None,
        "--png",
        help="Memory bars of the top plans; the picked plan's schedule goes to NAME-schedule.png.",
    ),
    calibrate: list[Path] = typer.Option(
        [], "--calibrate", help="metrics.jsonl of a run on --gpus ranks (repeatable): refit the profile."
    ),
    save_profile: Path | None = typer.Option(
        None, "--save-profile", help="Write the calibrated profile here."
    ),
    layout: Annotated[str | None, typer.Option("--layout", help=LAYOUT_HELP)] = None,
    tp: Annotated[int | None, typer.Option("--tp", help="Only this tensor-parallel size.")] = None,
    pp: Annotated[int | None, typer.Option("--pp", help="Only this pipeline-parallel size.")] = None,
    max_tp: Annotated[int | None, typer.Option("--max-tp", help="Tensor-parallel sizes up to this.")] = None,
    micro_batch: Annotated[int | None, typer.Option("--micro-batch", help="Only this micro-batch.")] = None,
    recompute: Annotated[
        str | None,
        typer.Option("--recompute", help="Only these recompute modes: none, selective, full (a comma list)."),
    ] = None,
    software: Annotated[
        str,
        typer.Option(
            "--software",
            help="Kernels the time model counts: auto (mlm's own), mlm, mlm-triton, megatron-2021, "
            "megatron-2022, megatron-core, torchtitan, or a profile TOML.",
        ),
    ] = "auto",
) -> None:
    """Choose tp × pp × dp × cp (and ep for MoE models), micro-batch, recompute and optimizer
    sharding; predict memory and speed."""
    from mlm.console import console, make_console
    from mlm.errors import MlmError
    from mlm.layout import Layout
    from mlm.plan import report
    from mlm.plan.hardware import hardware_toml, load_hardware
    from mlm.plan.job import make_job
    from mlm.plan.search import RECOMPUTE, Constraints
    from mlm.plan.search import plan as search
    from mlm.plan.software import load_software
    from mlm.planfile import dumps, write_plan

    out = make_console(stderr=output == "-")

    if optimizer not in ("auto", "adam", "distributed", "fsdp"):
        raise MlmError(f"--optimizer {optimizer!r}: must be auto, adam, distributed or fsdp")
    sets = ([f"preset={preset}"] if preset else []) + list(overrides)
    given = Layout.parse(layout) if layout is not None else None
    if given is not None and given.global_batch is not None and global_batch is None and tokens is None:
        global_batch = given.global_batch
    job = make_job(
        config,
        sets,
        gpus,
        gpus_per_node,
        load_hardware(hardware),
        seq_length,
        global_batch,
        tokens,
        precision,
    )
    job = dataclasses.replace(job, software=load_software(software, job.cfg))
    if calibrate:
        from mlm.plan.calibrate import calibrate as refit
        from mlm.plan.calibrate import load_run

        runs = [load_run(m, gpus, gpus_per_node, job.hardware, job.software) for m in calibrate]
        hw, c, b = refit(job.hardware, runs)
        after = [load_run(m, gpus, gpus_per_node, hw, job.software) for m in calibrate]
        out.print(report.calibration_table(runs, after, c, b))
        if save_profile:
            from mlm.fileio import atomic_write_text

            atomic_write_text(save_profile, hardware_toml(hw))
            console.print(f"wrote {save_profile}; plan with --hardware {save_profile}")
        return
    modes = tuple(r.strip() for r in recompute.split(",")) if recompute is not None else RECOMPUTE
    k = Constraints(tp=tp, pp=pp, max_tp=max_tp, micro_batch=micro_batch, recompute=modes)
    if layout is not None:
        pinned = [
            o
            for o, v in (
                ("--tp", tp),
                ("--pp", pp),
                ("--max-tp", max_tp),
                ("--ep", ep),
                ("--cp", cp),
                ("--micro-batch", micro_batch),
                ("--recompute", recompute),
            )
            if v is not None
        ]
        if pinned:
            raise MlmError(
                f"--layout {layout} with {', '.join(pinned)}: the layout gives the mesh and its choices; "
                "write them in it (tp<N>, pp<N>, ep<N>, cp<N>, mb<N>, rcnone/rcsel/rcfull)"
            )
        chosen, ranked = _explain_layout(job, layout, given, optimizer, out), None
    else:
        result = search(job, optimizer, ep, cp, k)
        if not 1 <= pick <= len(result.ranked):
            raise MlmError(f"--pick {pick}: {len(result.ranked)} plans fit; choose 1 to {len(result.ranked)}")
        chosen, ranked = result.ranked[pick - 1], result.ranked
        out.print(report.ranked_table(job, result, top))
        out.print(report.rejected_table(result))
        if explain:
            out.print(report.explain(job, chosen))
    if png:
        report.save_memory_png(job, ranked or [chosen], str(png), top)
        console.print(f"wrote {png}")
        if chosen.layout.pp > 1:
            schedule = png.with_name(f"{png.stem}-schedule.png")
            report.save_schedule_png(chosen, str(schedule))
            console.print(f"wrote {schedule}")
    if output:
        text = dumps(report.plan_dict(job, chosen, preset or job.cfg.preset, sets))
        if output == "-":
            print(text, end="")
        else:
            write_plan(output, report.plan_dict(job, chosen, preset or job.cfg.preset, sets))
            console.print(f"wrote {output}: mlm train --config RUN.toml --plan {output}")


def _explain_layout(job, text: str, given, optimizer: str, out):
    """Print the explanation of `--layout TEXT` (parsed: `given`) and what was chosen for it; its
    candidate if it fits, else exit 1 after its memory breakdown (an invalid mesh is the rule's
    MlmError: exit 2)."""
    from mlm.console import console
    from mlm.plan import report
    from mlm.plan.pinned import complete
    from mlm.plan.search import sharding_name, why_not

    c, result = complete(job, given, optimizer)
    lo = c.layout
    chosen = [f"dp {lo.dp} (from --gpus {job.gpus})"] if given.dp is None else []
    if lo.tp > 1 and given.sequence_parallel is None:
        chosen.append("sequence parallelism on (tp > 1)")
    if given.micro_batch is None:
        chosen.append(f"micro-batch {lo.micro_batch}")
    if given.recompute is None:
        chosen.append(f"recompute {lo.recompute}")
    if given.distributed_optimizer is None and given.fsdp is None and optimizer == "auto" and lo.dp_cp > 1:
        chosen.append(f"sharding {sharding_name(lo)}")
    if lo.cp > 1 and given.cp_comm_type is None:
        chosen.append(f"{lo.cp_comm_type} attention")
    of = f"{len(result.ranked)} that fit" if c.fits else f"none of {result.evaluated} fits; the least memory"
    out.print(report.model_line(job), highlight=False)
    out.print(
        f"--layout {text} on {job.gpus} × {job.hardware.name}: {result.evaluated} layouts of this "
        f"mesh evaluated, {of}" + (f"; chosen: {', '.join(chosen)}" if chosen else ""),
        highlight=False,
    )
    out.print(report.explain(job, c))
    if not c.fits:
        console.print(f"[bold red]does not fit:[/] --layout {text} {why_not(c)}", highlight=False)
        raise typer.Exit(1)
    return c
