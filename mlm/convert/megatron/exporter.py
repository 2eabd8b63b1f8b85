"""`mlm export megatron CKPT OUT`: an mlm checkpoint → a Megatron-core `torch_dist` checkpoint.

    export_megatron("ckpt/run", "megatron/save")   # → OUT/latest_checkpointed_iteration.txt, OUT/iter_NNNNNNN/

The inverse of `mlm.convert.megatron.importer`, through the same name table (`names`, read
backwards) and `args` (`args.megatron_args`), written with plain `torch.distributed.checkpoint` as
Megatron's `dist_checkpointing.save` lays it out. What is written and refused, and how Megatron-LM
loads it: docs/megatron-export.md; the files: docs/formats-foreign.md ("Megatron-core torch_dist
checkpoint"). Memory: the whole model twice (read, then fused and stacked under Megatron's keys).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner

from mlm.checkpoint import checkpoint_config, read_group
from mlm.checkpoint.manager import iter_dir_name
from mlm.config import ModelConfig, describe_layers
from mlm.convert.common import Progress, Report, attention_options, noop
from mlm.convert.megatron.args import is_hybrid, megatron_args, unread_flags
from mlm.convert.megatron.dcp import MegatronCheckpoint
from mlm.convert.megatron.names import megatron_tensors, mlm_tensors, split_key
from mlm.errors import MlmError
from mlm.fileio import check_new_dir, staged_dir

CHECKPOINT_VERSION = 3.0
"""Megatron-LM's `checkpoint_version` for torch_dist checkpoints (no q/k/v reordering on load)."""

_LINEAR = re.compile(r"(.*(?:linear_\w+|eh_proj|mixer\.in_proj|mixer\.out_proj))\.weight(?:\.z)?$")
"""A Megatron linear layer's weight key (a Mamba in_proj's: its first piece, `.z`); its module saves
an `_extra_state` object beside it."""


def unsupported(cfg: ModelConfig) -> list[str]:
    """What of `cfg` a Megatron GPTModel (or, for a hybrid `cfg`, HybridModel) with this name table
    cannot hold, each naming the field."""
    options = [
        f"{o}: not written yet (Megatron's --apply-layernorm-1p, --rotary-percent and attention_output_gate "
        "are not checked against megatron-core here)"
        for o in attention_options(cfg)
    ]
    if is_hybrid(cfg):
        return options + _hybrid_unsupported(cfg)
    out = options
    specs = cfg.layer_specs()
    if len(cfg.mixer_kinds()) > 1:
        out.append(
            f"layers {describe_layers(specs)}: GPTModel's layers have one attention kind throughout (mixing "
            "gqa and mla is not written)"
        )
    if "mla" in cfg.mixer_kinds():
        out += _mla_unsupported(cfg)
    elif cfg.mixer_kinds() != ("gqa",):
        out.append(
            f"mixers {', '.join(cfg.mixer_kinds())}: the export writes GPTModel's linear_qkv attention only "
            "(Megatron's multi-latent attention has other module names)"
        )
    if cfg.qk_norm and cfg.normalization != "rmsnorm":
        out.append(
            "model.qk_norm with normalization=layernorm: mlm's q/k norms are RMSNorm, Megatron's q/k_layernorm "
            "follow --normalization (LayerNorm)"
        )
    if cfg.rope.scaling_factor is not None and "mla" not in cfg.mixer_kinds():
        llama3 = (
            cfg.rope.low_freq_factor,
            cfg.rope.high_freq_factor,
            cfg.rope.original_max_position_embeddings,
        )
        if cfg.rope.scaling_type != "llama3" or llama3 != (1.0, 4.0, 8192):
            out.append(
                f"model.rope.scaling_type={cfg.rope.scaling_type} (low/high freq factors {llama3[0]}/{llama3[1]}, "
                f"original positions {llama3[2]}): Megatron's --use-rope-scaling is Llama-3.1's with 1/4/8192 only"
            )
    return out


