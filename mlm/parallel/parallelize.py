"""Apply tensor (and sequence) parallelism to a plain model from outside, following the
`tp_plan` that each of its module classes declares (styles: `mlm.model.layers`).

    with torch.device("meta"):
        model = GPT(cfg, padded_vocab=cfg.padded_vocab_size(mesh.tp))
    parallelize(model, mesh, sequence_parallel)   # swap layers for their shards; nothing allocated
    model.to_empty(device=device)
    model.init_weights(seed)                      # every rank: its slice of the one-process init
    ...
    loss = model.head_loss(model.hidden_states(x_BT), y_BT)   # vocabulary-parallel loss
    loss.backward()
    allreduce_sequence_parallel_grads(model, mesh)  # norms saw one sequence shard each

Nothing here knows the model's class or attribute names: every module with a `tp_plan` gets,
per entry, its `nn.Linear` / `nn.Embedding` swapped for the parallel layer of the style holding
only its shard ("column", "row", "vocab"; a materialised model gives each its slice of the
weights), its input or a placeholder turned into the entry into the tp region ("enter": once
per module input, as Megatron's fused QKV enters once for q, k and v), the sequence split under
sequence parallelism ("scatter_sequence": one reduce-scatter that also sums the
vocabulary-parallel embedding's partial results), its in-region randomness forked per tp rank
("tp_rng"), its loss made vocabulary-parallel ("vocab_loss" from the logits, "vocab_linear_loss"
from the hidden states and the output weight's shard, chunked), its statistics reduced over the
sequence shards ("sp_group"). Every parameter left replicated gets a placement whose gradient is
summed over tp under sequence parallelism; "head_shared" ones (applied to each rank's heads)
always. A "full_sequence" module (learned positions, fed the whole sequence before the split)
adds its output on tp rank 0 only under sequence parallelism, where it joins the embedding's
partial results before their reduce-scatter (its gradient, all on rank 0, is summed over tp
like the others').
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from mlm.checkpoint import ShardedTensor
from mlm.errors import MlmError
from mlm.model.layers import TP_INPUT
from mlm.parallel.cross_entropy import linear_cross_entropy, vocab_parallel_loss
from mlm.parallel.mesh import Mesh, check_tensor_parallel
from mlm.parallel.placement import Placement, placements, replicated, sharded
from mlm.parallel.tensor import (
    ColumnParallelLinear,
    CopyToTP,
    GatherFromSP,
    ReduceScatterToSP,
    RowParallelLinear,
    TensorParallelRNG,
    VocabParallelEmbedding,
)

SHARDED = ("column", "row", "vocab")
STYLES = (
    *SHARDED,
    "channels",
    "replicated",
    "full_sequence",
    "head_shared",
    "sp_group",
    "enter",
    "scatter_sequence",
    "tp_rng",
    "vocab_loss",
    "vocab_linear_loss",
)


def _plans(model: nn.Module):
    """(module name, module, attribute, style) for every entry of every `tp_plan` in `model`."""
    for name, module in list(model.named_modules()):
        for attr, style in getattr(type(module), "tp_plan", {}).items():
            if style not in STYLES:
                raise MlmError(f"{type(module).__name__}.tp_plan[{attr!r}] = {style!r}: not one of {STYLES}")
            yield name, module, attr, style


def tp_split_dims(model: nn.Module) -> dict[str, int | None]:
    """Parameter name → the dim tensor parallelism splits it along (column-parallel weights and
    biases and vocabulary-parallel embeddings by rows, row-parallel weights by columns), or None
    when it is replicated; read from the plans of a (meta) model, whatever tp."""
    dims = {name: None for name, _ in model.named_parameters()}
    for name, module, attr, style in _plans(model):
        child = getattr(module, attr, None)
        if style == "channels" and child is not None:
            dims[f"{name}.{attr}" if name else attr] = 0
            continue
        if style not in SHARDED or child is None:
            continue
        for kind, _ in child.named_parameters():
            key = f"{name}.{attr}.{kind}" if name else f"{attr}.{kind}"
            dims[key] = 1 if style == "row" and kind == "weight" else (None if style == "row" else 0)
    return dims


def _parallel_layer(module: nn.Module, style: str, mesh: Mesh, sequence_parallel: bool) -> nn.Module:
    """The parallel layer of `style` for `module`, on its device, holding its slice if it has weights."""
    w = module.weight
    kw = dict(device=w.device, dtype=w.dtype)
    if style == "vocab":
        assert isinstance(module, nn.Embedding), module
        new = VocabParallelEmbedding(
            module.num_embeddings, module.embedding_dim, mesh, sequence_parallel, **kw
        )
    else:
        assert isinstance(module, nn.Linear), module
        bias = module.bias is not None
        if style == "column":  # the region is entered once per input (pre-hooks, "enter")
            new = ColumnParallelLinear(
                module.in_features,
                module.out_features,
                bias,
                mesh,
                sequence_parallel,
                enter_region=False,
                **kw,
            )
        else:
            new = RowParallelLinear(
                module.in_features, module.out_features, bias, mesh, sequence_parallel, **kw
            )
    if w.device.type != "meta":
        with torch.no_grad():
            for name, p in new.named_parameters():
                p.copy_(new.placements[name].slice_of(getattr(module, name)))
    return new


def _shard_channels(module: nn.Module, attr: str, p: nn.Parameter, mesh: Mesh) -> None:
    """Keep this rank's 1/tp of parameter `module.attr` along dim 0 (per-channel or per-head
    parameters of a module computing on its own channels: a depthwise convolution's, a
    recurrence's decay), with its placement; a materialised parameter keeps its slice's values."""
    assert isinstance(p, nn.Parameter), f"{type(module).__name__}.{attr}: 'channels' shards a parameter"
    place = sharded(mesh, tuple(p.shape), 0)
    local = torch.empty(place.shape, device=p.device, dtype=p.dtype)
    if p.device.type != "meta":
        with torch.no_grad():
            local.copy_(place.slice_of(p))
    setattr(module, attr, nn.Parameter(local, requires_grad=p.requires_grad))
    module.__dict__.setdefault("placements", {})[attr] = place


def _enter_tp_hook(module: nn.Module, args: tuple) -> tuple:
    """Forward pre-hook: the module's first input enters the tp region through `module.enter_tp`."""
    assert args, f"{type(module).__name__} must get its input positionally"
    return (module.enter_tp(args[0]), *args[1:])


