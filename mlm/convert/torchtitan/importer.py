"""`mlm convert from-torchtitan DIR OUT`: a torchtitan checkpoint of a Llama-3 model → mlm checkpoint.

    import_torchtitan("outputs/checkpoint", "ckpt/from-titan", ["preset=llama3-8b"])

What torchtitan writes is in docs/formats-foreign.md ("torchtitan checkpoint"); the names, the RoPE
permutation, the fused QKV state, tied embeddings, the config and the training position are in
docs/torchtitan.md. Entries are read with `mlm.convert.megatron.dcp`'s restricted reader.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator
from pathlib import Path

import torch

from mlm.checkpoint.keys import MOMENTS, moment_key
from mlm.checkpoint.rng import seeded_rng_state
from mlm.config import Config, DataConfig, ModelConfig, load_config, toml_value
from mlm.convert.common import Progress, Report, check_finite_logits, model_shapes, noop, write_import
from mlm.convert.layouts import rope_pairs_to_halves, split_grouped
from mlm.convert.megatron.dcp import MegatronCheckpoint
from mlm.errors import MlmError
from mlm.fileio import check_new_dir

_TOP = {
    "tok_embeddings.weight": "embed.weight",
    "norm.weight": "final_norm.weight",
    "output.weight": "output.weight",
    "lm_head.weight": "output.weight",
}
"""torchtitan parameters outside the layers → mlm keys (both spellings of the output layer)."""

_LAYER = {
    "attention_norm.weight": "attn_norm.weight",
    "attention.wq.weight": "attn.q.weight",
    "attention.wk.weight": "attn.k.weight",
    "attention.wv.weight": "attn.v.weight",
    "attention.qkv_linear.wq.weight": "attn.q.weight",
    "attention.qkv_linear.wk.weight": "attn.k.weight",
    "attention.qkv_linear.wv.weight": "attn.v.weight",
    "attention.wo.weight": "attn.out.weight",
    "ffn_norm.weight": "mlp_norm.weight",
    "feed_forward.w1.weight": "mlp.gate.weight",
    "feed_forward.w3.weight": "mlp.up.weight",
    "feed_forward.w2.weight": "mlp.down.weight",
}
"""torchtitan sub-keys of `layers.N.` → mlm sub-keys of `layers.N.`."""

_FUSED = re.compile(r"layers\.(\d+)\.attention\.qkv_linear\.wqkv\.weight")
"""torchtitan v0.3.0's fused q/k/v parameter: in the optimizer state only (the model's is split)."""

_STATES = ("optimizer.", "lr_scheduler.", "train_state.", "dataloader.")
"""Top-level entries that are torchtitan's training state, not parameters."""

_DEFAULTS = {
    "norm_eps": 1e-5,
    "rope.scaling_factor": 8.0,
    "rope.scaling_type": "llama3",
    "rope.low_freq_factor": 1.0,
    "rope.high_freq_factor": 4.0,
    "rope.original_max_position_embeddings": 8192,
}
"""torchtitan's defaults (TransformerModelArgs.norm_eps, RoPEScalingArgs) where no preset is given."""


def step_dir(src: str | Path) -> Path:
    """The DCP directory `src` names: itself (it holds `.metadata`) or, for torchtitan's checkpoint
    folder, its highest `step-N/`."""
    src = Path(src)
    if not src.is_dir():
        raise MlmError(
            f"from-torchtitan {src}: not a directory; pass torchtitan's checkpoint folder or a step-N/"
        )
    if (src / ".metadata").exists():
        return src
    steps = [
        (int(p.name[5:]), p)
        for p in src.glob("step-*")
        if p.name[5:].isdigit() and (p / ".metadata").exists()
    ]
    if not steps:
        raise MlmError(
            f"from-torchtitan {src}: not a torch DCP checkpoint: no .metadata file in it, nor step-N/ "
            "folders holding one. Pass torchtitan's checkpoint folder (--checkpoint.folder) or one of its step-N/"
        )
    return max(steps)[1]


def _mlm_name(key: str) -> str | None:
    """The mlm key of torchtitan parameter `key`, None where it is not one mlm reads."""
    if key in _TOP:
        return _TOP[key]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", key)
    return f"layers.{m[1]}.{_LAYER[m[2]]}" if m and m[2] in _LAYER else None


