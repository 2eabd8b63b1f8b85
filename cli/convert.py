"""`mlm convert`: reshard a checkpoint for another mesh; Hugging Face import and export; verified.

    mlm convert CKPT OUT --tp 2 --pp 2 [--vpp 2] [--dp 4] [--ep 4] [--dtype bf16] [--consolidate]   # another mesh
    mlm convert CKPT OUT --layout tp2pp2dp4                  # the same, as a layout (docs/layout.md)
    mlm convert --from-hf HF_DIR OUT                       # HF model folder → mlm checkpoint
    mlm convert --from-megatron DIR OUT [--set model.num_attention_heads=32 ...] [--weights-only]   # Megatron torch_dist / legacy → mlm
    mlm convert --from-dcp DIR OUT --set model.num_attention_heads=32 --set model.rope_base=500000 [--weights-only]   # torchtitan → mlm
    mlm convert CKPT --to-hf OUT [--dtype bf16] [--max-shard-size 5GB]   # mlm checkpoint → HF folder
    mlm convert CKPT --to-megatron OUT                     # mlm checkpoint → Megatron torch_dist (weights)

See docs/convert.md.
"""

from __future__ import annotations

from pathlib import Path

import typer


def convert(
    src: Path = typer.Argument(
        ...,
        help="mlm checkpoint (DIR or DIR/iter_N), a Hugging Face model folder with --from-hf, or a "
        "Megatron torch_dist checkpoint with --from-megatron, a torchtitan checkpoint with --from-dcp.",
    ),
    out: Path = typer.Argument(..., help="New output folder; must not exist."),
    from_hf: bool = typer.Option(
        False, "--from-hf", help="SRC is a Hugging Face folder; OUT an mlm checkpoint."
    ),
    from_megatron: bool = typer.Option(
        False,
        "--from-megatron",
        help="SRC is a Megatron-core torch_dist or legacy (mp_rank_*) checkpoint (its save dir or "
        "iter_NNNNNNN/); OUT an mlm checkpoint.",
    ),
    from_dcp: bool = typer.Option(
        False,
        "--from-dcp",
        help="SRC is a torchtitan checkpoint (its checkpoint folder or step-N/, torch DCP); OUT an mlm checkpoint.",
    ),
    overrides: list[str] = typer.Option(
        [],
        "--set",
        help="--from-megatron, --from-dcp: model.key=value (or preset=NAME; --from-dcp also data.seq_length=N) for what the checkpoint does not say.",
    ),
    weights_only: bool = typer.Option(
        False,
        "--weights-only",
        help="--from-megatron, --from-dcp: leave out the optimizer state (mlm train then starts a new run from the weights).",
    ),
    to_hf: bool = typer.Option(
        False, "--to-hf", help="SRC is an mlm checkpoint (DIR or DIR/iter_N); OUT a Hugging Face folder."
    ),
    to_megatron: bool = typer.Option(
        False,
        "--to-megatron",
        help="SRC is an mlm checkpoint (DIR or DIR/iter_N); OUT a Megatron-LM torch_dist save directory "
        "(weights only).",
    ),
    tp: int | None = typer.Option(
        None, "--tp", help="Reshard: target tensor-parallel size (default: the source's)."
    ),
    pp: int | None = typer.Option(
        None, "--pp", help="Reshard: target pipeline-parallel size (default: the source's)."
    ),
    vpp: int | None = typer.Option(
        None, "--vpp", help="Reshard: target virtual pipeline size (default: the source's)."
    ),
    dp: int | None = typer.Option(
        None,
        "--dp",
        help="Reshard: target data-parallel size, checked against the batch (default: the source's).",
    ),
    ep: int | None = typer.Option(
        None,
        "--ep",
        help="Reshard a MoE checkpoint: target expert-parallel size, dividing the experts and dp × tp "
        "(default: the source's).",
    ),
    layout: str | None = typer.Option(
        None,
        "--layout",
        help="Reshard: the target mesh as one text (docs/layout.md), e.g. tp2pp2dp4, instead of "
        "--tp/--pp/--vpp/--dp/--ep: sizes it leaves out are 1, dp the source's.",
    ),
    consolidate: bool = typer.Option(
        False, "--consolidate", help="Reshard: write every tensor as one chunk."
    ),
    dtype: str | None = typer.Option(
        None, "--dtype", help="Reshard and --to-hf: cast weights to bf16, fp16 or fp32 (default: as stored)."
    ),
    max_shard_size: str = typer.Option(
        "5GB", "--max-shard-size", help="--to-hf: largest safetensors file; e.g. 5GB, 500MB, 2GiB."
    ),
    tokenizer: Path | None = typer.Option(
        None,
        "--tokenizer",
        help="--to-hf: copy the tokenizer files of this folder (default: the checkpoint's).",
    ),
    verify: bool = typer.Option(
        True,
        "--verify/--no-verify",
        help="Check every checkpoint chunk's checksum as it is read, and compare the logits of both sides "
        "before keeping OUT.",
    ),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show a progress bar."),
) -> None:
    """Reshard a checkpoint for another mesh, import a Hugging Face, Megatron-LM or torchtitan
    checkpoint, or export to Hugging Face or Megatron-LM; verified before OUT appears."""
    from mlm.errors import MlmError

    modes = {
        "--from-hf": from_hf,
        "--to-hf": to_hf,
        "--from-megatron": from_megatron,
        "--to-megatron": to_megatron,
        "--from-dcp": from_dcp,
    }
    chosen = [m for m, on in modes.items() if on]
    if len(chosen) > 1:
        raise MlmError(f"mlm convert: pass at most one of {', '.join(modes)} (given: {' '.join(chosen)})")
    mode = chosen[0] if chosen else "reshard"
    given = {
        "--tp": tp is not None,
        "--pp": pp is not None,
        "--vpp": vpp is not None,
        "--dp": dp is not None,
        "--ep": ep is not None,
        "--layout": layout is not None,
        "--consolidate": consolidate,
        "--dtype": dtype is not None,
        "--max-shard-size": max_shard_size != "5GB",
        "--tokenizer": tokenizer is not None,
        "--set": bool(overrides),
        "--weights-only": weights_only,
    }
    bad = [o for o, on in given.items() if on and o not in _OPTIONS[mode]]
    if bad:
        where = "; ".join(
            f"{o} applies to {' and '.join(m for m in _OPTIONS if o in _OPTIONS[m])}" for o in bad
        )
        label = "SRC OUT (a reshard)" if mode == "reshard" else mode
        raise MlmError(f"mlm convert {label}: leave out {', '.join(bad)} ({_WHAT[mode]}; {where})")
    if mode == "reshard":
        if not any(given.values()):
            raise MlmError(
                "mlm convert SRC OUT: say what to convert: --layout or --tp/--pp/--vpp/--dp/--ep, "
                "--consolidate, --dtype (reshard), "
                "--from-hf or --to-hf (Hugging Face), --from-megatron or --to-megatron (Megatron-LM), or --from-dcp "
                "(torchtitan)"
            )
        if layout is not None:
            sizes = [o for o in ("--tp", "--pp", "--vpp", "--dp", "--ep") if given[o]]
            if sizes:
                raise MlmError(
                    f"mlm convert --layout {layout} with {', '.join(sizes)}: both give the target mesh; "
                    "write the sizes in the layout (tp<N>, pp<N>, vpp<N>, dp<N>, ep<N>) or drop --layout"
                )
            tp, pp, vpp, dp, ep = _layout_sizes(layout)
        return _reshard(src, out, tp, pp, vpp, dp, ep, dtype, consolidate, verify, progress)

    from mlm.convert import hf, megatron, megatron_export, torchtitan

    run = {
        "--from-hf": lambda show: hf.import_hf(src, out, verify=verify, progress=show),
        "--to-hf": lambda show: hf.export_hf(
            src,
            out,
            dtype=dtype,
            max_shard_size=max_shard_size,
            tokenizer=tokenizer,
            verify=verify,
            progress=show,
        ),
        "--from-megatron": lambda show: megatron.import_megatron(
            src, out, overrides, verify=verify, weights_only=weights_only, progress=show
        ),
        "--to-megatron": lambda show: megatron_export.export_megatron(src, out, verify=verify, progress=show),
        "--from-dcp": lambda show: torchtitan.import_torchtitan(
            src, out, overrides, verify=verify, weights_only=weights_only, progress=show
        ),
    }[mode]
    _print_report(_with_progress(run, progress), mode)


