"""The parallel mesh: every rank's coordinates and process groups, passed explicitly.

Megatron's rank order: tp varies fastest, then cp, then dp, then pp, so a tensor-parallel
group is `tp` consecutive ranks (one node's NVLink domain). Built on
`torch.distributed.device_mesh` with dims ("pp", "dp", "cp", "tp"); expert parallelism is
folded over each pipeline stage's dp × cp × tp ranks for MoE layers (Megatron's parallel
folding, expert tensor parallelism 1). One process without torch.distributed is the mesh of
size 1 (`Mesh.single()`), whose groups are None and whose collectives are no-ops. A mesh is
built from a `mlm.layout.Layout` (a `ParallelConfig` is read as one): `build` with every process
group, `of` one rank's coordinates alone (checks and dry runs).
Importing this module does not import torch, so that `mlm plan` can check meshes with
`shape_for` and `check_tensor_parallel` in well under a second.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mlm.config import ModelConfig, ParallelConfig
from mlm.errors import MlmError
from mlm.layout import Layout

DIMS = ("pp", "dp", "cp", "tp")


@dataclass
class Mesh:
    """Every rank's coordinates on the pp × dp × cp × tp grid and the process groups between
    them (all created in `build`), passed explicitly to whatever communicates."""

    world_size: int
    rank: int
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    tp_rank: int = 0
    cp_rank: int = 0
    dp_rank: int = 0
    pp_rank: int = 0
    device_mesh: object = None  # torch.distributed.device_mesh.DeviceMesh when world_size > 1
    extra_groups: dict = field(default_factory=dict)
    """Process groups beyond the mesh dims, made by `build`: "pp_grad" (a second communicator
    per pipeline, for gradients), "embedding" (each pipeline's first and last stage), "gloo" (all
    ranks, on gloo, when asked for: background checkpoint saves synchronise there), and under expert parallelism
    "ep" and "edp" (see `expert_groups`), under context parallelism "dp_cp" (gradients) and
    "tp_cp" (a sequence's shards)."""

    @property
    def stage_index(self) -> int:
        """This rank's index among its pipeline stage's dp × cp × tp ranks (tp fastest)."""
        return (self.dp_rank * self.cp + self.cp_rank) * self.tp + self.tp_rank

    @property
    def ep_rank(self) -> int:
        """This rank's place in its expert-parallel group (the stage folded as edp × ep, ep fastest)."""
        return self.stage_index % self.ep

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: the ranks holding the same experts, dp × cp × tp / ep."""
        return self.dp * self.cp * self.tp // self.ep

    @property
    def edp_rank(self) -> int:
        return self.stage_index // self.ep

    @classmethod
    def single(cls) -> Mesh:
        return cls(world_size=1, rank=0)

    @classmethod
    def of(cls, layout: Layout, rank: int = 0) -> Mesh:
        """Rank `rank`'s coordinates on a complete `layout` (Megatron's order, tp fastest), without
        process groups: what checks and dry runs need."""
        tp, cp, dp = layout.tp, layout.cp, layout.dp
        coords = {
            "tp": rank % tp,
            "cp": rank // tp % cp,
            "dp": rank // (tp * cp) % dp,
            "pp": rank // (tp * cp * dp),
        }
        sizes = {d: getattr(layout, d) for d in ("tp", "pp", "dp", "cp", "ep")}
        return cls(world_size=layout.gpus, rank=rank, **sizes, **{f"{d}_rank": coords[d] for d in DIMS})

    @staticmethod
    def shape_for(cfg: ParallelConfig, world_size: int) -> dict[str, int]:
        """{"pp", "dp", "cp", "tp"} sizes, dp inferred; errors show the product (`Layout.with_world`)."""
        lo = Layout.from_parallel(cfg, world_size)
        return {d: getattr(lo, d) for d in DIMS}

    @classmethod
    def build(
        cls, layout: Layout | ParallelConfig, device_type: str = "cpu", gloo_group: bool = False
    ) -> Mesh:
        """The mesh of `layout` (a ParallelConfig: `Layout.from_parallel`) on the initialised
        default process group (or `single()` without one), with every process group; a dp the
        layout leaves open is what the world size leaves. `gloo_group`: also the all-ranks gloo
        group (for background checkpoint saves; one more rendezvous over every rank at start-up,
        so only when asked)."""
        import torch.distributed as dist  # here, so that the planner can use shape_for without torch

        distributed = dist.is_available() and dist.is_initialized()
        world, rank = (dist.get_world_size(), dist.get_rank()) if distributed else (1, 0)
        layout = (
            Layout.from_parallel(layout, world)
            if isinstance(layout, ParallelConfig)
            else layout.with_world(world)
        )
        if not distributed:
            return cls.single()
        from torch.distributed.device_mesh import init_device_mesh

        dm = init_device_mesh(device_type, tuple(getattr(layout, d) for d in DIMS), mesh_dim_names=DIMS)
        mesh = cls.of(layout, rank)
        mesh.device_mesh = dm
        assert all(dm.get_local_rank(d) == getattr(mesh, f"{d}_rank") for d in DIMS), "Megatron's rank order"
        # Every other group, created here on every rank in the same order (new_group is collective).
        if gloo_group:
            mesh.extra_groups["gloo"] = dist.new_group(backend="gloo")
        if mesh.pp > 1:
            pipelines = mesh.all_pipelines()
            mesh.extra_groups["pp_grad"] = _new_groups(pipelines, rank)
            mesh.extra_groups["embedding"] = _new_groups([[p[0], p[-1]] for p in pipelines], rank)
        if mesh.cp > 1:  # gradients are reduced over dp × cp; a sequence's shards span tp × cp
            grid = dm.mesh  # [pp, dp, cp, tp]
            mesh.extra_groups["dp_cp"] = _new_groups(
                [grid[p, :, :, t].flatten().tolist() for p in range(mesh.pp) for t in range(mesh.tp)], rank
            )
            mesh.extra_groups["tp_cp"] = _new_groups(
                [grid[p, d].flatten().tolist() for p in range(mesh.pp) for d in range(mesh.dp)], rank
            )
        if mesh.ep > 1:
            ep_lists, edp_lists = mesh.expert_groups()
            mesh.extra_groups["ep"] = _new_groups(ep_lists, rank)
            mesh.extra_groups["edp"] = _new_groups(edp_lists, rank) if mesh.edp > 1 else None
        return mesh

    def group(self, dim: str):
        """The process group of a mesh dim ("tp", "dp", "cp", "pp"; None when it has one rank) or
        of an extra group ("pp_grad", "embedding", "gloo", "ep", "edp", and under context
        parallelism "dp_cp" (the dp group at cp = 1) and "tp_cp"; None where there is none)."""
        if dim in ("dp_cp", "tp_cp") and self.cp == 1:
            return self.group(dim[:2])
        if dim in ("pp_grad", "embedding", "gloo", "ep", "edp", "dp_cp", "tp_cp"):
            return self.extra_groups.get(dim)
        if self.device_mesh is None or getattr(self, dim) == 1:
            return None
        return self.device_mesh.get_group(dim)

    def sequence_group(self, sequence_parallel: bool):
        """The ranks holding the other parts of this rank's sequences: tp under sequence
        parallelism, × cp under context parallelism (None when a rank holds whole sequences)."""
        split_tp = sequence_parallel and self.tp > 1
        if self.cp > 1:
            return self.group("tp_cp") if split_tp else self.group("cp")
        return self.tp_group if split_tp else None

    def all_pipelines(self) -> list[list[int]]:
        """The global ranks of every pipeline (pp group), each in stage order, the same on every rank."""
        grid = self.device_mesh.mesh  # [pp, dp, cp, tp] global ranks
        return [
            grid[:, d, c, t].tolist() for d in range(self.dp) for c in range(self.cp) for t in range(self.tp)
        ]

    def expert_groups(self) -> tuple[list[list[int]], list[list[int]]]:
        """Every expert-parallel group and every expert-data-parallel group, as global ranks.

        Megatron's parallel folding with expert tensor parallelism 1: each pipeline stage's
        dp × cp × tp ranks (in rank order, tp fastest) are laid out as edp × ep with ep fastest; an
        ep group holds different experts, an edp group the same ones (their gradients are
        reduced there). At tp = ep an ep group is a tp group."""
        grid = self.device_mesh.mesh  # [pp, dp, cp, tp] global ranks
        ep_lists, edp_lists = [], []
        for p in range(self.pp):
            folded = grid[p].reshape(self.edp, self.ep)
            ep_lists += folded.tolist()
            edp_lists += folded.T.tolist()
        return ep_lists, edp_lists

    def pipeline_ranks(self) -> list[int]:
        """The global ranks of this rank's pipeline, in stage order."""
        return next(p for p in self.all_pipelines() if self.rank in p)

    @property
    def tp_group(self):
        return self.group("tp")

    @property
    def dp_group(self):
        return self.group("dp")

    def describe(self) -> dict:
        return {
            "tp": self.tp,
            "pp": self.pp,
            "dp": self.dp,
            "cp": self.cp,
            "ep": self.ep,
            "world_size": self.world_size,
        }

    def __str__(self) -> str:
        ep = f" ep={self.ep}" if self.ep > 1 else ""
        return f"tp={self.tp} pp={self.pp} dp={self.dp} cp={self.cp}{ep} (world {self.world_size})"