def _weights(ckpt: MegatronCheckpoint) -> dict[str, str]:
    """{torchtitan key: mlm key} for every parameter; MlmError naming the first entry that is
    neither a Llama-3 parameter nor training state."""
    out = {}
    for key in [*ckpt.stored, *ckpt.bytes_keys]:
        if key.startswith(_STATES):
            continue
        name = _mlm_name(key)
        if name is None or key in ckpt.bytes_keys:
            raise MlmError(
                f"{ckpt.path}: torchtitan entry {key!r} is not read by mlm convert from-torchtitan: it reads "
                "torchtitan's Llama 3 (tok_embeddings, layers.N.attention.{wq,wk,wv,wo} or "
                "attention.qkv_linear.{wq,wk,wv}, feed_forward.{w1,w2,w3}, attention_norm, ffn_norm, norm, "
                "output or lm_head) and its training state; not MoE, biases, q/k norms or other models"
            )
        out[key] = name
    names = set(out.values())
    if "embed.weight" not in names or "layers.0.attn.q.weight" not in names:
        raise MlmError(
            f"{ckpt.path}: not a torchtitan Llama checkpoint: no tok_embeddings.weight or "
            f"layers.0.attention.wq.weight (it holds {', '.join(list(ckpt.stored)[:4]) or 'no tensors'})"
        )
    if len(names) < len(out):  # one parameter under both spellings
        name = next(n for n in names if list(out.values()).count(n) > 1)
        both = [k for k, n in out.items() if n == name]
        raise MlmError(f"{ckpt.path}: {' and '.join(both)} are the same parameter under both spellings")
    _check_complete(ckpt, out)
    return out


def _check_complete(ckpt: MegatronCheckpoint, weights: dict[str, str]) -> None:
    """MlmError naming the first torchtitan parameter a Llama model needs and the checkpoint lacks:
    layers 0 … L-1 each with every parameter of `_LAYER` (in the spelling the checkpoint uses), and
    the final norm."""
    layers = sorted({int(k.split(".")[1]) for k in weights if k.startswith("layers.")})
    if layers != list(range(len(layers))):
        gap = next(i for i in range(len(layers) + 1) if i not in layers)
        raise MlmError(
            f"{ckpt.path}: holds layers {', '.join(map(str, layers))}: layer {gap} is missing; copy the "
            "whole torchtitan checkpoint (every .distcp file of the step)"
        )
    fused = any(".attention.qkv_linear." in k for k in weights)
    subs = {}  # mlm sub-key → the torchtitan sub-key this checkpoint's spelling gives it
    for sub, name in _LAYER.items():
        if (
            name not in ("attn.q.weight", "attn.k.weight", "attn.v.weight")
            or (".qkv_linear." in sub) == fused
        ):
            subs.setdefault(name, sub)
    wanted = ["norm.weight", *(f"layers.{i}.{sub}" for i in layers for sub in subs.values())]
    lacking = [k for k in wanted if k not in weights]
    if lacking:
        raise MlmError(
            f"{ckpt.path}: the checkpoint lacks {lacking[0]}{f' (and {len(lacking) - 1} more)' if len(lacking) > 1 else ''}; "
            "it is not a whole Llama model: copy the whole torchtitan checkpoint"
        )


def _split_names(fused: str) -> list[str]:
    """The model-state names of fused parameter `fused`'s q, k and v parts (v0.3.0's split hook)."""
    return [fused.replace(".wqkv.", f".{w}.") for w in ("wq", "wk", "wv")]


def _tied(ckpt: MegatronCheckpoint, weights: dict[str, str]) -> str | None:
    """The output layer's key where it is the embedding (torchtitan's `enable_weight_tying`, its
    Llama 3.2 1B and 3B), else None. The model's state dict holds the shared parameter under both
    names and the optimizer's state once, under tok_embeddings.weight; tied iff the output layer
    has no optimizer state of its own and its values are the embedding's (a model-only save of an
    untied model costs the reading of both)."""
    out = next((k for k, name in weights.items() if name == "output.weight"), None)
    if out is None or f"optimizer.state.{out}.step" in ckpt.stored:
        return None
    if ckpt.shape(out) != ckpt.shape("tok_embeddings.weight"):
        return None
    return out if torch.equal(ckpt.read(out), ckpt.read("tok_embeddings.weight")) else None


