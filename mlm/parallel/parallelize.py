"""Apply tensor (and sequence) parallelism to a plain GPT from outside, following its `TP_PLAN`.

    with torch.device("meta"):
        model = GPT(cfg, padded_vocab=cfg.padded_vocab_size(mesh.tp))
    parallelize(model, mesh, sequence_parallel)   # swap layers for their shards; nothing allocated
    model.to_empty(device=device)
    model.init_weights(seed)                      # every rank: its slice of the one-process init
    ...
    loss = vocab_parallel_cross_entropy(model(x_BT), y_BT, mesh, cfg.vocab_size).mean()
    loss.backward()
    allreduce_sequence_parallel_grads(model, mesh)  # norms saw one sequence shard each

What changes, in order: every `nn.Linear` / `nn.Embedding` named in `TP_PLAN` becomes the parallel
layer holding only its shard (a materialised model gives each its slice of the weights); the
attention and MLP inputs enter the tp region once each (q/k/v and gate/up share it, as Megatron's
fused QKV does), by a forward pre-hook calling the `enter_tp` module put beside them; attention
dropout draws from a per-tp-rank stream (`TensorParallelRNG`); `enter_output` enters the tp region
so that the (tied or untied) output projection yields vocabulary-sharded logits [B, T, V/tp]; under
sequence parallelism `enter_layers` scatters the sequence, and norms, residuals and hidden dropout
run on [B, T/tp, D] shards.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from mlm.checkpoint import ShardedTensor
from mlm.config import ModelConfig, ParallelConfig
from mlm.errors import MlmError
from mlm.model.gpt import GPT, TP_PLAN, VOCAB_ROWS
from mlm.parallel.mesh import Mesh, check_tensor_parallel
from mlm.parallel.pipeline import split_for_pipeline, tied_output_copy
from mlm.parallel.tensor import (
    ColumnParallelLinear,
    CopyToTP,
    GatherFromSP,
    RowParallelLinear,
    ScatterToSP,
    TensorParallelRNG,
    VocabParallelEmbedding,
    local_slice,
)


def _style(name: str) -> str | None:
    """The TP_PLAN style of module `name` ("layers.3.attn.q" → "column"), or None."""
    for key, style in TP_PLAN.items():
        if name == key or name.endswith("." + key):
            return style
    return None


def tp_split_dim(name: str) -> int | None:
    """The dim along which tensor parallelism splits parameter `name` ("layers.0.attn.q.weight" → 0,
    "layers.0.attn.out.weight" → 1), or None when it is replicated: column-parallel weights and
    biases and the vocabulary-parallel embedding by rows, row-parallel weights by columns."""
    module, _, kind = name.rpartition(".")
    style = _style(module)
    if style in ("column", "vocab"):
        return 0
    if style == "row" and kind == "weight":
        return 1
    return None


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
        if style == "column":  # the region is entered once per input (pre-hooks, enter_output)
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
            assert style == "row", style
            new = RowParallelLinear(
                module.in_features, module.out_features, bias, mesh, sequence_parallel, **kw
            )
    if w.device.type != "meta":
        with torch.no_grad():
            for name, p in new.named_parameters():
                p.copy_(local_slice(getattr(module, name), p))
    return new


def _enter_tp_hook(module: nn.Module, args: tuple) -> tuple:
    """Forward pre-hook: the module's first input enters the tp region through `module.enter_tp`."""
    assert args, f"{type(module).__name__} must get its input positionally"
    return (module.enter_tp(args[0]), *args[1:])


def parallelize(model: GPT, mesh: Mesh, sequence_parallel: bool = False) -> GPT:
    """Apply tensor parallelism over `mesh.tp` (and sequence parallelism if asked) to `model`, in
    place; return it. At tp = 1 the model is returned untouched. All checks run before any change."""
    if mesh.tp == 1:
        return model
    if any(isinstance(m, VocabParallelEmbedding | ColumnParallelLinear) for m in model.modules()):
        raise MlmError("the model is already tensor-parallel: call parallelize once per model")
    check_tensor_parallel(model.cfg, model.padded_vocab, mesh.tp)

    # 1. Swap the layers of TP_PLAN for their shards (names and parameter order unchanged).
    for name, module in list(model.named_modules()):
        style = _style(name)
        if style is not None:
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            setattr(parent, attr, _parallel_layer(module, style, mesh, sequence_parallel))

    # 2. Enter the tp region once per attention / MLP input; per-rank attention dropout.
    enter = GatherFromSP if sequence_parallel else CopyToTP
    rng = TensorParallelRNG(mesh)
    for block in model.layers.values():
        for sub in (block.attn, block.mlp):
            sub.enter_tp = enter(mesh)
            sub.register_forward_pre_hook(_enter_tp_hook)
        block.attn.rng_region = rng.fork  # read by Attention.core around the attention dropout
    model.tp_rng = rng

    # 3. Output projection on vocabulary shards; under SP the layers run on sequence shards.
    model.enter_output = enter(mesh)
    if sequence_parallel:
        model.enter_layers = ScatterToSP(mesh)
        model.sequence_shards = mesh.tp  # pipeline stages pass [B, T/tp, D] shards
        for p in sequence_parallel_params(model):
            p.sequence_parallel = True
    return model


