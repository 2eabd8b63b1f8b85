"""Predicted time of one training step of a layout, term by term, for the kernels and overlaps of a
software profile (`mlm.plan.software`: mlm's own by default, or what a published run used).

    GEMMs and attention
                per micro-batch and pipeline rank: its tokens (micro-batch × seq_length / cp: under
                context parallelism each rank holds 1/cp of every sequence, and the zigzag split
                gives every cp rank the same causal attention work) × its layers' GEMM FLOPs and
                the logits' on the last stage (Megatron's count, `mlm.flops`), plus recompute
                (full: one more forward of each layer; torchtitan's per-op selective policy: every
                other matmul's), over tp × peak (fp8's under train.fp8, but the logits' at the
                compute dtype's: the output layer is not fp8) × efficiency(smallest GEMM
                side) (`Hardware.efficiency`), but MLA's down-projections over peak × efficiency on
                this rank's e/u tokens (u = tp under sequence parallelism, else 1: replicated over
                tp, each rank computes them whole for its own tokens, Megatron's layout);
                the attention core (`core_seconds`): with flash attention the causal half at the
                profile's `attention_efficiency` of peak, without it two batched GEMMs over every
                score at the efficiency of the head dim; selective and full recompute repeat it;
                the last stage adds each MTP depth: its layer (never recomputed), eh_proj over its
                e/u tokens and another pass of the output layer;
                an MoE layer's router and k routed experts run whole on each rank over its e/u
                tokens, at the efficiency of the expert GEMMs' smallest side (rows per expert
                = e/u · k · ep / E: ep raises it), the router at the compute dtype's peak and the
                experts at fp8's only under the profile's fp8_experts
    memory-bound ops
                the bytes a micro-batch's norms, activations, RoPE, residual adds, attention copies
                (and without flash attention its softmax over the s × s scores), MoE dispatch, loss
                over the vocabulary, embedding, fp8 and autocast casts and gradient accumulation
                move (`mlm.plan.work`, by the profile's fused or torch-op kernels) over
                hbm_bandwidth × memory_efficiency
    launch overhead (exposed)
                kernels per micro-batch × the profile's launch_s, where that host time exceeds the
                GPU's work (small micro-batches of small models)
    data loading
                the micro-batch's tokens, labels, loss mask and positions (28 B a token) over the
                host link
    tp          per layer and micro-batch 4 all-reduces of [b, s, h] (2 forward, 2 backward; under
                sequence parallelism the same bytes as all-gathers + reduce-scatters; 6 with full
                recompute), ring cost 2(t−1)/t · bytes / bandwidth + latency, on NVLink when the tp
                group fits in a node and on the network (much slower) when it does not.
                MLA (`tp_layer_time`): the attention enters the tp region with its latents, not the
                hidden state: Q + C + R values per token (the query latent, the key/value latent
                and the rope key), or without a query latent h (q's input) + C + R in two
                collectives; the output's reduce and the MLP's stay h wide; full recompute repeats
                the forward's share (without SP the two output all-reduces, under SP the gathers
                and reduce-scatters, half of every pair)
    ep          per MoE layer and micro-batch the token exchange (`ep_exchange_time`): alltoall
                about 4 · (e/u) · k · h · bytes · (ep − 1)/ep, the shares for ranks in the node
                over NVLink, the rest over the network; not overlapped with compute (as in mlm) unless
                the profile's ep_overlap
    cp          per layer and micro-batch (`cp_exchange_time`), with s = seq_length / cp local tokens
                and one message = this rank's K and V, 2·b·s·(G/t)·K·A bytes, on NVLink when the
                cp group (tp·cp consecutive ranks) fits in a node, else on the network:
                p2p   forward cp − 1 ring steps each sending one message; backward cp − 1 steps
                      sending the message and the fp32 dK/dV accumulators, plus the accumulators'
                      last send home. Each step's transfer overlaps that step's attention compute
                      (1/cp of the core's forward time, `core_seconds`: the attention's own rate,
                      never fp8's; twice in the backward), so a step takes max(transfer,
                      compute) and only the excess counts; the last send is exposed. Recompute
                      repeats the forward ring where it re-runs the attention core (full;
                      selective with the profile's selective = "core").
                all_gather  all-gather K and V of the whole sequence before attention
                      ((cp − 1)/cp of 2·b·S·(G/t)·K·A per rank), reduce-scatter their gradients
                      in the backward (the same bytes), not overlapped; the forward's repeated
                      as the ring's.
    p2p         per micro-batch and model chunk one activation forward and one gradient backward,
                [b, s/sp, h] in the parameters' dtype, on NVLink if a pipeline neighbour is in the node, else the network
    bubble      the pipeline step is m · (compute + tp + ep + cp + p2p) / (1 − bubble_fraction(pp, m, vpp)),
                i.e. (pp − 1)/(vpp · m) more than the work itself (Narayanan et al. 2021)
    dp          gradient all-reduce (or reduce-scatter with the distributed optimizer) of the fp32
                (or bf16) gradient buffer over dp × cp, and under ep of the experts' buffer over edp, overlapped
                with the last micro-batch's backward (only the excess counts); the distributed
                optimizer's all-gather of the parameters (fp32, or bf16/fp16 under
                train.param_dtype) after the step, overlapped with the next step's first forward
                (only the excess over a third of a micro-batch's compute counts)
    fsdp        (the layout's fsdp / hsdp<N>, `fsdp_seconds`) instead of dp: per micro-batch every
                unit's parameters all-gathered over the shard group S in the parameters' dtype
                for the forward and again for the backward (once without
                parallel.fsdp_reshard_after_forward), behind the compute (a third of a
                micro-batch's forward, two thirds backward; the first unit's gather exposed);
                the fp32 gradients reduce-scattered over S in the last micro-batch's backward,
                then under HSDP all-reduced (1/S of them) across the dp·cp / S groups; NVLink
                when tp·S ranks fit in a node
    optimizer   fused AdamW, the gradient norm and zeroing the gradients are memory-bound: 36 bytes
                read or written per local element / (HBM bandwidth × memory efficiency)
    overlaps    by the profile: `tp_overlap` (the tp collectives in tp chunks pipelined with the
                GEMMs: the first chunk and any excess over the GEMMs count), `ep_overlap` (the
                all-to-all behind another micro-batch's compute), `overlap_grad_reduce` and
                `overlap_param_gather` (else the dp collectives count whole)

Tokens/s per GPU = global batch × seq / step / GPUs; MFU = Megatron model FLOPs (no recompute)
per step / (step × GPUs × peak).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import NamedTuple

from mlm.config import Config, LayerSpec
from mlm.flops import eh_proj_flops, logits_flops, part_flops
from mlm.layout import Layout
from mlm.model import kinds
from mlm.parallel.schedules import bubble_fraction
from mlm.plan.job import Job
from mlm.plan.memo import cached
from mlm.plan.memory import Stage, act_bytes, local_tokens, micro, micro_key, param_bytes, state_parts
from mlm.plan.work import Work, embedding_work, layer_work, loss_work, parameter_work

OPTIMIZER_BYTES = 36
"""Bytes per local element of the optimizer step: fused AdamW reads the fp32 parameter, gradient
and two moments and writes three (28), the gradient norm reads the gradient (4), and zeroing the
gradient buffer writes it (4)."""


@dataclass
class Timing:
    """Seconds per step by term, and the rates derived from them."""

    terms: dict[str, float]
    compute_s: float
    """The compute-bound part of the step (scales with 1 / efficiency)."""
    comm_s: float
    """The communication-bound part (scales with 1 / bandwidth)."""
    fixed_s: float
    """The rest (the HBM-bound optimizer step)."""
    step_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    gemm_efficiency: float


def _collective(bytes_: float, ranks: int, bandwidth: float, latency: float, factor: float) -> float:
    """Ring time of a collective moving `factor`·(ranks − 1)/ranks of `bytes_` per rank."""
    if ranks <= 1:
        return 0.0
    return factor * (ranks - 1) / ranks * bytes_ / bandwidth + latency


def _link(hw, in_node: bool) -> tuple[float, float]:
    """(bandwidth, latency) of NVLink inside a node, else of the network."""
    return (hw.intra_bandwidth, hw.intra_latency) if in_node else (hw.inter_bandwidth, hw.inter_latency)


def ep_ranks_per_node(ep: int, gpus_per_node: int) -> int:
    """Ranks of one expert-parallel group that share a node (at least): the group is ep consecutive
    ranks of a pipeline stage (Mesh.expert_groups: ep fastest), aligned to multiples of ep."""
    return math.gcd(ep, gpus_per_node)


def all_to_all_time(bytes_away: float, ep: int, gpus_per_node: int, hw) -> float:
    """One all-to-all in which a rank sends `bytes_away` to the other ep − 1 ranks of its group in
    equal shares: the shares for ranks in its node over NVLink, the rest over the network, one
    after the other (the network's share dominates once the group spans nodes)."""
    if ep <= 1:
        return 0.0
    local = ep_ranks_per_node(ep, gpus_per_node)
    near, far = bytes_away * (local - 1) / (ep - 1), bytes_away * (ep - local) / (ep - 1)
    latency = hw.intra_latency if local == ep else hw.inter_latency
    return near / hw.intra_bandwidth + far / hw.inter_bandwidth + latency


def ep_exchange_time(cfg: Config, job: Job, layout: Layout, kind: str) -> float:
    """One expert-parallel layer's token exchanges (MLP `kind`, its spec's `ep_exchange`) for one
    micro-batch, forward and backward (the backward reverses each, the forward runs again under
    full recompute). Each rank routes N = e/u tokens (its sequence shard).

    alltoall: dispatch and combine forward, their reverse backward; each moves this rank's N·k
    copies, (ep − 1)/ep of them to other ranks: the dispatch and the combine in the autocast
    dtype (the norm's output is in it, `kernels.lean`), the backward likewise, i.e. about
    4 · N · k · D · bytes · (ep − 1)/ep per layer and micro-batch.
    allgather: all-gather the tokens (autocast dtype), weights and mask of the group, reduce-scatter the
    outputs; (ep − 1)·N·D·bytes each, whatever the routing; the backward the reverse."""
    ep = layout.ep
    if ep <= 1:
        return 0.0
    hw = job.hardware
    passes = 2 if layout.recompute == "full" else 1  # forward exchanges (recompute repeats them)
    bw, lat = _link(hw, ep_ranks_per_node(ep, job.gpus_per_node) == ep)
    forward = 0.0
    for collective, bytes_ in kinds.mlp(kind).ep_exchange(cfg.model, micro(cfg, layout)):
        if collective == "all_to_all":
            forward += all_to_all_time(bytes_, ep, job.gpus_per_node, hw)
        else:  # all_gather, reduce_scatter: a ring moving (ep − 1)/ep of the whole
            forward += _collective(bytes_, ep, bw, lat, 1.0)
    return passes * forward + forward


def cp_link(job: Job, layout: Layout) -> tuple[float, float]:
    """(bandwidth, latency) of a cp group: tp·cp consecutive ranks (tp fastest, then cp), so
    NVLink when they fit in a node, else the network (the slowest hop paces a ring)."""
    return _link(job.hardware, layout.tp * layout.cp <= job.gpus_per_node)


def cp_exchange_time(cfg: Config, job: Job, layout: Layout, rate: float, kind: str) -> float:
    """Exposed seconds of one layer's cp exchange for one micro-batch, forward and backward (see
    the module doc) for mixer `kind`; `rate`: the FLOP/s its attention core runs at on this rank,
    in Megatron's count of its FLOPs (`mixer_flops(...).core` per token over `core_seconds`)."""
    cp = layout.cp
    if cp <= 1:
        return 0.0
    m = cfg.model
    A = act_bytes(cfg)
    S, s, b = cfg.data.seq_length, local_tokens(cfg, layout), layout.micro_batch
    spec = kinds.mixer(kind)
    kv = spec.cp_kv_elements(m, micro(cfg, layout), s)  # one message: this rank's K and V
    bw, lat = cp_link(job, layout)
    # the forward exchange again where recompute re-runs the attention core (as `core_seconds`)
    rerun = layout.recompute == "full" or (
        layout.recompute == "selective" and job.software.selective == "core"
    )
    passes = 2 if rerun else 1
    if layout.cp_comm_type == "all_gather":
        # K and V gathered separately (two collectives), their gradients reduce-scattered
        one = 2 * _collective(kv * cp / 2 * A, cp, bw, lat, 1.0)
        return passes * one + one
    core_forward = b * s * spec.flops(m, S).core / 3 / rate  # the local queries (rate: all tp ranks)
    step = core_forward / cp
    forward = (cp - 1) * max(0.0, kv * A / bw + lat - step)
    backward = (cp - 1) * max(0.0, kv * (A + 4) / bw + lat - 2 * step) + kv * 4 / bw + lat
    return passes * forward + backward


def tp_layer_time(cfg: Config, job: Job, layout: Layout, spec: LayerSpec) -> float:
    """One layer's tp collectives for one micro-batch, forward and backward (see the module doc):
    per region boundary pair one all-reduce of [b, s, width] (2(t−1)/t of its bytes + a latency):
    the mixer's entries (its spec's `tp_entries`: the hidden state for GQA, MLA's latents) and
    its output (h), the MLP's entry and output (h); under SP the same bytes as an all-gather and a
    reduce-scatter. Full recompute repeats the forward's share: without SP the outputs'
    all-reduces, under SP half of every pair (its forward collective)."""
    t = layout.tp
    if t <= 1:
        return 0.0
    h = cfg.model.hidden_size
    e = layout.micro_batch * local_tokens(cfg, layout)
    A = act_bytes(cfg)
    bw, lat = _link(job.hardware, t <= job.gpus_per_node)
    widths: list[float] = []
    if spec.mixer is not None:
        widths += [*kinds.mixer(spec.mixer).tp_entries(cfg.model), h]
    if spec.mlp is not None:
        widths += [h, h]
    one_way = sum((t - 1) / t * e * w * A / bw for w in widths)  # one collective per pair
    sec = 2 * one_way + len(widths) * lat
    if layout.recompute == "full":
        if layout.sequence_parallel:
            sec += one_way + len(widths) * lat / 2
        else:  # the outputs' all-reduces again, one per half
            halves = (spec.mixer is not None) + (spec.mlp is not None)
            sec += halves * _collective(e * h * A, t, bw, lat, 2.0)
    return sec


def gemm_rates(job: Job, layout: Layout) -> tuple[float, float, float]:
    """(peak FLOP/s, GEMM efficiency of the layer's projections, rate of its tp-split GEMMs):
    efficiency at the smallest GEMM side (tokens of a micro-batch, h/t, ffn/t); the peak is fp8's
    under train.fp8 (the layers' linear GEMMs; attention, the routers and the output layer stay
    in the compute dtype, the routed experts unless `Software.fp8_experts`: `mlm.parallel.fp8`)."""
    cfg, hw = job.cfg, job.hardware
    e, t = layout.micro_batch * local_tokens(cfg, layout), layout.tp
    peak = hw.peak("fp8" if cfg.train.fp8.format else cfg.train.precision)
    eff = hw.efficiency(min(e, cfg.model.hidden_size / t, cfg.model.ffn_size / t))
    return peak, eff, t * peak * eff


def core_seconds(job: Job, layout: Layout, recompute: str, kind: str) -> float:
    """Seconds per token of one layer's attention core (scores and values over the sequence) on a
    rank, for mixer `kind`. With flash attention (`Software.flash_attention`) the causal half
    Megatron's count includes is skipped and the kernel runs at `attention_efficiency` of peak;
    without it both batched GEMMs run over every score at the efficiency of their smallest side,
    the head dim (the spec's `core_side`; their s × s outputs' memory traffic is
    `mlm.plan.work`'s). Full recompute repeats the forward (a third of the work), selective
    recompute repeats it too (not torchtitan's per-op policy, which keeps the attention output)."""
    cfg, hw, sw = job.cfg, job.hardware, job.software
    m, t = cfg.model, layout.tp
    spec = kinds.mixer(kind)
    core = spec.flops(m, cfg.data.seq_length).core
    again = recompute == "full" or (recompute == "selective" and sw.selective == "core")
    core *= 4 / 3 if again else 1.0
    peak = hw.peak(cfg.train.precision)
    if sw.flash_attention:
        return core / 2 / (t * peak * sw.attention_efficiency)
    return core / (t * peak * hw.efficiency(spec.core_side(m)))


class _LayerTimes(NamedTuple):
    """What a micro-batch of `micro(cfg, layout)` costs per layer kind and per stage part, whatever
    the pipeline, dp or optimizer (computed once per micro in a search, `mlm.plan.memo`)."""

    gemm: dict[LayerSpec, float]
    """Seconds per token of a layer's GEMMs and attention core."""
    work: dict[LayerSpec, Work]
    tp: dict[LayerSpec, float]
    ep: dict[LayerSpec, float]
    cp: dict[LayerSpec, float]
    logits: float
    """Seconds per token of the output layer."""
    mtp_gemm: float
    mtp_work: Work
    mtp_tp: float
    mtp_ep: float
    mtp_cp: float
    loss: Work
    embed: Work
    data: float
    """Seconds of the micro-batch's host-to-GPU copy."""
    eff: float
    """The GEMM efficiency of the layer's projections (`gemm_rates`)."""


def _layer_times(job: Job, layout: Layout) -> _LayerTimes:
    cfg: Config = job.cfg
    hw, m, sw = job.hardware, cfg.model, job.software
    u = layout.tp if layout.sequence_parallel else 1
    logits_per_token = logits_flops(m)
    peak, eff, rate = gemm_rates(job, layout)
    compute_peak = hw.peak(cfg.train.precision)  # what stays out of fp8 runs at (`gemm_rates`)
    logits_rate = layout.tp * compute_peak * eff
    whole = replace(layout, recompute="none")  # MTP depths: `mlm.parallel.recompute` never wraps them
    mb = micro(cfg, layout)

    def gemm_seconds(spec: LayerSpec, recompute: str) -> float:
        """Seconds per token of one layer's GEMMs: tp-split projections at `rate`; replicated ones
        (MLA's down-projections) whole on each tp rank over its e/u tokens; the router and the
        routed experts whole on each rank, on its e/u tokens, at the experts' GEMM efficiency
        (their spec's `gemm_side`: rows per expert = the copies a rank's E/ep experts receive from
        the ep ranks) and at fp8's peak only where the software runs them in fp8
        (`Software.fp8_experts`). The attention core is `core_seconds`'."""
        rerun = 4 / 3 if recompute == "full" else 1.0  # full: one more forward
        if recompute == "selective" and sw.selective == "op":
            rerun = 7 / 6  # torchtitan's per-op policy: every other matmul's forward again
        f = part_flops(m, spec, cfg.data.seq_length)
        sec = f.tp * rerun / rate
        sec += f.replicated * rerun / (peak * eff * u)
        side = kinds.mlp(spec.mlp).gemm_side(m, mb) if spec.mlp is not None else None
        if side is not None:
            eff_e = hw.efficiency(side)
            experts_peak = peak if sw.fp8_experts else compute_peak  # the router never in fp8
            sec += (f.routed * rerun / (eff_e * experts_peak) + f.router * rerun / (eff * compute_peak)) / u
        return sec

    def core(spec: LayerSpec, lo: Layout, recompute: str) -> float:
        return core_seconds(job, lo, recompute, spec.mixer) if spec.mixer is not None else 0.0

    def ep_time(spec: LayerSpec, lo: Layout) -> float:
        """One layer's expert-parallel exchange (0 unless its MLP is spread by ep)."""
        if spec.mlp is None or not kinds.mlp(spec.mlp).expert_parallel:
            return 0.0
        return ep_exchange_time(cfg, job, lo, spec.mlp)

    def cp_time(spec: LayerSpec, lo: Layout) -> float:
        """One layer's cp exchange: its mixer's keys and values around the cp ranks, hidden behind
        the FLOP/s (Megatron's count of the core) its attention runs at."""
        if layout.cp <= 1 or spec.mixer is None:
            return 0.0
        core_flops = kinds.mixer(spec.mixer).flops(m, cfg.data.seq_length).core
        rate = core_flops / core_seconds(job, whole, "none", spec.mixer)
        return cp_exchange_time(cfg, job, lo, rate, spec.mixer)

    specs = set(job.layer_kinds)
    # one MTP depth: its layer (the last layer's kinds, never recomputed), eh_proj (replicated over
    # tp, on this rank's e/u tokens) and another pass of the output layer and its loss
    last = job.layer_kinds[-1]
    mtp_gemm = (
        gemm_seconds(last, "none")
        + core(last, whole, "none")
        + eh_proj_flops(m) / (peak * eff * u)
        + logits_per_token / logits_rate
    )
    mtp_work = layer_work(cfg, whole, sw, last, "none")
    mtp_work += loss_work(cfg, layout, sw)
    return _LayerTimes(
        gemm={k: gemm_seconds(k, layout.recompute) + core(k, layout, layout.recompute) for k in specs},
        work={k: layer_work(cfg, layout, sw, k, layout.recompute) for k in specs},
        tp={k: tp_layer_time(cfg, job, layout, k) for k in specs},
        ep={k: ep_time(k, layout) for k in specs},
        cp={k: cp_time(k, layout) for k in specs},
        logits=logits_per_token / logits_rate,
        mtp_gemm=mtp_gemm,
        mtp_work=mtp_work,
        mtp_tp=tp_layer_time(cfg, job, whole, last),
        # an MTP depth's layer communicates as a layer does, without recompute
        mtp_ep=ep_time(last, whole),
        mtp_cp=cp_time(last, whole),
        loss=loss_work(cfg, layout, sw),
        embed=embedding_work(cfg, layout),
        # the batch from host memory: tokens, labels, loss mask and positions (8 + 8 + 4 + 8 bytes)
        data=layout.micro_batch * local_tokens(cfg, layout) * 28 / hw.host_bandwidth,
        eff=eff,
    )


def _stage_time(job: Job, layout: Layout, stage: Stage, lt: _LayerTimes) -> tuple[float, ...]:
    """(busy, GEMMs and attention, memory-bound, exposed launches, tp, ep, cp) seconds of one
    micro-batch on `stage`, busy their sum (the pipeline's p2p and the data come on top)."""
    cfg, hw, sw = job.cfg, job.hardware, job.software
    t, e = layout.tp, layout.micro_batch * local_tokens(cfg, layout)
    c = e * sum(lt.gemm[k] * n for k, n in stage.kind_counts)
    c += e * ((lt.logits if stage.last else 0.0) + stage.mtp * lt.mtp_gemm)
    w = Work()
    parts = [(lt.work[k], n) for k, n in stage.kind_counts]
    for part, times in parts + [(lt.loss, stage.last), (lt.embed, stage.first), (lt.mtp_work, stage.mtp)]:
        w.bytes += times * part.bytes
        w.kernels += times * part.kernels
    params = sum(stage.numels) + sum(stage.expert_numels)
    w.bytes += parameter_work(cfg, sw, params, layout.recompute)
    mem, kernels = w.bytes / (hw.hbm_bandwidth * hw.memory_efficiency), w.kernels
    launch = max(0.0, kernels * sw.launch_s - c - mem)
    tp_s = sum(lt.tp[k] * n for k, n in stage.kind_counts) + stage.mtp * lt.mtp_tp
    if sw.tp_overlap:  # pipelined in tp chunks with the GEMMs: the first chunk is exposed
        tp_s = tp_s / t + max(0.0, tp_s * (t - 1) / t - c)
    ep_s = sum(lt.ep[k] * n for k, n in stage.kind_counts) + stage.mtp * lt.mtp_ep
    if sw.ep_overlap:  # behind another micro-batch's compute
        ep_s = max(0.0, ep_s - c)
    cp_s = sum(lt.cp[k] * n for k, n in stage.kind_counts) + stage.mtp * lt.mtp_cp
    return c + mem + launch + tp_s + ep_s + cp_s, c, mem, launch, tp_s, ep_s, cp_s


def fsdp_seconds(job: Job, layout: Layout, stages: list[Stage], c_mb: float) -> tuple[float, float]:
    """(exposed seconds of FSDP's collectives per step, the elements of a rank's shards, which the
    optimizer steps) on the stage with the most parameters (see the module doc). Per micro-batch
    each unit's parameters are all-gathered over the shard group in the parameters' dtype for the
    forward and again for the backward (once without parallel.fsdp_reshard_after_forward), each
    behind the unit before's compute (FSDP2's prefetch): the forward's gathers hide behind its
    third of the compute, the backward's behind two thirds, and only the excess counts, plus one
    unit's gather that nothing hides (the first). The last micro-batch's backward also
    reduce-scatters the fp32 gradients over the shard group and, under HSDP, all-reduces each
    shard across the dp·cp / S groups. Experts (ep > 1) are sharded over edp."""
    cfg, hw, g = job.cfg, job.hardware, job.gpus_per_node
    stage = max(stages, key=lambda st: sum(st.numels) + sum(st.expert_numels))
    S, tp = layout.fsdp_shard_size, layout.tp
    shard_link = _link(hw, tp * S <= g)  # S consecutive dp × cp ranks: tp·S consecutive ranks
    replica_link = _link(hw, tp * layout.dp_cp <= g)
    pb = param_bytes(cfg)
    units = len(stage.layers) + 2
    gather = reduce = local = 0.0
    for elems, ranks, link, replicas in (
        (sum(stage.numels), S, shard_link, layout.dp_cp // S),
        (sum(stage.expert_numels), layout.edp, replica_link, 1),
    ):
        if not elems or ranks <= 1:
            local += elems
            continue
        bw, lat = link
        gather += (ranks - 1) / ranks * elems * pb / bw + units * lat
        reduce += (ranks - 1) / ranks * elems * 4 / bw + units * lat
        reduce += _collective(elems / ranks * 4, replicas, *replica_link, 2.0)
        local += elems / ranks
    first = gather / units
    backward = gather if cfg.parallel.fsdp_reshard_after_forward else 0.0
    forward_s = max(0.0, gather - c_mb / 3) + first
    backward_s = max(0.0, backward - c_mb * 2 / 3) + (first if backward else 0.0)
    last_s = max(0.0, backward + reduce - c_mb * 2 / 3) + (first if backward else 0.0)
    m = layout.num_micro
    return m * forward_s + (m - 1) * backward_s + last_s, local


class _Pace(NamedTuple):
    """The terms of a step that do not depend on how the model state is sharded (computed once per
    mesh, micro-batch and recompute in a search, `mlm.plan.memo`, and shared by its shardings)."""

    terms: dict[str, float]
    slowest: tuple
    """(busy, GEMMs and attention, memory-bound, launches, tp, ep, cp) of the slowest stage's
    micro-batch, busy with its p2p and data loading."""
    bubble: float
    data: float
    eff: float


def _pace(job: Job, layout: Layout, stages: list[Stage], memo: dict | None) -> _Pace:
    cfg: Config = job.cfg
    hw = job.hardware
    t, u = layout.tp, layout.tp if layout.sequence_parallel else 1
    e, h = layout.micro_batch * local_tokens(cfg, layout), cfg.model.hidden_size
    mk = micro_key(layout)
    lt = cached(memo, ("layer times", mk), _layer_times, job, layout)
    data = lt.data
    pp_bw, pp_lat = _link(hw, t * layout.cp * layout.dp < job.gpus_per_node)
    p2p = 2 * layout.vpp * (e * h / u * param_bytes(cfg) / pp_bw + pp_lat) if layout.pp > 1 else 0.0
    per_micro = []
    for stage in stages:
        busy, *parts = cached(memo, ("stage time", mk, stage), _stage_time, job, layout, stage, lt)
        per_micro.append((busy + p2p + data, *parts))
    slowest = max(per_micro)
    c_mb, mem_mb, launch_mb, tp_mb, ep_mb, cp_mb = slowest[1:]
    m = layout.num_micro
    stretch = m / (1 - bubble_fraction(layout.pp, m, layout.vpp))
    bubble = (stretch - m) * slowest[0]
    terms = {
        "GEMMs and attention": m * c_mb,
        "memory-bound ops": m * mem_mb,
        "launch overhead (exposed)": m * launch_mb,
        "data loading": m * data,
        "tp collectives": m * tp_mb,
        "ep all-to-all": m * ep_mb,
        "cp exchange (exposed)": m * cp_mb,
        "pp p2p": m * p2p,
        "pipeline bubble": bubble,
    }
    return _Pace(terms, slowest, bubble, data, lt.eff)


def step_time(job: Job, layout: Layout, stages: list[Stage], memo: dict | None = None) -> Timing:
    """The step of `layout`; `stages`: the pipeline ranks to consider (the slowest sets the pace);
    `memo`: a search's shared terms (`mlm.plan.memo`)."""
    cfg: Config = job.cfg
    hw, sw = job.hardware, job.software
    t = layout.tp
    memory_rate = hw.hbm_bandwidth * hw.memory_efficiency
    key = ("pace", micro_key(layout), tuple(stages), layout.num_micro, layout.dp, layout.vpp)
    pace = cached(memo, key, _pace, job, layout, stages, memo)
    slowest, bubble, data = pace.slowest, pace.bubble, pace.data
    c_mb, mem_mb, launch_mb = slowest[1:4]

    if layout.fsdp:
        key = (
            "fsdp",
            tuple(stages),
            layout.fsdp_shard_size,
            layout.dp_cp,
            layout.edp,
            layout.num_micro,
            c_mb,
        )
        dp_exposed, local = cached(memo, key, fsdp_seconds, job, layout, stages, c_mb)
    else:
        # gradients: the dense buffer over dp × cp, the experts' over edp (a stage's ranks with the
        # same experts, every ep-th; both groups span the stage's dp × cp × tp ranks)
        parts = max(
            (state_parts(cfg, st, layout, memo) for st in stages),
            key=lambda d: d["dense"][1] + d["expert"][1],
        )
        dp_bw, dp_lat = _link(hw, t * layout.cp * layout.dp <= job.gpus_per_node)
        reduce = gather = local = 0.0
        for (_, grad_bytes, _), ranks in ((parts["dense"], layout.dp_cp), (parts["expert"], layout.edp)):
            elems = grad_bytes / 4
            wire = elems * (2 if cfg.parallel.grad_reduce_dtype == "bf16" else 4)
            if layout.distributed_optimizer:
                reduce += _collective(wire, ranks, dp_bw, dp_lat, 1.0)
                gather += _collective(elems * param_bytes(cfg), ranks, dp_bw, dp_lat, 1.0)
                local += elems / ranks
            else:
                reduce += _collective(wire, ranks, dp_bw, dp_lat, 2.0)
                local += elems
        gathers = max(0.0, gather - c_mb / 3) if sw.overlap_param_gather else gather
        dp_exposed = (max(0.0, reduce - c_mb * 2 / 3) if sw.overlap_grad_reduce else reduce) + gathers
    optimizer = OPTIMIZER_BYTES * local / memory_rate

    terms = {**pace.terms, "dp (exposed)": dp_exposed, "optimizer step": optimizer}
    step = sum(terms.values())
    busy = slowest[0]
    compute_s = terms["GEMMs and attention"] + bubble * (c_mb / busy if busy else 0)
    fixed_s = (
        optimizer
        + terms["memory-bound ops"]
        + terms["launch overhead (exposed)"]
        + terms["data loading"]
        + bubble * ((mem_mb + launch_mb + data) / busy if busy else 0)
    )
    comm_s = step - compute_s - fixed_s
    tokens = layout.global_batch * cfg.data.seq_length
    gpus = layout.gpus
    return Timing(
        terms=terms,
        compute_s=compute_s,
        comm_s=comm_s,
        fixed_s=fixed_s,
        step_s=step,
        tokens_per_s_per_gpu=tokens / step / gpus,
        mfu=job.flops_per_token * tokens / (step * gpus * hw.peak(cfg.train.precision)),
        gemm_efficiency=pace.eff,
    )
