"""`mlm convert from-megatron DIR OUT`: a Megatron-core `torch_dist` checkpoint (or Megatron-LM's
legacy per-rank layout, `--ckpt-format torch`: `mlm.convert.megatron.legacy`) → mlm checkpoint.

    import_megatron("megatron/save", "ckpt/from-megatron", ["model.num_attention_heads=32", ...])

The weights go through `names`' table and splits; the model config is the tensor shapes, then the
saved `args` (`mlm.convert.megatron.args`), then the user's `--set model.*`, each over the one
before, checked against `GPT(config)` before anything is written; with the distributed optimizer's
state the output continues the run (`mlm.convert.megatron.optim`). What is read, mapped, checked
and refused: docs/megatron.md and docs/megatron-resume.md.
"""

from __future__ import annotations

import math
import os
from functools import partial
from pathlib import Path

import torch

from mlm.config import Config, DataConfig, ModelConfig, load_config, toml_value
from mlm.convert.common import Progress, Report, check_finite_logits, model_shapes, noop, write_import
from mlm.convert.megatron.args import args_overrides, config_field, saved_args, training_position
from mlm.convert.megatron.dcp import MegatronCheckpoint, checkpoint_dir, iteration_dir
from mlm.convert.megatron.legacy import LegacyCheckpoint, is_legacy
from mlm.convert.megatron.names import (
    GDN,
    HYBRID_TOP,
    LAYER,
    MAMBA,
    MLA_SUBS,
    TOP,
    hybrid_checkpoint,
    known_mtp,
    layer_keys,
    mlm_shapes,
    mlm_tensors,
    mtp_key,
    split_key,
)
from mlm.convert.megatron.optim import MOMENTS, MegatronOptimizer, resumed_run
from mlm.errors import MlmError
from mlm.fileio import check_new_dir


def _mtp_depths(ckpt: MegatronCheckpoint) -> int:
    """How many MTP depths the checkpoint holds (`mtp.layers.<d>.*`)."""
    return len({m[0] for m in map(mtp_key, ckpt.tensors) if m is not None})


def _known(ckpt: MegatronCheckpoint) -> None:
    """MlmError naming the first Megatron key mlm has no mapping for, or the GPTModel parts it lacks."""
    if "tok_embeddings.weight" in ckpt.tensors:
        raise MlmError(
            f"{ckpt.path}: a torchtitan checkpoint (tok_embeddings.weight, layers.N.*), not a Megatron one: "
            f"import it with mlm convert from-torchtitan {ckpt.path} OUT"
        )
    hybrid = hybrid_checkpoint(ckpt.tensors)
    top, layer = (HYBRID_TOP, {**LAYER, **MAMBA, **GDN}) if hybrid else (TOP, LAYER)
    for key in ckpt.tensors:
        if key in top or (key.startswith("decoder.layers.") and split_key(key)[1] in layer) or known_mtp(key):
            continue
        raise MlmError(
            f"{ckpt.path}: Megatron module {key!r} is not supported by mlm convert from-megatron (it reads "
            "GPTModel's and HybridModel's embedding, self_attention (linear_qkv, linear_proj, q/k_layernorm, "
            "or multi-latent attention's linear_q*/kv* projections and latent norms), Mamba mixers, dense mlp, "
            "MoE router / experts / shared_experts, norms, output_layer and MTP depths; not other specs)"
        )
    subs = {split_key(k)[1] for k in ckpt.tensors if k.startswith("decoder.layers.")}
    mla = "self_attention.linear_kv_down_proj.weight" in subs
    needed = (
        ("embedding.word_embeddings.weight",)
        if hybrid
        else (
            "embedding.word_embeddings.weight",
            "self_attention.linear_kv_down_proj.weight" if mla else "self_attention.linear_qkv.weight",
            "self_attention.linear_proj.weight",
        )
    )
    lacking = [n for n in needed if n not in ckpt.tensors and n not in subs]
    if lacking:
        raise MlmError(
            f"{ckpt.path}: not a Megatron GPTModel checkpoint: no {', '.join(lacking)} (it holds "
            f"{', '.join(list(ckpt.tensors)[:4]) or 'no tensors'}{' …' if len(ckpt.tensors) > 4 else ''})"
        )


