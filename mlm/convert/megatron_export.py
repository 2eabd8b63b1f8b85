"""`mlm export megatron CKPT OUT`: an mlm checkpoint → a Megatron-core `torch_dist` checkpoint.

    export_megatron("ckpt/run", "megatron/save")   # → OUT/latest_checkpointed_iteration.txt, OUT/iter_NNNNNNN/

The inverse of `mlm.convert.megatron` (`mlm convert from-megatron`), through the same name table (`_TOP`,
`_LAYER`, read backwards: where two Megatron names map to one mlm tensor, the first — the name
torch_dist gives both GPTModel specs — is written) and the same layouts: `linear_qkv` fused per
query group, `linear_fc1` = [gate; up], a homogeneous stack's layers stacked on a leading axis under
`decoder.layers.<sub>`, per-layer keys `decoder.layers.<n>.<sub>` where Megatron makes the stack
heterogeneous (`moe_layer_freq` a list or above 1), experts on the global expert axis. Vocabulary
rows are written as mlm holds them (padded; `args.padded_vocab_size` says how many).

OUT/iter_NNNNNNN/ (the mlm checkpoint's iteration) is what Megatron's `dist_checkpointing.save`
writes, produced with plain `torch.distributed.checkpoint` (no megatron import): `.metadata`, one
`__0_0.distcp`, every tensor one whole chunk (Megatron reshards on load, to any tp / pp / ep), an
empty `_extra_state` object for each linear layer (Megatron's load requires them), `metadata.json`
(`torch_dist`), and `common.pt` = {`args`: a plain `argparse.Namespace` of builtins under Megatron-LM's
argument names (the model, `padded_vocab_size`, `iteration`, `consumed_train_samples`,
`no_save_optim` / `no_save_rng`), `iteration`, `checkpoint_version`: 3.0}, so Megatron-LM's
`--use-checkpoint-args` and `mlm convert from-megatron` read the model back. Weights only: no optimizer
state, scheduler or RNG states. Multi-latent attention is written as the local spec's
MLASelfAttention (`--multi-latent-attention --qk-layernorm`: q_layernorm / kv_layernorm, and the
layer norms under their own names input_layernorm / pre_mlp_layernorm, which that spec does not
remap) with its YaRN as MLATransformerConfig's; multi-token prediction depths as
`mtp.layers.<d>.{enorm,hnorm,eh_proj,transformer_layer.<sub>,final_layernorm}`. What GPTModel's
layers (or this name table) cannot hold — YaRN outside MLA, MLA with rotate-half RoPE, RMS q/k
norms in a LayerNorm model, a tensor with no Megatron name — is refused, naming it.

Memory: the whole model twice (read with `read_group`, checksums checked; then fused and stacked
under Megatron's keys). Verification reads OUT back with mlm's own Megatron reader and requires
every tensor to equal the source bitwise.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner

from mlm.checkpoint import read_group
from mlm.checkpoint.manager import iter_dir_name
from mlm.checkpoint.store import dtype_name
from mlm.config import Config, ModelConfig, config_from_dict, describe_layers
from mlm.convert.common import Progress, Report, noop
from mlm.convert.megatron import _LAYER, _MLA_SUBS, _MTP, _TOP, _fc1_axis, _fuse_qkv, _mlm_tensors
from mlm.convert.megatron_dcp import MegatronCheckpoint
from mlm.errors import MlmError
from mlm.fileio import check_new_dir, staged_dir

CHECKPOINT_VERSION = 3.0
"""Megatron-LM's `checkpoint_version` for torch_dist checkpoints (no q/k/v reordering on load)."""

_LINEAR = re.compile(r"(.*(?:linear_\w+|eh_proj))\.weight$")
"""A Megatron linear layer's weight key; its module saves an `_extra_state` object beside it."""


def _parts(sub: str, name: str) -> list[str]:
    """The mlm keys under `layers.N.` that the Megatron sub-key `sub` (mapped to `name` in `_LAYER`) is made of."""
    suffix = sub.rsplit(".", 1)[1]
    if name == "qkv":
        return [f"attn.{p}.{suffix}" for p in "qkv"]
    if name.startswith("fc1:"):
        return [f"{name[4:]}.gate.{suffix}", f"{name[4:]}.up.{suffix}"]
    return [name]


