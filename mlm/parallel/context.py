"""Context parallelism: each sequence split over the cp ranks, attention exchanging keys and values.

The split (Megatron's load-balanced layout): a sequence of T tokens is cut into 2·cp chunks and
cp rank r holds chunks r and 2·cp − 1 − r, so every rank does the same causal work. Inputs,
labels and positions are split the same way (`zigzag_indices`); the model runs on its T / cp
tokens with their global positions (RoPE), and only attention sees the other ranks' tokens:

    allgather   the keys and values of all cp ranks gathered before attention (autograd's
                backward reduce-scatters their gradients); the mask compares global positions.
    ring        (mlm.parallel.ring_attention) the keys and values passed around the ring of cp
                ranks, one chunk pair per step, each step's partial attention merged by its
                log-sum-exp.

Losses are means over each rank's tokens (equal counts), so their mean over cp is the
sequence's; gradients are reduced over dp × cp. Checkpoints have no cp axis.

Shape legend: B batch, T whole sequence, t = T / cp this rank's tokens, H heads, G key/value
groups, K head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mlm.errors import MlmError

IMPLS = ("allgather", "ring")


def check_context_parallel(seq_length: int, cp: int) -> None:
    if cp > 1 and seq_length % (2 * cp):
        raise MlmError(
            f"data.seq_length={seq_length} is not divisible by 2 × parallel.cp = {2 * cp}: context "
            f"parallelism cuts each sequence into 2·cp chunks; choose a length that is a multiple of {2 * cp}"
        )


def zigzag_indices(T: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """The positions (0 … T − 1) cp rank `rank` holds: chunks `rank` and 2·cp − 1 − `rank` of 2·cp."""
    c = T // (2 * cp)
    first = torch.arange(rank * c, (rank + 1) * c, device=device)
    second = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)
    return torch.cat([first, second])


def allgather_attention(q_BtHK, k_BtGK, v_BtGK, group, cp: int, rank: int) -> torch.Tensor:
    """Causal attention of this rank's queries over every cp rank's keys and values (gathered),
    masked by global position; [B, t, H, K] out."""
    from mlm.parallel.tensor import gather_seq_over

    t = q_BtHK.shape[1]
    k = gather_seq_over(k_BtGK, group, cp)  # [B, T, G, K], rank r's t tokens at r·t
    v = gather_seq_over(v_BtGK, group, cp)
    T = t * cp
    kpos = torch.cat([zigzag_indices(T, cp, r, q_BtHK.device) for r in range(cp)])
    qpos = zigzag_indices(T, cp, rank, q_BtHK.device)
    mask_tT = kpos[None, :] <= qpos[:, None]
    q, k, v = (x.transpose(1, 2) for x in (q_BtHK, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_tT, enable_gqa=k.shape[1] != q.shape[1])
    return out.transpose(1, 2)
