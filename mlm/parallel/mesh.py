"""The parallel mesh: every rank's coordinates and process groups, passed explicitly.

Megatron's rank order: tp varies fastest, then cp, then dp, then pp, so a tensor-parallel
group is `tp` consecutive ranks (one node's NVLink domain). Built on
`torch.distributed.device_mesh` with dims ("pp", "dp", "cp", "tp"); expert parallelism is
folded over dp × cp for MoE layers. One process without torch.distributed is the mesh of
size 1 (`Mesh.single()`), whose groups are None and whose collectives are no-ops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from mlm.config import ParallelConfig
from mlm.errors import MlmError

DIMS = ("pp", "dp", "cp", "tp")


@dataclass
class Mesh:
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

    @classmethod
    def single(cls) -> Mesh:
        return cls(world_size=1, rank=0)

    @staticmethod
    def shape_for(cfg: ParallelConfig, world_size: int) -> dict[str, int]:
        """{"pp", "dp", "cp", "tp"} sizes, dp inferred; errors show the product."""
        inner = cfg.tp * cfg.pp * cfg.cp
        if world_size % inner:
            raise MlmError(
                f"tp({cfg.tp}) × pp({cfg.pp}) × cp({cfg.cp}) = {inner} does not divide world size {world_size}; "
                "choose sizes whose product divides the number of processes"
            )
        dp = world_size // inner
        if (dp * cfg.cp) % cfg.ep:
            raise MlmError(f"ep({cfg.ep}) must divide dp({dp}) × cp({cfg.cp}) = {dp * cfg.cp}")
        return {"pp": cfg.pp, "dp": dp, "cp": cfg.cp, "tp": cfg.tp}

    @classmethod
    def build(cls, cfg: ParallelConfig, device_type: str = "cpu") -> Mesh:
        """The mesh of the initialised default process group (or `single()` without one)."""
        if not dist.is_available() or not dist.is_initialized():
            cls.shape_for(cfg, 1)
            return cls.single()
        from torch.distributed.device_mesh import init_device_mesh

        world, rank = dist.get_world_size(), dist.get_rank()
        shape = cls.shape_for(cfg, world)
        dm = init_device_mesh(device_type, tuple(shape[d] for d in DIMS), mesh_dim_names=DIMS)
        coords = {d: dm.get_local_rank(d) for d in DIMS}
        return cls(
            world_size=world,
            rank=rank,
            ep=cfg.ep,
            device_mesh=dm,
            **shape,
            **{f"{d}_rank": coords[d] for d in DIMS},
        )

    def group(self, dim: str):
        """The process group of one dim ("tp", "dp", "cp", "pp"), or None when it has one rank."""
        if self.device_mesh is None or getattr(self, dim) == 1:
            return None
        return self.device_mesh.get_group(dim)

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
        return f"tp={self.tp} pp={self.pp} dp={self.dp} cp={self.cp} (world {self.world_size})"
