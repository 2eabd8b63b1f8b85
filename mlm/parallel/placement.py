"""Where each parameter lives on the mesh: one `Placement` per parameter.

A placement says the parameter's global shape, this rank's slice of it (offset; the local
shape is the parameter's), the mesh dims whose ranks hold other slices (`sharded_over`), the
dims whose ranks hold the same slice (`replicated_over`) and which of those copies this rank's
is (`replica_id`). The checkpoint writer of each slice is its replica 0, so a tensor sharded
over any group (tp; experts over ep, see `expert_sharded`) is written exactly once, by exactly the
ranks that hold its distinct slices.

Modules that hold sharded parameters describe them in a `placements` dict (local parameter name
→ Placement), as mlm's parallel layers do; it is module state, so it survives `to_empty`. Every
other parameter is replicated over dp, cp and tp. The last pipeline stage's copy of a tied
embedding is one more replica (over pp) and is never written.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch import nn

from mlm.parallel.mesh import Mesh

DATA_DIMS = ("dp", "cp", "tp")
"""Mesh dims inside one pipeline stage: a parameter is sharded or replicated over each."""


@dataclass(frozen=True)
class Placement:
    global_shape: tuple[int, ...]
    """The parameter's shape in one process (and in checkpoints)."""
    offset: tuple[int, ...]
    """Where this rank's slice starts in the global tensor."""
    shape: tuple[int, ...]
    """This rank's slice's shape (the parameter's)."""
    sharded_over: tuple[str, ...] = ()
    """Mesh dims whose ranks hold other slices (e.g. ("tp",))."""
    replicated_over: tuple[str, ...] = DATA_DIMS
    """Mesh dims whose ranks hold this same slice."""
    replica_id: int = 0
    """This rank's index among the ranks holding the slice; replica 0 writes it."""
    grad_sum_tp: bool = False
    """Replicated over tp but fed one sequence shard (sequence parallelism): sum its gradient over tp."""

    @property
    def writer(self) -> bool:
        return self.replica_id == 0

    @property
    def tensor_parallel(self) -> bool:
        return "tp" in self.sharded_over

    @property
    def expert_parallel(self) -> bool:
        """Sharded over ep (its gradient is reduced over edp, not dp)."""
        return "ep" in self.sharded_over

    def writer_without(self, mesh: Mesh, *dims: str) -> bool:
        """Whether this rank writes the slice once the replicas over `dims` are one (e.g. the
        distributed optimizer gathers the moments over dp × cp and picks the rank that writes)."""
        return replica_index(mesh, tuple(d for d in self.replicated_over if d not in dims)) == 0

    def slice_of(self, full):
        """This rank's slice of `full`, a tensor in the global shape."""
        return full[tuple(slice(o, o + n) for o, n in zip(self.offset, self.shape, strict=True))]


def replica_index(mesh: Mesh, dims: tuple[str, ...]) -> int:
    """This rank's index among the ranks that differ only in `dims` (mixed radix, last dim fastest)."""
    index = 0
    for d in dims:
        index = index * getattr(mesh, d) + getattr(mesh, f"{d}_rank")
    return index


def sharded(mesh: Mesh, global_shape: tuple[int, ...], dim: int, over: str = "tp") -> Placement:
    """This rank's 1/size slice of `global_shape` along `dim`, split over mesh dim `over`."""
    size, rank = getattr(mesh, over), getattr(mesh, f"{over}_rank")
    assert global_shape[dim] % size == 0, f"{global_shape}[{dim}] over {over}={size}"
    offset, shape = [0] * len(global_shape), list(global_shape)
    shape[dim] //= size
    offset[dim] = rank * shape[dim]
    rest = tuple(d for d in DATA_DIMS if d != over)
    return Placement(
        tuple(global_shape), tuple(offset), tuple(shape), (over,), rest, replica_index(mesh, rest)
    )


def expert_sharded(mesh: Mesh, global_shape: tuple[int, ...]) -> Placement:
    """This rank's experts of stacked expert weights [E, ...]: split over ep along dim 0, the
    same on the edp ranks (expert parallelism folds the stage's dp × cp × tp ranks as edp × ep)."""
    E = global_shape[0]
    assert E % mesh.ep == 0, f"{E} experts over ep={mesh.ep}"
    n = E // mesh.ep
    offset = (mesh.ep_rank * n,) + (0,) * (len(global_shape) - 1)
    return Placement(tuple(global_shape), offset, (n, *global_shape[1:]), ("ep",), ("edp",), mesh.edp_rank)


def replicated(mesh: Mesh, shape: tuple[int, ...], grad_sum_tp: bool = False) -> Placement:
    shape = tuple(shape)
    return Placement(
        shape, (0,) * len(shape), shape, (), DATA_DIMS, replica_index(mesh, DATA_DIMS), grad_sum_tp
    )


def placements(model: nn.Module, mesh: Mesh) -> dict[str, Placement]:
    """name → Placement of every parameter of `model` on this rank."""
    tied = model.tied_copy() if hasattr(model, "tied_copy") else None
    out = {}
    for module_name, module in model.named_modules():
        described = getattr(module, "placements", {})
        for local, p in module.named_parameters(recurse=False):
            name = f"{module_name}.{local}" if module_name else local
            place = described.get(local) or replicated(mesh, tuple(p.shape))
            if p is tied:  # the last stage's copy: another replica (pp rank > 0), never written
                over = (*place.replicated_over, "pp")
                place = replace(place, replicated_over=over, replica_id=replica_index(mesh, over))
            out[name] = place
    return out