def parallelize(model: nn.Module, mesh: Mesh, sequence_parallel: bool = False) -> nn.Module:
    """Apply tensor parallelism over `mesh.tp` (and sequence parallelism if asked) to `model`, in
    place, following its modules' `tp_plan`s; return it. At tp = 1 the model is returned
    untouched. All checks run before any change."""
    if mesh.tp == 1:
        return model
    if any(isinstance(m, VocabParallelEmbedding | ColumnParallelLinear) for m in model.modules()):
        raise MlmError("the model is already tensor-parallel: call parallelize once per model")
    check_tensor_parallel(model.cfg, model.padded_vocab, mesh.tp)
    plans = list(_plans(model))

    enter = GatherFromSP if sequence_parallel else CopyToTP
    rng = TensorParallelRNG(mesh)
    head_shared: set[int] = set()
    for _, module, attr, style in plans:
        if attr == TP_INPUT:
            assert style == "enter", f"{type(module).__name__}: its input can only 'enter' the tp region"
            module.enter_tp = enter(mesh)
            module.register_forward_pre_hook(_enter_tp_hook)
            continue
        if style == "sp_group":
            if sequence_parallel:
                setattr(module, attr, mesh.tp_group)
            continue
        child = getattr(module, attr, None)
        if child is None:  # absent on this pipeline stage, or not in this configuration
            continue
        if style in SHARDED:
            setattr(module, attr, _parallel_layer(child, style, mesh, sequence_parallel))
        elif style == "channels":
            _shard_channels(module, attr, child, mesh)
        elif style == "enter":
            setattr(module, attr, enter(mesh))
        elif style == "scatter_sequence" and sequence_parallel:
            setattr(module, attr, ReduceScatterToSP(mesh))
            module.sequence_shards = mesh.tp  # pipeline stages pass [B, T/tp, D] shards
        elif style == "tp_rng":
            setattr(module, attr, rng.fork)
        elif style == "vocab_loss":
            setattr(module, attr, functools.partial(vocab_parallel_loss, mesh=mesh))
        elif style == "vocab_linear_loss":
            setattr(module, attr, functools.partial(linear_cross_entropy, mesh=mesh))
        elif style == "full_sequence" and sequence_parallel and mesh.tp_rank > 0:
            child.register_forward_hook(_contribute_nothing)
        elif style == "head_shared":
            head_shared.update(id(p) for p in child.parameters())

    # Replicated parameters: under sequence parallelism each tp rank computes their gradient from
    # its sequence shard (a full-sequence module: rank 0 all of it), so it is summed over tp; those
    # applied to each rank's own heads always are.
    for module in model.modules():
        for local, p in module.named_parameters(recurse=False):
            described = module.__dict__.setdefault("placements", {})
            if local not in described:
                grad_sum = sequence_parallel or id(p) in head_shared
                described[local] = replicated(mesh, tuple(p.shape), grad_sum_tp=grad_sum)
    model.tp_rng = rng
    return model


def _contribute_nothing(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    """Forward hook: zeros instead of the module's output (a full-sequence module on tp ranks > 0
    under sequence parallelism: rank 0's output alone joins the embedding's partial sums), still
    in the graph so that its parameters get a (zero) gradient to sum over tp."""
    return output * 0.0


def allreduce_sequence_parallel_grads(
    model: nn.Module, mesh: Mesh, places: dict[str, Placement] | None = None, grad_of=None
) -> None:
    """Sum over tp the gradients of the replicated parameters inside the sequence-parallel region
    (placements with `grad_sum_tp`: norms, row-parallel biases), which each tp rank computed from
    its sequence shard; call after backward, before clipping and the optimizer step (it commutes
    with the data-parallel reduction). `places`: the model's placements, if the caller keeps them.
    A no-op at tp = 1 and without sequence parallelism. `grad_of`: parameter → its fp32 gradient
    (`GradBucketSet.grad_of`, which bf16 parameters need; default `.grad`)."""
    if mesh.tp == 1:
        return
    places = places or placements(model, mesh)
    grad_of = grad_of or (lambda p: p.grad)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for name, p in model.named_parameters():
        if places[name].grad_sum_tp and (g := grad_of(p)) is not None:
            by_dtype.setdefault(g.dtype, []).append(g)
    for grads in by_dtype.values():
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=mesh.tp_group)
        for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
            g.copy_(reduced)


def model_shards(model: nn.Module, mesh: Mesh) -> list[ShardedTensor]:
    """Every parameter as this rank's slice of its global checkpoint tensor, written by its replica
    0 (`mlm.parallel.placement`), loaded into in place by `load_checkpoint`. Rows named in the
    model's `padded_rows` (the vocabulary, padded per tp) load from a checkpoint of another tp."""
    places = placements(model, mesh)
    padded = getattr(model, "padded_rows", ())
    return [
        ShardedTensor(
            name,
            p.data,
            places[name].global_shape,
            places[name].offset,
            writer=places[name].writer,
            padded_rows=name in padded,
        )
        for name, p in model.named_parameters()
    ]
