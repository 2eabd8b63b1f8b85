"""Reshard a checkpoint for another mesh (tp × pp (× vpp) (× ep), dp), dtype or chunking: what it
rewrites, how it streams and what it verifies is in docs/convert.md ("Resharding").

One tensor is read, converted and written at a time, into a temporary directory beside OUT that
is renamed to OUT only when complete and verified.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from mlm.checkpoint import checkpoint_config, manager, read_group, read_manifest, resolve_checkpoint, store
from mlm.checkpoint.keys import param_of
from mlm.convert.common import TOLERANCE, Progress, noop
from mlm.errors import MlmError
from mlm.fileio import check_new_dir, staged_dir
from mlm.model.contract import declaring, submodule
from mlm.model.gpt import GPT, VOCAB_ROWS
from mlm.parallel.parallelize import check_tensor_parallel, tp_split_dims
from mlm.parallel.pipeline import stage_layer_counts
from mlm.parallel.schedules import micro_batches_per_step
from mlm.tokenizer import copy_tokenizer_files
from mlm.units import DTYPES
from mlm.verify import prompt_logits

Split = tuple[int, int] | None
"""(dim, ways) a tensor is split along on the target mesh; None: whole."""


def split_dims(cfg, consolidate: bool, tp: int = 1, ep: int = 1) -> dict[str, Split]:
    """Parameter name → how a tp × ep mesh splits it: (dim, tp) from the model's tensor-parallel
    plans, (0, ep) for the stacked expert weights [E, ...] (expert tensor parallelism is 1), None
    when whole (all None when consolidating)."""
    with torch.device("meta"):
        model = GPT(cfg)
    dims: dict[str, Split] = {k: None if d is None else (d, tp) for k, d in tp_split_dims(model).items()}
    for name, module, plan in declaring(model, "ep_plan"):
        for path, style in plan.items():
            if style == "experts" and submodule(module, path) is not None:
                dims[f"{name}.{path}.weight"] = (0, ep)
    return {k: None for k in dims} if consolidate else dims


def target_chunk(split: Split, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The chunk shape rank 0 of the target mesh writes for a tensor split as `split` (None: whole)."""
    if split is None or not shape:
        return shape
    dim, ways = split
    return tuple(n // ways if d == dim else n for d, n in enumerate(shape))


def target_ep(cfg, ep: int | None, dp: int, tp: int, where: Path) -> int:
    """The target's ep for checkpoint `where` of config `cfg`: `ep`, by default the source's (a dense
    model's: 1); MlmError unless it spreads the experts over a pipeline stage's dp × tp ranks."""
    if ep is not None and ep < 1:
        raise MlmError(f"--ep {ep}: must be at least 1")
    if "moe" not in cfg.model.mlp_kinds():
        if ep not in (None, 1):
            raise MlmError(
                f"--ep {ep}: {where} holds a dense model (model.mlp_kind={cfg.model.mlp_kind!r}, no "
                "experts to spread); leave out --ep, or pass --ep 1"
            )
        return 1  # nothing to spread: a dense model's record says so whatever its run used
    ep = cfg.parallel.ep if ep is None else ep
    E = cfg.model.moe.num_experts
    if E % ep:
        fits = ", ".join(str(n) for n in range(1, E + 1) if E % n == 0)
        raise MlmError(
            f"--ep {ep}: model.moe.num_experts={E} is not divisible by ep={ep}; each expert-parallel "
            f"rank holds E / ep whole experts: choose an ep that divides {E} ({fits})"
        )
    if (dp * tp) % ep:
        raise MlmError(
            f"--ep {ep} must divide dp({dp}) × tp({tp}) = {dp * tp}, the ranks of a pipeline stage that "
            f"the experts are spread over; pass a --dp that makes it a multiple of {ep}"
        )
    return ep


def _converted(src: Path, infos: dict, padded: int, dtype, dims, verify) -> Iterator:
    """Each tensor of `src`, converted: re-chunked at file level (`store.plan_rechunk`,
    `store.write_pieces`) when that is all it needs, else read into one of two buffers in turn
    (see `save_streaming`)."""
    buffers: list[np.ndarray] = []  # allocated for the first tensor read whole
    for i, (full_key, info) in enumerate(infos.items()):
        group, key = full_key.split("/", 1)
        where = f"{src}: tensor {full_key}"
        arr = store.open_array(manager.array_path(src, f"{group}/{key}"), where)
        sums = info.get(manager.CHECKSUMS) if verify else None
        name = param_of(key)
        chunk = target_chunk(dims.get(name), arr.shape)
        repad = name in VOCAB_ROWS and arr.shape[0] != padded
        cast = dtype is not None and group == "model" and arr.dtype.is_floating_point and arr.dtype != dtype
        if not repad and not cast and store.can_rechunk(arr, chunk):
            # only re-chunked: checked here, while the last tensor is written; the writer thread
            # has the kernel copy byte ranges of the old chunk files
            plan = store.plan_rechunk(arr, chunk, where, sums)
            write = functools.partial(
                store.write_pieces, shape=arr.shape, chunk=chunk, dtype=arr.dtype, plan=plan
            )
            yield group, key, write
            continue
        if not buffers:
            largest = max(store.nbytes(info) for info in infos.values())
            buffers = [np.empty(largest, np.uint8) for _ in range(2)]
        t = store.read_slice(arr, (0,) * len(arr.shape), arr.shape, where, sums, buffers[i % 2])
        if repad:  # padding rows are zeros: cut or add them (a new tensor, not the buffer)
            t = torch.cat([t[:padded], t.new_zeros(max(padded - t.shape[0], 0), *t.shape[1:])])
        if cast:
            t = t.to(dtype)
        yield group, key, t, target_chunk(dims.get(name), tuple(t.shape))


def reshard(
    src: str | os.PathLike,
    out: str | os.PathLike,
    tp: int,
    pp: int,
    vpp: int = 1,
    dp: int | None = None,
    ep: int | None = None,
    dtype: str | None = None,
    consolidate: bool = False,
    verify: bool = True,
    progress: Progress = noop,
) -> float | None:
    """Write `src` (a checkpoint dir or iter_ dir) to the new checkpoint dir `out`, laid out for
    tp × pp (× vpp) × dp with the experts over ep (dp, ep: the source's by default); returns the max
    logit difference of the verification (None unverified). docs/convert.md ("Resharding")."""
    it_dir = resolve_checkpoint(src)
    out = Path(out)
    check_new_dir(out)
    if dtype is not None and dtype not in DTYPES:
        raise MlmError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")
    manifest = read_manifest(it_dir)
    cfg = checkpoint_config(manifest, it_dir)
    dp = dp or manifest.get("mesh", {}).get("dp", 1)
    ep = target_ep(cfg, ep, dp, tp, it_dir)
    parallel = dataclasses.replace(cfg.parallel, tp=tp, pp=pp, vpp=vpp, ep=ep)  # checks vpp against pp
    padded = cfg.model.padded_vocab_size(tp)
    check_tensor_parallel(cfg.model, padded, tp)
    stage_layer_counts(cfg.model.num_layers, pp, vpp, parallel.first_stage_layers, parallel.last_stage_layers)
    infos = manifest["tensors"]
    for k, v in infos.items():  # what the manifest claims is on disk, before buffers are sized by it
        store.open_checked(manager.array_path(it_dir, k), f"{it_dir}: tensor {k}", v)
    own = manager.checkpoint_tokenizer(manifest, it_dir, vocabulary=False)
    groups = sorted({k.split("/", 1)[0] for k in infos})
    extra = {k: v for k, v in manifest.items() if k not in manager.RESERVED}
    extra["config"] = dataclasses.replace(cfg, parallel=parallel).to_dict()
    micro_batches_per_step(cfg.train.global_batch_size, cfg.train.micro_batch_size, dp, pp, vpp)
    extra["mesh"] = {"tp": tp, "pp": pp, "dp": dp, "cp": 1, "ep": ep, "world_size": tp * pp * dp}
    if pp != manifest.get("mesh", {}).get("pp", 1):
        extra["rng_per_stage"] = None  # per-stage RNG states belong to the old pipeline
    cast = DTYPES[dtype] if dtype else None
    total, dims = sum(store.nbytes(v) for v in infos.values()), split_dims(cfg.model, consolidate, tp, ep)

    def tensors():
        done = 0
        for group, key, *item in _converted(it_dir, infos, padded, cast, dims, verify):
            yield group, key, *item
            done += store.nbytes(infos[f"{group}/{key}"])
            progress(f"{group}/{key}", done, total)

    with staged_dir(out) as tmp:
        manager.save_streaming(tmp, int(manifest["iteration"]), tensors(), extra, groups)
        if own is not None:
            copy_tokenizer_files(own, tmp / manager.TOKENIZER_DIR)  # the checkpoint's own copy goes with it
        if not verify:
            return None
        progress("verifying logits", 0, 0)
        before, _, _ = read_group(it_dir)
        theirs = prompt_logits(before, cfg.model, before["embed.weight"].shape[0])
        del before
        after, _, _ = read_group(tmp)
        ours = prompt_logits(after, cfg.model, padded)
        diff = (ours - theirs).abs().max().item()
        limit = 0.0 if cast is None else TOLERANCE[cast] * max(1.0, theirs.abs().max().item())
        if not diff <= limit:
            raise MlmError(
                f"verification failed: the logits of {out} differ from {it_dir}'s by {diff:.3g} (allowed "
                f"{limit:.3g}); the output was removed. This is a bug in mlm convert: please report it"
            )
        return diff
