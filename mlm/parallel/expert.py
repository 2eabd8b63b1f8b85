"""Expert parallelism, applied from outside: each MoE layer keeps its 1/ep slice of the experts
and gets a token dispatcher over its expert-parallel group (Megatron's parallel folding: the
stage's dp × cp × tp ranks laid out as edp × ep, `Mesh.expert_groups`; expert tensor
parallelism is 1, each expert whole on one rank, as torchtitan does).

    apply_expert_parallel(model, mesh, sequence_parallel)   # after parallelize, before to_empty

Two dispatchers, both exact (dropless, no capacity is imposed by the exchange):

    alltoall   Megatron's MoEAlltoAllTokenDispatcher: the token counts per expert are exchanged
               first (all_to_all_single), then each (token, expert) copy goes to the rank holding
               the expert and its result comes back (all_to_all_single with uneven splits; the
               backward is the reverse exchange); the weighted sum is taken at home.
               Bytes per rank and direction: the copies sent away, ~ N·k·(ep − 1)/ep · D.
    allgather  Megatron's MoEAllGatherTokenDispatcher: every rank gathers the group's tokens and
               weights, runs its experts on the copies routed to them, and the weighted outputs
               are reduce-scattered home. Bytes per rank: (ep − 1)·N·D gathered + the same
               reduce-scattered, whatever the routing.

Expert weights get an `expert_sharded` placement (`mlm.parallel.placement`): checkpoints keep the
global [E, ...] axis, written by edp replica 0, so any ep loads any other. Their gradients are
reduced over edp (the training optimizer's second gradient buffer), not dp. At tp > 1 the tp
ranks are expert-parallel ranks too, so they must hold different tokens: sequence parallelism.

Shape legend: N this rank's tokens, E experts, L local experts (E / ep), D hidden, M copies.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from mlm.config import ModelConfig
from mlm.errors import MlmError
from mlm.model import kinds
from mlm.model.contract import declaring, submodule
from mlm.model.kinds.moe.experts import GroupedExperts
from mlm.model.kinds.moe.module import combine
from mlm.parallel.data_parallel import all_gather, reduce_scatter
from mlm.parallel.mesh import Mesh
from mlm.parallel.placement import expert_sharded


class _GatherRows(torch.autograd.Function):
    """[N, ...] → [size·N, ...] over `group`; backward: reduce-scatter."""

    @staticmethod
    def forward(ctx, x, group, size):
        ctx.group, ctx.size = group, size
        x = x.contiguous()
        out = x.new_empty((size * x.shape[0], *x.shape[1:]))
        all_gather(out, x, group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        out = grad.new_empty((grad.shape[0] // ctx.size, *grad.shape[1:]))
        reduce_scatter(out, grad, ctx.group)
        return out, None, None


class _ReduceScatterRows(torch.autograd.Function):
    """[size·N, ...] summed over `group`, this rank's N rows kept; backward: all-gather."""

    @staticmethod
    def forward(ctx, x, group, size):
        ctx.group, ctx.size = group, size
        x = x.contiguous()
        out = x.new_empty((x.shape[0] // size, *x.shape[1:]))
        reduce_scatter(out, x, group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        out = grad.new_empty((ctx.size * grad.shape[0], *grad.shape[1:]))
        all_gather(out, grad, ctx.group)
        return out, None, None


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """Rows to the ranks of `group` (`in_splits` rows to each), `out_splits` rows from each;
    backward: the reverse exchange."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (in_splits, out_splits), group
        return _all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, *ctx.splits, ctx.group), None, None, None


class AllToAllDispatcher:
    """Token copies to the ranks holding their experts and back (Megatron's alltoall)."""

    def __init__(self, group, ep: int):
        self.group, self.ep = group, ep

    def __call__(self, x_ND, probs_NE, mask_NE, experts: GroupedExperts) -> torch.Tensor:
        ep, L = self.ep, experts.num_local
        expert_M, token_M = mask_NE.T.nonzero(as_tuple=True)  # grouped by expert: by rank
        w_M = probs_NE[token_M, expert_M]
        counts_E = mask_NE.sum(0)
        # how many copies each rank sends me for each of my experts: [ep (source), L]
        recv_SL = torch.empty_like(counts_E).view(ep, L)
        dist.all_to_all_single(recv_SL, counts_E.view(ep, L).contiguous(), group=self.group)
        send = counts_E.view(ep, L).sum(1).tolist()
        recv = recv_SL.sum(1).tolist()
        x_MD = _AllToAll.apply(x_ND[token_M], recv, send, self.group)
        # received rows are ordered (source, local expert): group them by local expert
        local = torch.repeat_interleave(torch.arange(L, device=x_ND.device).repeat(ep), recv_SL.flatten())
        order = torch.argsort(local, stable=True)
        y_MD = experts(x_MD[order], recv_SL.sum(0).tolist())
        y_MD = y_MD[torch.argsort(order)]
        back_MD = _AllToAll.apply(y_MD, send, recv, self.group)
        return combine(back_MD, w_M, token_M, x_ND.shape[0])


class AllGatherDispatcher:
    """Every rank sees the group's tokens and computes its experts' share (Megatron's allgather)."""

    def __init__(self, group, ep: int, ep_rank: int):
        self.group, self.ep, self.ep_rank = group, ep, ep_rank

    def __call__(self, x_ND, probs_NE, mask_NE, experts: GroupedExperts) -> torch.Tensor:
        ep, L = self.ep, experts.num_local
        lo = self.ep_rank * L
        x_all = _GatherRows.apply(x_ND, self.group, ep)
        probs_all = _GatherRows.apply(probs_NE, self.group, ep)
        mask_all = torch.empty(
            (ep * mask_NE.shape[0], mask_NE.shape[1]), dtype=torch.uint8, device=x_ND.device
        )
        all_gather(mask_all, mask_NE.to(torch.uint8).contiguous(), self.group)
        mine = mask_all[:, lo : lo + L].bool()
        expert_M, token_M = mine.T.nonzero(as_tuple=True)
        y_MD = experts(x_all[token_M], mine.sum(0).tolist())
        w_M = probs_all[token_M, lo + expert_M]
        out_all = combine(y_MD, w_M, token_M, x_all.shape[0])
        return _ReduceScatterRows.apply(out_all, self.group, ep)


def check_expert_parallel(cfg: ModelConfig, ep: int, tp: int, sequence_parallel: bool) -> None:
    """MlmError unless `cfg`'s MoE layers split over `ep` ranks (at `tp`, with or without
    sequence parallelism)."""
    if ep == 1:
        return
    spread = [k for k in cfg.mlp_kinds() if kinds.mlp(k).expert_parallel]
    if not spread:
        raise MlmError(
            f"parallel.ep={ep}: the model has no MoE layers (its MLPs: {', '.join(cfg.mlp_kinds()) or 'none'}), "
            "so there are no experts to spread; set parallel.ep=1, or use an MoE model (model.mlp_kind=moe)"
        )
    if tp > 1 and not sequence_parallel:
        raise MlmError(
            f"parallel.ep={ep} with tp={tp}: the tp ranks are expert-parallel ranks too and must "
            "hold different tokens; set parallel.sequence_parallel=true (Megatron requires it as well)"
        )
    for kind in spread:
        kinds.mlp(kind).check_parallel(cfg, tp, ep, sequence_parallel)


def apply_expert_parallel(model: nn.Module, mesh: Mesh, sequence_parallel: bool, dispatcher: str) -> None:
    """Give every module of `model` (on the meta device) that declares an `ep_plan` (the MoE
    layers, `mlm.model.contract`) its 1/ep of the experts, with their placements, and the
    `dispatcher` ("alltoall" or "allgather") over `mesh`'s ep group. A no-op at ep = 1. Checks
    run before any change."""
    if mesh.ep == 1:
        return
    check_expert_parallel(model.cfg, mesh.ep, mesh.tp, sequence_parallel)
    group = mesh.group("ep")
    for _, module, plan in declaring(model, "ep_plan"):
        for path, style in plan.items():
            if style == "dispatcher":
                exchange = (
                    AllToAllDispatcher(group, mesh.ep)
                    if dispatcher == "alltoall"
                    else AllGatherDispatcher(group, mesh.ep, mesh.ep_rank)
                )
                setattr(module, path, exchange)
                continue
            w = submodule(module, path)
            if w is None:  # not built in this configuration (a plain MLP's gate)
                continue
            place = expert_sharded(mesh, tuple(w.weight.shape))
            assert w.weight.device.type == "meta", "apply expert parallelism before materialising"
            w.weight = nn.Parameter(torch.empty(place.shape, device="meta", dtype=w.weight.dtype))
            w.__dict__.setdefault("placements", {})["weight"] = place


@torch.no_grad()
def expert_load_step(model: nn.Module, mesh: Mesh, sequence_parallel: bool = False) -> dict[str, float]:
    """Once per step, after backward: every expert-parallel layer's tokens per expert of the step
    (`take_load`), summed over the stage's ranks that routed different tokens (dp; cp; tp under
    sequence parallelism). Each layer then updates its routing state from it (`update_routing`:
    the MoE layers' aux-loss-free expert bias) and the load metrics per layer are returned:
    `moe.load_max_mean.L` (the busiest expert's tokens over the mean: 1 is balanced) and
    `moe.dropped.L` (the share of token copies dropped over capacity). Collective over the stage."""
    taken = [(m, m.take_load()) for _, m, _ in declaring(model, "ep_plan")]
    taken = [(m, t) for m, t in taken if t is not None]
    if not taken:
        return {}
    counts = torch.stack([torch.cat([load, dropped.view(1)]) for _, (load, dropped) in taken])
    # the ranks routing other tokens: dp, and those holding the sequences' other parts (tp under
    # sequence parallelism, cp)
    for group in (mesh.dp_group, mesh.sequence_group(sequence_parallel)):
        if group is not None:
            dist.all_reduce(counts, group=group)
    loads, dropped = counts[:, :-1], counts[:, -1]
    for (module, _), load in zip(taken, loads, strict=True):
        module.update_routing(load)
    ratio = (loads.max(1).values / loads.mean(1).clamp(min=1e-9)).tolist()
    share = (dropped / loads.sum(1).clamp(min=1)).tolist()  # one device sync for all layers
    out = {}
    for (moe, _), r, d in zip(taken, ratio, share, strict=True):
        out[f"moe.load_max_mean.{moe.layer}"] = r
        out[f"moe.dropped.{moe.layer}"] = d
    return out
