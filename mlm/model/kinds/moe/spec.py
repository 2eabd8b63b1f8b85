"""The "moe" MLP's spec (Megatron's MoELayer; Mixtral, Qwen-MoE, DeepSeek; `module.py`): the
router and a shared experts' gate replicated over tp, E / ep whole routed experts per rank (expert
tensor parallelism 1: replicated over tp at ep = 1), shared experts split over tp like a dense MLP.
Torch-free."""

from __future__ import annotations

from mlm.config import ensure
from mlm.model.kinds import register
from mlm.model.kinds.dense.spec import activation_passes, matrices, mlp_params
from mlm.model.kinds.spec import Flops, MLPSpec, Param, PartWork


@register
class MoESpec(MLPSpec):
    name = "moe"
    symbol = "E"
    module = "mlm.model.kinds.moe.module:MoE"
    summary = "mixture of experts: router, routed and shared experts (model.moe)"
    expert_parallel = True

    def check(self, m):
        ensure(
            m.moe.num_experts >= 1,
            "model.mlp_kind=moe needs experts: set model.moe.num_experts (and model.moe.router_topk)",
        )

    def check_parallel(self, m, tp, ep, sequence_parallel):
        shared = m.moe.shared_expert_ffn_hidden_size
        ensure(
            not shared or shared % tp == 0,
            f"model.moe.shared_expert_ffn_hidden_size={shared} is not divisible by parallel.tp={tp}: the "
            f"shared experts split over tp like a dense MLP; choose a tp that divides {shared}",
        )
        E = m.moe.num_experts
        ensure(
            E % ep == 0,
            f"model.moe.num_experts={E} is not divisible by parallel.ep={ep}: each ep rank holds "
            f"E / ep whole experts; choose an ep that divides {E}",
        )

    def params(self, m, prefix, tp, ep):
        h, moe, F = m.hidden_size, m.moe, m.expert_ffn_size
        E, k = moe.num_experts, moe.router_topk
        out = [Param(f"{prefix}.router.weight", E * h, rows=E)]
        if moe.router_enable_expert_bias:
            out.append(Param(f"{prefix}.router.expert_bias", E, trainable=False))
        names = (["gate", "up"] if m.activation == "swiglu" else ["up"]) + ["down"]
        for n in names:
            numel = E // ep * F * h
            out.append(
                Param(
                    f"{prefix}.experts.{n}.weight",
                    numel,
                    linear=True,
                    expert_parallel=ep > 1,
                    active=numel - numel // E * (E - k),  # a token uses k of the E experts
                    rows=E // ep,  # [experts, out, in]
                )
            )
        if moe.shared_expert_ffn_hidden_size:
            out += mlp_params(m, f"{prefix}.shared", moe.shared_expert_ffn_hidden_size, tp)
            if moe.shared_expert_gate:
                out.append(Param(f"{prefix}.shared_gate.weight", h, linear=True, rows=1))
        return out

    def flops(self, m):
        """k experts of `expert_ffn_size`, the shared experts (split over tp), and the router's
        6·D·E (+ 6·D for the shared experts' gate): what a token uses, so MFU follows the active
        parameters."""
        D, moe = m.hidden_size, m.moe
        shared = moe.shared_expert_ffn_hidden_size or 0
        gate = 6 * D if shared and moe.shared_expert_gate else 0
        mats = matrices(m)
        return Flops(
            tp=6 * mats * D * shared,
            routed=6 * mats * D * moe.router_topk * m.expert_ffn_size,
            router=6 * D * moe.num_experts + gate,
        )

    def saved(self, m, mb):
        """Measured on the layer: each rank routes its N = e/u tokens (its sequence shard under
        sequence parallelism) and its experts compute M = N·k token copies (balanced routing;
        under ep the copies it receives): the router's fp32 input and scores, the top-k weights
        and indices, each copy's token index and weight; the copies' inputs; the experts' 3·M·F·A
        (gated); their outputs and the fp32 weighted copy; shared experts as a dense MLP of their
        width. `bmm` experts (CPU's auto) pad every expert to the busiest, up to +25 % in bf16."""
        moe = m.moe
        h, F, E, k, A = m.hidden_size, m.expert_ffn_size, moe.num_experts, moe.router_topk, mb.A
        e, u = mb.e, mb.u
        N = e / u
        M = N * k
        out = {
            "router": N * h * 4 + N * E * 4 + N * k * 12 + M * 12,
            "expert inputs": M * h * A,
            "experts": matrices(m) * M * F * A,
            "expert outputs": M * h * (A + 4),
        }
        shared = moe.shared_expert_ffn_hidden_size
        if shared:
            # its input is all-gathered over tp under sequence parallelism (as a dense MLP's), else
            # the norm's output, in fp32 the router's input already
            linear_in = e * h * A if u > 1 else (N * h * A if A == 2 else 0)
            # the gate: the shared experts' output and the sigmoid, saved by their product
            gate = N * h * A + N * 4 if moe.shared_expert_gate else 0
            out["shared experts"] = linear_in + (matrices(m) * e * shared / mb.tp * A) + gate
        return out

    def work(self, m, mb, sw, times):
        """The router's softmax, top-k and aux over E, the k copies permuted and unpermuted (4 + 4
        over k·h), the experts' activation on e/u·k rows; grouped experts: one GEMM per matrix."""
        moe = m.moe
        h, k, A, e, u = m.hidden_size, moe.router_topk, mb.A, mb.e, mb.u
        shared = moe.shared_expert_ffn_hidden_size or 0
        act = activation_passes(m, sw)
        part = PartWork(gemms=1 + (3 if shared else 0) + matrices(m))
        w = part.work
        w.add((2, 2, 4, 4), moe.num_experts, e / u, A, times.full)
        w.add((4, 4, 4, 4), k * h, e / u, A, times.full)
        w.add(act, m.expert_ffn_size, e / u * k, A, times.norm_act)
        # fp8 GEMM groups (hidden width, rows): the routed copies' where the software runs them in fp8
        groups = [(m.expert_ffn_size, e / u * k)] if sw.fp8_experts else []
        if shared:
            w.add(act, shared / mb.tp, e, A, times.norm_act)
            groups.append((shared / mb.tp, e))
        part.fp8 = [(h + width, width * (matrices(m) - 1) + h, rows) for width, rows in groups]
        return part

    def gemm_side(self, m, mb):
        """Rows per expert = the copies a rank's E/ep experts receive from the ep ranks."""
        rows = mb.e / mb.u * m.moe.router_topk * mb.ep / m.moe.num_experts
        return min(rows, m.hidden_size, m.expert_ffn_size)

    def ep_exchange(self, m, mb):
        """alltoall: dispatch and combine, each this rank's N·k copies, (ep − 1)/ep of them away,
        in the autocast dtype; allgather: the group's tokens, weights and mask gathered, the
        outputs reduce-scattered, (ep − 1)·N·D each whatever the routing."""
        ep = mb.ep
        if ep <= 1:
            return []
        moe, h, A = m.moe, m.hidden_size, mb.A
        N = mb.e / mb.u
        if moe.token_dispatcher == "alltoall":
            away = N * moe.router_topk * h * (ep - 1) / ep
            return [("all_to_all", away * A), ("all_to_all", away * A)]
        return [("all_gather", ep * N * (h * A + moe.num_experts * 5)), ("reduce_scatter", ep * N * h * A)]

    def ep_buffers(self, m, mb):
        """The exchange's buffers of one layer (the norm's output: tokens in the compute dtype):
        alltoall the copies sent and received, allgather the gathered tokens and the outputs."""
        n, h, A = mb.e / mb.u, m.hidden_size, mb.A
        if m.moe.token_dispatcher == "alltoall":
            return 2 * n * m.moe.router_topk * h * A
        return mb.ep * n * h * 2 * A
