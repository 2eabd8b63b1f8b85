"""The mixture-of-experts MLP kind ("moe"): router → token dispatch → experts → combine, plus
optional shared experts (Megatron's MoELayer; Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek).

    y = Σ_k w_k · expert_{e_k}(x)  [+ sigmoid(x · g) ·] shared(x)

A dispatcher moves the (token, expert) pairs to the experts and the results back. Here it is
`LocalDispatcher` (every expert on this rank); `mlm.parallel.expert` swaps in the all-to-all or
all-gather dispatcher under expert parallelism, with this rank's slice of the experts, from
outside. The balancing losses reach the total loss through `aux_losses` (`mlm.model.aux_loss`),
named per layer: `load_balancing.L`, `seq_load_balancing.L`, `z_loss.L`. Each forward in
training adds this micro-batch's tokens per expert to `load` (and dropped ones to `dropped`),
which the trainer reads once per step (load metrics, the expert-bias update) and resets.

Shape legend: B batch, T sequence (this rank's shard under sequence parallelism), D hidden,
N = B·T tokens, E experts, K top-k, M token copies sent to experts.
"""

from __future__ import annotations

import torch
from torch import nn

from mlm.config import ModelConfig
from mlm.model.aux_loss import recomputing
from mlm.model.kinds.dense.module import MLP
from mlm.model.kinds.moe import router as R
from mlm.model.kinds.moe.experts import GroupedExperts
from mlm.model.ops import Ops


class LocalDispatcher:
    """Every expert on this rank: group the pairs by expert, run the experts, sum weighted back."""

    def __call__(self, x_ND, probs_NE, mask_NE, experts: GroupedExperts) -> torch.Tensor:
        expert_M, token_M = mask_NE.T.nonzero(as_tuple=True)  # grouped by expert
        counts = mask_NE.sum(0).tolist()
        y_MD = experts(x_ND[token_M], counts)
        w_M = probs_NE[token_M, expert_M]
        return combine(y_MD, w_M, token_M, x_ND.shape[0])


def combine(y_MD, w_M, token_M, n: int) -> torch.Tensor:
    """Σ over each token's pairs of weight · expert output: [M, D] → [n, D] (in y's dtype)."""
    out = y_MD.new_zeros(n, y_MD.shape[1])
    return out.index_add(0, token_M, (y_MD.float() * w_M[:, None]).to(y_MD.dtype))