def _optimizer(ckpt: MegatronCheckpoint, weights: dict[str, str]) -> dict[str, dict[str, str]]:
    """{torchtitan parameter: {"step" / "exp_avg" / "exp_avg_sq": its DCP key}}, {} where the
    checkpoint holds no optimizer state. A parameter is a key of `weights` or a fused
    `layers.N.attention.qkv_linear.wqkv.weight`, whose state stands for its split wq, wk and wv.
    MlmError for state that is not AdamW's, a parameter lacking it, or a moment of another shape."""
    found: dict[str, dict[str, str]] = {}
    for key in ckpt.stored:
        if not key.startswith("optimizer.state."):
            continue
        param, _, field = key.removeprefix("optimizer.state.").rpartition(".")
        known = param in weights or (
            _FUSED.fullmatch(param) and all(k in weights for k in _split_names(param))
        )
        if not known or field not in ("step", *MOMENTS):
            raise MlmError(
                f"{ckpt.path}: optimizer state {key!r} is not read: mlm imports AdamW's step, exp_avg and "
                "exp_avg_sq of the model's parameters (not AMSGrad, other optimizers or other parameters); "
                "import the weights only (--weights-only)"
            )
        found.setdefault(param, {})[field] = key
    covered = {p: p for p in found if p in weights}
    for fused in (p for p in found if p not in weights):
        for part in _split_names(fused):
            if part in covered:
                raise MlmError(
                    f"{ckpt.path}: the optimizer state holds both {fused} and its part {part}; "
                    "import the weights only (--weights-only)"
                )
            covered[part] = fused
    lacking = [p for p in weights if set(found.get(covered.get(p, p), {})) != {"step", *MOMENTS}]
    if found and lacking:
        raise MlmError(
            f"{ckpt.path}: the optimizer state lacks step, exp_avg or exp_avg_sq of {lacking[0]} (a frozen "
            "parameter?); mlm's AdamW steps every parameter, so it cannot resume from this state: import "
            "the weights only (--weights-only)"
        )
    for param, fields in found.items():
        parts = [param] if param in weights else _split_names(param)
        shapes = [ckpt.shape(p) for p in parts]
        want = torch.Size([sum(s[0] for s in shapes), *shapes[0][1:]])
        for m in MOMENTS:
            if ckpt.shape(fields[m]) != want:
                raise MlmError(
                    f"{ckpt.path}: {fields[m]} has shape {list(ckpt.shape(fields[m]))} but "
                    f"{' + '.join(parts)} {'have' if len(parts) > 1 else 'has'} {list(want)}; import the "
                    "weights only (--weights-only)"
                )
    return found


def _split(fused: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, ...]:
    """torchtitan's fused wqkv rows → q, k, v rows, as its FusedQKVLinear._split_qkv_on_save splits
    the weight: per KV group, the group's query heads, its key head, its value head."""
    kv = cfg.query_groups * cfg.head_dim
    return split_grouped(fused, [cfg.num_attention_heads * cfg.head_dim, kv, kv], cfg.query_groups)


