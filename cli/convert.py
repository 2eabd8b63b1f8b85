"""`mlm convert`: reshard a checkpoint for another mesh; Hugging Face import and export; verified.

    mlm convert CKPT OUT --tp 2 --pp 2 [--vpp 2] [--dp 4] [--ep 4] [--dtype bf16] [--consolidate]   # another mesh
    mlm convert --from-hf HF_DIR OUT                       # HF model folder → mlm checkpoint
    mlm convert --from-megatron DIR OUT [--set model.num_attention_heads=32 ...] [--weights-only]   # Megatron torch_dist / legacy → mlm
    mlm convert --from-dcp DIR OUT --set model.num_attention_heads=32 --set model.rope_base=500000   # torchtitan → mlm
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
        help="--from-megatron, --from-dcp: model.key=value (or preset=NAME) for what the checkpoint does not say.",
    ),
    weights_only: bool = typer.Option(
        False,
        "--weights-only",
        help="--from-megatron: leave out the optimizer state (mlm train then starts a new run from the weights).",
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
    """Reshard a checkpoint for another mesh, import a Hugging Face model (--from-hf) or export a
    checkpoint to one (--to-hf); the logits of both sides are compared before OUT appears."""
    from mlm.errors import MlmError

    if from_megatron or from_dcp:
        if (
            from_hf
            or to_hf
            or (from_megatron and from_dcp)
            or to_megatron
            or any(v is not None for v in (tp, pp, vpp, dp, ep, dtype, tokenizer))
            or consolidate
        ):
            raise MlmError(
                f"{'--from-dcp imports a torchtitan' if from_dcp else '--from-megatron imports a Megatron'} "
                "checkpoint as it is: leave out --from-hf/--to-hf (and one of --from-megatron/--from-dcp) and the "
                "reshard options (reshard the imported checkpoint afterwards with mlm convert OUT OUT2 --tp ...)"
            )
        return _from_megatron(src, out, overrides, verify, progress, weights_only, torchtitan=from_dcp)
    if to_megatron:
        if (
            from_hf
            or to_hf
            or overrides
            or any(v is not None for v in (tp, pp, vpp, dp, ep, dtype, tokenizer))
            or consolidate
        ):
            raise MlmError(
                "--to-megatron exports the checkpoint's weights as they are: leave out --from-hf/--to-hf, --set "
                "and the reshard options (Megatron reshards a torch_dist checkpoint when it loads it)"
            )
        return _to_megatron(src, out, verify, progress)
    if overrides:
        raise MlmError("--set applies to --from-megatron and --from-dcp only")
    if from_hf and to_hf:
        raise MlmError("mlm convert: pass at most one of --from-hf (HF → mlm) or --to-hf (mlm → HF)")
    mesh_options = any(v is not None for v in (tp, pp, vpp, dp, ep)) or consolidate
    if (from_hf or to_hf) and mesh_options:
        raise MlmError(
            "--tp, --pp, --vpp, --dp, --ep and --consolidate reshard an mlm checkpoint; leave out --from-hf/--to-hf"
        )
    if from_hf and (dtype is not None or tokenizer is not None or max_shard_size != "5GB"):
        raise MlmError("--dtype, --tokenizer and --max-shard-size apply to --to-hf only")
    if not (from_hf or to_hf):
        if not mesh_options and dtype is None:
            raise MlmError(
                "mlm convert SRC OUT: say what to convert: --tp/--pp/--vpp/--dp/--ep/--consolidate/--dtype (reshard), "
                "--from-hf or --to-hf (Hugging Face), --from-megatron / --to-megatron or --from-dcp"
            )
        return _reshard(src, out, tp, pp, vpp, dp, ep, dtype, consolidate, verify, progress)

    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from mlm.console import console, human
    from mlm.convert.hf import export_hf, import_hf

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
            bar.update(task, description=desc, completed=done, total=total or None, size=size)

        if from_hf:
            report = import_hf(src, out, verify=verify, progress=show)
        else:
            report = export_hf(
                src,
                out,
                dtype=dtype,
                max_shard_size=max_shard_size,
                tokenizer=tokenizer,
                verify=verify,
                progress=show,
            )
    rate = report.bytes / 1e9 / max(report.seconds, 1e-9)
    line = (
        f"[bold green]{report.direction}ed[/] {report.architecture} {report.src} → {report.out}: "
        f"{report.tensors} tensors, {human(report.bytes, 'B')} {report.dtype}, {report.seconds:.1f} s "
        f"({rate:.3g} GB/s)"
    )
    if report.tokenizer_files:
        line += f", tokenizer: {', '.join(report.tokenizer_files)}"
    if report.max_abs_diff is None:
        line += "; logits not verified (--no-verify)"
    else:
        line += (
            f"; logits verified: max |diff| {report.max_abs_diff:.3g} ≤ {report.tolerance:.3g} "
            f"(max |logit| {report.max_abs_logit:.3g})"
        )
    console.print(line, highlight=False, soft_wrap=True)
    for note in report.notes:
        console.print(f"[bold yellow]note:[/] {note}", highlight=False, soft_wrap=True)


def _from_megatron(src, out, overrides, verify, progress, weights_only, torchtitan=False) -> None:
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

    from mlm.console import console, human
    from mlm.convert.megatron import import_megatron
    from mlm.convert.torchtitan import import_torchtitan

    columns = (TextColumn("[bold]{task.description:<28}"), BarColumn(), DownloadColumn())
    with Progress(*columns, console=console, disable=not progress or not console.is_terminal) as bar:
        task = bar.add_task("importing", total=None)

        def show(desc: str, done: int, total: int) -> None:
            bar.update(task, description=desc[:28], completed=done, total=total or None)

        if torchtitan:
            report = import_torchtitan(src, out, overrides, verify=verify, progress=show)
        else:
            report = import_megatron(
                src, out, overrides, verify=verify, weights_only=weights_only, progress=show
            )
    line = (
        f"[bold green]imported[/] {report.architecture} {report.src} → {report.out}: {report.tensors} tensors, "
        f"{human(report.bytes, 'B')} {report.dtype}, {report.seconds:.1f} s"
    )
    line += (
        "; not verified (--no-verify)"
        if report.max_abs_logit is None
        else "; checksums verified, shapes match the config, mlm logits finite (not compared with "
        f"{'torchtitan' if torchtitan else 'Megatron'}'s)"
    )
    console.print(line, highlight=False, soft_wrap=True)
    for note in report.notes:
        console.print(f"[bold yellow]note:[/] {note}", highlight=False, soft_wrap=True)


def _to_megatron(src, out, verify, progress) -> None:
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

    from mlm.console import console, human
    from mlm.convert.megatron_export import export_megatron

    columns = (TextColumn("[bold]{task.description:<28}"), BarColumn(), DownloadColumn())
    with Progress(*columns, console=console, disable=not progress or not console.is_terminal) as bar:
        task = bar.add_task("exporting", total=None)

        def show(desc: str, done: int, total: int) -> None:
            bar.update(task, description=desc[:28], completed=done, total=total or None)

        report = export_megatron(src, out, verify=verify, progress=show)
    line = (
        f"[bold green]exported[/] {report.src} → {report.out} ({report.architecture}, torch_dist): "
        f"{report.tensors} tensors, {human(report.bytes, 'B')} {report.dtype}, {report.seconds:.1f} s"
    )
    line += (
        "; read back with mlm's Megatron reader: every tensor bitwise equal"
        if verify
        else "; not verified (--no-verify)"
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
    ep_given, ep = ep is not None, read_manifest(resolve_checkpoint(out))["mesh"]["ep"]
    seconds = time.perf_counter() - start
    nbytes = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    line = (
        f"[bold green]resharded[/] {src} → {out} for tp={tp} pp={pp}"
        f"{f' vpp={vpp}' if vpp > 1 else ''} dp={dp}{f' ep={ep}' if ep_given or ep > 1 else ''}"
        f"{' (consolidated)' if consolidate else ''}: {nbytes / 1e9:.3g} GB in {seconds:.1f} s "
        f"({nbytes / 1e9 / max(seconds, 1e-9):.3g} GB/s)"
    )
    line += (
        "; checksums and logits not verified (--no-verify)"
        if diff is None
        else f"; checksums and logits verified: max |diff| {diff:.3g}"
    )
    console.print(line, highlight=False, soft_wrap=True)
