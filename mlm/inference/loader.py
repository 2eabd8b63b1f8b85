"""A checkpoint (trained by `mlm train` or imported by `mlm convert --from-hf`) as a model ready
for inference, and its tokenizer."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from mlm.checkpoint import read_group
from mlm.config import config_from_dict
from mlm.datasets.builder import parse_blend
from mlm.datasets.meta import read_meta
from mlm.errors import MlmError
from mlm.model.gpt import GPT
from mlm.tokenizer import Tokenizer, load_tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise MlmError(f"--device {device}: CUDA is not available here; use --device cpu")
    return dev


def load_model(ckpt: str | os.PathLike, dtype: str = "fp32", device: str = "auto") -> tuple[GPT, dict, Path]:
    """(the model in eval mode on `device` in `dtype`, the manifest, the iter dir) of a checkpoint
    (DIR or DIR/iter_N)."""
    if dtype not in DTYPES:
        raise MlmError(f"--dtype {dtype}: must be one of {', '.join(DTYPES)}")
    tensors, manifest, it_dir = read_group(ckpt)
    if "config" not in manifest:
        raise MlmError(f"{it_dir}/manifest.json has no config; it was not written by mlm train or convert")
    cfg = config_from_dict(manifest["config"]).model
    with torch.device("meta"):
        model = GPT(cfg, tensors["embed.weight"].shape[0])
    dev = resolve_device(device)
    state = {k: v.to(device=dev, dtype=DTYPES[dtype]) for k, v in tensors.items()}
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval().requires_grad_(False), manifest, it_dir


def load_checkpoint_tokenizer(manifest: dict, it_dir: Path, override: str | None = None) -> Tokenizer:
    """`override`, else what the checkpoint names: an imported model's copied tokenizer files,
    the run's data.tokenizer, or the tokenizer recorded by its first dataset."""
    if override:
        return load_tokenizer(override)
    recorded = manifest.get("tokenizer") or {}
    if set(recorded.get("files", [])) & set(TOKENIZER_FILES):  # not only generation_config.json
        return load_tokenizer(it_dir.parent / recorded["path"])
    data = manifest.get("config", {}).get("data", {})
    if data.get("tokenizer"):
        return load_tokenizer(data["tokenizer"])
    for _, prefix in parse_blend(data.get("data_path") or [])[:1]:
        meta = read_meta(prefix)
        if meta and meta.get("tokenizer", {}).get("path"):
            return load_tokenizer(meta["tokenizer"]["path"])
    raise MlmError(
        f"{it_dir}: the checkpoint names no tokenizer (no tokenizer files, no data.tokenizer, no dataset "
        "that records one); pass --tokenizer PATH (a SentencePiece .model, a tokenizer.json or a folder)"
    )
