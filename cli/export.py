"""`mlm export`: mlm checkpoints as Hugging Face, Megatron-LM and TensorRT-LLM checkpoints, checked.

    mlm export hf CKPT OUT [--dtype bf16] [--max-shard-size 5GB] [--tokenizer DIR]   # HF model folder
    mlm export megatron CKPT OUT                                   # Megatron-core torch_dist (weights)
    mlm export trtllm CKPT OUT --tp 2 --pp 1 [--dtype bfloat16]     # TensorRT-LLM folder
    mlm export trtllm --check OUT                                  # validate a TensorRT-LLM folder

The imports are `mlm convert from-hf | from-megatron | from-torchtitan | from-trtllm`. See
docs/hf.md, docs/megatron-export.md and docs/trtllm.md.
"""

from __future__ import annotations

from pathlib import Path

import typer

from cli.convert import OUT, PROGRESS, SRC_CKPT, VERIFY, _print_report, _with_progress

app = typer.Typer(
    help="Export mlm checkpoints to Hugging Face, Megatron-LM and TensorRT-LLM; verified before OUT appears.",
    no_args_is_help=True,
    rich_markup_mode=None,
)


@app.command("hf")
def hf(
    src: Path = SRC_CKPT,
    out: Path = OUT,
    dtype: str | None = typer.Option(
        None, "--dtype", help="Cast weights to bf16, fp16 or fp32 (default: as stored)."
    ),
    max_shard_size: str = typer.Option(
        "5GB", "--max-shard-size", help="Largest safetensors file; e.g. 5GB, 500MB, 2GiB."
    ),
    tokenizer: Path | None = typer.Option(
        None, "--tokenizer", help="Copy the tokenizer files of this folder (default: the checkpoint's)."
    ),
    verify: bool = VERIFY,
    progress: bool = PROGRESS,
) -> None:
    """Write a Hugging Face model folder (config.json, safetensors, tokenizer), its logits checked
    against the checkpoint's."""
    from mlm.convert.hf import folder as convert_hf

    def run(show):
        return convert_hf.export_hf(
            src,
            out,
            dtype=dtype,
            max_shard_size=max_shard_size,
            tokenizer=tokenizer,
            verify=verify,
            progress=show,
        )

    _print_report(_with_progress(run, progress))


@app.command("megatron")
def megatron(src: Path = SRC_CKPT, out: Path = OUT, verify: bool = VERIFY, progress: bool = PROGRESS) -> None:
    """Write a Megatron-LM torch_dist save directory (the weights as they are; Megatron reshards a
    torch_dist checkpoint when it loads it), read back with mlm's Megatron reader."""
    from mlm.convert.megatron import exporter as megatron_export

    def run(show):
        return megatron_export.export_megatron(src, out, verify=verify, progress=show)

    verified = "read back with mlm's Megatron reader: every tensor bitwise equal"
    _print_report(_with_progress(run, progress), verified)


@app.command("trtllm")
def trtllm(
    src: Path | None = typer.Argument(None, help="mlm checkpoint (DIR or DIR/iter_N)."),
    out: Path | None = typer.Argument(None, help="New output folder; must not exist."),
    tp: int = typer.Option(1, "--tp", help="Tensor-parallel ranks of the engine."),
    pp: int = typer.Option(1, "--pp", help="Pipeline-parallel ranks of the engine."),
    dtype: str | None = typer.Option(
        None, "--dtype", help="bfloat16, float16 or float32 (default: the stored dtype)."
    ),
    check: Path | None = typer.Option(
        None, "--check", help="Only validate this TensorRT-LLM folder (names, shapes, dtypes, config)."
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
        if src is not None or out is not None:
            raise MlmError("mlm export trtllm --check DIR takes no other path")
        from mlm.convert.trtllm.check import check_trtllm

        problems = check_trtllm(check)
        if problems:
            raise MlmError(f"{check}: {len(problems)} problem(s): " + "; ".join(problems))
        console.print(f"[bold green]ok[/] {check}: a valid TensorRT-LLM checkpoint", highlight=False)
        return
    if src is None or out is None:
        raise MlmError("mlm export trtllm: pass CKPT OUT (or --check DIR)")
    from mlm.convert.trtllm.exporter import export_trtllm

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
