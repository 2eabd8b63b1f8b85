"""The MoE router: which experts each token goes to, with what weight, and the balancing losses.

Megatron's `TopKRouter` math (`topk_routing_with_score_function`), all in fp32:

    softmax, default        top-k of the logits, softmax over those k (= HF Mixtral / Qwen3-MoE:
                            softmax over all, top-k, renormalise)
    softmax, pre_softmax    softmax over all experts, top-k, no renormalisation (Qwen2-MoE)
    sigmoid                 s = sigmoid(logits); top-k of s (+ the selection-only expert bias);
                            the weights are the unbiased s of the chosen, over their sum (k > 1)

then the weights times `router_topk_scaling_factor`. Group-limited top-k (DeepSeek's n_group /
topk_group) first keeps, per token, the `group_topk` groups with the largest sum of their top
k / group_topk scores, and chooses among their experts only.

Balancing losses, each from this rank's tokens; under sequence parallelism (`group`: the tp
ranks holding the other sequence shards) the token counts are summed over the group and each
rank returns its share, so the shares add up to the loss of the whole sequence:

    aux (Switch)        coeff · E / (k · N²) · Σ_e count_e · Σ_t p_te     (1 · coeff when balanced)
    seq aux (DeepSeek)  the same per sequence, averaged over the batch
    z-loss              coeff · Σ_t logsumexp(logits_t)² / N

p are the scores over all experts (softmax, or the sigmoid normalised over all experts), N the
tokens of the micro-batch. Shape legend: N tokens, E experts, K top-k, B batch, T sequence.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mlm.config import MoEConfig


def topk(scores_NE: torch.Tensor, k: int, groups: int | None, group_topk: int | None):
    """(values, indices) of the top `k` of each row; group-limited when `groups` is set."""
    if not groups:
        return torch.topk(scores_NE, k, dim=-1)
    N, E = scores_NE.shape
    per_group = scores_NE.view(N, groups, E // groups)
    group_scores = per_group.topk(k // group_topk, dim=-1).values.sum(-1)  # [N, groups]
    chosen = torch.topk(group_scores, group_topk, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen, True)
    masked = per_group.masked_fill(~keep[..., None], float("-inf")).view(N, E)
    return torch.topk(masked, k, dim=-1)


def route(logits_NE: torch.Tensor, cfg: MoEConfig, bias_E: torch.Tensor | None = None):
    """(weights [N, K], experts [N, K]) from fp32 router logits."""
    k, groups, gk = cfg.router_topk, cfg.router_num_groups, cfg.router_group_topk
    if cfg.router_score_function == "softmax":
        if cfg.router_pre_softmax:
            probs_NK, experts_NK = topk(logits_NE.softmax(-1), k, groups, gk)
        else:
            top_NK, experts_NK = topk(logits_NE, k, groups, gk)
            probs_NK = top_NK.softmax(-1)
    else:
        scores_NE = logits_NE.sigmoid()
        choice_NE = scores_NE if bias_E is None else scores_NE + bias_E
        experts_NK = topk(choice_NE, k, groups, gk).indices
        probs_NK = scores_NE.gather(1, experts_NK)
        if k > 1:
            probs_NK = probs_NK / (probs_NK.sum(-1, keepdim=True) + 1e-20)
    if cfg.router_topk_scaling_factor is not None:
        probs_NK = probs_NK * cfg.router_topk_scaling_factor
    return probs_NK, experts_NK


def aux_scores(logits_NE: torch.Tensor, cfg: MoEConfig) -> torch.Tensor:
    """The scores over all experts that the balancing losses use (Megatron's
    `compute_routing_scores_for_aux_loss`): softmax, or the sigmoid normalised over all experts."""
    if cfg.router_score_function == "softmax":
        return logits_NE.softmax(-1)
    s = logits_NE.sigmoid()
    return s / (s.sum(-1, keepdim=True) + 1e-20)


def _sum_over(t: torch.Tensor, group) -> torch.Tensor:
    if group is not None:
        t = t.clone()
        dist.all_reduce(t, group=group)
    return t


def _group_size(group) -> int:
    return dist.get_world_size(group) if group is not None else 1


def aux_loss(scores_NE, selected_NE, k: int, coeff: float, group=None) -> torch.Tensor:
    """Switch/GShard load-balancing loss over the micro-batch (this rank's share)."""
    N, E = scores_NE.shape
    counts_E = _sum_over(selected_NE.sum(0).float(), group)
    total = N * _group_size(group)
    return (scores_NE.sum(0) * counts_E).sum() * (E * coeff / (k * total * total))


def seq_aux_loss(scores_NE, selected_NE, batch: int, k: int, coeff: float, group=None) -> torch.Tensor:
    """DeepSeek's sequence-wise balancing loss: the aux loss of each sequence, averaged (this
    rank's share; under sequence parallelism the rows are this rank's part of each sequence)."""
    N, E = scores_NE.shape
    T = N // batch * _group_size(group)  # whole sequence length
    counts_BE = _sum_over(selected_NE.view(batch, -1, E).sum(1).float(), group)
    probs_BE = scores_NE.view(batch, -1, E).sum(1) / T
    return (counts_BE * E / (k * T) * probs_BE).sum(-1).mean() * coeff


def z_loss(logits_NE: torch.Tensor, coeff: float, group=None) -> torch.Tensor:
    """Router z-loss (ST-MoE): coeff · mean logsumexp² over the micro-batch (this rank's share)."""
    total = logits_NE.shape[0] * _group_size(group)
    return torch.logsumexp(logits_NE, -1).square().sum() * (coeff / total)


def capacity(tokens: int, cfg: MoEConfig) -> int:
    """Megatron's `get_capacity`: ceil(tokens · k / E · capacity_factor)."""
    return math.ceil(tokens * cfg.router_topk / cfg.num_experts * cfg.capacity_factor)


def drop_over_capacity(probs_NE: torch.Tensor, selected_NE: torch.Tensor, cfg: MoEConfig):
    """(probs, selected) [N, E] after capacity: each expert keeps at most `capacity` tokens, those
    with the highest weights ("probs") or the first ones ("position"); with `pad_to_capacity`
    every expert gets exactly `capacity` rows (tokens it was not chosen by come with weight 0)."""
    N = probs_NE.shape[0]
    C = min(capacity(N, cfg), N)
    if cfg.token_drop_policy == "probs":
        rank_NE = probs_NE.detach().masked_fill(~selected_NE, -1.0)
        keep_idx = torch.topk(rank_NE, C, dim=0).indices  # [C, E]
        keep_NE = torch.zeros_like(selected_NE).scatter_(0, keep_idx, True)
    else:
        order = torch.cumsum(selected_NE.int(), dim=0)  # position among the expert's tokens
        keep_NE = order <= C
        if cfg.pad_to_capacity:  # fill up with the first tokens not chosen
            spare = torch.cumsum((~selected_NE).int(), dim=0)
            keep_NE = torch.where(selected_NE, keep_NE, spare <= C - selected_NE.sum(0).clamp(max=C))
    mask_NE = keep_NE if cfg.pad_to_capacity else keep_NE & selected_NE
    return probs_NE * mask_NE, mask_NE


def sparse(probs_NK: torch.Tensor, experts_NK: torch.Tensor, num_experts: int):
    """[N, K] weights and indices as dense [N, E] weights (0 off the chosen) and a selection mask."""
    N = probs_NK.shape[0]
    probs_NE = torch.zeros(N, num_experts, dtype=probs_NK.dtype, device=probs_NK.device)
    probs_NE = probs_NE.scatter(1, experts_NK, probs_NK)
    selected_NE = torch.zeros(N, num_experts, dtype=torch.bool, device=probs_NK.device)
    return probs_NE, selected_NE.scatter_(1, experts_NK, True)


def router_logits(x_ND: torch.Tensor, weight_ED: torch.Tensor) -> torch.Tensor:
    """x · Wᵀ in fp32 (outside autocast), Megatron's moe_router_dtype=fp32."""
    with torch.autocast(x_ND.device.type, enabled=False):
        return F.linear(x_ND.float(), weight_ED.float())
