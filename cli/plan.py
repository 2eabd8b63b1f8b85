"""`mlm plan`: the mesh and batching for a model on N GPUs, from a memory and time model.

mlm plan --preset llama3-70b --gpus 512 --hardware h100-80g --global-batch 1024 -o plan.toml
mlm plan --preset llama3-70b --gpus 512 --explain --png plan.png
mlm plan --preset mixtral-8x7b --gpus 64 --global-batch 512 --ep 8
mlm plan --preset llama3-8b --gpus 64 --seq-length 131072 --global-batch 64 --cp 8
mlm plan --config run.toml --gpus 8 --calibrate runs/x/metrics.jsonl --save-profile mine.toml
"""

from __future__ import annotations

from pathlib import Path

import typer


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
        "auto", "--optimizer", help="adam (replicated), distributed (sharded over dp) or auto (try both)."
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
) -> None:
    """Choose tp × pp × dp × cp (and ep for MoE models), micro-batch, recompute and optimizer
    sharding; predict memory and speed."""
    from mlm.console import console
    from mlm.errors import MlmError
    from mlm.plan import report
    from mlm.plan.hardware import hardware_toml, load_hardware
    from mlm.plan.layout import make_job
    from mlm.plan.search import plan as search
    from mlm.planfile import dumps, write_plan

    if optimizer not in ("auto", "adam", "distributed"):
        raise MlmError(f"--optimizer {optimizer!r}: must be auto, adam or distributed")
    sets = ([f"preset={preset}"] if preset else []) + list(overrides)
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
    if calibrate:
        from mlm.plan.calibrate import calibrate as refit
        from mlm.plan.calibrate import load_run

        runs = [load_run(m, gpus, gpus_per_node, job.hardware) for m in calibrate]
        hw, c, b = refit(job.hardware, runs)
        after = [load_run(m, gpus, gpus_per_node, hw) for m in calibrate]
        console.print(report.calibration_table(runs, after, c, b))
        if save_profile:
            from mlm.fileio import atomic_write_text

            atomic_write_text(save_profile, hardware_toml(hw))
            console.print(f"wrote {save_profile}; plan with --hardware {save_profile}")
        return
    result = search(job, optimizer, ep, cp)
    if not 1 <= pick <= len(result.ranked):
        raise MlmError(f"--pick {pick}: {len(result.ranked)} plans fit; choose 1 to {len(result.ranked)}")
    chosen = result.ranked[pick - 1]
    console.print(report.ranked_table(job, result, top))
    console.print(report.rejected_table(result))
    if explain:
        console.print(report.explain(job, chosen))
    if png:
        report.save_memory_png(job, result.ranked, str(png), top)
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