def _new_groups(rank_lists: list[list[int]], rank: int):
    """`dist.new_group` for every list (all ranks call it for all lists); the one holding `rank`."""
    import torch.distributed as dist

    mine = None
    for ranks in rank_lists:
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    if mine is not None:  # NCCL: the first call on a group must involve all of its ranks
        dist.barrier(group=mine)
    return mine


def check_tensor_parallel(cfg: ModelConfig, padded_vocab: int, tp: int) -> None:
    """MlmError unless every tensor-parallel layer of `cfg` splits evenly over `tp` ranks (each
    kind's spec checks its own: heads, groups, ffn widths)."""
    from mlm.model import kinds

    for kind in cfg.mixer_kinds():
        kinds.mixer(kind).check_parallel(cfg, tp, 1, False)
    for kind in cfg.mlp_kinds():
        kinds.mlp(kind).check_parallel(cfg, tp, 1, False)
    if padded_vocab % tp:
        raise MlmError(
            f"padded vocabulary {padded_vocab} (model.vocab_size={cfg.vocab_size}) is not divisible "
            f"by parallel.tp={tp}; build the model as GPT(cfg, padded_vocab=cfg.padded_vocab_size({tp})) "
            f"= {cfg.padded_vocab_size(tp)} rows"
        )


def check_context_parallel(seq_length: int, cp: int, sequence_shards: int = 1) -> None:
    """MlmError unless sequences of `seq_length` split over `cp` ranks (2·cp chunks), each rank's
    tokens then over `sequence_shards` tp ranks (sequence parallelism)."""
    if cp == 1:
        return
    if seq_length % (2 * cp):
        raise MlmError(
            f"data.seq_length={seq_length} is not divisible by 2 × parallel.cp = {2 * cp}: context "
            f"parallelism cuts each sequence into 2·cp chunks; choose a length that is a multiple of {2 * cp}"
        )
    if (seq_length // cp) % sequence_shards:
        raise MlmError(
            f"data.seq_length={seq_length} over parallel.cp={cp} leaves {seq_length // cp} tokens per rank, "
            f"not divisible by tp={sequence_shards} (sequence parallelism); choose a length that is a "
            f"multiple of {2 * cp * sequence_shards}"
        )
