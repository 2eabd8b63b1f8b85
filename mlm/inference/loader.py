"""A checkpoint (trained by `mlm train` or imported by `mlm convert from-hf`) as a model ready
for inference (whole, or this rank's tensor-parallel shard of it), and its tokenizer.

Mixture-of-experts checkpoints load like any other: the checkpoint keeps the experts on their
global [E, ...] axis whatever expert parallelism trained them, and serving builds the model with
ep = 1, so every rank holds every expert whole (replicated over tp ranks, which route the same
tokens). Serving is dropless: `model.moe.capacity_factor` is a training setting, and with it a
sequence's output would depend on what shares its batch (capacity counts the step's tokens).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from mlm.build import build_rank_model
from mlm.checkpoint import checkpoint_config, load_checkpoint, read_manifest, resolve_checkpoint
from mlm.checkpoint.manager import tokenizer_path
from mlm.config import ModelConfig, ParallelConfig
from mlm.errors import MlmError
from mlm.model.gpt import GPT
from mlm.parallel.launch import pick_device
from mlm.parallel.mesh import Mesh
from mlm.parallel.parallelize import model_shards
from mlm.tokenizer import Tokenizer, load_tokenizer
from mlm.units import DTYPES


def model_config(ckpt: str | os.PathLike) -> ModelConfig:
    """The model config of a checkpoint (DIR or DIR/iter_N), without reading its tensors."""
    it_dir = resolve_checkpoint(ckpt)
    return checkpoint_config(read_manifest(it_dir), it_dir).model


def serving_config(cfg: ModelConfig) -> ModelConfig:
    """The model as served: MoE layers dropless (no capacity factor, no padding to capacity),
    without the multi-token prediction depths, which only training uses (their tensors stay in
    the checkpoint, unread), and with the fastest kernels and attention backend of the serving
    device (training chose them for its own)."""
    return dataclasses.replace(
        cfg,
        mtp_num_layers=0,
        layer_pattern=cfg.layer_pattern.split("/")[0],
        kernels="auto",
        attention_backend="auto",
        moe=dataclasses.replace(cfg.moe, capacity_factor=None, pad_to_capacity=False),
    )


def load_model(
    ckpt: str | os.PathLike,
    dtype: str = "fp32",
    device: str | torch.device = "auto",
    mesh: Mesh | None = None,
) -> tuple[GPT, dict, Path]:
    """(the model in eval mode on `device` in `dtype`, the manifest, the iter dir) of a checkpoint
    (DIR or DIR/iter_N), as served (`serving_config`). With a tensor-parallel `mesh`, this rank's
    shard of it (built by `parallelize`, as in training), which reads only its slices of the stored
    global tensors; experts stay whole on every rank (expert parallelism is 1 for serving)."""
    if dtype not in DTYPES:
        raise MlmError(f"--dtype {dtype}: must be one of {', '.join(DTYPES)}")
    it_dir = resolve_checkpoint(ckpt)
    manifest = read_manifest(it_dir)
    cfg = serving_config(checkpoint_config(manifest, it_dir).model)
    mesh = mesh or Mesh.single()
    assert mesh.ep == 1, f"serving keeps every expert whole on each rank; got a mesh with ep={mesh.ep}"
    model = build_rank_model(
        cfg, ParallelConfig(tp=mesh.tp), mesh, pick_device(device, "--device"), dtype=DTYPES[dtype]
    )
    shards = model_shards(model, mesh)
    # every stored tensor must be the model's, except the MTP depths', which serving leaves out
    mtp = {k.split("/", 1)[1] for k in manifest["tensors"] if k.startswith("model/mtp.")}
    load_checkpoint(it_dir, {"model": shards}, job_keys={"model": {st.key for st in shards} | mtp})
    return model.eval().requires_grad_(False), manifest, it_dir


def load_checkpoint_tokenizer(manifest: dict, it_dir: Path, override: str | None = None) -> Tokenizer:
    """`override`, else what the checkpoint names: an imported model's copied tokenizer files,
    the run's data.tokenizer, or the tokenizer recorded by its first dataset."""
    if override:
        return load_tokenizer(override)
    path = tokenizer_path(manifest, it_dir)
    if path is not None:
        return load_tokenizer(path)
    raise MlmError(
        f"{it_dir}: the checkpoint names no tokenizer (no tokenizer files, no data.tokenizer, no dataset "
        "that records one); pass --tokenizer PATH (a SentencePiece .model, a tokenizer.json or a folder)"
    )