_GQA_ONLY = (
    "self_attention.linear_qkv.weight",
    "self_attention.linear_qkv.bias",
    "self_attention.linear_qkv.layer_norm_weight",
    "self_attention.linear_qkv.layer_norm_bias",
    "mlp.linear_fc1.layer_norm_weight",
    "mlp.linear_fc1.layer_norm_bias",
)
"""Sub-keys of the attention with linear_qkv, with the layer norms' torch_dist names in its specs
(sharded_state_dict_keys_map); MLASelfAttention's local spec keeps input_layernorm / pre_mlp_layernorm."""


def _export_layer(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(Megatron sub-key, `_LAYER` name) to write for `cfg`'s attention kind: the first of the names
    that read one mlm tensor."""
    out, claimed = [], set()
    skipped = _GQA_ONLY if "mla" in cfg.mixer_kinds() else _MLA_SUBS  # MLA's linear_q_proj is linear_qkv's q
    for sub, name in _LAYER.items():
        parts = tuple(_parts(sub, name))
        if parts not in claimed and sub not in skipped:
            claimed.add(parts)
            out.append((sub, name))
    return out


def _unsupported(cfg: ModelConfig) -> list[str]:
    """What of `cfg` a Megatron GPTModel with this name table cannot hold, each naming the field."""
    out = []
    specs = cfg.layer_specs()
    if len(cfg.mixer_kinds()) > 1 or any(s.mixer is None or s.mlp is None for s in specs):
        out.append(
            f"layers {describe_layers(specs)}: GPTModel's layers are attention and an MLP, one attention "
            "kind throughout (a hybrid pattern is Megatron's HybridModel, not written yet)"
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
    if cfg.rope_scaling_factor is not None and "mla" not in cfg.mixer_kinds():
        llama3 = (
            cfg.rope_low_freq_factor,
            cfg.rope_high_freq_factor,
            cfg.rope_original_max_position_embeddings,
        )
        if cfg.rope_scaling_type != "llama3" or llama3 != (1.0, 4.0, 8192):
            out.append(
                f"model.rope_scaling_type={cfg.rope_scaling_type} (low/high freq factors {llama3[0]}/{llama3[1]}, "
                f"original positions {llama3[2]}): Megatron's --use-rope-scaling is Llama-3.1's with 1/4/8192 only"
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
    if cfg.rope_scaling_factor is not None and cfg.rope_scaling_type != "yarn":
        out.append(
            f"model.rope_scaling_type={cfg.rope_scaling_type} with attention_kind=mla: Megatron's MLA scales "
            "RoPE with YaRN only"
        )
    if cfg.rope_scaling_factor is not None and not cfg.rope_yarn_mscale and cfg.rope_yarn_mscale_all_dim:
        out.append(
            f"model.rope_yarn_mscale=0 with rope_yarn_mscale_all_dim={cfg.rope_yarn_mscale_all_dim}: Megatron's "
            "YaRN multiplies cos and sin by mscale(factor, mscale) / mscale(factor, mscale_all_dim), not mlm's "
            "mscale(factor) for that pair"
        )
    return out


def _mla_args(cfg: ModelConfig) -> dict:
    """Megatron-LM's MLA arguments for an MLA `cfg` (qk_head_dim: the dims without RoPE). mlm's
    YaRN attention factor with mscale_all_dim 0 is mscale(factor): Megatron's with mscale 1."""
    m, yarn = cfg.mla, cfg.rope_scaling_factor is not None
    mscale_all = cfg.rope_yarn_mscale_all_dim if yarn else 0.0
    return dict(
        multi_latent_attention=True,
        qk_layernorm=True,  # the latent norms
        group_query_attention=False,
        q_lora_rank=m.q_lora_rank,
        kv_lora_rank=m.kv_lora_rank,
        qk_head_dim=m.qk_nope_head_dim,
        qk_pos_emb_head_dim=m.qk_rope_head_dim,
        v_head_dim=m.v_head_dim,
        rope_type="yarn" if yarn else "rope",
        rotary_scaling_factor=cfg.rope_scaling_factor if yarn else 1.0,
        mscale=cfg.rope_yarn_mscale if yarn and mscale_all else 1.0,
        mscale_all_dim=mscale_all,
        use_rope_scaling=False,
    )


def _moe_layer_freq(cfg: ModelConfig) -> int | list[int]:
    """Megatron's moe_layer_freq for `cfg`: mlp_kind_freq, or a 0/1 list per layer where first_k_dense
    or a list decides."""
    if isinstance(cfg.mlp_kind_freq, int) and not cfg.first_k_dense:
        return cfg.mlp_kind_freq
    return [int(spec.mlp == "moe") for spec in cfg.layer_specs()]


def _heterogeneous(cfg: ModelConfig) -> bool:
    """Whether Megatron saves per-layer keys (TransformerBlock.sharded_state_dict's non_homogeneous_layers)."""
    if not any(spec.mlp == "moe" for spec in cfg.layer_specs()):
        return False
    freq = _moe_layer_freq(cfg)
    return isinstance(freq, list) or freq > 1


_UNREAD = {
    "norm_epsilon": 1e-5,
    "use_rope_scaling": False,
    "rope_scaling_factor": 8.0,
    "qk_layernorm": False,
    "moe_router_num_groups": None,
    "moe_router_group_topk": None,
    "moe_router_dtype": None,
    "moe_expert_capacity_factor": None,
    "moe_pad_expert_input_to_capacity": False,
    "moe_token_drop_policy": "probs",
    "moe_shared_expert_gate": False,
    "moe_router_load_balancing_type": "aux_loss",
    "moe_aux_loss_coeff": 0.0,
    "moe_z_loss_coeff": None,
    "moe_router_bias_update_rate": 1e-3,
    "multi_latent_attention": False,
    "q_lora_rank": None,
    "kv_lora_rank": 32,
    "qk_head_dim": 128,
    "qk_pos_emb_head_dim": 64,
    "v_head_dim": 128,
    "rope_type": None,
    "rotary_scaling_factor": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 0.0,
    "mtp_num_layers": None,
}
"""Args the export writes that Megatron-LM's `--use-checkpoint-args` does not read
(`load_args_from_checkpoint`, core_v0.16.1), with Megatron-LM's defaults: where the model's
value differs, Megatron-LM builds another model (or trains it otherwise) unless given the flag."""


def unread_flags(args: argparse.Namespace) -> list[str]:
    """Megatron-LM command-line flags for the `_UNREAD` args whose value differs from Megatron-LM's
    default (a store-true flag alone, else the flag and its value)."""
    out = []
    for name, default in _UNREAD.items():
        value = getattr(args, name, default)
        if value == default or (name == "rope_scaling_factor" and not args.use_rope_scaling):
            continue
        if name == "moe_router_load_balancing_type" and not getattr(args, "moe_aux_loss_coeff", 0.0):
            continue  # "none" and "aux_loss" with coefficient 0 are the same
        flag = "--" + name.replace("_", "-")
        values = value if isinstance(value, list) else [value]
        out.append(flag if value is True else " ".join([flag, *map(str, values)]))
    return out


def _one_or_list(values: list):
    return values[0] if len(values) == 1 else values


def megatron_args(config: Config, padded_vocab: int, iteration: int, consumed: int) -> argparse.Namespace:
    """Megatron-LM's `args` for the run `config` (builtins only: mlm's reader and
    `torch.load(weights_only=True)` read it), as `--use-checkpoint-args` and `mlm convert from-megatron`
    read them."""
    cfg = config.model
    rope = cfg.position_embedding == "rope"
    args = dict(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_hidden_size or 4 * cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        group_query_attention=cfg.query_groups != cfg.num_attention_heads,
        num_query_groups=cfg.query_groups,
        kv_channels=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        seq_length=config.data.seq_length,
        position_embedding_type="rope" if rope else "learned_absolute",
        add_position_embedding=not rope,
        use_rotary_position_embeddings=rope,
        rotary_base=int(cfg.rope_base) if float(cfg.rope_base).is_integer() else cfg.rope_base,
        rotary_percent=1.0,
        rotary_interleaved=False,
        use_rope_scaling=cfg.rope_scaling_factor is not None,
        rope_scaling_factor=cfg.rope_scaling_factor or 8.0,
        normalization="RMSNorm" if cfg.normalization == "rmsnorm" else "LayerNorm",
        norm_epsilon=cfg.norm_eps,
        apply_layernorm_1p=False,
        swiglu=cfg.activation == "swiglu",
        openai_gelu=cfg.activation == "gelu_tanh",
        squared_relu=False,
        untie_embeddings_and_output_weights=not cfg.tie_embeddings,
        add_bias_linear=cfg.add_bias,
        add_qkv_bias=cfg.qkv_bias,
        qk_layernorm=cfg.qk_norm,
        multi_latent_attention=False,
        hidden_dropout=cfg.hidden_dropout,
        attention_dropout=cfg.attention_dropout,
        init_method_std=cfg.init_std,
        vocab_size=cfg.vocab_size,
        padded_vocab_size=padded_vocab,
        make_vocab_size_divisible_by=cfg.make_vocab_size_divisible_by,
        tensor_model_parallel_size=1,  # every tensor is one whole chunk: Megatron reshards on load
        pipeline_model_parallel_size=1,
        expert_model_parallel_size=1,
        ckpt_format="torch_dist",
        iteration=iteration,
        consumed_train_samples=consumed,
        no_save_optim=True,  # weights only: Megatron-LM's load then asks for no optimizer or RNG state
        no_save_rng=True,
        num_experts=None,
        moe_layer_freq=1,
        mtp_num_layers=cfg.mtp_num_layers or None,
        mtp_loss_scaling_factor=cfg.mtp_loss_scaling_factor,
    )
    if "mla" in cfg.mixer_kinds():
        args.update(_mla_args(cfg))
    if any(spec.mlp == "moe" for spec in cfg.layer_specs()):
        moe = cfg.moe
        balancing = [
            (kind, coeff)
            for kind, coeff in (("aux_loss", moe.aux_loss_coeff), ("seq_aux_loss", moe.seq_aux_loss_coeff))
            if coeff
        ]
        args.update(
            num_experts=moe.num_experts,
            moe_layer_freq=_moe_layer_freq(cfg),
            moe_ffn_hidden_size=moe.ffn_hidden_size or args["ffn_hidden_size"],
            moe_router_topk=moe.router_topk,
            moe_router_score_function=moe.router_score_function,
            moe_router_pre_softmax=moe.router_pre_softmax,
            moe_router_num_groups=moe.router_num_groups,
            moe_router_group_topk=moe.router_group_topk,
            moe_router_topk_scaling_factor=moe.router_topk_scaling_factor,
            moe_router_enable_expert_bias=moe.router_enable_expert_bias,
            moe_router_bias_update_rate=moe.router_bias_update_rate,
            moe_router_dtype="fp32",  # mlm computes the router in fp32
            # as Megatron-LM's arguments.py leaves them: one type and coefficient unwrapped, lists for two
            moe_router_load_balancing_type=_one_or_list([k for k, _ in balancing]) or "none",
            moe_aux_loss_coeff=_one_or_list([c for _, c in balancing]) or 0.0,
            moe_z_loss_coeff=moe.z_loss_coeff or None,
            moe_expert_capacity_factor=moe.capacity_factor,
            moe_pad_expert_input_to_capacity=moe.pad_to_capacity,
            moe_token_drop_policy=moe.token_drop_policy,
            moe_token_dispatcher_type=moe.token_dispatcher,
            moe_shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size,
            moe_shared_expert_gate=moe.shared_expert_gate,
            moe_grouped_gemm=False,
        )
    return argparse.Namespace(**args)


def megatron_tensors(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """mlm's tensors under Megatron's torch_dist keys (fused, stacked or per layer as GPTModel shards
    them); MlmError naming an mlm tensor the name table has no Megatron key for."""
    out, used = {}, set()
    for key, name in _TOP.items():
        if name in state:
            out[key] = state[name]
            used.add(name)
    stacked = not _heterogeneous(cfg)
    for sub, name in _export_layer(cfg):
        layers = [_layer_tensor(state, f"layers.{i}.", sub, name, cfg, used) for i in range(cfg.num_layers)]
        if stacked and all(t is not None for t in layers):
            out[f"decoder.layers.{sub}"] = torch.stack(layers)
        else:
            out.update({f"decoder.layers.{i}.{sub}": t for i, t in enumerate(layers) if t is not None})
    for d in range(cfg.mtp_num_layers):  # one layer each, no stacked axis
        for rest, name in _MTP.items():
            if f"mtp.{d}.{name}" in state:
                out[f"mtp.layers.{d}.{rest}"] = state[f"mtp.{d}.{name}"]
                used.add(f"mtp.{d}.{name}")
        for sub, name in _export_layer(cfg):
            t = _layer_tensor(state, f"mtp.{d}.layer.", sub, name, cfg, used)
            if t is not None:
                out[f"mtp.layers.{d}.transformer_layer.{sub}"] = t
    left = sorted(set(state) - used)
    if left:
        raise MlmError(
            f"mlm tensor {left[0]}{f' (and {len(left) - 1} more)' if len(left) > 1 else ''} has no Megatron "
            "GPTModel key in the export's name table (mlm.convert.megatron._LAYER); it cannot be exported "
            "to Megatron"
        )
    return {k: t.contiguous() for k, t in out.items()}


def _layer_tensor(
    state: dict[str, torch.Tensor], prefix: str, sub: str, name: str, cfg: ModelConfig, used: set[str]
) -> torch.Tensor | None:
    """The Megatron sub-key `sub` (`_LAYER` name `name`) of the mlm layer under `prefix` (fused),
    None where the layer has no such tensor; the mlm keys read are added to `used`."""
    keys = [prefix + p for p in _parts(sub, name) if prefix + p in state]
    used.update(keys)
    parts = [state[k] for k in keys]
    if not parts:
        return None
    if name == "qkv":
        return _fuse_qkv(*parts, cfg)
    if name.startswith("fc1:"):  # [gate; up], or up alone without a gate
        return torch.cat(parts, dim=_fc1_axis(name))
    return parts[0]


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
        stacked = key.startswith("decoder.layers.") and not key[15:].split(".", 1)[0].isdigit()
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
    for key, t in _mlm_tensors(ckpt, cfg):
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
    start = time.perf_counter()
    if (ckpt / ".metadata").exists() or (ckpt / "latest_checkpointed_iteration.txt").exists():
        raise MlmError(
            f"{ckpt}: a Megatron (or torch DCP) checkpoint, not an mlm one; mlm export megatron exports an mlm "
            f"checkpoint. To read this one into mlm: mlm convert from-megatron {ckpt} OUT"
        )
    progress("reading the checkpoint", 0, 0)
    state, manifest, it_dir = read_group(ckpt, verify=verify)
    if "config" not in manifest:
        raise MlmError(
            f"{it_dir}/manifest.json has no 'config'; it was not written by mlm train or mlm convert"
        )
    config = config_from_dict(manifest["config"])
    cfg = config.model
    refused = _unsupported(cfg)
    if refused:
        raise MlmError(f"{it_dir}: cannot export to a Megatron GPTModel: {'; '.join(refused)}")
    tensors = megatron_tensors(state, cfg)
    iteration = int(manifest["iteration"])
    padded = state["embed.weight"].shape[0]
    args = megatron_args(config, padded, iteration, int(manifest.get("consumed_samples", 0)))
    common = {"args": args, "iteration": iteration, "checkpoint_version": CHECKPOINT_VERSION}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    notes = [
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
    yarn = (cfg.rope_original_max_position_embeddings, cfg.rope_yarn_beta_fast, cfg.rope_yarn_beta_slow)
    if "mla" in cfg.mixer_kinds() and cfg.rope_scaling_factor is not None and yarn != (4096, 32.0, 1.0):
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
        report = Report(
            "export",
            ckpt,
            out,
            "Megatron-core GPTModel",
            tensors=len(tensors),
            bytes=total,
            seconds=0.0,
            dtype=",".join(sorted({dtype_name(t.dtype) for t in tensors.values()})),
            tokenizer_files=[],
            notes=notes,
        )
        if verify:
            progress("verifying", 0, 0)
            _verify(tmp / name, state, cfg)
            report.verified = True
    report.seconds = time.perf_counter() - start
    return report
