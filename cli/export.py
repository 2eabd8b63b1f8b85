"""`mlm export trtllm`: TensorRT-LLM checkpoints from mlm checkpoints, checked; and back.

    mlm export trtllm CKPT OUT --tp 2 --pp 1 [--dtype bfloat16]   # mlm checkpoint → TRT-LLM folder
    mlm export trtllm --check OUT                                # validate a TRT-LLM folder
    mlm export trtllm --from-trtllm TRT_DIR OUT                  # TRT-LLM folder → mlm checkpoint

See docs/export.md.
"""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(
    help="Export checkpoints for deployment runtimes (TensorRT-LLM).",
    no_args_is_help=True,
    rich_markup_mode=None,
)


@app.command("trtllm")
def trtllm(
    src: Path | None = typer.Argument(
        None, help="mlm checkpoint (DIR or DIR/iter_N), or a TensorRT-LLM folder with --from-trtllm."
    ),
    out: Path | None = typer.Argument(None, help="New output folder; must not exist."),
    tp: int = typer.Option(1, "--tp", help="Tensor-parallel ranks of the engine."),
    pp: int = typer.Option(1, "--pp", help="Pipeline-parallel ranks of the engine."),
    dtype: str | None = typer.Option(
        None, "--dtype", help="bfloat16, float16 or float32 (default: the stored dtype)."
    ),
    check: Path | None = typer.Option(
        None, "--check", help="Only validate this TensorRT-LLM folder (names, shapes, dtypes, config)."
    ),
    from_trtllm: bool = typer.Option(
        False, "--from-trtllm", help="SRC is a TensorRT-LLM folder; OUT an mlm checkpoint."
    ),
    verify: bool = typer.Option(
        True,
        "--verify/--no-verify",
        help="Check chunk checksums, and read the export back (tensors and logits) before keeping OUT.",
    ),
) -> None:
    """Write a TensorRT-LLM checkpoint (config.json + rank{N}.safetensors) for tp × pp ranks, checked
    and read back before OUT appears; print the trtllm-build line to run next."""
    from mlm.console import console, human
    from mlm.errors import MlmError

    if check is not None:
        if src is not None or out is not None or from_trtllm:
            raise MlmError("mlm export trtllm --check DIR takes no other path and no --from-trtllm")
        from mlm.export.trtllm_check import check_trtllm

        problems = check_trtllm(check)
        if problems:
            raise MlmError(f"{check}: {len(problems)} problem(s): " + "; ".join(problems))
        console.print(f"[bold green]ok[/] {check}: a valid TensorRT-LLM checkpoint", highlight=False)
        return
    if src is None or out is None:
        raise MlmError("mlm export trtllm: pass CKPT OUT (or --check DIR, or --from-trtllm TRT_DIR OUT)")
    if from_trtllm:
        if (tp, pp, dtype) != (1, 1, None):
            raise MlmError("--tp, --pp and --dtype apply to exports; --from-trtllm keeps the folder's dtype")
        from mlm.export.trtllm_import import import_trtllm

        r = import_trtllm(src, out)
        console.print(
            f"[bold green]imported[/] {r.architecture} {r.src} → {r.out}: {r.tensors} tensors, "
            f"{human(r.bytes, 'B')} {r.dtype}, {r.seconds:.1f} s; read back bit for bit",
            highlight=False,
            soft_wrap=True,
        )
        return
    from mlm.export.trtllm import export_trtllm

    r = export_trtllm(src, out, tp=tp, pp=pp, dtype=dtype, verify=verify)
    verified = (
        "not read back (--no-verify)"
        if r.max_abs_diff is None
        else f"read back bit for bit; logits vs the uncast source: max |diff| {r.max_abs_diff:.3g}"
    )
    console.print(
        f"[bold green]exported[/] {r.architecture} {r.src} → {r.out} for tp={r.tp} pp={r.pp}: "
        f"{r.tp * r.pp} rank file(s), {r.tensors} tensors, {human(r.bytes, 'B')} {r.dtype}, "
        f"{r.seconds:.1f} s; checked; {verified}",
        highlight=False,
        soft_wrap=True,
    )
    console.print("next, on a machine with TensorRT-LLM:", highlight=False)
    print(r.build_command)
