"""The conversion engine: applies an architecture's adapter to a state dict, tensor by tensor.

For every adapter alike (docs/hf.md): shapes checked against the config, the vocabulary rows
padded to `cfg.padded_vocab_size()` (import) or sliced back (export), a tied `lm_head.weight` and
other stored copies (`copied` templates) checked equal to their originals and dropped on import,
written on export. The key templates (`mlm.convert.keymap`) do the renaming, splitting and stacking.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import google_crc32c
import numpy as np
import torch
from torch import nn

from mlm.config import ModelConfig, describe_layers
from mlm.convert.common import model_shapes
from mlm.convert.hf.adapter import Adapter
from mlm.convert.hf.registry import adapter, arch_of, config_from_hf
from mlm.errors import MlmError
from mlm.model.gpt import GPT, VOCAB_ROWS


def _check_mlm_state(mlm_state: dict, cfg: ModelConfig, padded_vocab: int | None) -> None:
    want = model_shapes(cfg, padded_vocab)
    missing = sorted(want.keys() - mlm_state.keys())
    unknown = sorted(mlm_state.keys() - want.keys())
    if missing or unknown:
        raise MlmError(
            f"mlm state dict does not match the config: missing {missing or 'none'}; unexpected {unknown or 'none'} "
            "(was it saved from a model with this config?)"
        )
    for k, shape in want.items():
        if mlm_state[k].shape != shape:
            raise MlmError(
                f"mlm state dict {k}: shape {list(mlm_state[k].shape)}, but the config needs {list(shape)}"
            )


def mlm_to_hf(
    mlm_state: dict[str, torch.Tensor], cfg: ModelConfig, arch: str, padded_vocab: int | None = None
) -> tuple[dict[str, torch.Tensor], dict]:
    """mlm state dict → (Hugging Face state dict, config.json dict): the vocabulary unpadded, a tied
    `lm_head.weight` left out (as `save_pretrained` does); tensors contiguous, in their dtype."""
    a = adapter(arch)
    hf_config = a.config_to_hf(cfg)
    _check_mlm_state(mlm_state, cfg, padded_vocab)

    def unpadded(k: str) -> torch.Tensor:
        return mlm_state[k][: cfg.vocab_size] if k in VOCAB_ROWS else mlm_state[k]

    keymap = a.keymap(cfg)
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    for unit in keymap.units():
        if unit.rule.copy:  # a second stored copy (DeepSeek's MTP embedding and head): its own tensor
            (m,) = unit.mlm
            source = "embed.weight" if m == "output.weight" and cfg.tie_embeddings else m
            out[unit.hf[0]] = unpadded(source).clone(memory_format=torch.contiguous_format)
            continue
        present = [k in mlm_state for k in unit.mlm]
        if not any(present):  # lm_head when tied; a dense MLP's keys in an MoE layer, and back
            continue
        assert all(present), f"{unit.template}: only some of {unit.mlm} in the state"
        for hf_key, t in keymap.to_hf(unit, [unpadded(k) for k in unit.mlm]):
            out[hf_key] = t.contiguous()
        used.update(unit.mlm)
    unnamed = [k for k in mlm_state if k not in used]
    if unnamed:  # never drop a tensor: the adapter's require() should have refused the config
        raise MlmError(
            f"mlm tensors {', '.join(unnamed)} have no Hugging Face {a.model_type} name, so the export "
            f"would lose them; this model cannot be written as {a.hf_class}"
        )
    return out, hf_config


def _hf_shapes(cfg: ModelConfig, arch: str, padded_vocab: int | None) -> dict[str, torch.Size]:
    """The HF key → shape that `cfg` implies: the export of a model built on the meta device."""
    with torch.device("meta"):
        state = GPT(cfg, padded_vocab).state_dict()
    hf_state, _ = mlm_to_hf(state, cfg, arch, padded_vocab)
    return {k: v.shape for k, v in hf_state.items()}


LazyTensor = tuple[torch.Size, Callable[[], torch.Tensor]]
"""A tensor not read yet: its shape, and a function that reads it."""


def hf_to_mlm(
    hf_state: dict[str, torch.Tensor],
    cfg: ModelConfig,
    arch: str | None = None,
    padded_vocab: int | None = None,
) -> dict[str, torch.Tensor]:
    """Hugging Face state dict → mlm state dict, keys exactly as `GPT(cfg).state_dict()` has them.

    `arch` defaults to the one `cfg` describes (learned positions: gpt2, else llama). The
    vocabulary rows are padded with zeros to `padded_vocab` (default `cfg.padded_vocab_size()`).
    Tensors keep their dtype; those stored as mlm keeps them share memory with `hf_state`."""
    lazy = {k: (t.shape, lambda t=t: t) for k, t in hf_state.items()}
    return dict(iter_hf_to_mlm(lazy, cfg, arch, padded_vocab))


def iter_hf_to_mlm(
    hf_tensors: dict[str, LazyTensor],
    cfg: ModelConfig,
    arch: str | None = None,
    padded_vocab: int | None = None,
    passthrough: Callable[[str], object] | None = None,
) -> Iterator[tuple[str, object]]:
    """`hf_to_mlm` one tensor at a time: every key and shape is checked before the first tensor is
    read, then each is read, converted and yielded (mlm key, tensor) in turn, so memory holds one
    Hugging Face tensor (all of a stack's). Stored copies (a tied `lm_head.weight`, `copied`
    templates) may be left out; their values are checked by CRC-32C as they pass (MlmError after
    the last tensor), and they are not yielded. `passthrough`: a tensor that converts to itself (no
    split, transpose, stack or padding) is not read; (mlm key, passthrough(its Hugging Face key)) is
    yielded, for a caller that copies its bytes."""
    a = adapter(arch or arch_of(cfg))
    a.config_to_hf(cfg)  # raises if cfg is not this architecture
    V = padded_vocab or cfg.padded_vocab_size()
    want = _hf_shapes(cfg, a.model_type, padded_vocab)
    keymap = a.keymap(cfg)
    units, stored = keymap.plan(hf_tensors)  # unknown keys, indices beyond the config, partial stacks
    by_mlm = {r.mlm: t for t, r in keymap.rules.items() if r is not None and not r.copy}
    # stored copies: HF key → (the HF key it must equal, why); checked as they pass, then dropped
    copy_of: dict[str, tuple[str, str]] = {}
    for u in units:
        tied_head = cfg.tie_embeddings and u.template == by_mlm[("output.weight",)]
        if u.rule.copy or tied_head:  # with tied embeddings, copies of the output layer are the embedding's
            m = u.mlm[0]
            original = by_mlm[("embed.weight" if m == "output.weight" and cfg.tie_embeddings else m,)]
            copy_of[stored[u.hf[0]]] = (stored.get(original, original), _TIED if tied_head else a.copy_note)
    originals = {o for o, _ in copy_of.values()}
    homeless = [stored[k] for u in units for k in u.hf if k not in want and stored[k] not in copy_of]
    if homeless:  # e.g. a dense MLP's key in a layer the config gives experts
        raise MlmError(
            f"Hugging Face {a.model_type} state has {', '.join(homeless)}, which the config has no "
            f"tensor for (its layers: {describe_layers(cfg.layer_specs())}); build the config with "
            "config_from_hf from the checkpoint's own config.json"
        )
    bad = [
        f"{stored[k]}: shape {list(hf_tensors[stored[k]][0])} in the Hugging Face state, but the config "
        f"needs {list(want[k])}{_note(a.shape_note(u.template, cfg))}"
        for u in units
        for k in u.hf
        if stored[k] not in copy_of and hf_tensors[stored[k]][0] != want[k]
    ]
    if bad:
        raise MlmError(
            "Hugging Face state does not match the config: "
            + "; ".join(bad)
            + " (build the config with config_from_hf from the checkpoint's own config.json)"
        )
    optional = {k for u in keymap.units() if u.rule.copy for k in u.hf}  # copies may be left out
    missing = sorted(want.keys() - stored.keys() - optional)
    if missing:
        _, note = a.config_for_keys(cfg, hf_tensors)  # e.g. MTP depths transformers did not save
        fix = ""
        if note:
            mtp = [k for k in missing if "depth" in keymap.locate(k)[1]]
            missing = [k for k in missing if k not in mtp]
            missing.append(f"the {len(mtp)} tensors of the MTP depths (model.layers.{cfg.num_layers}.*)")
            fix = f"; {note}: build the config with mtp_num_layers=0 to convert it without them"
        raise MlmError(f"Hugging Face {a.model_type} state lacks {', '.join(missing)}{fix}")
    unequal = [
        (k, o, why)
        for k, (o, why) in copy_of.items()
        if o in hf_tensors and hf_tensors[k][0] != hf_tensors[o][0]
    ]
    if unequal:
        raise MlmError(_differ(a, unequal, hf_tensors))

    shapes = model_shapes(cfg, padded_vocab)
    digests: dict[str, tuple] = {}  # of the stored copies and their originals
    for unit in units:
        keys = [stored[k] for k in unit.hf]
        checked = keys[0] in copy_of or keys[0] in originals
        padded = unit.mlm[0] in VOCAB_ROWS and hf_tensors[keys[0]][0][0] != V
        if passthrough is not None and unit.rule.identity and not padded and not checked:
            yield unit.mlm[0], passthrough(keys[0])  # stored as it is: the caller copies it
            continue
        ts = [hf_tensors[k][1]() for k in keys]
        for k, t in zip(keys, ts, strict=True):
            if not t.is_floating_point():
                raise MlmError(
                    f"Hugging Face {a.model_type} tensor {k} is stored as {t.dtype}: a model's weights are "
                    "floating point (float32, bfloat16, float16); the file is damaged or not this model's"
                )
        if checked:
            digests[keys[0]] = (ts[0].shape, ts[0].dtype, _digest(ts[0]))
            if keys[0] in copy_of:
                continue
        for mk, p in keymap.to_mlm(unit, ts, shapes):
            if mk in VOCAB_ROWS and p.shape[0] != V:
                p = torch.cat([p, p.new_zeros(V - p.shape[0], *p.shape[1:])])
            yield mk, p.contiguous()
    unequal = [(k, o, why) for k, (o, why) in copy_of.items() if digests[k] != digests.get(o)]
    if unequal:
        raise MlmError(_differ(a, unequal, hf_tensors, digests))


_TIED = (
    "the config ties embeddings (tie_word_embeddings=true); use a config with "
    "tie_word_embeddings=false for this checkpoint"
)


def _note(text: str) -> str:
    return f" ({text})" if text else ""


def _differ(
    a: Adapter, unequal: list[tuple[str, str, str]], hf_tensors: dict, digests: dict | None = None
) -> str:
    """The message for stored copies that differ from their originals (by shape, or by value)."""

    def what(k: str) -> str:
        if digests is None:
            return f"shape {list(hf_tensors[k][0])}"
        shape, dtype, crc = digests[k]
        return f"{str(dtype).removeprefix('torch.')} {list(shape)} CRC-32C {crc:08x}"

    parts = [f"{k} differs from {o} ({what(k)} vs {what(o)})" for k, o, _ in unequal]
    reasons = list(dict.fromkeys(why for _, _, why in unequal))
    return f"Hugging Face {a.model_type} state: {'; '.join(parts)}: {'; '.join(reasons)}"


def _digest(t: torch.Tensor) -> int:
    data = t.detach().contiguous().view(torch.uint8).numpy() if t.numel() else np.zeros(0, np.uint8)
    return google_crc32c.value(data.reshape(-1))


_NUMERICS = (
    "num_layers hidden_size num_attention_heads num_query_groups ffn_hidden_size vocab_size normalization "
    "norm_eps position_embedding activation add_bias tie_embeddings head_dim qkv_bias qk_norm"
).split()
_RESOLVED = {"num_query_groups": "query_groups", "ffn_hidden_size": "ffn_size"}  # unset: its default
_MOE_NUMERICS = (
    "num_experts router_topk router_score_function router_pre_softmax router_num_groups router_group_topk "
    "router_topk_scaling_factor router_enable_expert_bias capacity_factor shared_expert_ffn_hidden_size "
    "shared_expert_gate"
).split()
"""The `model.moe` fields that change what an MoE layer computes (not the losses or kernels)."""


def _numerics(cfg: ModelConfig) -> dict[str, object]:
    """The config values that change what the model computes (not dropout, init or max length)."""
    d = {k: getattr(cfg, _RESOLVED.get(k, k)) for k in _NUMERICS}
    d["layers"] = describe_layers(cfg.layer_specs())
    if "mla" in cfg.mixer_kinds():
        d.update({f"mla.{k}": v for k, v in vars(cfg.mla).items()})
    d["mtp_num_layers"] = cfg.mtp_num_layers
    if any(s.mlp == "moe" for s in cfg.layer_specs()):
        d.update({f"moe.{k}": getattr(cfg.moe, k) for k in _MOE_NUMERICS})
        d["expert_ffn_size"] = cfg.expert_ffn_size
    if cfg.position_embedding == "rope":
        rope = ["base", "scaling_factor"]
        if cfg.rope.scaling_factor is not None:
            rope += ["scaling_type", "original_max_position_embeddings"]
            yarn = [f"yarn_{k}" for k in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim")]
            rope += yarn if cfg.rope.scaling_type == "yarn" else ["low_freq_factor", "high_freq_factor"]
        d.update({f"rope.{k}": getattr(cfg.rope, k) for k in rope})
    return d


def load_hf_into(model: GPT, hf_model_or_state: nn.Module | dict[str, torch.Tensor]) -> GPT:
    """Load a transformers model (or its state dict) into an mlm model with `strict=True`.

    Given a model, its config must describe the same network as `model.cfg` (build that with
    `config_from_hf(hf_model.config.to_dict())`) and its tensors are taken as `save_pretrained`
    writes them (`saved_state`); a state dict is checked by its shapes only, and must use the
    names of the saved files. A transformers model holds no MTP depths (DeepSeek-V3's
    DeepseekV3ForCausalLM drops them), so the mlm model's `mtp_num_layers` must then be 0."""
    cfg = model.cfg
    state = hf_model_or_state
    if isinstance(hf_model_or_state, nn.Module):
        state = saved_state(hf_model_or_state)
        hf_config = hf_model_or_state.config.to_dict()
        theirs = config_from_hf(hf_config)
        # what the model holds: transformers' DeepSeek-V3 has no MTP depths, whatever its config says
        theirs, note = adapter(hf_config["model_type"]).config_for_keys(theirs, state)
        ours, theirs = _numerics(cfg), _numerics(theirs)
        diff = [
            f"model.{k}: mlm {ours[k]!r}, Hugging Face {theirs.get(k)!r}"
            for k in ours
            if ours[k] != theirs.get(k)
        ]
        if diff:
            fix = "build the mlm model from config_from_hf(hf_model.config.to_dict())"
            if note:
                fix = (
                    f"{note}; build the mlm model from config_from_hf(hf_model.config.to_dict()) with "
                    "mtp_num_layers=0, or convert the checkpoint's files (mlm convert from-hf), which "
                    "keep the MTP layers"
                )
            raise MlmError(f"the Hugging Face model and the mlm model differ: {'; '.join(diff)} ({fix})")
    model.load_state_dict(hf_to_mlm(state, cfg, padded_vocab=model.embed.weight.shape[0]), strict=True)
    return model


def saved_state(hf_model: nn.Module) -> dict[str, torch.Tensor]:
    """A transformers model's tensors under the names and layouts `save_pretrained` writes.

    transformers 5 holds some weights otherwise in memory than in its files (the experts of
    Mixtral and Qwen-MoE fused as `mlp.experts.gate_up_proj` [E, 2F, D]) and converts them back
    when saving (`revert_weight_conversion`); mlm's adapters name the saved files' keys, so the
    same conversion is applied here. transformers 4 holds the saved layout already."""
    state = hf_model.state_dict()
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4.x: no in-memory conversions
        return state
    return dict(revert_weight_conversion(hf_model, state))
