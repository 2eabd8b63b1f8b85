"""Context parallelism: each sequence split over the cp ranks, attention exchanging keys and values.

The split (Megatron's load-balanced layout): a sequence of T tokens is cut into 2·cp chunks and
cp rank r holds chunks r and 2·cp − 1 − r, so every rank does the same causal work. Inputs,
labels and positions are split the same way (`zigzag_indices`); the model runs on its T / cp
tokens with their global positions (RoPE), and only attention sees the other ranks' tokens:

    all_gather  the keys and values of all cp ranks gathered before attention (autograd's
                backward reduce-scatters their gradients); the mask compares global positions.
    p2p         (mlm.parallel.ring_attention) the keys and values passed around the ring of cp
                ranks, one chunk pair per step, each step's partial attention merged by its
                log-sum-exp.

`parallel.cp_comm_type` chooses (Megatron's names). Losses are means over each rank's tokens (equal counts), so their mean over cp is the
sequence's; gradients are reduced over dp × cp. Checkpoints have no cp axis.

Shape legend: B batch, T whole sequence, t = T / cp this rank's tokens, H heads, G key/value
groups, K head dim.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mlm.errors import MlmError
from mlm.model.contract import declaring
from mlm.parallel.mesh import Mesh, check_context_parallel  # noqa: F401  (the rule, torch-free)
from mlm.parallel.ring_attention import ring_attention

COMM_TYPES = ("all_gather", "p2p")


def zigzag_indices(T: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """The positions (0 … T − 1) cp rank `rank` holds: chunks `rank` and 2·cp − 1 − `rank` of 2·cp."""
    c = T // (2 * cp)
    first = torch.arange(rank * c, (rank + 1) * c, device=device)
    second = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)
    return torch.cat([first, second])


def allgather_attention(
    q_BtHK, k_BtGK, v_BtGK, group, cp: int, rank: int, documents_BT=None, scale: float | None = None
) -> torch.Tensor:
    """Causal attention of this rank's queries over every cp rank's keys and values (gathered),
    masked by global position (and, with `documents_BT`, this rank's tokens' document indices,
    within each packed document); [B, t, H, K] out."""
    from mlm.model.attention import document_mask
    from mlm.parallel.tensor import gather_seq_over

    t = q_BtHK.shape[1]
    k = gather_seq_over(k_BtGK, group, cp)  # [B, T, G, K], rank r's t tokens at r·t
    v = gather_seq_over(v_BtGK, group, cp)
    T = t * cp
    kpos = torch.cat([zigzag_indices(T, cp, r, q_BtHK.device) for r in range(cp)])
    qpos = zigzag_indices(T, cp, rank, q_BtHK.device)
    if documents_BT is None:
        mask = kpos[None, :] <= qpos[:, None]
    else:
        parts = [torch.empty_like(documents_BT) for _ in range(cp)]
        dist.all_gather(parts, documents_BT.contiguous(), group=group)
        mask = document_mask(documents_BT, torch.cat(parts, 1), qpos, kpos)
    q, k, v = (x.transpose(1, 2) for x in (q_BtHK, k, v))
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
    )
    return out.transpose(1, 2)


def apply_context_parallel(model: nn.Module, mesh: Mesh, comm_type: str, sequence_parallel: bool) -> None:
    """Make every module declaring `cp_attention` (the attention cores, `mlm.model.contract`) of
    `model` attend over the whole sequence held across `mesh`'s cp ranks (`comm_type` "all_gather" or "p2p", Megatron's cp_comm_type), and point modules that
    reduce statistics over a sequence's shards (MoE balancing) at the ranks holding its other
    parts (cp, × tp under sequence parallelism). A no-op at cp = 1."""
    if mesh.cp == 1:
        return
    if model.cfg.attention_dropout > 0:
        raise MlmError(
            f"model.attention_dropout={model.cfg.attention_dropout} with parallel.cp={mesh.cp}: attention "
            "dropout is not built under context parallelism; set it to 0"
        )
    if comm_type not in COMM_TYPES:
        raise MlmError(f"parallel.cp_comm_type={comm_type!r}: must be one of {', '.join(COMM_TYPES)}")
    impl = ring_attention if comm_type == "p2p" else allgather_attention
    attend = functools.partial(impl, group=mesh.group("cp"), cp=mesh.cp, rank=mesh.cp_rank)
    shards = mesh.sequence_group(sequence_parallel)
    if getattr(model, "aux_losses", None) is not None:  # shares of a loss whose gradients cp averages
        model.aux_losses.partial_factor = float(mesh.cp)
    for _, module, attr in declaring(model, "cp_attention"):
        setattr(module, attr, attend)
    for _, module, plan in declaring(model, "tp_plan"):
        for attr, style in plan.items():
            if style == "sp_group":
                setattr(module, attr, shards)


@contextlib.contextmanager
def whole_sequences(model: nn.Module):
    """Attention over the local tokens only, for a forward in which every rank holds whole
    sequences (sampling a prompt during training under cp)."""
    cores = [(m, attr, getattr(m, attr)) for _, m, attr in declaring(model, "cp_attention")]
    for m, attr, _ in cores:
        setattr(m, attr, None)
    try:
        yield
    finally:
        for m, attr, context in cores:
            setattr(m, attr, context)
