"""Predicted time of one training step of a layout, term by term.

    compute     per micro-batch and pipeline rank: tokens × (its layers' FLOPs + the logits' on the
                last stage; Megatron's count, `mlm.flops`), plus recompute (full: one more forward
                of each layer; selective: one more forward of the attention core), over
                tp × peak(precision) × efficiency(smallest GEMM side)  (`Hardware.efficiency`)
    tp          per layer and micro-batch 4 all-reduces of [b, s, h] (2 forward, 2 backward; under
                sequence parallelism the same bytes as all-gathers + reduce-scatters; 6 with full
                recompute), ring cost 2(t−1)/t · bytes / bandwidth + latency, on NVLink when the tp
                group fits in a node and on the network (much slower) when it does not
    p2p         per micro-batch and model chunk one activation forward and one gradient backward,
                [b, s/sp, h] fp32, on NVLink if a pipeline neighbour is in the node, else the network
    bubble      the pipeline step is m · (compute + tp + p2p) / (1 − bubble_fraction(pp, m, vpp)),
                i.e. (pp − 1)/(vpp · m) more than the work itself (Narayanan et al. 2021)
    dp          gradient all-reduce (or reduce-scatter with the distributed optimizer) of the fp32
                (or bf16) gradient buffer, overlapped with the last micro-batch's backward (only the
                excess counts); the distributed optimizer's all-gather of the fp32 parameters after
                the step is not overlapped in mlm and counts in full
    optimizer   fused AdamW is memory-bound: 28 bytes read or written per local element / HBM bandwidth

Tokens/s per GPU = global batch × seq / step / GPUs; MFU = Megatron model FLOPs (no recompute)
per step / (step × GPUs × peak).
"""

from __future__ import annotations

from dataclasses import dataclass

from mlm.config import Config
from mlm.flops import flops_per_token
from mlm.parallel.schedules import bubble_fraction
from mlm.plan.layout import Job, Layout
from mlm.plan.memory import Stage, model_state_bytes

_AUTOCAST = ("bf16", "fp16")


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


def step_time(job: Job, layout: Layout, stages: list[Stage]) -> Timing:
    """The step of `layout`; `stages`: the pipeline ranks to consider (the slowest sets the pace)."""
    cfg: Config = job.cfg
    hw, m = job.hardware, cfg.model
    s, t, u = cfg.data.seq_length, layout.tp, layout.tp if layout.sequence_parallel else 1
    e, h = layout.micro_batch * s, m.hidden_size
    A = 2 if cfg.train.precision in _AUTOCAST else 4
    total_per_token = flops_per_token(m, s)
    logits_per_token = 6 * h * m.padded_vocab_size()
    layer_per_token = (total_per_token - logits_per_token) / m.num_layers
    extra = {"full": layer_per_token / 3, "selective": 4 * s * h, "none": 0.0}[layout.recompute]
    side = min(e, h / t, m.ffn_size / t)
    eff = hw.efficiency(side)
    rate = t * hw.peak(cfg.train.precision) * eff

    def compute(stage: Stage) -> float:
        flops = len(stage.layers) * (layer_per_token + extra) + (logits_per_token if stage.last else 0.0)
        return e * flops / rate

    in_node = t <= job.gpus_per_node
    tp_bw, tp_lat = (
        (hw.intra_bandwidth, hw.intra_latency) if in_node else (hw.inter_bandwidth, hw.inter_latency)
    )
    per_layer_collectives = 6 if layout.recompute == "full" else 4
    tp_one = _collective(e * h * A, t, tp_bw, tp_lat, 2.0)
    pp_in_node = t * layout.cp * layout.dp < job.gpus_per_node
    pp_bw, pp_lat = (
        (hw.intra_bandwidth, hw.intra_latency) if pp_in_node else (hw.inter_bandwidth, hw.inter_latency)
    )
    p2p = 2 * layout.vpp * (e * h / u * 4 / pp_bw + pp_lat) if layout.pp > 1 else 0.0

    per_micro = []
    for stage in stages:
        c = compute(stage)
        tp_s = len(stage.layers) * per_layer_collectives * tp_one
        per_micro.append((c + tp_s + p2p, c, tp_s))
    slowest = max(per_micro)
    c_mb, tp_mb = slowest[1], slowest[2]
    stretch = layout.num_micro / (1 - bubble_fraction(layout.pp, layout.num_micro, layout.vpp))
    bubble = (stretch - layout.num_micro) * slowest[0]

    state = max((model_state_bytes(cfg, st, layout) for st in stages), key=lambda d: d["gradients"])
    buffer_elems = state["gradients"] / 4
    grad_bytes = buffer_elems * (2 if cfg.parallel.grad_reduce_dtype == "bf16" else 4)
    dp_in_node = t * layout.cp * layout.dp <= job.gpus_per_node
    dp_bw, dp_lat = (
        (hw.intra_bandwidth, hw.intra_latency) if dp_in_node else (hw.inter_bandwidth, hw.inter_latency)
    )
    if layout.distributed_optimizer:
        reduce = _collective(grad_bytes, layout.dp, dp_bw, dp_lat, 1.0)
        gather = _collective(buffer_elems * 4, layout.dp, dp_bw, dp_lat, 1.0)
        local = buffer_elems / layout.dp
    else:
        reduce = _collective(grad_bytes, layout.dp, dp_bw, dp_lat, 2.0)
        gather = 0.0
        local = buffer_elems
    dp_exposed = max(0.0, reduce - c_mb * 2 / 3) + gather
    optimizer = 28 * local / hw.hbm_bandwidth

    terms = {
        "compute": layout.num_micro * c_mb,
        "tp collectives": layout.num_micro * tp_mb,
        "pp p2p": layout.num_micro * p2p,
        "pipeline bubble": bubble,
        "dp (exposed)": dp_exposed,
        "optimizer step": optimizer,
    }
    step = sum(terms.values())
    work = slowest[0]
    compute_s = terms["compute"] + bubble * (c_mb / work if work else 0)
    comm_s = step - compute_s - optimizer
    tokens = layout.global_batch * s
    gpus = layout.gpus
    return Timing(
        terms=terms,
        compute_s=compute_s,
        comm_s=comm_s,
        fixed_s=optimizer,
        step_s=step,
        tokens_per_s_per_gpu=tokens / step / gpus,
        mfu=total_per_token * tokens / (step * gpus * hw.peak(cfg.train.precision)),
        gemm_efficiency=eff,
    )
