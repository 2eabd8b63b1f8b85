"""`mlm export trtllm CKPT OUT --tp T --pp P [--dtype D]`: an mlm checkpoint as a TensorRT-LLM checkpoint.

    report = export_trtllm("runs/tiny/checkpoints", "out/trt", tp=2, pp=1, dtype="bfloat16")
    print(report.build_command)     # the trtllm-build line to run next

Every tensor is read once in its global shape, cast, cut into each rank's slices (`names`) and
written in `OUT.tmp-PID`, renamed to OUT once checked and read back: docs/trtllm.md ("What is
checked before OUT appears"). Memory holds the model twice (the source and the cast copy).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from mlm.checkpoint import checkpoint_config, read_group
from mlm.checkpoint.store import dtype_name
from mlm.convert.trtllm.check import CONFIG, check_or_raise, rank_file
from mlm.convert.trtllm.config import DTYPES, dtype_choice, trt_config
from mlm.convert.trtllm.importer import read_trtllm
from mlm.convert.trtllm.names import fixed_dtypes, rank_rules, shard, sources
from mlm.errors import MlmError
from mlm.fileio import check_new_dir, staged_dir
from mlm.model.gpt import VOCAB_ROWS
from mlm.verify import prompt_logits


@dataclass
class Report:
    """What an export did, for the summary line."""

    src: Path
    out: Path
    architecture: str
    tp: int
    pp: int
    dtype: str
    tensors: int
    """Tensors written, over all ranks."""
    bytes: int
    seconds: float
    build_command: str
    max_abs_diff: float | None = None
    """Max |logit difference| from the source in its stored dtype (0 when not cast); None unverified."""


def build_command(out: Path, config: dict) -> str:
    """The `trtllm-build` line for an exported folder: one engine per rank, for the model's context."""
    world, n = config["mapping"]["world_size"], config["max_position_embeddings"]
    workers = f" --workers {min(world, 8)}" if world > 1 else ""
    return (
        f"trtllm-build --checkpoint_dir {out} --output_dir {out}-engine --gemm_plugin auto "
        f"--max_batch_size 8 --max_input_len {n} --max_seq_len {n}{workers}"
    )


def export_trtllm(
    ckpt: str | os.PathLike,
    out: str | os.PathLike,
    *,
    tp: int = 1,
    pp: int = 1,
    dtype: str | None = None,
    verify: bool = True,
) -> Report:
    """mlm checkpoint (DIR or DIR/iter_N) → TensorRT-LLM checkpoint folder `out` for tp × pp ranks."""
    ckpt, out = Path(ckpt), Path(out)
    check_new_dir(out)
    target = dtype_choice(dtype) if dtype is not None else None
    start = time.perf_counter()
    state, manifest, it_dir = read_group(ckpt, verify=verify)
    cfg = checkpoint_config(manifest, it_dir).model
    if cfg.moe.capacity_factor is not None:  # TensorRT-LLM's MoE is dropless: verify that model
        cfg = dataclasses.replace(
            cfg, moe=dataclasses.replace(cfg.moe, capacity_factor=None, pad_to_capacity=False)
        )
    if target is None:
        stored = {dtype_name(t.dtype) for t in state.values()}
        target = stored.pop() if len(stored) == 1 and stored <= set(DTYPES) else "float32"
    config = trt_config(cfg, tp, pp, target)  # refuses a model or a mesh TensorRT-LLM's layout has not
    arch = config["architecture"]
    fixed = fixed_dtypes(arch, cfg)  # Mixtral's router: float32 whatever the dtype
    cast = {k: t.to(getattr(torch, fixed.get(k, target))) for k, t in state.items()}
    tensors = nbytes = 0
    with staged_dir(out) as tmp:
        (tmp / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        for rank in range(tp * pp):
            weights = {
                name: shard(rule, [cast[k] for k in sources(rule, layer, cfg)], cfg, tp, rank % tp)
                for name, rule, layer in rank_rules(arch, cfg, tp, pp, rank)
            }
            save_file(weights, tmp / rank_file(rank))
            tensors += len(weights)
            nbytes += sum(t.numel() * t.element_size() for t in weights.values())
        check_or_raise(tmp)
        diff = _verify(tmp, cfg, state, cast) if verify else None
    seconds = time.perf_counter() - start
    return Report(ckpt, out, arch, tp, pp, target, tensors, nbytes, seconds, build_command(out, config), diff)


def _verify(tmp: Path, cfg, state: dict, cast: dict) -> float:
    """Read the export back: the global tensors must be the cast source's bit for bit, and so must the
    logits; returns the max |logit difference| from the uncast source."""
    back_cfg, back = read_trtllm(tmp)
    V = cfg.vocab_size
    if back.keys() != cast.keys():
        raise MlmError(
            f"verification failed: read back {sorted(back.keys() ^ cast.keys())} differently; this is a bug"
        )
    for k, t in cast.items():
        same = torch.equal(back[k][:V], t[:V]) if k in VOCAB_ROWS else torch.equal(back[k], t)
        if not same:
            raise MlmError(
                f"verification failed: {k} does not read back as exported; this is a bug, please report it"
            )
    padded = cast["embed.weight"].shape[0]
    ours = prompt_logits(cast, cfg, padded)
    theirs = prompt_logits(back, back_cfg, back["embed.weight"].shape[0])
    if not torch.equal(ours, theirs):
        raise MlmError(
            "verification failed: the exported model's logits differ from the source's; this is a bug"
        )
    return (ours - prompt_logits(state, cfg, padded)).abs().max().item()
