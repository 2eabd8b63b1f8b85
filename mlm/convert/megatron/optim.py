"""Adam's state of a Megatron-LM run, read from its torch_dist or legacy checkpoint: the moments per
Megatron sharded key, the fp32 main parameters, Adam's step and the run's position.

    opt = MegatronOptimizer(ckpt)          # ckpt: MegatronCheckpoint or LegacyCheckpoint
    opt.step, opt.param_groups             # Adam's step (param_groups[*]["step"])
    opt.view("exp_avg").read(key)          # the moment of model key `key`, in the weight's global shape

The layouts read (per parameter, `fully_reshardable`; per DDP bucket, `dp_reshardable` and the
legacy `distrib_optim.pt`) are in docs/formats-foreign.md; how the buckets are decoded (`decode_buckets`,
`parameter_order`, the main params checked against the weights) and what is refused, in
docs/megatron-resume.md. Bytes entries are read with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import torch

from mlm.checkpoint.keys import MOMENTS
from mlm.config import Config
from mlm.convert.megatron.args import run_settings, saved_args
from mlm.convert.megatron.dcp import MegatronCheckpoint
from mlm.convert.megatron.legacy import LegacyCheckpoint, join_tp, tp_dim, tp_rule
from mlm.convert.megatron.names import layer_keys, split_key
from mlm.convert.megatron.unpickle import load_megatron_pickle
from mlm.errors import MlmError

_ALIGN = 64
"""Megatron DDP starts every parameter of a distributed-optimizer buffer at a multiple of 64 elements."""

_BUCKET = re.compile(
    r"optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(.+)\.bucket_idx_(\d+)\.(\w+)"
)

_EMBEDDING = ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight")
_FINAL = ("decoder.final_layernorm.weight", "decoder.final_layernorm.bias", "output_layer.weight")
_LINEARS = {  # a linear's parameters, in registration order (weight, then bias)
    name: (f"{name}.weight", f"{name}.bias")
    for name in (
        "self_attention.linear_proj",
        "self_attention.linear_qkv",
        "mlp.linear_fc1",
        "mlp.linear_fc2",
    )
}
_TIED_COPY = ("output_layer.weight", None)
"""At pp > 1 the last stage's copy of a tied embedding: a parameter (registered last) that the
checkpoint does not hold."""
_QK_NORMS = ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight")
_ATTN_NORM = ("self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.layer_norm_bias")
_MLP_NORM = ("mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.layer_norm_bias")
_LOCAL_NORMS = (
    ("input_layernorm.weight", "input_layernorm.bias"),
    ("pre_mlp_layernorm.weight", "pre_mlp_layernorm.bias"),
)
"""The local spec's norms under their module names, as a legacy checkpoint keeps them."""
_LAYER_ORDERS = {
    # local spec: input_layernorm, then SelfAttention (linear_proj is built by its base class
    # before linear_qkv and the q/k norms), pre_mlp_layernorm, MLP; torch_dist names the two
    # norms after the linear they precede, the legacy layout by their modules
    "local": (*_ATTN_NORM, *_LOCAL_NORMS[0], *_LINEARS["self_attention.linear_proj"],
              *_LINEARS["self_attention.linear_qkv"], *_QK_NORMS, *_MLP_NORM, *_LOCAL_NORMS[1],
              *_LINEARS["mlp.linear_fc1"], *_LINEARS["mlp.linear_fc2"]),
    # Transformer Engine spec: the norms are parameters of the fused LayerNormLinear, which registers
    # layer_norm_weight / layer_norm_bias before weight / bias (not run here: no TE)
    "transformer_engine": (*_LINEARS["self_attention.linear_proj"], *_ATTN_NORM,
                           *_LINEARS["self_attention.linear_qkv"], *_QK_NORMS, *_MLP_NORM,
                           *_LINEARS["mlp.linear_fc1"], *_LINEARS["mlp.linear_fc2"]),
}  # fmt: skip
"""A dense layer's parameters in `model.parameters()` order, by sub-key (after `decoder.layers.`)."""


_UNEVEN_PIPELINE = (  # Megatron-LM args that place the layers on pipeline stages other than evenly
    "virtual_pipeline_model_parallel_size",
    "num_layers_per_virtual_pipeline_stage",
    "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers",
    "pipeline_model_parallel_layout",
    "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split",
)


