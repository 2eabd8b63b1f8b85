"""`mlm convert`: reshard a checkpoint, or import one from another framework; verified.

    mlm convert reshard CKPT OUT --tp 2 --pp 2 [--vpp 2] [--dp 4] [--ep 4] [--dtype bf16] [--consolidate]
    mlm convert reshard CKPT OUT --layout tp2pp2dp4            # the same, as a layout (docs/layout.md)
    mlm convert from-hf HF_DIR OUT                             # Hugging Face model folder → mlm
    mlm convert from-megatron DIR OUT [--set KEY=VALUE ...] [--weights-only]     # Megatron-LM → mlm
    mlm convert from-torchtitan DIR OUT --set model.num_attention_heads=32 --set model.rope.base=500000
    mlm convert from-trtllm TRT_DIR OUT                        # TensorRT-LLM checkpoint → mlm

Exports are `mlm export hf | megatron | trtllm` (cli/export.py). The forms before these
subcommands (`mlm convert --from-hf A B`, `mlm convert CKPT --to-hf OUT`, ...) stop with one line
naming the new command (`old_form`). See docs/convert.md.
"""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(
    help="Reshard mlm checkpoints, or import Hugging Face, Megatron-LM, torchtitan and TensorRT-LLM "
    "checkpoints; every conversion verified before OUT appears.",
    no_args_is_help=True,
    rich_markup_mode=None,
)

SRC_CKPT = typer.Argument(..., help="mlm checkpoint (DIR or DIR/iter_N).")
OUT = typer.Argument(..., help="New output folder; must not exist.")
VERIFY = typer.Option(
    True,
    "--verify/--no-verify",
    help="Check every checkpoint chunk's checksum as it is read, and compare the logits of both sides "
    "before keeping OUT.",
)
PROGRESS = typer.Option(True, "--progress/--no-progress", help="Show a progress bar.")
SETS = typer.Option(
    [], "--set", help="model.key=value (or preset=NAME) for what the checkpoint does not say."
)
WEIGHTS_ONLY = typer.Option(
    False,
    "--weights-only",
    help="Leave out the optimizer state (mlm train then starts a new run from the weights).",
)


@app.command("reshard")
def reshard(
    src: Path = SRC_CKPT,
    out: Path = OUT,
    tp: int | None = typer.Option(None, "--tp", help="Target tensor-parallel size (default: the source's)."),
    pp: int | None = typer.Option(
        None, "--pp", help="Target pipeline-parallel size (default: the source's)."
    ),
    vpp: int | None = typer.Option(
        None, "--vpp", help="Target virtual pipeline size (default: the source's)."
    ),
    dp: int | None = typer.Option(
        None, "--dp", help="Target data-parallel size, checked against the batch (default: the source's)."
    ),
    ep: int | None = typer.Option(
        None,
        "--ep",
        help="A MoE checkpoint's target expert-parallel size, dividing the experts and dp × tp "
        "(default: the source's).",
    ),
    layout: str | None = typer.Option(
        None,
        "--layout",
        help="The target mesh as one text (docs/layout.md), e.g. tp2pp2dp4, instead of "
        "--tp/--pp/--vpp/--dp/--ep: sizes it leaves out are 1, dp the source's.",
    ),
    consolidate: bool = typer.Option(False, "--consolidate", help="Write every tensor as one chunk."),
    dtype: str | None = typer.Option(
        None, "--dtype", help="Cast weights to bf16, fp16 or fp32 (default: as stored)."
    ),
    verify: bool = VERIFY,
    progress: bool = PROGRESS,
) -> None:
    """Rewrite an mlm checkpoint for another mesh (tp, pp, vpp, dp, ep), dtype or chunking."""
    from mlm.errors import MlmError

    sizes = [o for o, v in (("--tp", tp), ("--pp", pp), ("--vpp", vpp), ("--dp", dp), ("--ep", ep)) if v]
    if layout is None and not sizes and not consolidate and dtype is None:
        raise MlmError(
            "mlm convert reshard SRC OUT: say what to change: --layout or --tp/--pp/--vpp/--dp/--ep, "
            "--consolidate or --dtype"
        )
    if layout is not None:
        if sizes:
            raise MlmError(
                f"mlm convert reshard --layout {layout} with {', '.join(sizes)}: both give the target mesh; "
                "write the sizes in the layout (tp<N>, pp<N>, vpp<N>, dp<N>, ep<N>) or drop --layout"
            )
        tp, pp, vpp, dp, ep = _layout_sizes(layout)
    _reshard(src, out, tp, pp, vpp, dp, ep, dtype, consolidate, verify, progress)