_OPTIONS = {
    "reshard": {"--tp", "--pp", "--vpp", "--dp", "--ep", "--layout", "--consolidate", "--dtype"},
    "--from-hf": set(),
    "--to-hf": {"--dtype", "--max-shard-size", "--tokenizer"},
    "--from-megatron": {"--set", "--weights-only"},
    "--to-megatron": set(),
    "--from-dcp": {"--set", "--weights-only"},
}
"""The options each mode takes (besides --verify and --progress)."""

_WHAT = {
    "reshard": "a reshard rewrites an mlm checkpoint for another mesh",
    "--from-hf": "--from-hf imports a Hugging Face model as it is; reshard the import afterwards with mlm convert OUT OUT2 --tp ...",
    "--to-hf": "--to-hf exports the checkpoint's weights",
    "--from-megatron": "--from-megatron imports a Megatron checkpoint as it is; reshard the import afterwards with mlm convert OUT OUT2 --tp ...",
    "--to-megatron": "--to-megatron exports the checkpoint's weights as they are; Megatron reshards a torch_dist checkpoint when it loads it",
    "--from-dcp": "--from-dcp imports a torchtitan checkpoint as it is; reshard the import afterwards with mlm convert OUT OUT2 --tp ...",
}

_VERIFIED = {
    "--from-megatron": "checksums verified, shapes match the config, mlm logits finite (not compared with Megatron's)",
    "--from-dcp": "checksums verified, shapes match the config, mlm logits finite (not compared with torchtitan's)",
    "--to-megatron": "read back with mlm's Megatron reader: every tensor bitwise equal",
}
"""What verification checked where it is not a logit comparison of both sides."""


