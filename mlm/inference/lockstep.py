"""Tensor-parallel serving: the tp ranks run every engine step in lockstep.

    torchrun --nproc-per-node 2 -m cli.main serve CKPT      # tp = WORLD_SIZE = 2

Every rank holds its tp shard of the model and the keys and values of its own heads. Rank 0 runs
the scheduler (and the HTTP server); at each step it broadcasts the step's chunks (tokens,
positions, block tables, which chunks sample) over the tp group, every rank runs the same forward
(the parallel layers' all-reduces pair up), the vocabulary-sharded logits are gathered and rank 0
samples. A step of no chunks is the stop message that ends the other ranks' loop.

A step travels as two broadcasts of int64 tensors on the model's device (NCCL needs CUDA
tensors): its length, then [B, (n, start, blocks, sample, slot) × B, tokens…, block ids…] (slot
−1: none).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mlm.config import ModelConfig, ParallelConfig
from mlm.errors import MlmError
from mlm.parallel.launch import detect, init_distributed
from mlm.parallel.mesh import Mesh, check_tensor_parallel


def serving_mesh(cfg: ModelConfig, tp: int | None, device: torch.device) -> Mesh:
    """Join the job's process group (torchrun, srun) and return the serving mesh: `tp` ranks (default
    WORLD_SIZE) and nothing else. Checks run before any rank talks to another, so that every rank
    stops with the same message."""
    world = detect().world_size
    tp = tp or world
    if tp != world:
        raise MlmError(
            f"--tp {tp} with {world} process(es): mlm serves with tensor parallelism only (pipeline and "
            f"data parallelism, pp > 1 or dp > 1, are not supported), so tp must equal the number of "
            f"processes; run `torchrun --nproc-per-node {tp} -m cli.main serve CKPT` (tp defaults to "
            "WORLD_SIZE)"
        )
    check_tensor_parallel(cfg, cfg.padded_vocab_size(tp), tp)
    init_distributed(device)
    return Mesh.build(ParallelConfig(tp=tp), device.type)


def _src(mesh: Mesh) -> int:
    return dist.get_global_rank(mesh.tp_group, 0)


def broadcast_step(chunks: list, mesh: Mesh, device: torch.device) -> None:
    """Rank 0: send the step's chunks (`model_runner.Segment`s) to the other tp ranks; [] stops them."""
    head: list[int] = [len(chunks)]
    tokens: list[int] = []
    blocks: list[int] = []
    for c in chunks:
        head += [len(c.tokens), c.start, len(c.blocks), int(c.sample), -1 if c.slot is None else c.slot]
        tokens += c.tokens
        blocks += c.blocks
    data = head + tokens + blocks if chunks else []
    dist.broadcast(torch.tensor([len(data)], device=device), src=_src(mesh), group=mesh.tp_group)
    if data:
        dist.broadcast(torch.tensor(data, device=device), src=_src(mesh), group=mesh.tp_group)


def receive_step(
    mesh: Mesh, device: torch.device
) -> list[tuple[list[int], int, list[int], bool, int | None]]:
    """The other tp ranks: the next step's chunks as (tokens, start, blocks, sample, slot); []
    means stop."""
    size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.broadcast(size, src=_src(mesh), group=mesh.tp_group)
    if int(size) == 0:
        return []
    data = torch.empty(int(size), dtype=torch.int64, device=device)
    dist.broadcast(data, src=_src(mesh), group=mesh.tp_group)
    values = data.tolist()
    B = values[0]
    head = [values[1 + 5 * i : 6 + 5 * i] for i in range(B)]
    t = 1 + 5 * B
    b = t + sum(n for n, *_ in head)
    chunks = []
    for n, start, nb, sample, slot in head:
        chunks.append(
            (values[t : t + n], start, values[b : b + nb], bool(sample), None if slot < 0 else slot)
        )
        t, b = t + n, b + nb
    return chunks


def stop_followers(mesh: Mesh, device: torch.device) -> None:
    """Rank 0: end the other tp ranks' loop (the step of no chunks)."""
    broadcast_step([], mesh, device)
