"""Join the job's process group, whoever launched it: torchrun, SLURM's srun, or nobody.

- torchrun (and any launcher that sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): used as is.
- srun without torchrun: rank, world size and local rank from SLURM_PROCID, SLURM_NTASKS,
  SLURM_LOCALID; the master is the first host of SLURM_JOB_NODELIST; the port is MASTER_PORT
  if set, else derived from the job id so that jobs sharing a node do not collide.
- neither: one process, no process group.
NCCL on CUDA, gloo on CPU. Rendezvous is torch.distributed's own (env://).
"""

from __future__ import annotations

import datetime
import os
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mlm.errors import MlmError


@dataclass(frozen=True)
class Launch:
    rank: int
    world_size: int
    local_rank: int
    launcher: str  # "torchrun", "slurm" or "single"


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed host list → host names: "gpu[01-03,07],login" → gpu01, gpu02, gpu03, gpu07, login."""
    hosts = []
    for name, ranges in re.findall(r"([^,\[]+)(?:\[([^\]]+)\])?,?", nodelist):
        if not ranges:
            hosts.append(name)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            width = len(lo)
            for i in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{name}{i:0{width}d}")
    return hosts


def detect(env: dict | None = None) -> Launch:
    """Who launched this process, from the environment (also fills the env:// variables for srun)."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return Launch(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)), "torchrun")
    if int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in env:
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if not nodelist:
            raise MlmError(
                "running under srun but SLURM_JOB_NODELIST is not set; launch with srun inside sbatch/salloc"
            )
        env.setdefault("MASTER_ADDR", expand_nodelist(nodelist)[0])
        env.setdefault("MASTER_PORT", str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000))
        launch = Launch(
            int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0)), "slurm"
        )
        env.update(
            RANK=str(launch.rank), WORLD_SIZE=str(launch.world_size), LOCAL_RANK=str(launch.local_rank)
        )
        return launch
    return Launch(0, 1, 0, "single")


def init_distributed(device: torch.device, store=None, timeout: datetime.timedelta | None = None) -> Launch:
    """Initialise the default process group when there is more than one process: on `store`
    (the job's rendezvous store, `dist.rendezvous("env://")`) when given, else through env://;
    `timeout` for its collectives (None: torch's default)."""
    launch = detect()
    if launch.world_size == 1 or dist.is_initialized():
        return launch
    if device.type == "cuda":
        torch.cuda.set_device(launch.local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    kw = {"timeout": timeout} if timeout is not None else {}
    if store is None:
        dist.init_process_group(backend, init_method="env://", **kw)
    else:
        dist.init_process_group(backend, store=store, rank=launch.rank, world_size=launch.world_size, **kw)
    return launch


def pick_device(requested: str | torch.device, where: str = "train.device") -> torch.device:
    """`auto` → cuda when visible, else cpu; an explicit cuda device must be visible (`where` names
    the setting in the message)."""
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(requested)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise MlmError(f"{where}={str(requested)!r} but no CUDA device is visible here; use cpu")
    return dev