@app.command("from-hf")
def from_hf(
    src: Path = typer.Argument(..., help="Hugging Face model folder (config.json and weights)."),
    out: Path = OUT,
    verify: bool = VERIFY,
    progress: bool = PROGRESS,
) -> None:
    """Import a Hugging Face model folder as it is (reshard it afterwards with mlm convert reshard)."""
    from mlm.convert.hf import folder as hf

    report = _with_progress(lambda show: hf.import_hf(src, out, verify=verify, progress=show), progress)
    _print_report(report)


@app.command("from-megatron")
def from_megatron(
    src: Path = typer.Argument(
        ..., help="Megatron-core torch_dist or legacy (mp_rank_*) checkpoint: its save dir or iter_NNNNNNN/."
    ),
    out: Path = OUT,
    overrides: list[str] = SETS,
    weights_only: bool = WEIGHTS_ONLY,
    verify: bool = VERIFY,
    progress: bool = PROGRESS,
) -> None:
    """Import a Megatron-LM checkpoint with its optimizer state and data position, as it is
    (reshard it afterwards with mlm convert reshard)."""
    from mlm.convert.megatron import importer as megatron

    def run(show):
        return megatron.import_megatron(
            src, out, overrides, verify=verify, weights_only=weights_only, progress=show
        )

    _print_report(_with_progress(run, progress), _VERIFIED["megatron"])


@app.command("from-torchtitan")
def from_torchtitan(
    src: Path = typer.Argument(..., help="torchtitan checkpoint folder or its step-N/ (torch DCP)."),
    out: Path = OUT,
    overrides: list[str] = typer.Option(
        [],
        "--set",
        help="model.key=value (or preset=NAME), data.seq_length=N: what the checkpoint does not say "
        "(the attention heads and the RoPE base at least).",
    ),
    weights_only: bool = WEIGHTS_ONLY,
    verify: bool = VERIFY,
    progress: bool = PROGRESS,
) -> None:
    """Import a torchtitan Llama checkpoint with its AdamW state and step, as it is (reshard it
    afterwards with mlm convert reshard)."""
    from mlm.convert.torchtitan import importer as torchtitan

    def run(show):
        return torchtitan.import_torchtitan(
            src, out, overrides, verify=verify, weights_only=weights_only, progress=show
        )

    _print_report(_with_progress(run, progress), _VERIFIED["torchtitan"])


@app.command("from-trtllm")
def from_trtllm(
    src: Path = typer.Argument(..., help="TensorRT-LLM checkpoint folder (config.json + rank*.safetensors)."),
    out: Path = OUT,
    progress: bool = PROGRESS,
) -> None:
    """Import a TensorRT-LLM checkpoint (one mlm exports: Llama or Mixtral layouts), read back bit for bit."""
    from mlm.convert.trtllm.importer import import_trtllm

    _print_report(_with_progress(lambda show: import_trtllm(src, out, show), progress), _VERIFIED["trtllm"])


OLD_FORMS = {
    "--from-hf": "convert from-hf",
    "--from-megatron": "convert from-megatron",
    "--from-dcp": "convert from-torchtitan",
    "--to-hf": "export hf",
    "--to-megatron": "export megatron",
}
"""The mode flags of `mlm convert` before its subcommands, and the command each became."""


def old_form(argv: list[str]) -> str | None:
    """The one-line message for a command line in a form from before the subcommands (`mlm convert
    --from-hf A B`, `mlm convert CKPT --to-hf OUT`, `mlm convert CKPT OUT --tp 2`, `mlm export trtllm
    --from-trtllm A B`), naming the command to run instead with the same arguments; else None."""
    rest = " ".join(a for a in argv[2:] if a != "--from-trtllm")
    if argv[:2] == ["export", "trtllm"] and "--from-trtllm" in argv:
        return f"mlm export trtllm --from-trtllm is now: mlm convert from-trtllm {rest}"
    if argv[:1] != ["convert"] or len(argv) < 2:
        return None
    for flag, verb in OLD_FORMS.items():
        if flag in argv[1:]:
            args = " ".join(a for a in argv[1:] if a != flag)
            return f"mlm convert {flag} is now: mlm {verb} {args}"
    if not argv[1].startswith("-") and argv[1] not in {c.name for c in app.registered_commands}:
        return f"mlm convert SRC OUT (a reshard) is now: mlm convert reshard {' '.join(argv[1:])}"
    return None


_VERIFIED = {
    "trtllm": "read back bit for bit",
    "megatron": "checksums verified, shapes match the config, mlm logits finite (not compared with Megatron's)",
    "torchtitan": "checksums verified, shapes match the config, mlm logits finite (not compared with torchtitan's)",
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


def _print_report(report, verified: str | None = None) -> None:
    """One line for an import or export (`verified`: what verification checked, where it is not a
    logit comparison of both sides), then its notes."""
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
    elif verified:
        line += f"; {verified}"
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
