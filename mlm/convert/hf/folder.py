"""`mlm convert from-hf` / `mlm export hf`: Hugging Face model folder ⇄ mlm checkpoint, verified.

    import_hf("hf/llama", "ckpt/llama")               # → ckpt/llama/{latest, iter_0000000/, config.toml, tokenizer/}
    export_hf("ckpt/llama", "hf/llama-back", dtype="bf16", max_shard_size="5GB")

The key and layout mapping is `mlm.convert.hf` (one adapter per architecture). Each conversion is built
in `OUT.tmp-PID` beside OUT and renamed to OUT only after it is complete and, unless
`verify=False`, after the logits of mlm (`GPT` with the checkpoint's tensors, whose chunk checksums are
checked as they are read) and of transformers
(`AutoModelForCausalLM`) agree on a fixed prompt; otherwise the temporary folder is removed, so
OUT never holds a conversion that did not pass.
"""

from __future__ import annotations

import json
import math
import os
from functools import partial
from pathlib import Path

import torch

from mlm.checkpoint import checkpoint_config, read_group, store
from mlm.checkpoint.manager import checkpoint_tokenizer
from mlm.checkpoint.store import dtype_name
from mlm.config import Config, DataConfig, ModelConfig
from mlm.convert import hf as adapters
from mlm.convert.common import TOLERANCE, Progress, Report, noop, write_import
from mlm.convert.hf import io as hf_io
from mlm.errors import MlmError
from mlm.fileio import check_new_dir, staged_dir
from mlm.tokenizer import copy_tokenizer
from mlm.units import DTYPES, parse_size
from mlm.verify import prompt, prompt_logits

_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def check_transformers(hf_class: str) -> None:
    """MlmError unless the installed transformers has `hf_class`, which verification loads."""
    import transformers

    if getattr(transformers, hf_class, None) is None:
        since = adapters.adapter(hf_class).since
        raise MlmError(
            f"transformers {transformers.__version__} has no {hf_class} (it came in {since}), and the "
            f"logit check loads the model with it: upgrade (pip install 'transformers>={since}'), or "
            "pass --no-verify to convert without the check"
        )


def hf_logits(hf_dir: Path, cfg: ModelConfig) -> torch.Tensor:
    """Logits of transformers' `AutoModelForCausalLM` loaded from `hf_dir` in fp32 on the CPU."""
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        return model(input_ids=prompt(cfg.vocab_size, cfg.max_position_embeddings)).logits


def check_logits(report: Report, ours: torch.Tensor, theirs: torch.Tensor, tol_dtype: torch.dtype) -> None:
    """Fill the report's logit comparison; raise MlmError above the tolerance."""
    if ours.shape != theirs.shape:
        raise MlmError(
            f"verification failed: mlm logits have shape {list(ours.shape)}, transformers' {list(theirs.shape)}"
        )
    report.max_abs_diff = (ours - theirs).abs().max().item()
    report.max_abs_logit = theirs.abs().max().item()
    report.tolerance = TOLERANCE[tol_dtype] * max(1.0, report.max_abs_logit)
    if not report.max_abs_diff <= report.tolerance:  # also catches NaN
        raise MlmError(
            f"verification failed: max |logit difference| between mlm and transformers is "
            f"{report.max_abs_diff:.3g} (max |logit| {report.max_abs_logit:.3g}), above the "
            f"{dtype_name(tol_dtype)} tolerance {report.tolerance:.3g}; the output was removed and "
            f"{report.out} was not written. This is a conversion bug or an unsupported config field: "
            "please report it with the config.json"
        )
    report.verified = True


def _hf_class(hf_config: dict) -> str:
    """The supported transformers class a config.json describes, or an MlmError naming the supported ones."""
    supported = {a.hf_class: a for a in adapters.ADAPTERS.values()}
    classes = hf_config.get("architectures") or []
    model_type = hf_config.get("model_type")
    if classes:
        if classes[0] not in supported:
            raise MlmError(
                f"Hugging Face architecture {classes[0]!r} (model_type {model_type!r}) is not supported; "
                f"supported: {', '.join(supported)}"
            )
        return classes[0]
    return adapters.adapter(str(model_type)).hf_class