_REWRITE = (
    "have Megatron-LM rewrite the checkpoint as torch_dist (--ckpt-convert-format torch_dist "
    "--ckpt-convert-save DIR) and import that"
)


def _param_groups(entry) -> list | None:
    """`entry["optimizer"]["param_groups"]` of a Megatron-LM optimizer entry; None where absent."""
    inner = entry.get("optimizer") if isinstance(entry, dict) else None
    return inner.get("param_groups") if isinstance(inner, dict) else None


def read_object(ckpt: MegatronCheckpoint, key: str):
    """A Megatron ShardedObject (a DCP bytes entry, `torch.save([obj])`): obj, read by the
    checkpoint's restricted reader (`MegatronCheckpoint.values`)."""
    value = ckpt.values([key])[key]
    return value[0] if isinstance(value, list) and len(value) == 1 else value


def parameter_order(
    ckpt: MegatronCheckpoint, spec: str, layers: range | None = None, first: bool = True, last: bool = True
) -> list[tuple[str, int | None]]:
    """The parameters of the checkpoint's GPTModel (of one pipeline stage: its global `layers`, the
    embedding if `first`, the final norm and output layer if `last`) in `model.parameters()` order
    under `spec`, as (sharded key, layer index along its stacked axis or None)."""
    per_layer = {i: subs for i, subs in layer_keys(ckpt).items() if layers is None or i in layers}
    order = [(k, None) for k in _EMBEDDING if first and k in ckpt.tensors]
    for i in sorted(per_layer):
        unknown = sorted(set(per_layer[i]) - set(_LAYER_ORDERS[spec]))
        if unknown:
            raise MlmError(
                f"a layer with {unknown[0]}, which the {spec} spec's dense GPTModel layer does not have "
                "(MoE layers' experts live in separate buffers)"
            )
        order += [per_layer[i][sub] for sub in _LAYER_ORDERS[spec] if sub in per_layer[i]]
    return order + [(k, None) for k in _FINAL if last and k in ckpt.tensors]


