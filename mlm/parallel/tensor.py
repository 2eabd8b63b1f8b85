"""Megatron-style tensor- and sequence-parallel layers over torch.distributed collectives.

Tensor parallelism splits each linear layer over the `tp` ranks of `mesh.tp_group`: a column-parallel
layer holds a slice of the output features, a row-parallel layer a slice of the input features, so a
column layer followed by a row layer needs one all-reduce forward and one backward (Megatron-LM,
Shoeybi et al. 2019). Sequence parallelism (Korthikanti et al. 2022) also splits the activations
outside that region (norms, dropout, residuals) along the sequence: the all-reduce becomes a
reduce-scatter followed by an all-gather, moving the same bytes while each rank stores 1/tp of them.

Each region boundary is a small autograd function whose forward and backward are a pair of
collectives (table below); at tp = 1 every one of them is the identity. mlm is batch-first, so the
sequence dim is 1 (Megatron's is 0); collectives run on dim-0-contiguous buffers.

    function              forward              backward
    copy_to_tp            identity             all-reduce
    reduce_from_tp        all-reduce           identity
    gather_from_tp        all-gather last dim  split last dim
    scatter_to_tp         split last dim       all-gather last dim
    gather_from_sp        all-gather T         reduce-scatter T
    reduce_scatter_to_sp  reduce-scatter T     all-gather T

Every layer describes its parameters in `placements` (`mlm.parallel.placement`): global
shape, this rank's slice, the ranks holding the same slice; so `GPT.init_weights` draws only
this rank's slice of the one-process init (`mlm.model.init`), and checkpoints store it in its
global layout.

Shape legend: B batch, T sequence (t: this rank's T / tp), D hidden, v this rank's vocabulary shard.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mlm.errors import MlmError
from mlm.parallel.data_parallel import all_gather, reduce_scatter
from mlm.parallel.mesh import Mesh
from mlm.parallel.placement import Placement, replicated, sharded

# ---------------------------------------------------------------- collectives on one dim


def _all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """All-reduce into a fresh contiguous tensor (never into a tensor the caller may hold)."""
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, op=op, group=group)
    return out


def _all_gather(x: torch.Tensor, dim: int, group, size: int) -> torch.Tensor:
    x0 = x.movedim(dim, 0).contiguous()
    out = x0.new_empty((size * x0.shape[0], *x0.shape[1:]))
    all_gather(out, x0, group)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, group, size: int) -> torch.Tensor:
    x0 = x.movedim(dim, 0).contiguous()
    assert x0.shape[0] % size == 0, f"reduce-scatter of {x0.shape[0]} rows over {size} ranks"
    out = x0.new_empty((x0.shape[0] // size, *x0.shape[1:]))
    reduce_scatter(out, x0, group)
    return out.movedim(0, dim).contiguous()


def _split(x: torch.Tensor, dim: int, size: int, rank: int) -> torch.Tensor:
    n = x.shape[dim]
    assert n % size == 0, f"cannot split {n} along dim {dim} over {size} ranks"
    return x.narrow(dim, rank * (n // size), n // size).contiguous()


_OPS = {
    "identity": lambda x, group, size, rank: x,
    "all_reduce": lambda x, group, size, rank: _all_reduce(x, group),
    "gather_last": lambda x, group, size, rank: _all_gather(x, -1, group, size),
    "split_last": lambda x, group, size, rank: _split(x, -1, size, rank),
    "gather_seq": lambda x, group, size, rank: _all_gather(x, 1, group, size),
    "reduce_scatter_seq": lambda x, group, size, rank: _reduce_scatter(x, 1, group, size),
}


class _Region(torch.autograd.Function):
    """One region boundary: collective `fwd` forward, collective `bwd` on the gradient."""

    @staticmethod
    def forward(ctx, x, fwd: str, bwd: str, group, size: int, rank: int):
        ctx.args = (bwd, group, size, rank)
        return _OPS[fwd](x, group, size, rank)

    @staticmethod
    def backward(ctx, grad):
        bwd, group, size, rank = ctx.args
        return _OPS[bwd](grad, group, size, rank), None, None, None, None, None


def _region(x: torch.Tensor, mesh: Mesh, fwd: str, bwd: str) -> torch.Tensor:
    if mesh.tp == 1:
        return x
    group = mesh.tp_group
    assert group is not None, f"tp={mesh.tp} needs the mesh's tp process group"
    return _Region.apply(x, fwd, bwd, group, mesh.tp, mesh.tp_rank)


def gather_seq_over(x: torch.Tensor, group, size: int) -> torch.Tensor:
    """[B, t, ...] → [B, size·t, ...] over any `group` (ranks in group order); backward:
    reduce-scatter (context parallelism's key/value gather)."""
    if size == 1:
        return x
    return _Region.apply(x, "gather_seq", "reduce_scatter_seq", group, size, dist.get_rank(group))


def copy_to_tp(x: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """Enter the tp region: forward identity, backward all-reduce."""
    return _region(x, mesh, "identity", "all_reduce")


def reduce_from_tp(x: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """Leave the tp region by summing the ranks' partial results: forward all-reduce, backward identity."""
    return _region(x, mesh, "all_reduce", "identity")


def gather_from_tp(x: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """[..., n/tp] → [..., n]: forward all-gather the last dim, backward keep this rank's slice."""
    return _region(x, mesh, "gather_last", "split_last")


def scatter_to_tp(x: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """[..., n] → [..., n/tp]: forward keep this rank's slice of the last dim, backward all-gather."""
    return _region(x, mesh, "split_last", "gather_last")


def gather_from_sp(x_BtD: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """[B, t, D] → [B, T, D]: forward all-gather T, backward reduce-scatter T (the sum over ranks)."""
    return _region(x_BtD, mesh, "gather_seq", "reduce_scatter_seq")


def reduce_scatter_to_sp(x_BTD: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """Partial [B, T, D] → summed [B, t, D]: forward reduce-scatter T, backward all-gather T."""
    return _region(x_BTD, mesh, "reduce_scatter_seq", "gather_seq")


class _RegionModule(nn.Module):
    def __init__(self, mesh: Mesh):
        super().__init__()
        self.mesh = mesh

    def extra_repr(self) -> str:
        return f"tp={self.mesh.tp}"


class CopyToTP(_RegionModule):
    """`copy_to_tp` as a module (for the model's hooks)."""

    def forward(self, x):
        return copy_to_tp(x, self.mesh)


class GatherFromSP(_RegionModule):
    """`gather_from_sp` as a module (for the model's hooks)."""

    def forward(self, x_BtD):
        return gather_from_sp(x_BtD, self.mesh)


class ReduceScatterToSP(_RegionModule):
    """`reduce_scatter_to_sp` as a module: the model's `enter_layers` under sequence parallelism,
    which sums the vocabulary-parallel embedding's partial results and keeps this rank's sequence
    slice in one reduce-scatter (Megatron's, instead of an all-reduce and a split)."""

    def forward(self, x_BTD):
        T, tp = x_BTD.shape[1], self.mesh.tp
        if T % tp:
            raise MlmError(
                f"sequence length {T} is not divisible by parallel.tp={tp}: sequence parallelism "
                f"splits the sequence over the tp ranks; set data.seq_length to a multiple of {tp}"
            )
        return reduce_scatter_to_sp(x_BTD, self.mesh)


# ---------------------------------------------------------------- layers


class _Sharded(nn.Module):
    """Holds parameters described in `self.placements` (local name → Placement)."""

    def __init__(self, mesh: Mesh):
        super().__init__()
        self.mesh = mesh
        self.placements: dict[str, Placement] = {}

    def _param(self, name: str, place: Placement, local_shape, device, dtype) -> None:
        self.register_parameter(name, nn.Parameter(torch.empty(local_shape, device=device, dtype=dtype)))
        self.placements[name] = place

    def _shard(self, name: str, global_shape: tuple[int, ...], dim: int, device, dtype) -> None:
        """Register `name` as this rank's 1/tp slice of `global_shape` along `dim`."""
        place = sharded(self.mesh, tuple(global_shape), dim)
        self._param(name, place, place.shape, device, dtype)


def _check_divisible(layer: str, field: str, n: int, tp: int) -> None:
    if n % tp:
        raise MlmError(f"{layer}: {field}={n} is not divisible by tp={tp}; choose a tp that divides {n}")


class ColumnParallelLinear(_Sharded):
    """y = x Wᵀ + b with W's output rows split over tp: weight [out/tp, in], bias [out/tp].

    The product is `self.linear_op(x, weight, bias)`, `F.linear` unless replaced from outside
    (`mlm.parallel.fp8.apply_fp8`: the fp8 linear).

    The input enters the tp region here (copy_to_tp, or gather_from_sp under sequence
    parallelism) unless `enter_region=False`, where the caller has already entered it once for
    several layers reading the same input (q, k, v); the output stays sharded on the last dim."""

    linear_op = staticmethod(F.linear)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        mesh: Mesh,
        sequence_parallel: bool = False,
        *,
        enter_region: bool = True,
        device=None,
        dtype=None,
    ):
        super().__init__(mesh)
        _check_divisible("ColumnParallelLinear", "out_features", out_features, mesh.tp)
        self.in_features, self.out_features = in_features, out_features
        self.sequence_parallel, self.enter_region = sequence_parallel, enter_region
        self._shard("weight", (out_features, in_features), 0, device, dtype)
        if bias:
            self._shard("bias", (out_features,), 0, device, dtype)
        else:
            self.register_parameter("bias", None)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        if self.enter_region:
            x_BTD = (
                gather_from_sp(x_BTD, self.mesh) if self.sequence_parallel else copy_to_tp(x_BTD, self.mesh)
            )
        return self.linear_op(x_BTD, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} "
            f"(local {self.weight.shape[0]}), bias={self.bias is not None}, tp={self.mesh.tp}, "
            f"sequence_parallel={self.sequence_parallel}, enter_region={self.enter_region}"
        )


class RowParallelLinear(_Sharded):
    """y = x Wᵀ + b with W's input columns split over tp: weight [out, in/tp], bias [out] replicated.

    The input is already sharded on its last dim (a column layer's output); the partial products
    are all-reduced (reduce_from_tp) or, under sequence parallelism, reduce-scattered along T; the
    bias is added after the reduction. Under sequence parallelism the bias then sees one sequence
    shard, so its placement says `grad_sum_tp` (its gradient needs an all-reduce over tp).
    The product is `self.linear_op(x, weight)`, as in `ColumnParallelLinear`."""

    linear_op = staticmethod(F.linear)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        mesh: Mesh,
        sequence_parallel: bool = False,
        *,
        device=None,
        dtype=None,
    ):
        super().__init__(mesh)
        _check_divisible("RowParallelLinear", "in_features", in_features, mesh.tp)
        self.in_features, self.out_features = in_features, out_features
        self.sequence_parallel = sequence_parallel
        self._shard("weight", (out_features, in_features), 1, device, dtype)
        if bias:
            place = replicated(mesh, (out_features,), grad_sum_tp=sequence_parallel)
            self._param("bias", place, (out_features,), device, dtype)
        else:
            self.register_parameter("bias", None)

    def forward(self, x_BTf: torch.Tensor) -> torch.Tensor:
        y_BTD = self.linear_op(x_BTf, self.weight)
        if self.sequence_parallel:
            y_BTD = reduce_scatter_to_sp(y_BTD, self.mesh)
        else:
            y_BTD = reduce_from_tp(y_BTD, self.mesh)
        return y_BTD if self.bias is None else y_BTD + self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} (local {self.weight.shape[1]}), "
            f"out_features={self.out_features}, bias={self.bias is not None}, tp={self.mesh.tp}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


class OpLinear(nn.Linear):
    """An `nn.Linear` (the same parameters and placements) whose product is `linear_op`, set from
    outside like the parallel linears' (`mlm.parallel.fp8`: the fp8 linear;
    `mlm.inference.packed_weights`: MKL-packed weights)."""

    def __init__(self, linear: nn.Linear, op):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        if "placements" in linear.__dict__:
            self.placements = linear.placements
        self.linear_op = op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_op(x, self.weight, self.bias)


class VocabParallelEmbedding(_Sharded):
    """Embedding with its rows split over tp: weight [V/tp, D], rows from tp_rank · V/tp.

    Ids outside this rank's rows look up a zero vector, so the ranks' results sum to the full
    embedding: without sequence parallelism they are all-reduced (the complete [B, T, D] on every
    rank); under it the output is this rank's partial [B, T, D], summed and split over the sequence
    by one reduce-scatter in the model's `enter_layers` (`ReduceScatterToSP`), past position
    embeddings (added by tp rank 0 only) and dropout (the same mask on every tp rank, so it
    commutes with the sum)."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        mesh: Mesh,
        sequence_parallel: bool = False,
        *,
        device=None,
        dtype=None,
    ):
        super().__init__(mesh)
        _check_divisible("VocabParallelEmbedding", "num_embeddings", num_embeddings, mesh.tp)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.sequence_parallel = sequence_parallel
        self.vocab_start = mesh.tp_rank * (num_embeddings // mesh.tp)
        self.vocab_end = self.vocab_start + num_embeddings // mesh.tp
        self._shard("weight", (num_embeddings, embedding_dim), 0, device, dtype)

    def forward(self, tokens_BT: torch.Tensor) -> torch.Tensor:
        if self.mesh.tp == 1:
            return F.embedding(tokens_BT, self.weight)
        outside_BT = (tokens_BT < self.vocab_start) | (tokens_BT >= self.vocab_end)
        local_BT = (tokens_BT - self.vocab_start).masked_fill(outside_BT, 0)
        x_BTD = F.embedding(local_BT, self.weight).masked_fill(outside_BT.unsqueeze(-1), 0.0)
        return x_BTD if self.sequence_parallel else reduce_from_tp(x_BTD, self.mesh)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim} (rows {self.vocab_start}:{self.vocab_end}), "
            f"tp={self.mesh.tp}"
        )


# ---------------------------------------------------------------- randomness in the tp region


class TensorParallelRNG:
    """Randomness inside the tp region (attention dropout): different on each tp rank, whose heads
    differ, while randomness outside it (hidden dropout) stays identical across tp ranks.

    Megatron keeps a second CUDA generator seeded `seed + 2718 + tp_rank` and must checkpoint it
    and restore it around activation recompute. Here `fork()` instead draws one number from the
    default CPU generator (the same on every tp rank, and restored by torch.utils.checkpoint before
    a recompute), then runs its body with the default CPU and device generators seeded
    `draw + 2718 + tp_rank`; afterwards the default streams go on as if only that number had been
    drawn. So recompute reproduces the same masks and there is no extra state to save."""

    OFFSET = 2718

    def __init__(self, mesh: Mesh):
        self.tp_rank = mesh.tp_rank

    @contextlib.contextmanager
    def fork(self, device: torch.device | str | None = None):
        device = torch.device(device or "cpu")
        draw = int(torch.randint(0, 2**62, (1,)).item())
        seed = draw + self.OFFSET + self.tp_rank
        if device.type == "cpu":
            with torch.random.fork_rng(devices=[]):
                torch.default_generator.manual_seed(seed)
                yield
            return
        module = torch.get_device_module(device.type)
        index = device.index if device.index is not None else module.current_device()
        with torch.random.fork_rng(devices=[index], device_type=device.type):
            torch.default_generator.manual_seed(seed)
            with module.device(index):
                module.manual_seed(seed)
            yield

    def __repr__(self) -> str:
        return f"TensorParallelRNG(tp_rank={self.tp_rank})"
