"""Megatron-core GPTModel's and HybridModel's torch_dist tensor names ⇄ mlm's, both directions from
one table: `TOP`, `LAYER` and `MTP` below (HybridModel: `HYBRID_TOP`, `MAMBA` and `LAYER`, one
Megatron layer per pattern symbol, `hybrid_keymap`); `keymap` turns them into `mlm.convert.keymap` templates, read by
`mlm_tensors` (import) and written by `megatron_tensors` (export). The layouts (fused linear_qkv,
[gate; up], stacked or per-layer keys, the expert axis) are in docs/formats-foreign.md ("Megatron-core
torch_dist checkpoint"); the table as a whole in docs/megatron.md."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import replace

import torch

from mlm.config import ModelConfig
from mlm.convert.common import model_shapes
from mlm.convert.keymap import KeyMap, Rule
from mlm.convert.megatron.args import is_hybrid, moe_layer_freq
from mlm.convert.megatron.dcp import MegatronCheckpoint
from mlm.errors import MlmError

TOP = {
    "embedding.word_embeddings.weight": "embed.weight",
    "embedding.position_embeddings.weight": "pos_embed.weight",
    "decoder.final_layernorm.weight": "final_norm.weight",
    "decoder.final_layernorm.bias": "final_norm.bias",
    "output_layer.weight": "output.weight",
}
"""Megatron keys outside the layers → mlm keys."""


LAYER = {
    "self_attention.linear_qkv.layer_norm_weight": "attn_norm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "attn_norm.bias",
    "input_layernorm.weight": "attn_norm.weight",
    "input_layernorm.bias": "attn_norm.bias",
    "self_attention.linear_qkv.weight": "qkv",
    "self_attention.linear_qkv.bias": "qkv",
    "self_attention.linear_proj.weight": "attn.out.weight",
    "self_attention.linear_proj.bias": "attn.out.bias",
    "self_attention.q_layernorm.weight": "attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "attn.k_norm.weight",
    "self_attention.linear_q_proj.weight": "attn.q.weight",
    "self_attention.linear_q_down_proj.weight": "attn.q_down.weight",
    "self_attention.linear_q_up_proj.layer_norm_weight": "attn.q_norm.weight",
    "self_attention.linear_q_up_proj.weight": "attn.q_up.weight",
    "self_attention.linear_kv_down_proj.weight": "attn.kv_down.weight",
    "self_attention.kv_layernorm.weight": "attn.kv_norm.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "attn.kv_norm.weight",
    "self_attention.linear_kv_up_proj.weight": "attn.kv_up.weight",
    "mlp.linear_fc1.layer_norm_weight": "mlp_norm.weight",
    "mlp.linear_fc1.layer_norm_bias": "mlp_norm.bias",
    "pre_mlp_layernorm.weight": "mlp_norm.weight",
    "pre_mlp_layernorm.bias": "mlp_norm.bias",
    "mlp.linear_fc1.weight": "fc1:mlp",
    "mlp.linear_fc1.bias": "fc1:mlp",
    "mlp.linear_fc2.weight": "mlp.down.weight",
    "mlp.linear_fc2.bias": "mlp.down.bias",
    "mlp.router.weight": "mlp.router.weight",
    "mlp.router.expert_bias": "mlp.router.expert_bias",
    "mlp.experts.experts.linear_fc1.weight": "fc1:mlp.experts",
    "mlp.experts.experts.linear_fc2.weight": "mlp.experts.down.weight",
    "mlp.shared_experts.linear_fc1.weight": "fc1:mlp.shared",
    "mlp.shared_experts.linear_fc2.weight": "mlp.shared.down.weight",
    "mlp.shared_experts.gate_weight": "mlp.shared_gate.weight",
}
"""Megatron sub-keys of a layer (after `decoder.layers.`) → the mlm key under `layers.N.`; `qkv`:
split into attn.{q,k,v}; `fc1:P`: [gate; up] into P.gate and P.up (P.up alone when not gated).
Multi-latent attention's tensors have mlm's layouts as they are (docs/megatron.md)."""


MLA_SUBS = tuple(sub for sub in LAYER if ".linear_q_" in sub or "kv_" in sub)
"""The sub-keys of multi-latent attention (with linear_proj, shared with linear_qkv's attention)."""


MTP = {
    "enorm.weight": "enorm.weight",
    "enorm.bias": "enorm.bias",
    "hnorm.weight": "hnorm.weight",
    "hnorm.bias": "hnorm.bias",
    "eh_proj.weight": "eh_proj.weight",
    "final_layernorm.weight": "final_norm.weight",
    "final_layernorm.bias": "final_norm.bias",
}
"""Megatron sub-keys of multi-token prediction depth d (after `mtp.layers.<d>.`) → mlm keys under
`mtp.<d>.`; its `transformer_layer.<sub>` is one layer named as `LAYER` names it, mlm's `mtp.<d>.layer.`."""


MAMBA = {
    "mixer.in_proj.layer_norm_weight": "attn_norm.weight",
    "norm.weight": "attn_norm.weight",
    **{f"mixer.in_proj.weight.{p}": f"attn.in_{p}.weight" for p in ("z", "x", "B", "C", "dt")},
    **{f"mixer.conv1d.{w}.{p}": f"attn.conv_{p}.{w}" for w in ("weight", "bias") for p in "xBC"},
    "mixer.A_log": "attn.A_log",
    "mixer.D": "attn.D",
    "mixer.dt_bias": "attn.dt_bias",
    "mixer.norm.weight": "attn.norm.weight",
    "mixer.out_proj.weight": "attn.out.weight",
}
"""Megatron HybridModel's Mamba layer sub-keys (after `decoder.layers.<i>.`, Megatron's
`MambaMixer.sharded_state_dict`: in_proj saved as its five pieces `.z .x .B .C .dt`, conv1d as
`.x .B .C`; the pre-norm fused into in_proj under the TE spec, `norm.weight` under the local one) →
mlm keys under `layers.N.`; mlm keeps the same pieces as its own tensors."""

GDN = {
    "self_attention.in_proj.layer_norm_weight": "attn_norm.weight",
    "input_layernorm.weight": "attn_norm.weight",
    **{
        f"self_attention.in_proj.weight.{theirs}": f"attn.in_{ours}.weight"
        for theirs, ours in (
            ("query", "q"),
            ("key", "k"),
            ("value", "v"),
            ("z", "z"),
            ("beta", "b"),
            ("alpha", "a"),
        )
    },
    **{
        f"self_attention.conv1d.weight.{theirs}": f"attn.conv_{theirs[0]}.weight"
        for theirs in ("query", "key", "value")
    },
    "self_attention.A_log": "attn.A_log",
    "self_attention.dt_bias": "attn.dt_bias",
    "self_attention.out_norm.weight": "attn.norm.weight",
    "self_attention.out_proj.weight": "attn.out.weight",
}
"""Megatron's GatedDeltaNet layer sub-keys (megatron-core's `GatedDeltaNet.sharded_state_dict`:
in_proj saved as `.query .key .value .z .beta .alpha`, conv1d as `.query .key .value`; the pre-norm
fused into in_proj under the TE spec) → mlm keys under `layers.N.`."""

HYBRID_TOP = {
    "embedding.word_embeddings.weight": "embed.weight",
    "decoder.final_norm.weight": "final_norm.weight",
    "output_layer.weight": "output.weight",
}
"""HybridModel's keys outside the layers (its final norm is `final_norm`, GPTModel's `final_layernorm`)."""


def hybrid_layers(cfg: ModelConfig) -> list[tuple[int, int, str]]:
    """(Megatron layer, mlm layer, "mixer" or "mlp"): HybridModel numbers one layer per pattern
    symbol, mlm one per mixer and the MLP after it."""
    out, i = [], 0
    for j, spec in enumerate(cfg.layer_specs()):
        for half, kind in (("mixer", spec.mixer), ("mlp", spec.mlp)):
            if kind is not None:
                out.append((i, j, half))
                i += 1
    return out


def _half(sub: str) -> str:
    """Which half of an mlm layer a GPTModel sub-key belongs to."""
    return "mlp" if sub.startswith(("mlp.", "pre_mlp_layernorm.")) else "mixer"


def hybrid_keymap(cfg: ModelConfig, export: bool = False) -> KeyMap:
    """The keys of a HybridModel checkpoint for `cfg`, one per stored tensor (each Megatron layer's
    own: HybridModel never stacks layers): Mamba layers by `MAMBA`, attention and MLP layers by
    GPTModel's `LAYER`. `export`: only the sub-keys the export writes (the TE spec's names)."""
    table: dict[str, Rule] = {key: Rule((name,)) for key, name in HYBRID_TOP.items()}
    gpt_subs = _export_subs(cfg) if export else list(LAYER)
    own = {"mamba": MAMBA, "gdn": GDN}  # the mixers HybridModel names its own way
    local = ("norm.weight", "input_layernorm.weight")  # the local spec's pre-norms: read, not written
    for i, j, half in hybrid_layers(cfg):
        spec = cfg.layer_specs()[j]
        if half == "mixer" and spec.mixer in own:
            for sub, name in own[spec.mixer].items():
                if not (export and sub in local):
                    table[f"decoder.layers.{i}.{sub}"] = Rule((f"layers.{j}.{name}",))
            continue
        for sub in gpt_subs:
            if _half(sub) == half:
                table[f"decoder.layers.{i}.{sub}"] = _rule(sub, cfg, f"layers.{j}.")
    return KeyMap(table, {"layer": cfg.num_layers}, "Megatron HybridModel", groups=cfg.query_groups)


def hybrid_checkpoint(keys: Iterable[str]) -> bool:
    """Whether stored keys are HybridModel's (its `final_norm`, a Mamba mixer or a gated delta net)."""
    return any(k == "decoder.final_norm.weight" or ".mixer." in k or ".in_proj.weight." in k for k in keys)


def split_key(key: str) -> tuple[int | None, str]:
    """`decoder.layers.<n>.<sub>` → (n, sub); `decoder.layers.<sub>` (stacked) → (None, sub)."""
    rest = key.removeprefix("decoder.layers.")
    head, _, tail = rest.partition(".")
    return (int(head), tail) if head.isdigit() else (None, rest)


def layer_keys(ckpt: MegatronCheckpoint) -> dict[int, dict[str, tuple[str, int | None]]]:
    """{layer number: {sub-key: (the Megatron key holding it, the layer's index along its stacked
    axis or None for a per-layer key)}}, over the checkpoint's `decoder.layers.*` tensors."""
    out: dict[int, dict[str, tuple[str, int | None]]] = {}
    for key in ckpt.tensors:
        if key.startswith("decoder.layers."):
            n, sub = split_key(key)
            for i in [n] if n is not None else range(ckpt.shape(key)[0]):
                out.setdefault(i, {})[sub] = (key, None if n is not None else i)
    return out


def mtp_key(key: str) -> tuple[int, str] | None:
    """`mtp.layers.<d>.<rest>` → (d, rest); None for any other key."""
    if not key.startswith("mtp.layers."):
        return None
    head, _, rest = key.removeprefix("mtp.layers.").partition(".")
    return (int(head), rest) if head.isdigit() else None


def known_mtp(key: str) -> bool:
    """Whether `key` is a tensor of an MTP depth that `MTP` or `LAYER` names."""
    rest = (mtp_key(key) or (None, ""))[1]
    return rest in MTP or (
        rest.startswith("transformer_layer.") and rest.removeprefix("transformer_layer.") in LAYER
    )


def _rule(sub: str, cfg: ModelConfig, prefix: str) -> Rule:
    """What the Megatron sub-key `sub` of one layer is in mlm, under the mlm layer `prefix`: q/k/v
    fused per group, [gate; up] (up alone without a gate), or one tensor."""
    name, suffix = LAYER[sub], sub.rsplit(".", 1)[1]
    if name == "qkv":
        return Rule(tuple(f"{prefix}attn.{p}.{suffix}" for p in "qkv"), grouped=True)
    if name.startswith("fc1:"):  # [gate; up] on axis 0 of one layer's tensor, 1 under the expert axis
        mlp = f"{prefix}{name[4:]}"
        if cfg.activation != "swiglu":
            return Rule((f"{mlp}.up.{suffix}",))
        return Rule((f"{mlp}.gate.{suffix}", f"{mlp}.up.{suffix}"), split_dim=int(name == "fc1:mlp.experts"))
    return Rule((prefix + name,))


def keymap(cfg: ModelConfig, subs: Iterable[str] = LAYER) -> KeyMap:
    """The key templates of a GPTModel checkpoint for `cfg` (the layer sub-keys `subs`): each layer
    sub-key stacked (`decoder.layers.<sub>`, every layer on axis 0), per layer
    (`decoder.layers.{layer}.<sub>`) and in the MTP depths."""
    table: dict[str, Rule] = {key: Rule((name,)) for key, name in TOP.items()}
    for sub in subs:
        table[f"decoder.layers.{sub}"] = replace(_rule(sub, cfg, "layers.{layer}."), unstack="layer")
        table[f"decoder.layers.{{layer}}.{sub}"] = _rule(sub, cfg, "layers.{layer}.")
        table[f"mtp.layers.{{depth}}.transformer_layer.{sub}"] = _rule(sub, cfg, "mtp.{depth}.layer.")
    table |= {f"mtp.layers.{{depth}}.{rest}": Rule((f"mtp.{{depth}}.{name}",)) for rest, name in MTP.items()}
    counts = {"layer": cfg.num_layers, "depth": cfg.mtp_num_layers}
    return KeyMap(table, counts, "Megatron GPTModel", groups=cfg.query_groups)


def _converted(ckpt: MegatronCheckpoint, cfg: ModelConfig, read) -> Iterator[tuple[str, torch.Tensor]]:
    keys = hybrid_keymap(cfg) if hybrid_checkpoint(ckpt.tensors) else keymap(cfg)
    units, stored = keys.plan(ckpt.tensors)
    shapes = model_shapes(cfg, None)  # the sizes of the split pieces
    for unit in units:
        for name, t in keys.to_mlm(unit, [read(stored[k]) for k in unit.hf], shapes):
            yield name, t.contiguous()


def mlm_tensors(ckpt: MegatronCheckpoint, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(mlm key, tensor) for every tensor of the checkpoint, one Megatron key read at a time."""
    return _converted(ckpt, cfg, ckpt.read)


def mlm_shapes(ckpt: MegatronCheckpoint, cfg: ModelConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    """The (mlm key, shape) pairs `mlm_tensors` will yield, from the metadata alone."""
    for name, t in _converted(ckpt, cfg, lambda key: torch.empty(ckpt.shape(key), device="meta")):
        yield name, tuple(t.shape)


_GQA_ONLY = tuple(
    s for s in LAYER if s.startswith(("self_attention.linear_qkv.", "mlp.linear_fc1.layer_norm_"))
)
"""Sub-keys of the attention with linear_qkv, with the layer norms' torch_dist names in its specs
(sharded_state_dict_keys_map); MLASelfAttention's local spec keeps input_layernorm / pre_mlp_layernorm."""


def _export_subs(cfg: ModelConfig) -> list[str]:
    """The Megatron sub-keys to write for `cfg`'s attention kind: of those that hold the same mlm
    tensors, the first."""
    out, claimed = [], set()
    skipped = _GQA_ONLY if "mla" in cfg.mixer_kinds() else MLA_SUBS  # MLA's linear_q_proj is linear_qkv's q
    for sub in LAYER:
        parts = _rule(sub, cfg, "").mlm
        if parts not in claimed and sub not in skipped:
            claimed.add(parts)
            out.append(sub)
    return out


def _heterogeneous(cfg: ModelConfig) -> bool:
    """Whether Megatron saves per-layer keys (TransformerBlock.sharded_state_dict's non_homogeneous_layers)."""
    freq = moe_layer_freq(cfg)
    return any(spec.mlp == "moe" for spec in cfg.layer_specs()) and (isinstance(freq, list) or freq > 1)


def megatron_tensors(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """mlm's tensors under Megatron's torch_dist keys (fused, stacked or per layer as GPTModel shards
    them; HybridModel's per pattern symbol for a hybrid `cfg`); MlmError naming an mlm tensor the name table has no Megatron key for."""
    hybrid = is_hybrid(cfg)
    keys = hybrid_keymap(cfg, export=True) if hybrid else keymap(cfg, _export_subs(cfg))
    stacked = not hybrid and not _heterogeneous(cfg)
    out, used, whole = {}, set(), set()
    for unit in keys.units():
        if not all(k in state for k in unit.mlm):  # tied: no output layer; a dense layer: no router
            continue
        sub = unit.template.removeprefix("decoder.layers.").removeprefix("{layer}.")
        if (unit.rule.unstack and not stacked) or (
            unit.template.startswith("decoder.layers.{") and sub in whole
        ):
            continue
        if unit.rule.unstack:
            whole.add(sub)
        out.update(keys.to_hf(unit, [state[k] for k in unit.mlm]))
        used.update(unit.mlm)
    left = sorted(set(state) - used)
    if left:
        raise MlmError(
            f"mlm tensor {left[0]}{f' (and {len(left) - 1} more)' if len(left) > 1 else ''} has no Megatron "
            "GPTModel key in the export's name table (mlm.convert.megatron.names.LAYER); it cannot be "
            "exported to Megatron"
        )
    return {k: t.contiguous() for k, t in out.items()}