def _layout_sizes(text: str) -> tuple[int, int, int, int | None, int]:
    """--layout TEXT → the reshard's tp, pp, vpp, dp (None: the source's) and ep; a note says when
    the layout gives more (the run's choices: a checkpoint's tensors are the same under them)."""
    from mlm.console import console
    from mlm.layout import Layout

    lo = Layout.parse(text)
    target = Layout(lo.tp, lo.pp, lo.dp, None, None, lo.vpp, ep=lo.ep).mesh()
    if str(lo) != str(target):
        console.print(
            f"[bold yellow]note:[/] --layout {text}: a reshard applies its mesh, {target}; the rest are "
            "the run's choices, which change no tensor: give them to mlm train (--layout, --plan or --set)",
            highlight=False,
            soft_wrap=True,
        )
    return lo.tp, lo.pp, lo.vpp, lo.dp, lo.ep


def _with_progress(run, progress: bool):
    """`run(show)` under a rich progress bar (bytes read or written so far); its result."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from mlm.console import console, human

    bar = Progress(
        TextColumn("[bold]{task.description:<28}"),
        BarColumn(),
        TextColumn("{task.fields[size]}"),
        TimeElapsedColumn(),
        console=console,
        disable=not progress or not console.is_terminal,
    )
    with bar:
        task = bar.add_task("converting", total=None, size="")

        def show(desc: str, done: int, total: int) -> None:
            size = f"{human(done, 'B')} / {human(total, 'B')}" if total else ""
            bar.update(task, description=desc[:28], completed=done, total=total or None, size=size)

        return run(show)


def _print_report(report, mode: str) -> None:
    from mlm.console import console, human

    rate = report.bytes / 1e9 / max(report.seconds, 1e-9)
    line = (
        f"[bold green]{report.direction}ed[/] {report.architecture} {report.src} → {report.out}: "
        f"{report.tensors} tensors, {human(report.bytes, 'B')} {report.dtype}, {report.seconds:.1f} s "
        f"({rate:.3g} GB/s)"
    )
    if report.tokenizer_files:
        line += f", tokenizer: {', '.join(report.tokenizer_files)}"
    if not report.verified:
        line += "; not verified (--no-verify)"
    elif mode in _VERIFIED:
        line += f"; {_VERIFIED[mode]}"
    else:
        line += (
            f"; logits verified: max |diff| {report.max_abs_diff:.3g} ≤ {report.tolerance:.3g} "
            f"(max |logit| {report.max_abs_logit:.3g})"
        )
    console.print(line, highlight=False, soft_wrap=True)
    for note in report.notes:
        console.print(f"[bold yellow]note:[/] {note}", highlight=False, soft_wrap=True)


def _reshard(src, out, tp, pp, vpp, dp, ep, dtype, consolidate, verify, progress) -> None:
    import time

    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    from mlm.checkpoint import read_manifest, resolve_checkpoint
    from mlm.console import console
    from mlm.convert.reshard import reshard
    from mlm.layout import Layout

    manifest = read_manifest(resolve_checkpoint(src))
    parallel = manifest["config"]["parallel"]
    tp, pp, dp = tp or parallel["tp"], pp or parallel["pp"], dp or manifest.get("mesh", {}).get("dp", 1)
    vpp = vpp or (parallel.get("vpp", 1) if pp > 1 else 1)
    start = time.perf_counter()
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn())
    with Progress(*columns, console=console, disable=not progress or not console.is_terminal) as bar:
        task = bar.add_task("resharding", total=None)

        def show(desc: str, done: int, total: int) -> None:
            bar.update(task, completed=done, total=total or None)

        diff = reshard(
            src,
            out,
            tp,
            pp,
            vpp,
            dp=dp,
            ep=ep,
            dtype=dtype,
            consolidate=consolidate,
            verify=verify,
            progress=show,
        )
    ep = read_manifest(resolve_checkpoint(out))["mesh"]["ep"]
    seconds = time.perf_counter() - start
    nbytes = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    target = Layout(tp, pp, dp, None, None, vpp, ep=ep).mesh()
    line = (
        f"[bold green]resharded[/] {src} → {out} for {target}"
        f"{' (consolidated)' if consolidate else ''}: {nbytes / 1e9:.3g} GB in {seconds:.1f} s "
        f"({nbytes / 1e9 / max(seconds, 1e-9):.3g} GB/s)"
    )
    line += (
        "; checksums and logits not verified (--no-verify)"
        if diff is None
        else f"; checksums and logits verified: max |diff| {diff:.3g}"
    )
    console.print(line, highlight=False, soft_wrap=True)