def _hybrid_unsupported(cfg: ModelConfig) -> list[str]:
    """What of a hybrid `cfg` the export's HybridModel names cannot hold."""
    out = []
    other = [k for k in cfg.mixer_kinds() if k not in ("gqa", "mamba", "gdn")]
    if other:
        out.append(
            f"mixers {', '.join(other)} in a hybrid: the HybridModel export writes Mamba, gated delta nets and linear_qkv attention"
        )
    if cfg.mtp_num_layers:
        out.append(f"model.mtp_num_layers={cfg.mtp_num_layers}: HybridModel's MTP layers are not written yet")
    if "gdn" in cfg.mixer_kinds() and cfg.activation != "swiglu":
        out.append(
            f"model.activation={cfg.activation!r} with gdn layers: Megatron's gated delta net applies the model's "
            "activation function (SiLU only with --swiglu), mlm's always SiLU"
        )
    if cfg.position_embedding == "learned":
        out.append("model.position_embedding=learned: HybridModel has no learned position embedding")
    if cfg.qk_norm and cfg.normalization != "rmsnorm":
        out.append(
            "model.qk_norm with normalization=layernorm: Megatron's q/k_layernorm follow --normalization"
        )
    return out


def _mla_unsupported(cfg: ModelConfig) -> list[str]:
    """What of an MLA `cfg` Megatron's MLASelfAttention cannot reproduce."""
    out = []
    if not cfg.mla.rope_interleave:
        out.append(
            "model.mla.rope_interleave=false: Megatron's multi-latent attention always rotates the rope dims "
            "as interleaved pairs (DeepSeek's)"
        )
    if cfg.rope.scaling_factor is not None and cfg.rope.scaling_type != "yarn":
        out.append(
            f"model.rope.scaling_type={cfg.rope.scaling_type} with attention_kind=mla: Megatron's MLA scales "
            "RoPE with YaRN only"
        )
    if cfg.rope.scaling_factor is not None and not cfg.rope.yarn_mscale and cfg.rope.yarn_mscale_all_dim:
        out.append(
            f"model.rope.yarn_mscale=0 with model.rope.yarn_mscale_all_dim={cfg.rope.yarn_mscale_all_dim}: Megatron's "
            "YaRN multiplies cos and sin by mscale(factor, mscale) / mscale(factor, mscale_all_dim), not mlm's "
            "mscale(factor) for that pair"
        )
    return out


def _extra_states(tensors: dict[str, torch.Tensor]) -> dict[str, list]:
    """The `_extra_state` ShardedObject of every linear layer, as Megatron keys it
    (`<module>._extra_state/shard_<offsets>_<shape>` over the layer and expert axes) and saves it
    (`torch.save([None])`: the local spec keeps no fp8 metadata)."""
    out = {}
    for key, t in tensors.items():
        match = _LINEAR.match(key)
        if not key.startswith(("decoder.layers.", "mtp.layers.")) or match is None:
            continue
        module = f"{match.group(1)}._extra_state"
        stacked = key.startswith("decoder.layers.") and split_key(key)[0] is None
        axes = list(t.shape[: int(stacked) + int(".experts.experts." in key)]) or [1]
        for index in itertools.product(*(range(n) for n in axes)):
            out[f"{module}/shard_{'.'.join(map(str, index))}_{'.'.join(map(str, axes))}"] = [None]
    return out


def write_torch_dist(path: Path, tensors: dict[str, torch.Tensor], common: dict) -> None:
    """A torch_dist directory at `path` (new) holding `tensors` whole, their `_extra_state` objects,
    `common.pt` and metadata.json, as Megatron's dist_checkpointing.save lays it out."""
    path.mkdir()
    state = {**tensors, **_extra_states(tensors)}
    with warnings.catch_warnings():  # "torch.distributed is disabled … save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        # unflattened, as Megatron's own planner saves (flattening turns the [None] lists into '<key>.0')
        dcp.save(
            state, checkpoint_id=path, no_dist=True, planner=DefaultSavePlanner(flatten_state_dict=False)
        )
    torch.save(common, path / "common.pt")
    meta = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch"}
    (path / "metadata.json").write_text(json.dumps({**meta, "common_backend_version": 1}))


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shapes and bytes (NaNs included)."""
    return a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


def _verify(it_dir: Path, state: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
    """Read `it_dir` back with mlm's Megatron reader: MlmError unless every tensor equals the source
    bitwise, none is missing, and common.pt reads under the reader's allow-list."""
    ckpt = MegatronCheckpoint(it_dir)
    ckpt.common()  # MlmError unless it reads under the allow-list
    seen = set()
    for key, t in mlm_tensors(ckpt, cfg):
        seen.add(key)
        if key not in state or t.dtype != state[key].dtype or not _same_bits(t, state[key]):
            raise MlmError(
                f"verification failed: {key} read back from {it_dir} differs from the mlm checkpoint's "
                "(a conversion bug: please report it with the model config)"
            )
    missing = sorted(set(state) - seen)
    if missing:
        raise MlmError(f"verification failed: {it_dir} lacks {', '.join(missing[:4])}")