def import_hf(
    hf_dir: str | os.PathLike,
    out: str | os.PathLike,
    *,
    verify: bool = True,
    progress: Progress = noop,
) -> Report:
    """Hugging Face model folder → mlm checkpoint folder `out` (iteration 0, group "model")."""
    hf_dir, out = Path(hf_dir), Path(out)
    check_new_dir(out)
    hf_config = hf_io.read_hf_config(hf_dir)
    report = Report("import", hf_dir, out, _hf_class(hf_config))
    if verify:
        check_transformers(report.architecture)
    model_cfg = adapters.config_from_hf(hf_config)
    hf_tensors, ranges = hf_io.lazy_tensors(hf_dir)
    # e.g. DeepSeek-V3 MTP depths that config.json counts but transformers did not save
    model_cfg, note = adapters.adapter(report.architecture).config_for_keys(model_cfg, hf_tensors)
    if note:
        report.notes.append(f"{note}; imported without them (model.mtp_num_layers=0)")
    model_cfg.check_depth(len(hf_tensors), str(hf_dir))
    total = sum(f.stat().st_size for f in hf_io.weight_files(hf_dir))
    config = Config(
        model=model_cfg,
        data=DataConfig(seq_length=min(DataConfig().seq_length, model_cfg.max_position_embeddings)),
    )

    def raw(hf_key: str):
        """A tensor stored as it is: copied from its safetensors file by the kernel."""
        where = ranges.get(hf_key)
        if where is None or where[2] not in _SAFETENSORS_DTYPES:  # a .bin tensor: read it
            return hf_tensors[hf_key][1]()
        shape, dtype = tuple(hf_tensors[hf_key][0]), _SAFETENSORS_DTYPES[where[2]]
        piece = store.file_piece(where[0], where[1], math.prod(shape) * dtype.itemsize)  # checked here,
        plan = {"/".join(("c", *"0" * len(shape))): [piece]}  # copied in the writer thread
        return shape, dtype, partial(store.write_pieces, shape=shape, chunk=shape, dtype=dtype, plan=plan)

    def check(tmp: Path, config: Config, report: Report, progress: Progress) -> None:
        progress("verifying logits", 0, 0)
        stored = read_group(tmp)[0]  # what was written, not what was meant to be
        ours = prompt_logits(stored, model_cfg, stored["embed.weight"].shape[0])
        check_logits(report, ours, hf_logits(hf_dir, model_cfg), torch.float32)
        progress("verified logits", 0, 0)

    # read (or copied), converted and written one at a time (see save_streaming)
    tensors = adapters.iter_hf_to_mlm(hf_tensors, model_cfg, hf_config["model_type"], passthrough=raw)
    items = (("model", key, item) for key, item in tensors)
    extra = {"source": {"hf_dir": str(hf_dir.resolve()), "architecture": report.architecture}}
    return write_import(
        out, report, 0, items, extra, ["model"], config, progress, total,
        check=check if verify else None, tokenizer=hf_dir,
    )  # fmt: skip


def _no_tokenizer_outside(manifest: dict, it_dir: Path) -> None:
    """MlmError when a checkpoint without its own tokenizer copy names one outside it that exists
    here (its run's `data.tokenizer`, or its first dataset's): export reads no file outside the
    checkpoint unless `--tokenizer` names it (a manifest from elsewhere could name any file)."""
    from mlm.datasets.builder import parse_blend

    data = (manifest.get("config") or {}).get("data") or {}
    named = [Path(data["tokenizer"])] if data.get("tokenizer") else []
    named += [Path(f"{prefix}.json") for _, prefix in parse_blend(data.get("data_path") or [])[:1]]
    root = it_dir.parent.resolve()
    outside = next((p for p in named if p.exists() and not p.resolve().is_relative_to(root)), None)
    if outside is not None:
        raise MlmError(
            f"{it_dir}: the checkpoint holds no copy of its tokenizer, and its run read it from {outside}, "
            "outside the checkpoint, which export does not read unless you name it: pass --tokenizer PATH"
        )


