"""The global gradient norm over the whole mesh, counting every element once.

A gradient piece is either tensor-parallel (each tp rank holds a different slice: sum over tp)
or replicated over tp (identical on every tp rank: count once). With the distributed optimizer
each rank holds only its dp shard of the reduced gradient (sum over dp); otherwise every dp
rank holds all of it (count once). Expert weights are sharded over ep (sum over ep) and, under
the distributed optimizer, their edp shards too (sum over edp). Pipeline stages hold different
parameters (sum over pp).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _sum_sq(grads: list[torch.Tensor], device) -> torch.Tensor:
    if not grads:
        return torch.zeros((), device=device)
    return torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]).square().sum()


def global_grad_norm(
    pieces: list[tuple[torch.Tensor, bool | str]],
    tp_group,
    dp_shard_group,
    device,
    pp_group=None,
    expert_groups: tuple = (),
) -> torch.Tensor:
    """L2 norm of the full gradient from (gradient piece, kind) pairs, kind True (tensor-parallel),
    False (replicated over tp) or "expert" (expert weights). `dp_shard_group`: the dp group when
    each rank holds only its dp shard of the gradient (distributed optimizer), else None;
    `tp_group`: None at tp = 1; `expert_groups`: the groups whose ranks hold other parts of the
    expert gradients (ep, and edp under the distributed optimizer); `pp_group`: None at pp = 1
    (each stage holds other parameters; a tied embedding's last-stage copy must not be among
    the pieces)."""
    sq = torch.stack([_sum_sq([g for g, kind in pieces if kind is k], device) for k in (True, False)])
    if dp_shard_group is not None:
        dist.all_reduce(sq, group=dp_shard_group)
    if tp_group is not None:
        tp_sq = sq[0].clone()
        dist.all_reduce(tp_sq, group=tp_group)
        sq = torch.stack([tp_sq, sq[1]])
    total = sq.sum()
    if expert_groups:
        expert_sq = _sum_sq([g for g, kind in pieces if kind == "expert"], device)
        for group in expert_groups:
            dist.all_reduce(expert_sq, group=group)
        total = total + expert_sq
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    return total.sqrt()


def clip_(grads: list[torch.Tensor], norm: torch.Tensor, max_norm: float) -> None:
    """Scale `grads` as torch.nn.utils.clip_grad_norm_ would for a total norm `norm`."""
    if 0 < max_norm < float("inf") and grads:
        torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))


def any_nonfinite(grads: list[torch.Tensor], device) -> bool:
    """Whether any rank of the job holds an inf/nan gradient (the fp16 loss scaler's test)."""
    bad = (
        torch.stack([(~torch.isfinite(g)).any() for g in grads]).any().float()
        if grads
        else torch.zeros((), device=device)
    )
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return bool(bad)