def export_megatron(
    ckpt: str | os.PathLike,
    out: str | os.PathLike,
    *,
    verify: bool = True,
    progress: Progress = noop,
) -> Report:
    """mlm checkpoint (DIR or DIR/iter_N, model group) → Megatron-LM save directory `out`
    (`latest_checkpointed_iteration.txt`, `iter_NNNNNNN/` in torch_dist). `verify`: check the
    source's chunk checksums, and read `out` back (every tensor bitwise equal)."""
    ckpt, out = Path(ckpt), Path(out)
    check_new_dir(out)
    report = Report("export", ckpt, out, "Megatron-core GPTModel")
    if (ckpt / ".metadata").exists() or (ckpt / "latest_checkpointed_iteration.txt").exists():
        raise MlmError(
            f"{ckpt}: a Megatron (or torch DCP) checkpoint, not an mlm one; mlm export megatron exports an mlm "
            f"checkpoint. To read this one into mlm: mlm convert from-megatron {ckpt} OUT"
        )
    progress("reading the checkpoint", 0, 0)
    state, manifest, it_dir = read_group(ckpt, verify=verify)
    config = checkpoint_config(manifest, it_dir)
    cfg = config.model
    model = "HybridModel" if is_hybrid(cfg) else "GPTModel"
    report.architecture = f"Megatron-core {model}"
    refused = unsupported(cfg)
    if refused:
        raise MlmError(f"{it_dir}: cannot export to a Megatron {model}: {'; '.join(refused)}")
    tensors = megatron_tensors(state, cfg)
    iteration = int(manifest["iteration"])
    padded = state["embed.weight"].shape[0]
    args = megatron_args(config, padded, iteration, int(manifest.get("consumed_samples", 0)))
    common = {"args": args, "iteration": iteration, "checkpoint_version": CHECKPOINT_VERSION}
    for t in tensors.values():
        report.count(tuple(t.shape), t.dtype)
    total, notes = report.bytes, report.notes
    notes += [
        "weights only: no optimizer, scheduler or RNG state (args.no_save_optim / no_save_rng are set); load "
        "it in Megatron-LM with --finetune, or --no-load-optim to continue at its iteration"
    ]
    if cfg.activation == "gelu_tanh":
        notes.append(
            "model.activation=gelu_tanh: Megatron-core's GPTModel has no tanh-approximated GELU (Megatron-LM's "
            "--openai-gelu reaches its legacy models only), so Megatron computes exact GELU: its logits differ "
            "from mlm's by the approximation, and mlm convert from-megatron reads the export back as activation=gelu"
        )
    flags = unread_flags(args)
    if flags:
        names = ", ".join(f.split()[0].removeprefix("--").replace("-", "_") for f in flags)
        notes.append(
            f"--use-checkpoint-args does not read {names}: pass {' '.join(flags)} to Megatron-LM (its "
            "defaults differ from this model's)"
        )
    yarn = (cfg.rope.original_max_position_embeddings, cfg.rope.yarn_beta_fast, cfg.rope.yarn_beta_slow)
    if "mla" in cfg.mixer_kinds() and cfg.rope.scaling_factor is not None and yarn != (4096, 32.0, 1.0):
        notes.append(
            f"YaRN's original positions {yarn[0]}, beta_fast {yarn[1]}, beta_slow {yarn[2]} have no Megatron-LM "
            "argument (it uses MLATransformerConfig's 4096, 32, 1): set original_max_position_embeddings, "
            "beta_fast and beta_slow in the MLATransformerConfig"
        )
    with staged_dir(out) as tmp:
        progress("writing torch_dist", 0, total)
        name = iter_dir_name(iteration)
        write_torch_dist(tmp / name, tensors, common)
        (tmp / "latest_checkpointed_iteration.txt").write_text(f"{iteration}\n")
        progress("wrote torch_dist", total, total)
        if verify:
            progress("verifying", 0, 0)
            _verify(tmp / name, state, cfg)
            report.verified = True
    return report.finish()