def _legacy_tp(ckpt: LegacyCheckpoint) -> None:
    """MlmError for a legacy checkpoint saved at tp > 1 that holds MLA or MTP tensors: its reader
    joins the tp shards of the embeddings, linear_qkv, linear_fc1, linear_proj and linear_fc2 only."""
    tp = saved_args(ckpt.common()).get("tensor_model_parallel_size") or 1
    odd = [k for k in ckpt.tensors if mtp_key(k) is not None or split_key(k)[1] in MLA_SUBS]
    if tp > 1 and odd:
        raise MlmError(
            f"{ckpt.path}: a legacy (--ckpt-format torch) checkpoint saved at tp {tp} with {odd[0]}: mlm joins "
            "the tp shards of multi-latent attention and MTP depths from torch_dist only; have Megatron-LM "
            "rewrite it as torch_dist (--ckpt-convert-format torch_dist --ckpt-convert-save DIR) and import that"
        )


def _layers(ckpt: MegatronCheckpoint) -> tuple[int, dict[int, dict]]:
    """(number of layers, `names.layer_keys`); MlmError where a layer below the last is absent."""
    subs = layer_keys(ckpt)
    absent = sorted(set(range(max(subs, default=-1) + 1)) - set(subs))
    if absent:
        raise MlmError(
            f"{ckpt.path}: holds decoder.layers.{max(subs)} but no tensor of layer {absent[0]}"
            f"{f' (nor of {len(absent) - 1} more)' if len(absent) > 1 else ''}: an incomplete checkpoint; "
            "copy the whole iteration folder as Megatron-LM wrote it"
        )
    return len(subs), subs


def _layer_shape(ckpt: MegatronCheckpoint, sub: str) -> tuple[int, ...] | None:
    """One layer's shape of `sub`, from the stacked key or the first per-layer key holding it."""
    for key in ckpt.tensors:
        n, s = split_key(key) if key.startswith("decoder.layers.") else (None, None)
        if s == sub:
            return ckpt.shape(key) if n is not None else ckpt.shape(key)[1:]
    return None


def _hybrid_pattern(ckpt: MegatronCheckpoint, subs: dict[int, dict]) -> str:
    """A HybridModel checkpoint's layer pattern, one symbol per Megatron layer from its sub-keys."""
    symbols = []
    for i in range(len(subs)):
        layer = subs[i]
        if any(k.startswith("mixer.") for k in layer):
            symbols.append("M")
        elif "self_attention.in_proj.weight.query" in layer:
            symbols.append("G")
        elif "self_attention.linear_qkv.weight" in layer:
            symbols.append("*")
        elif "mlp.router.weight" in layer:
            symbols.append("E")
        elif "mlp.linear_fc1.weight" in layer:
            symbols.append("-")
        else:
            raise MlmError(
                f"{ckpt.path}: HybridModel layer decoder.layers.{i} ({', '.join(sorted(layer))}) is none of a "
                "Mamba mixer, a gated delta net, linear_qkv attention, a dense MLP or MoE, the layers mlm reads"
            )
    return "".join(symbols)