def build_sharded(
    cfg: ModelConfig,
    parallel: ParallelConfig,
    mesh: Mesh,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
) -> GPT:
    """This rank's part of the plain GPT, allocated on `device` in `dtype` but not initialised:
    built on meta, cut to its pipeline stage, parallelized, then materialised (only the local
    shards take memory). Fill it with `init_weights` (training) or `load_checkpoint` of
    `model_shards` (resuming, serving)."""
    with torch.device("meta"):
        model = GPT(cfg, padded_vocab=cfg.padded_vocab_size(mesh.tp)).to(dtype)
    split_for_pipeline(model, mesh, parallel)
    parallelize(model, mesh, parallel.sequence_parallel)
    return model.to_empty(device=device)


def sequence_parallel_params(model: GPT) -> list[nn.Parameter]:
    """Replicated parameters inside the sequence-parallel region (norms; row-parallel biases), whose
    gradients each tp rank computes from its sequence shard only. Found by place, not by tag, since
    `to_empty` drops tags set on the meta model. Empty unless `enter_layers` scatters the sequence."""
    if not isinstance(model.enter_layers, ScatterToSP):
        return []
    region = [m for m in (model.layers, model.final_norm) if m is not None]
    return [p for m in region for p in m.parameters() if not getattr(p, "tensor_parallel", False)]


def allreduce_sequence_parallel_grads(model: nn.Module, mesh: Mesh) -> None:
    """Sum over tp the gradients of the replicated parameters in the sequence-parallel region (call
    after backward, before clipping and the optimizer step; it commutes with the data-parallel
    reduction). Works on a GPT (every such parameter) or on any module (those tagged
    `sequence_parallel`). A no-op at tp = 1 and without sequence parallelism."""
    if mesh.tp == 1:
        return
    if isinstance(model, GPT):
        params = sequence_parallel_params(model)
    else:
        params = [p for p in model.parameters() if getattr(p, "sequence_parallel", False)]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        p.sequence_parallel = True
        if p.grad is not None:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=mesh.tp_group)
        for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
            g.copy_(reduced)


def param_layout(model: nn.Module, mesh: Mesh) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], bool]]:
    """name → (global_shape, global_offset, writer) of every parameter, for `ShardedTensor`s.

    Sharded parameters: their slice, written by their rank. Replicated ones: the whole tensor,
    written only by tp rank 0 (replicas over dp are the checkpoint code's to exclude). A tied
    embedding's last-stage copy is never written (its first stage writes it)."""
    copy = tied_output_copy(model) if isinstance(model, GPT) else None
    layout = {}
    for name, p in model.named_parameters():
        if getattr(p, "tensor_parallel", False):
            layout[name] = (tuple(p.global_shape), tuple(p.global_offset), p is not copy)
        else:
            layout[name] = (tuple(p.shape), (0,) * p.ndim, mesh.tp_rank == 0 and p is not copy)
    return layout


def model_shards(model: nn.Module, mesh: Mesh) -> list[ShardedTensor]:
    """Every parameter as this rank's slice of its global checkpoint tensor (see `param_layout`;
    written by dp rank 0 only), loaded into in place by `load_checkpoint`. The vocabulary rows are
    padded per tp, so a checkpoint saved under another tp loads too."""
    layout = param_layout(model, mesh)
    return [
        ShardedTensor(
            name,
            p.data,
            layout[name][0],
            layout[name][1],
            layout[name][2] and mesh.dp_rank == 0,
            padded_rows=name in VOCAB_ROWS,
        )
        for name, p in model.named_parameters()
    ]