def _layout(name: str, t: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Tensor `t` of mlm parameter `name` (or of its moment) in mlm's layout."""
    if name.endswith("attn.q.weight"):
        return rope_pairs_to_halves(t, cfg.num_attention_heads)
    if name.endswith("attn.k.weight"):
        return rope_pairs_to_halves(t, cfg.query_groups)
    return t.contiguous()


def model_config(
    ckpt: MegatronCheckpoint, weights: dict[str, str], overrides: list[str]
) -> tuple[Config, list[str]]:
    """(the run config: the shapes, torchtitan's defaults unless a preset is given, then `overrides`;
    notes for the report). The heads and RoPE base must be given; query groups and head dim follow."""
    bad = [s for s in overrides if not s.startswith(("model.", "preset=", "data.seq_length="))]
    if bad:
        raise MlmError(
            f"--set {bad[0]}: from-torchtitan takes model.* fields, data.seq_length or preset=NAME"
        )
    key = {name: k for k, name in weights.items()}
    shape = {name: ckpt.shape(k) for k, name in weights.items()}
    rows, hidden = shape["embed.weight"]
    shapes = {
        "num_layers": len({n.split(".")[1] for n in shape if n.startswith("layers.")}),
        "hidden_size": hidden,
        "ffn_hidden_size": shape["layers.0.mlp.gate.weight"][0]
        if "layers.0.mlp.gate.weight" in shape
        else None,
        "vocab_size": rows,
        "tie_embeddings": "output.weight" not in shape,
        "normalization": "rmsnorm",
        "position_embedding": "rope",
        "activation": "swiglu",
        "add_bias": False,
        "qkv_bias": False,
        "qk_norm": False,
    }
    sets = [f"model.{k}={toml_value(v)}" for k, v in shapes.items() if v is not None]
    preset = any(s.startswith("preset=") for s in overrides)
    notes = []
    if not preset:
        sets += [f"model.{k}={toml_value(v)}" for k, v in _DEFAULTS.items()]
        given = {s.split("=", 1)[0].removeprefix("model.") for s in overrides}
        defaulted = [f"{k}={v}" for k, v in _DEFAULTS.items() if k not in given]
        if defaulted:
            notes.append(
                f"not in the checkpoint, torchtitan's defaults used: model.{', model.'.join(defaulted)}"
            )
    missing = [
        f
        for f in ("num_attention_heads", "rope.base")
        if not preset and not any(s.startswith(f"model.{f}=") for s in overrides)
    ]
    if missing:
        raise MlmError(
            f"{ckpt.path}: a torchtitan checkpoint does not say its {' or '.join(missing)}: pass the model's "
            f"n_heads and rope_theta as --set model.num_attention_heads=N --set model.rope.base=THETA "
            "(or preset=NAME)"
        )
    heads = load_config(None, [*sets, *overrides, "data.seq_length=1"]).model.num_attention_heads
    q_rows, k_rows = shape["layers.0.attn.q.weight"][0], shape["layers.0.attn.k.weight"][0]
    head_dim = q_rows // heads
    if head_dim * heads != q_rows or head_dim % 2 or not head_dim or k_rows % head_dim:
        raise MlmError(
            f"{ckpt.path}: model.num_attention_heads={heads} does not divide {key['layers.0.attn.q.weight']}'s "
            f"{q_rows} rows into even head dims that also divide wk's {k_rows}; set the model's n_heads"
        )
    sets += [f"model.kv_channels={head_dim}", f"model.num_query_groups={k_rows // head_dim}", *overrides]
    if not any(s.startswith("data.seq_length=") for s in overrides):
        max_pos = load_config(None, [*sets, "data.seq_length=1"]).model.max_position_embeddings
        sets.append(f"data.seq_length={min(DataConfig().seq_length, max_pos)}")  # as import_hf
    return load_config(None, sets), notes


def _check_shapes(ckpt: MegatronCheckpoint, weights: dict[str, str], cfg: ModelConfig) -> None:
    """MlmError naming the first parameter whose shape differs from GPT(cfg)'s, or one it lacks."""
    cfg.check_depth(len(ckpt.tensors), str(ckpt.path))
    expected = model_shapes(cfg, ckpt.shape("tok_embeddings.weight")[0])
    for key, name in weights.items():
        if expected.get(name) != ckpt.shape(key):
            raise MlmError(
                f"{ckpt.path}: {key} has shape {list(ckpt.shape(key))} but the model config gives "
                f"{list(expected[name]) if name in expected else 'no such tensor'} for {name}; set the model "
                "with --set model.* to match the torchtitan run"
            )
    missing = sorted(set(expected) - set(weights.values()))
    if missing:
        raise MlmError(
            f"{ckpt.path}: the checkpoint lacks {', '.join(missing[:4])}; it is not a whole Llama model"
        )


def _position(ckpt: MegatronCheckpoint, optim: dict, config: Config) -> tuple[dict, dict, list[str]]:
    """(the manifest's training position, the `source` record, notes): iteration, Adam's step and
    consumed samples where the optimizer state is imported; torchtitan's own counters as read."""
    wanted = [
        k
        for k in (
            "train_state.step",
            "train_state.ntokens_seen",
            "lr_scheduler.last_epoch",
            "dataloader.world_size",
        )
        if k in ckpt.bytes_keys
    ]
    values = ckpt.values(wanted)
    source = {k: v for k, v in values.items() if isinstance(v, int)}
    if not optim:
        return (
            {},
            source,
            ["no optimizer state in the checkpoint (a model-only save): iteration 0, weights only"],
        )
    steps = {t.item() for t in ckpt.read_all([f["step"] for f in optim.values()]).values()}
    if len(steps) != 1:
        raise MlmError(
            f"{ckpt.path}: the parameters' Adam steps differ ({sorted(steps)}); mlm keeps one step count"
        )
    adam_step = int(steps.pop())
    source["optimizer.state.*.step"] = adam_step
    iteration = int(values.get("train_state.step", adam_step))
    seq = config.data.seq_length
    dp = values.get("dataloader.world_size") or len(
        [k for k in ckpt.bytes_keys if re.fullmatch(r"dataloader\.dp_rank_\d+", k)]
    )
    tokens = values.get("train_state.ntokens_seen")
    notes = [f"the RNG state is a fresh run's with train.seed={config.train.seed} (torchtitan saves none)"]
    if not isinstance(tokens, int):
        why = "no train_state.ntokens_seen"
    elif not dp:
        why = "no dataloader.world_size: the data-parallel size that ntokens_seen (rank 0's) is multiplied by"
    elif (dp * tokens) % seq:
        why = (
            f"ntokens_seen {tokens} × {dp} data-parallel ranks is not a whole number of data.seq_length={seq} "
            "sequences (--set data.seq_length=<torchtitan's training.seq_len>)"
        )
    else:
        why = ""
    consumed = 0 if why else dp * tokens // seq
    if why:
        notes.append(f"consumed_samples 0 ({why}): mlm's data starts at its beginning")
    notes.insert(
        0,
        f"training state imported: iteration {iteration}, Adam step {adam_step}, {consumed} samples consumed; "
        "mlm train --load OUT resumes there",
    )
    position = {
        "consumed_samples": consumed,
        "optimizer_step": adam_step,
        "rng": seeded_rng_state(config.train.seed),
    }
    return {"iteration": iteration, **position}, source, notes


def _tensors(
    ckpt: MegatronCheckpoint, weights: dict[str, str], optim: dict[str, dict[str, str]], cfg: ModelConfig
) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(group, mlm key, tensor in mlm's layout), one tensor read at a time: the weights, then Adam's
    moments (a fused wqkv's split into its wq, wk and wv parts first)."""
    for key, name in weights.items():
        yield "model", name, _layout(name, ckpt.read(key), cfg)
    for param, fields in optim.items():
        for m in MOMENTS:
            t = ckpt.read(fields[m])
            parts = (
                [(param, t)] if param in weights else zip(_split_names(param), _split(t, cfg), strict=True)
            )
            for part, moment in parts:
                yield "optim", moment_key(m, weights[part]), _layout(weights[part], moment, cfg)


def import_torchtitan(
    src: str | os.PathLike,
    out: str | os.PathLike,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    verify: bool = True,
    weights_only: bool = False,
    progress: Progress = noop,
) -> Report:
    """torchtitan DCP checkpoint (`step-N/` or the checkpoint folder) → mlm checkpoint folder `out`.
    `verify`: read back what was written (checksums) and check mlm's logits on it are finite.
    `weights_only`: leave the optimizer state out (iteration 0: a new run from the weights)."""
    src, out = Path(src), Path(out)
    check_new_dir(out)
    report = Report("import", src, out, "torchtitan Llama 3")
    ckpt = MegatronCheckpoint(step_dir(src))
    weights = _weights(ckpt)
    tied = _tied(ckpt, weights)
    weights = {k: name for k, name in weights.items() if k != tied}
    config, report.notes = model_config(ckpt, weights, list(overrides))
    if tied:
        report.notes.append(
            f"{tied} is tok_embeddings.weight (tied): imported with model.tie_embeddings=true"
        )
    _check_shapes(ckpt, weights, config.model)
    optim = {} if weights_only else _optimizer(ckpt, weights)
    position, source, more = _position(ckpt, optim, config)
    stored = [k for k in ckpt.stored if k.startswith("optimizer.state.")]
    if weights_only and stored:
        more = [
            f"the optimizer state ({len(stored)} tensors, e.g. {stored[0]}) is not imported (--weights-only): "
            "iteration 0, mlm train starts a new run from the weights"
        ]
    report.notes += more
    keys = [*weights, *[f[m] for f in optim.values() for m in MOMENTS]]
    total = sum(math.prod(ckpt.shape(k)) * ckpt.stored[k].properties.dtype.itemsize for k in keys)
    extra = {**position, "source": {"torchtitan_dir": str(ckpt.path.resolve()), **source}}
    iteration = extra.pop("iteration", 0)
    tensors = _tensors(ckpt, weights, optim, config.model)
    groups = ["model", "optim"] if optim else ["model"]
    check = check_finite_logits if verify else None
    return write_import(out, report, iteration, tensors, extra, groups, config, progress, total, check=check)