def decode_buckets(
    order: list[tuple[str, int | None]],
    shapes: Callable[[str, int | None], tuple[int, ...]],
    bucket_numels: list[int],
) -> dict[tuple[str, int | None], tuple[int, int]]:
    """Megatron DDP's distributed-optimizer bucket layout: each parameter's (bucket, offset in the
    bucket), given the parameters in `model.parameters()` order and the saved unpadded bucket
    lengths. Parameters fill the buckets in reverse order, each starting at a multiple of 64
    elements; a bucket ends where its parameters reach its saved length. MlmError when the
    parameters do not fill the buckets exactly."""
    layout, bucket, offset = {}, 0, 0
    for param in reversed(order):
        numel = torch.Size(shapes(*param)).numel()
        start = -(-offset // _ALIGN) * _ALIGN
        if bucket >= len(bucket_numels) or start + numel > bucket_numels[bucket]:
            raise MlmError(
                f"parameter {param[0]}{'' if param[1] is None else f' (layer {param[1]})'} does not fit the "
                f"saved bucket lengths {bucket_numels}"
            )
        layout[param] = (bucket, start)
        offset = start + numel
        if offset == bucket_numels[bucket]:
            bucket, offset = bucket + 1, 0
    if bucket != len(bucket_numels):
        raise MlmError(
            f"the parameters fill {bucket} of the {len(bucket_numels)} saved buckets {bucket_numels}"
        )
    return layout


@dataclasses.dataclass(frozen=True)
class _Domain:
    """One model-parallel rank's buckets (Megatron's dp_group_idx_<tp rank + tp · pp rank>)."""

    tp_rank: int
    pp_rank: int
    bucket_key: dict[int, str]  # bucket index → its key without the state's name
    bucket_numels: list[int]  # per_bucket_numel_unpadded


LEGACY = "distrib_optim.pt"
"""`MegatronOptimizer.sharding` of a legacy checkpoint's distributed-optimizer state."""


class MegatronOptimizer:
    """The optimizer state of a Megatron torch_dist or legacy checkpoint (see the module docstring)."""

    def __init__(self, ckpt: MegatronCheckpoint | LegacyCheckpoint):
        self.ckpt = ckpt
        keys = set(ckpt.optimizer_keys)
        if not keys:
            raise MlmError(
                f"{ckpt.path}: the checkpoint holds no optimizer state (saved with --no-save-optim?)"
            )
        if isinstance(ckpt, LegacyCheckpoint):
            self.sharding = LEGACY
            groups = self._init_legacy()
        elif any(k.startswith("optimizer.state.") for k in keys):
            self.sharding = "per_parameter"
            groups = _param_groups(ckpt.common().get("optimizer"))
            names = {k.split(".")[2] for k in keys}
            self._main = "fp32_param" if "fp32_param" in names else "param"
            lacking = [
                f"optimizer.state.{m}.{k}" for k in ckpt.tensors for m in (*MOMENTS, self._main)
                if f"optimizer.state.{m}.{k}" not in keys
            ]  # fmt: skip
            if lacking:
                raise MlmError(
                    f"{ckpt.path}: the optimizer state lacks {lacking[0]} (Adam's state per parameter)"
                )
        elif any(k.startswith("optimizer.distributed.") for k in keys):
            self.sharding = "dp_reshardable"
            entry = read_object(ckpt, "optimizer.distributed.dp_group_idx_0.optimizer/shard_0_1")
            groups = (entry or {}).get("param_groups")
            self._init_buckets(keys)
        else:
            raise MlmError(f"{ckpt.path}: optimizer state {sorted(keys)[0]} is in a layout mlm does not read")
        if not groups or any(g.get("step") != groups[0].get("step") for g in groups):
            raise MlmError(
                f"{ckpt.path}: Adam's param_groups with one 'step' not found (chained or non-Adam optimizers "
                "are not read)"
            )
        self.param_groups: list[dict] = groups
        self.step = int(groups[0]["step"])

    def _init_buckets(self, keys: set[str]) -> None:
        """The buckets of every model-parallel domain (`self.domains`), and their layout
        (`self.layout`, `self.spec`) reconstructed and checked against the weights."""
        found = [(m, k) for k in keys if (m := _BUCKET.fullmatch(k))]
        if {m.group(2) for m, _ in found} != {"0"}:
            self._refuse("several gradient buffers (MoE expert buffers or several dtypes)")
        self._parallel()
        domains = sorted({int(m.group(1)) for m, _ in found})
        if domains != list(range(self.tp * self.pp)):
            self._refuse(
                f"dp groups {domains}, where the args' tensor_model_parallel_size={self.tp} and "
                f"pipeline_model_parallel_size={self.pp} give one per model-parallel rank 0 … {self.tp * self.pp - 1}"
            )
        self.domains = [self._domain(d, [(m, k) for m, k in found if int(m.group(1)) == d]) for d in domains]
        self.layout, self.spec = self._match_layout()

    def _parallel(self) -> dict:
        """The checkpoint's args (a dict): `self.tp`, `self.pp` and the tp rules `self.rules` from them;
        refused where the layers are not split evenly over pp, or the gating needed at tp > 1 is unknown."""
        args = saved_args(self.ckpt.common())
        self.tp, self.pp = (args.get(f"{n}_model_parallel_size") or 1 for n in ("tensor", "pipeline"))
        uneven = [n for n in _UNEVEN_PIPELINE if args.get(n)]
        if uneven:
            self._refuse(
                f"args.{uneven[0]}={args[uneven[0]]} (only an even split of the layers over pp is decoded)"
            )
        gated = args.get("swiglu")
        if gated is None and self.tp > 1:
            self._refuse("args without `swiglu` at tp > 1 (needed to join linear_fc1's tp shards)")
        self.rules = {key: tp_rule(key, bool(gated)) for key in self.ckpt.tensors}
        return args

    def _init_legacy(self) -> list[dict] | None:
        """The buckets of every model-parallel rank's `distrib_optim.pt` (`self.domains`, one
        coalesced bucket each, the flat states in `self._legacy`) and their layout, as for
        dp_reshardable; returns the param groups of `model_optim_rng.pt`'s `optimizer` entry."""
        ckpt = self.ckpt
        args = self._parallel()
        if (args.get("expert_model_parallel_size") or 1) > 1:
            self._refuse(f"args.expert_model_parallel_size={args['expert_model_parallel_size']}")
        ranks = [(t, p) for p in range(self.pp) for t in range(self.tp)]  # dp group index t + tp · p
        folders = {rank: ckpt.rank_folder(*rank) for rank in ranks}
        held = [rank for rank in ranks if (folders[rank] / LEGACY).is_file()]
        if not held:  # the non-distributed optimizer: its state is in model_optim_rng.pt
            raise MlmError(
                f"{ckpt.path}: the legacy layout's optimizer state without {LEGACY} (the non-distributed "
                f"optimizer's, {ckpt.optimizer_keys[0]}, …) is not imported: pass --weights-only to import the "
                f"weights (a new run), or {_REWRITE}"
            )
        if held != ranks:
            lacking = next(r for r in ranks if r not in held)
            raise MlmError(
                f"{folders[lacking] / LEGACY} is missing (the other rank folders hold theirs); copy the whole "
                "iteration folder as Megatron-LM wrote it, or pass --weights-only"
            )
        self._legacy, self.domains = [], []
        for t, p in ranks:
            flat = self._legacy_buffer(folders[t, p] / LEGACY)
            self._legacy.append(flat)
            self.domains.append(_Domain(t, p, {0: str(folders[t, p] / LEGACY)}, [flat["numel_unpadded"]]))
        self.layout, self.spec = self._match_layout()
        return _param_groups(ckpt.rank_state(0, 0).get("optimizer"))

    def _legacy_buffer(self, path) -> dict:
        """{"param", "exp_avg", "exp_avg_sq": flat fp32 tensor, "numel_unpadded": n} of the one
        coalesced gradient buffer of `distrib_optim.pt` at `path` (memory-mapped)."""
        state = load_megatron_pickle(path, mmap=True)
        buffers = (
            {k: v for k, v in state.items() if k != "buckets_coalesced"} if isinstance(state, dict) else {}
        )
        if not isinstance(state, dict) or state.get("buckets_coalesced") is not True:
            self._refuse("buckets not coalesced (an older Megatron-LM's file)", path)
        if list(buffers) != [0] or not isinstance(buffers[0], dict) or len(buffers[0]) != 1:
            self._refuse(f"gradient buffers {list(buffers)} (one, of one dtype, is decoded)", path)
        flat = next(iter(buffers[0].values()))
        n = flat.get("numel_unpadded") if isinstance(flat, dict) else None
        for what in ("param", *MOMENTS):
            t = flat.get(what) if isinstance(n, int) else None
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != (n,) or t.dtype != torch.float32:
                self._refuse(f"{what} {getattr(t, 'shape', t)} where numel_unpadded is {n}", path)
        return flat

    def _refuse(self, why: str, where=None) -> None:
        what = f"the legacy {LEGACY}" if self.sharding == LEGACY else "dp_reshardable optimizer state"
        raise MlmError(f"{where or self.ckpt.path}: {what} with {why} is not decoded; {self._way_out()}")

    def _way_out(self) -> str:
        if self.sharding == LEGACY:
            return f"{_REWRITE}, or import the weights only (--weights-only)"
        return "save the run with --dist-ckpt-optim-fully-reshardable, or import the weights only (--weights-only)"

    def _domain(self, index: int, found: list) -> _Domain:
        """Model-parallel domain `index` (dp_group_idx: tp rank + tp · pp rank, its rank in Megatron's
        tp-pp group): its buckets' keys and saved unpadded lengths, checked against the tensors."""
        prefix = f"optimizer.distributed.dp_group_idx_{index}"
        bucket_key = {int(m.group(4)): k.rsplit(".", 1)[0] for m, k in found}
        numels = read_object(self.ckpt, f"{prefix}.per_bucket_numel_unpadded/shard_0_1")
        per_dtype = numels[0] if isinstance(numels, list) and len(numels) == 1 else {}
        bucket_numels = next(iter(per_dtype.values())) if len(per_dtype) == 1 else None
        if bucket_numels is None or len(bucket_numels) != len(bucket_key):
            raise MlmError(
                f"{self.ckpt.path}: {prefix}.per_bucket_numel_unpadded {numels} does not describe one buffer's "
                "buckets"
            )
        for b, n in enumerate(bucket_numels):
            for what in ("param", *MOMENTS):
                key = f"{bucket_key.get(b)}.{what}"
                meta = self.ckpt.optimizer_meta.get(key)
                if meta is None or tuple(meta.size) != (n,):
                    raise MlmError(
                        f"{self.ckpt.path}: {key} is {'absent' if meta is None else list(meta.size)}; "
                        f"per_bucket_numel_unpadded gives bucket {b} {n} elements"
                    )
        return _Domain(index % self.tp, index // self.tp, bucket_key, bucket_numels)

    def _local_shape(self, key: str, layer: int | None) -> tuple[int, ...]:
        """The shape of one tp rank's shard of `key` (of its layer `layer` if stacked; the tied
        embedding's for the last stage's copy `_TIED_COPY`)."""
        key = _EMBEDDING[0] if (key, layer) == _TIED_COPY and key not in self.ckpt.tensors else key
        shape = list(self.ckpt.shape(key)[int(layer is not None) :])
        dim = tp_dim(self.rules[key])
        if dim is not None:
            if shape[dim] % self.tp:
                raise MlmError(f"{self.ckpt.path}: {key} {shape} does not split over tp {self.tp}")
            shape[dim] //= self.tp
        return tuple(shape)

    def _stage_layers(self) -> list[range]:
        """Each pipeline stage's global layer numbers (an even split)."""
        n = len(layer_keys(self.ckpt))
        if n % self.pp:
            self._refuse(f"{n} layers over pp {self.pp} (not an even split)")
        return [range(p * n // self.pp, (p + 1) * n // self.pp) for p in range(self.pp)]

    def _decode(self, spec: str) -> dict[tuple[str, int | None], list[tuple[int, int, int, tuple]]]:
        """Under `spec`'s parameter order: (key, layer) → per tp rank (domain, bucket, offset, local shape)."""
        stages, layout = self._stage_layers(), {}
        for d, dom in enumerate(self.domains):
            last = dom.pp_rank == self.pp - 1
            order = parameter_order(self.ckpt, spec, stages[dom.pp_rank], dom.pp_rank == 0, last)
            copy = last and self.pp > 1 and _TIED_COPY[0] not in self.ckpt.tensors  # a tied embedding's
            try:
                placed = decode_buckets(order + [_TIED_COPY] * copy, self._local_shape, dom.bucket_numels)
            except MlmError as e:
                raise MlmError(f"dp group {d} (tp rank {dom.tp_rank}, pp rank {dom.pp_rank}): {e}") from None
            if copy:  # its state is the first stage's embedding's (same gradients)
                del placed[_TIED_COPY]
            for param, (bucket, offset) in placed.items():
                shard = (d, bucket, offset, self._local_shape(*param))
                layout.setdefault(param, [None] * self.tp)[dom.tp_rank] = shard
        return layout

    def _match_layout(self) -> tuple[dict, str]:
        """(layout, spec) of the parameter order whose decoded main params (their tp shards joined)
        equal the weights (cast to the weights' dtype), reading one weight at a time: MlmError if no
        order does."""
        ckpt, reasons, layouts = self.ckpt, [], {}
        for spec in _LAYER_ORDERS:
            try:
                layouts[spec] = self._decode(spec)
            except MlmError as e:
                reasons.append(f"{spec} order: {e}")
        mains = self._buckets("param") if layouts else []
        for key in ckpt.tensors:
            if not layouts:
                break
            weight = ckpt.read(key)
            for spec, layout in list(layouts.items()):
                for (k, layer), shards in layout.items():
                    want = weight if layer is None else weight[layer]
                    if k == key and not torch.equal(self._joined(mains, key, shards).to(want.dtype), want):
                        reasons.append(
                            f"{spec} order: the decoded main param of {key} differs from the weight"
                        )
                        del layouts[spec]
                        break
        if layouts:
            spec = next(iter(layouts))
            return layouts[spec], spec
        raise MlmError(
            f"{ckpt.path}: the {self.sharding} bucket layout was not reconstructed ({'; '.join(reasons)}); "
            f"{self._way_out()}"
        )

    def _buckets(self, what: str) -> list[dict[int, torch.Tensor]]:
        """State `what` of every domain's buckets, whole: [domain][bucket]."""
        if self.sharding == LEGACY:
            return [{0: flat[what]} for flat in self._legacy]
        return [{b: self.ckpt.read(f"{k}.{what}") for b, k in dom.bucket_key.items()} for dom in self.domains]

    def _joined(self, flat: list[dict[int, torch.Tensor]], key: str, shards: list) -> torch.Tensor:
        """The tensor whose tp shards lie at `shards` [(domain, bucket, offset, shape) per tp rank]
        of the buckets `flat`, joined by `key`'s tp rule (`legacy.tp_rule`)."""
        parts = [flat[d][b][o : o + torch.Size(shape).numel()].view(shape) for d, b, o, shape in shards]
        return join_tp(parts, self.rules[key])

    def view(self, what: str) -> _StateView:
        """The state `what` (exp_avg, exp_avg_sq, or "main" for the fp32 main params) per model key,
        as a checkpoint-like object for `names.mlm_tensors`."""
        return _StateView(self, what)


class _StateView:
    """`.path`, `.tensors` (the model's keys) and `.read(key)`: one optimizer state per model key.
    A dp_reshardable state's buckets are read on the first `read` and kept until every key has been read."""

    def __init__(self, opt: MegatronOptimizer, what: str):
        self.path, self.tensors, self._opt, self._what = opt.ckpt.path, opt.ckpt.tensors, opt, what
        self._flat: list[dict[int, torch.Tensor]] | None = None
        self._unread = set(self.tensors)  # the buckets are dropped once every key has been read

    def read(self, key: str) -> torch.Tensor:
        opt = self._opt
        if opt.sharding == "per_parameter":
            return opt.ckpt.read(f"optimizer.state.{opt._main if self._what == 'main' else self._what}.{key}")
        if self._flat is None:
            self._flat = opt._buckets("param" if self._what == "main" else self._what)
        parts = sorted((p[1] or 0, shards) for p, shards in opt.layout.items() if p[0] == key)
        joined = [opt._joined(self._flat, key, shards) for _, shards in parts]
        stacked = key.startswith("decoder.layers.") and split_key(key)[0] is None  # layers on axis 0
        out = torch.stack(joined) if stacked else joined[0]  # join_tp copies
        self._unread.discard(key)
        if not self._unread:
            self._flat = None
        return out


def resumed_run(opt: MegatronOptimizer, config: Config, common: dict) -> tuple[Config, int, dict, list[str]]:
    """(the run config with the settings `run_settings` carries, the iteration, the manifest fields a
    resumable mlm checkpoint holds — consumed_samples, optimizer_step, scheduler, source additions —,
    notes) for continuing the Megatron-LM run whose optimizer `opt` is."""
    args = saved_args(common)
    iteration, consumed = common.get("iteration"), args.get("consumed_train_samples")
    if not isinstance(iteration, int) or not isinstance(consumed, int):
        raise MlmError(
            f"{opt.ckpt.path}: common.pt lacks Megatron-LM's iteration or args.consumed_train_samples "
            f"(iteration={iteration!r}, consumed_train_samples={consumed!r}), which a resumed run needs; "
            "import the weights only (--weights-only)"
        )
    group = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
    betas = group.get("betas") or (None, None)
    from_group = {  # Adam's own settings, where the args (e.g. a trimmed Namespace) lack them
        "lr": group.get("max_lr"), "min_lr": group.get("min_lr"), "adam_beta1": betas[0],
        "adam_beta2": betas[1], "adam_eps": group.get("eps"), "weight_decay": group.get("weight_decay"),
    }  # fmt: skip
    settings, notes = run_settings({**{k: v for k, v in from_group.items() if v is not None}, **args})
    sections = {}
    for dotted, value in settings.items():
        section, field = dotted.split(".")
        sections.setdefault(section, {})[field] = value
    config = dataclasses.replace(
        config, **{s: dataclasses.replace(getattr(config, s), **f) for s, f in sections.items()}
    )
    extra = {
        "consumed_samples": consumed,
        "optimizer_step": opt.step,
        "scheduler": {"total_iters": config.train.train_iters, "decay_style": config.optimizer.decay_style},
        **dict.fromkeys(("loss_scaler", "rng", "rng_per_stage", "faults")),
        "source": {
            "megatron_optimizer": {"sharding": opt.sharding, "param_group": _json_safe(group)},
            "opt_param_scheduler": _json_safe(common.get("opt_param_scheduler")),
            "run_settings": settings,
        },
    }
    notes.append(
        f"optimizer state carried ({opt.sharding}): Adam step {opt.step}, iteration {iteration}, "
        f"{consumed} samples consumed; not carried: RNG states (train.seed's), the fp16 loss scale"
    )
    return config, iteration, extra, notes


def _json_safe(value):
    """`value` with what JSON cannot hold (e.g. torch dtypes) as its repr."""
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value if value is None or isinstance(value, bool | int | float | str) else repr(value)