def export_hf(
    ckpt: str | os.PathLike,
    out: str | os.PathLike,
    *,
    dtype: str | None = None,
    max_shard_size: str | int = "5GB",
    tokenizer: str | os.PathLike | None = None,
    verify: bool = True,
    progress: Progress = noop,
) -> Report:
    """mlm checkpoint (DIR or DIR/iter_N, model group) → Hugging Face model folder `out`."""
    ckpt, out = Path(ckpt), Path(out)
    check_new_dir(out)
    if dtype is not None and dtype not in DTYPES:
        raise MlmError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)} (default: the stored dtype)")
    max_bytes = parse_size(max_shard_size, "--max-shard-size")
    if tokenizer is not None and not Path(tokenizer).is_dir():
        raise MlmError(
            f"--tokenizer {tokenizer}: not a directory; pass the folder holding tokenizer.json etc."
        )
    report = Report("export", ckpt, out, "")
    progress("reading the checkpoint", 0, 0)
    mlm_state, manifest, it_dir = read_group(ckpt, verify=verify)
    progress("read the checkpoint", 0, 0)
    cfg = checkpoint_config(manifest, it_dir).model
    padded = mlm_state["embed.weight"].shape[0] if "embed.weight" in mlm_state else None
    source = (manifest.get("source") or {}).get("architecture", "")
    arch = adapters.arch_of(cfg, source)
    hf_state, hf_config = adapters.mlm_to_hf(mlm_state, cfg, arch, padded)
    if verify:
        check_transformers(adapters.adapter(arch).hf_class)
    fp32 = adapters.adapter(arch).float32_keys  # e.g. DeepSeek's expert biases: float32 whatever --dtype
    stored = {t.dtype for k, t in hf_state.items() if not k.endswith(fp32)}
    target = DTYPES[dtype] if dtype else (stored.pop() if len(stored) == 1 else torch.float32)
    dtypes = {k: torch.float32 if k.endswith(fp32) else target for k in hf_state}
    lossy = any(
        t.dtype.itemsize > dtypes[k].itemsize or t.dtype != dtypes[k] and dtypes[k] != torch.float32
        for k, t in hf_state.items()
    )
    hf_state = {k: t.to(dtypes[k]) for k, t in hf_state.items()}
    # transformers ≥ 4.56 reads `dtype` (and warns on `torch_dtype` alone); older ones `torch_dtype`
    hf_config["torch_dtype"] = hf_config["dtype"] = dtype_name(target)
    tok_dir = (
        Path(tokenizer) if tokenizer is not None else checkpoint_tokenizer(manifest, it_dir, vocabulary=False)
    )
    if tok_dir is None:
        _no_tokenizer_outside(manifest, it_dir)
    total = sum(t.numel() * t.element_size() for t in hf_state.values())
    report.architecture, report.tensors, report.bytes = adapters.adapter(arch).hf_class, len(hf_state), total
    report.dtype = dtype_name(target)
    with staged_dir(out) as tmp:
        written = 0

        def on_shard(name: str, n: int) -> None:
            nonlocal written
            written += n
            progress(f"wrote {name}", written, total)

        hf_io.write_safetensors(hf_state, tmp, max_bytes, on_shard)
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        report.tokenizer_files = copy_tokenizer(tok_dir, tmp) if tok_dir is not None else []
        gen = hf_io.generation_config(tok_dir)
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        del hf_state  # transformers reads it back from the files
        if verify:
            progress("verifying logits", 0, 0)
            ours = prompt_logits(mlm_state, cfg, padded or cfg.padded_vocab_size())
            check_logits(report, ours, hf_logits(tmp, cfg), target if lossy else torch.float32)
            progress("verified logits", 0, 0)
    return report.finish()