def _shape_overrides(ckpt: MegatronCheckpoint) -> list[str]:
    """model.* fields that the tensor shapes determine, as --set strings."""
    shape = partial(_layer_shape, ckpt)
    num_layers, subs = _layers(ckpt)
    moe = [int("mlp.router.weight" in subs[i]) for i in range(num_layers)]
    hybrid = hybrid_checkpoint(ckpt.tensors)
    out = {
        "num_layers": num_layers,
        "hidden_size": ckpt.shape("embedding.word_embeddings.weight")[1],
        "tie_embeddings": "output_layer.weight" not in ckpt.tensors,
        "position_embedding": "learned" if "embedding.position_embeddings.weight" in ckpt.tensors else "rope",
        "normalization": "layernorm"
        if {"decoder.final_layernorm.bias", "decoder.final_norm.bias"} & set(ckpt.tensors)
        else "rmsnorm",
        "add_bias": shape("self_attention.linear_proj.bias") is not None,
        "qkv_bias": shape("self_attention.linear_qkv.bias") is not None,
        "qk_norm": shape("self_attention.q_layernorm.weight") is not None,
    }
    if _mtp_depths(ckpt):
        out["mtp_num_layers"] = _mtp_depths(ckpt)
    if out["normalization"] == "layernorm":
        out["activation"] = "gelu"  # a GPT-2-like model; swiglu from args or --set otherwise
    kv_down = shape("self_attention.linear_kv_down_proj.weight")
    if kv_down is not None:  # multi-latent attention: q_layernorm is its query latent's norm
        latent = shape("self_attention.linear_kv_up_proj.weight")[1]
        out |= {"attention_kind": "mla", "qk_norm": False, "mla.kv_lora_rank": latent}
        out["mla.qk_rope_head_dim"] = kv_down[0] - latent
        q_down = shape("self_attention.linear_q_down_proj.weight")
        if q_down is not None:
            out["mla.q_lora_rank"] = q_down[0]
    fc2 = shape("mlp.linear_fc2.weight")
    if fc2 is not None:
        out["ffn_hidden_size"] = fc2[1]
    if hybrid:  # the pattern gives every layer's kinds; Mamba's sizes from its pieces
        from mlm.model.kinds.pattern import parse

        pattern = _hybrid_pattern(ckpt, subs)
        out |= {"num_layers": len(parse(pattern)[0]), "layer_pattern": pattern}
        if "embedding.position_embeddings.weight" not in ckpt.tensors:
            out["position_embedding"] = "none"
        z, dt = shape("mixer.in_proj.weight.z"), shape("mixer.in_proj.weight.dt")
        if z is not None:
            out |= {"mamba.num_heads": dt[0], "mamba.head_dim": z[0] // dt[0]}
            out["mamba.conv_kernel"] = shape("mixer.conv1d.weight.x")[-1]
    if any(moe):
        if not hybrid:
            out["mlp_kind"] = "moe"
            out["mlp_kind_freq"] = 1 if all(moe) else moe
        experts = shape("mlp.experts.experts.linear_fc2.weight")
        out["moe.num_experts"], out["moe.ffn_hidden_size"] = experts[0], experts[2]
        shared = shape("mlp.shared_experts.linear_fc2.weight")
        if shared is not None:
            out["moe.shared_expert_ffn_hidden_size"] = shared[1]
            out["moe.shared_expert_gate"] = shape("mlp.shared_experts.gate_weight") is not None
        if shape("mlp.router.expert_bias") is not None:
            out["moe.router_enable_expert_bias"] = True
            out["moe.router_score_function"] = "sigmoid"
    return [f"model.{k}={toml_value(v)}" for k, v in out.items()]


def _check_shapes(ckpt: MegatronCheckpoint, cfg: ModelConfig, padded_vocab: int) -> None:
    """MlmError naming the first tensor whose shape (after the splits) differs from GPT(cfg)'s."""
    expected = model_shapes(cfg, padded_vocab)
    seen = set()
    for key, shape in mlm_shapes(ckpt, cfg):
        seen.add(key)
        if expected.get(key) != shape:
            raise MlmError(
                f"{ckpt.path}: tensor {key} has shape {list(shape)} but the model config gives "
                f"{list(expected[key]) if key in expected else 'no such tensor'}; set the model with "
                "--set model.* (e.g. model.num_attention_heads, model.num_query_groups, model.kv_channels, "
                "model.activation) to match the Megatron run"
            )
    missing = sorted(set(expected) - seen)
    if missing:
        raise MlmError(
            f"{ckpt.path}: the model config needs {', '.join(missing[:4])}{' …' if len(missing) > 4 else ''}, "
            "which the Megatron checkpoint lacks; set the model with --set model.* to match the Megatron run"
        )


def _attention_overrides(ckpt: MegatronCheckpoint, heads: int) -> list[str]:
    """model.kv_channels and model.num_query_groups from the qkv and proj shapes, given the heads
    (MLA: its per-head dims, `_mla_head_overrides`)."""
    if _layer_shape(ckpt, "self_attention.linear_kv_down_proj.weight") is not None:
        return _mla_head_overrides(ckpt, heads)
    if _layer_shape(ckpt, "self_attention.linear_proj.weight") is None:  # a hybrid without attention
        return []
    width = _layer_shape(ckpt, "self_attention.linear_proj.weight")[1]  # heads · head dim
    rows = _layer_shape(ckpt, "self_attention.linear_qkv.weight")[0]  # (heads + 2 · groups) · head dim
    head_dim = width // heads
    groups = (rows - width) // (2 * head_dim) if head_dim else 0
    if head_dim * heads != width or (heads + 2 * groups) * head_dim != rows or groups < 1:
        raise MlmError(
            f"{ckpt.path}: model.num_attention_heads={heads} does not fit linear_proj's {width} inputs and "
            f"linear_qkv's {rows} rows; set the Megatron run's --num-attention-heads with "
            "--set model.num_attention_heads=N"
        )
    return [f"model.kv_channels={head_dim}", f"model.num_query_groups={groups}"]


def _mla_head_overrides(ckpt: MegatronCheckpoint, heads: int) -> list[str]:
    """model.mla.v_head_dim and qk_nope_head_dim from linear_proj's inputs (heads · v) and
    linear_kv_up_proj's rows (heads · (nope + v)), checked against the query rows (heads · (nope + rope))."""
    rows = partial(_layer_shape, ckpt)
    width = rows("self_attention.linear_proj.weight")[1]
    kv_up, latent = rows("self_attention.linear_kv_up_proj.weight")
    rope = rows("self_attention.linear_kv_down_proj.weight")[0] - latent
    q = rows("self_attention.linear_q_up_proj.weight") or rows("self_attention.linear_q_proj.weight")
    v, nope = width // heads, kv_up // heads - width // heads
    fits = v * heads == width and (nope + v) * heads == kv_up and nope >= 1
    if not fits or q is None or q[0] != heads * (nope + rope):
        raise MlmError(
            f"{ckpt.path}: model.num_attention_heads={heads} does not fit the multi-latent attention's shapes "
            f"(linear_proj's {width} inputs, linear_kv_up_proj's {kv_up} rows, query rows "
            f"{q[0] if q else 'none'}); set the Megatron run's --num-attention-heads with "
            "--set model.num_attention_heads=N"
        )
    return [f"model.mla.v_head_dim={v}", f"model.mla.qk_nope_head_dim={nope}"]


def model_config(ckpt: MegatronCheckpoint, overrides: list[str]) -> tuple[Config, list[str]]:
    """(the run config: shapes, then common.pt's args, then `overrides`; notes for the report).
    The heads must come from the args, `model.num_attention_heads` or a preset (no shape shows
    them); the query groups and head dim then follow from the qkv and proj shapes; the vocabulary
    size is the embedding's rows unless the args or `model.vocab_size` say it."""
    bad = [s for s in overrides if not (s.startswith("model.") or s.startswith("preset="))]
    if bad:
        raise MlmError(
            f"--set {bad[0]}: mlm convert from-megatron takes model.* fields (or preset=NAME) only"
        )
    common = ckpt.common()
    rows = ckpt.shape("embedding.word_embeddings.weight")[0]
    given = args_overrides(common) + list(overrides)
    shapes = [*_shape_overrides(ckpt), f"model.vocab_size={rows}"]
    sets = [*shapes, *given]
    if not any(s.startswith(("model.num_attention_heads=", "preset=")) for s in given):
        raise MlmError(
            f"{ckpt.path}: the checkpoint does not say its attention heads (no args in common.pt): "
            "pass the Megatron run's --num-attention-heads as --set model.num_attention_heads=N"
        )
    probe = f"data.seq_length={1 + _mtp_depths(ckpt)}"  # the shortest a model with the MTP depths accepts
    heads = load_config(None, [*sets, probe]).model.num_attention_heads
    sets = [*shapes, *_attention_overrides(ckpt, heads), *given]
    max_pos = load_config(None, [*sets, probe]).model.max_position_embeddings
    seq = min(DataConfig().seq_length, max_pos)  # as import_hf: the default, within the model's positions
    config = load_config(None, [*sets, f"data.seq_length={seq}"])
    if "gdn" in config.model.mixer_kinds() and config.model.activation != "swiglu":
        raise MlmError(
            f"{ckpt.path}: gated delta net layers with model.activation={config.model.activation!r}: Megatron's "
            "gated delta net applies the model's activation function, mlm's SiLU (Megatron's --swiglu); a run "
            "without --swiglu is not imported"
        )
    return config, [] if hasattr(common.get("args"), "__dict__") else [_defaults_note(config.model, given)]


def _defaults_note(cfg: ModelConfig, given: list[str]) -> str:
    """What the logits depend on that neither the shapes nor --set gave (no args in common.pt)."""
    fields = ["rope.base", "norm_eps", "activation", "max_position_embeddings"]
    if "moe" in cfg.mlp_kinds():
        fields += ["moe.router_topk", "moe.router_score_function", "moe.router_pre_softmax"]
    if "mla" in cfg.mixer_kinds():  # Megatron's MLA default is YaRN; without args mlm has none
        fields += ["rope.scaling_factor", "rope.scaling_type"]
    taken = [f for f in fields if not any(s.startswith(f"model.{f}=") for s in given)]
    values = ", ".join(f"{f}={toml_value(config_field(cfg, f))}" for f in taken)
    return (
        f"no Megatron-LM args in common.pt: {values} are mlm's defaults (or read off the shapes), not "
        "the run's; pass --set model.FIELD=VALUE where the Megatron run differed"
    )


def import_megatron(
    src: str | os.PathLike,
    out: str | os.PathLike,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    verify: bool = True,
    weights_only: bool = False,
    progress: Progress = noop,
) -> Report:
    """Megatron-core torch_dist or legacy checkpoint (`iter_NNNNNNN/` or the save root) → mlm checkpoint
    folder `out`: with the optimizer state the checkpoint holds (unless `weights_only`), a run
    `mlm train --load` resumes (Megatron's iteration, the "optim" group; `optim.resumed_run`),
    else iteration 0 with the "model" group. `verify`: read back what was written (checksums)
    and check mlm's logits on it are finite."""
    src, out = Path(src), Path(out)
    check_new_dir(out)
    report = Report("import", src, out, "Megatron-core GPTModel")
    folder = iteration_dir(src)
    ckpt = LegacyCheckpoint(folder) if is_legacy(folder) else MegatronCheckpoint(checkpoint_dir(folder))
    _known(ckpt)
    if hybrid_checkpoint(ckpt.tensors):
        report.architecture = "Megatron-core HybridModel"
    if isinstance(ckpt, LegacyCheckpoint):
        _legacy_tp(ckpt)
    config, notes = model_config(ckpt, list(overrides))
    if ckpt.optimizer_keys and weights_only:
        notes.append(
            f"the optimizer state ({len(ckpt.optimizer_keys)} tensors, e.g. {ckpt.optimizer_keys[0]}) is not "
            "imported (--weights-only): mlm train starts a new run from the weights"
        )
    if (
        not ckpt.optimizer_keys
        and isinstance(ckpt, LegacyCheckpoint)
        and "optimizer" in ckpt.rank_state(0, 0)
    ):
        notes.append(
            f"{ckpt.rank_folder(0, 0).name}/model_optim_rng.pt holds the optimizer's param groups but no Adam "
            "state, and no distrib_optim.pt is beside it (not copied?): the weights are imported, and mlm "
            "train starts a new run from them"
        )
    common = ckpt.common()
    position = training_position(common)
    opt, iteration, resume = None, 0, {}
    if ckpt.optimizer_keys and not weights_only:
        opt = MegatronOptimizer(ckpt)
        config, iteration, resume, more = resumed_run(opt, config, common)
        notes += more
    cfg = config.model
    padded = ckpt.shape("embedding.word_embeddings.weight")[0]
    if cfg.vocab_size > padded:
        raise MlmError(
            f"model.vocab_size={cfg.vocab_size} is above the checkpoint's {padded} embedding rows; "
            "set --set model.vocab_size to the tokenizer's vocabulary size"
        )
    _check_shapes(ckpt, cfg, padded)
    total = sum(math.prod(ckpt.shape(k)) * ckpt.tensors[k].properties.dtype.itemsize for k in ckpt.tensors)
    total *= 1 if opt is None else 3  # the weights (or fp32 main params, about as large) and two moments
    # mlm's model group holds the fp32 main weights: Megatron's main params where the weights are not fp32
    low = opt is not None and any(m.properties.dtype != torch.float32 for m in ckpt.tensors.values())
    states = [("model", "", opt.view("main") if low else ckpt)]
    states += [("optim", f"{m}.", opt.view(m)) for m in MOMENTS] if opt is not None else []
    items = (
        (group, prefix + key, t) for group, prefix, state in states for key, t in mlm_tensors(state, cfg)
    )
    source = {"megatron_dir": str(ckpt.path.resolve()), **position, **resume.pop("source", {})}
    groups = ["model", "optim"] if opt is not None else ["model"]
    report.notes = notes
    check = check_finite_logits if verify else None
    extra = {"source": source, **resume}
    return write_import(out, report, iteration, items, extra, groups, config, progress, total, check=check)