class Router(nn.Module):
    """The router weight [E, D] and, for aux-loss-free balancing, the selection-only expert bias
    (a parameter that never trains: it is checkpointed with the model and updated by
    `update_expert_bias`)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E = cfg.moe.num_experts
        self.weight = nn.Parameter(torch.empty(E, cfg.hidden_size))
        self.expert_bias = (
            nn.Parameter(torch.empty(E), requires_grad=False) if cfg.moe.router_enable_expert_bias else None
        )


class MoE(nn.Module):
    # Router and experts are replicated over tp (under sequence parallelism each tp rank routes
    # its own shard, and their gradients are summed over tp, as every such parameter's are);
    # expert parallelism shards the experts from outside (mlm.parallel.expert). The shared
    # experts are a dense MLP with its own tp plan.
    tp_plan = {"sequence_group": "sp_group"}
    ep_plan = {
        "experts.gate": "experts",
        "experts.up": "experts",
        "experts.down": "experts",
        "dispatcher": "dispatcher",
    }
    fp8_exempt = ("shared_gate",)
    residual_projections = (
        "experts.down",
    )  # the shared experts are an MLP, which declares its own  # a [1, D] gate: nothing for fp8 to gain

    def __init__(self, cfg: ModelConfig, layer: int = 0, ops: Ops | None = None):
        super().__init__()
        ops = ops or Ops()
        m = self.options = cfg.moe
        self.layer = layer
        self.router = Router(cfg)
        self.experts = GroupedExperts(
            m.num_experts, cfg.hidden_size, cfg.expert_ffn_size, cfg.activation, m.experts_impl, ops
        )
        self.shared = (
            MLP(cfg, layer, ops, ffn_size=m.shared_expert_ffn_hidden_size)
            if m.shared_expert_ffn_hidden_size
            else None
        )
        self.shared_gate = (
            nn.Linear(cfg.hidden_size, 1, bias=False)
            if self.shared is not None and m.shared_expert_gate
            else None
        )
        self.dispatcher = LocalDispatcher()
        self.aux_losses = None  # the model's AuxLosses (set by GPT)
        self.sequence_group = None  # tp group under sequence parallelism (tp ranks hold other tokens)
        self.load: torch.Tensor | None = None  # tokens per expert since the last read [E]
        self.dropped: torch.Tensor | None = None  # (token, expert) pairs dropped over capacity

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        B, T, D = x_BTD.shape
        m = self.options
        x_ND = x_BTD.reshape(-1, D)
        logits_NE = R.router_logits(x_ND, self.router.weight)
        bias = self.router.expert_bias
        probs_NK, experts_NK = R.route(logits_NE, m, bias)
        probs_NE, selected_NE = R.sparse(probs_NK, experts_NK, m.num_experts)
        mask_NE = selected_NE
        if m.capacity_factor is not None:
            probs_NE, mask_NE = R.drop_over_capacity(probs_NE, selected_NE, m)
        out_ND = self.dispatcher(x_ND, probs_NE, mask_NE, self.experts)
        out_BTD = out_ND.view(B, T, D).to(x_BTD.dtype)
        if self.shared is not None:
            shared = self.shared(x_BTD)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(x_BTD)) * shared
            out_BTD = out_BTD + shared
        if self.training and torch.is_grad_enabled():
            out_BTD = self._balance(out_BTD, logits_NE, selected_NE, mask_NE, B)
        return out_BTD

    def _balance(self, out, logits_NE, selected_NE, mask_NE, batch: int):
        """Attach the balancing losses to `out`; count the load (not again when recomputing)."""
        m, group = self.options, self.sequence_group
        if not recomputing():
            with torch.no_grad():
                load = selected_NE.sum(0).float()
                dropped = (selected_NE & ~mask_NE).sum().float()
                self.load = load if self.load is None else self.load + load
                self.dropped = dropped if self.dropped is None else self.dropped + dropped
        if self.aux_losses is None:
            return out
        partial = group is not None  # each tp rank holds its share of the loss
        k = m.router_topk
        if m.aux_loss_coeff or m.seq_aux_loss_coeff:
            scores_NE = R.aux_scores(logits_NE, m)
        if m.aux_loss_coeff:
            aux = R.aux_loss(scores_NE, selected_NE, k, m.aux_loss_coeff, group)
            out = self.aux_losses.attach(out, aux, f"load_balancing.{self.layer}", partial)
        if m.seq_aux_loss_coeff:
            aux = R.seq_aux_loss(scores_NE, selected_NE, batch, k, m.seq_aux_loss_coeff, group)
            out = self.aux_losses.attach(out, aux, f"seq_load_balancing.{self.layer}", partial)
        if m.z_loss_coeff:
            aux = R.z_loss(logits_NE, m.z_loss_coeff, group)
            out = self.aux_losses.attach(out, aux, f"z_loss.{self.layer}", partial)
        return out

    def inactive_parameters(self) -> int:
        """Parameters one token's forward skips: the (E − k)/E share of the routed experts (the
        shared experts and the router count in full)."""
        E, k = self.options.num_experts, self.options.router_topk
        routed = sum(p.numel() for p in self.experts.parameters())  # E whole experts
        return routed // E * (E - k)

    @torch.no_grad()
    def update_routing(self, load: torch.Tensor) -> None:
        """Aux-loss-free balancing (DeepSeek-V3, Megatron): the selection-only expert bias moves by
        rate · sign(mean load − load), from the step's tokens per expert over the stage."""
        if self.router.expert_bias is not None:
            self.router.expert_bias.add_(
                torch.sign(load.mean() - load) * self.options.router_bias_update_rate
            )

    def take_load(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(tokens per expert [E], dropped pairs) counted since the last call; None if none."""
        if self.load is None:
            return None
        out, self.load, self.dropped = (self.load, self.dropped), None, None
        return out
