"""Per-GPU memory of a layout, component by component, counting what mlm allocates.

Model state (exact, to the byte, checked against the real objects in tests/test_plan.py):

    weights     fp32 parameters, 4 B each (mlm keeps fp32 weights; bf16/fp16 run under
                autocast). With the distributed optimizer the parameters become views of a flat
                buffer laid out like the gradient buffer, padding included.
    gradients   the flat fp32 gradient buffer of `mlm.parallel.buckets.bucket_layout`: reverse
                parameter order, buckets of parallel.bucket_size_mb, each padded to lcm(dp, 128)
                under the distributed optimizer.
    optimizer   AdamW's two fp32 moments (8 B per parameter, or per element of this rank's 1/dp
                of every bucket with the distributed optimizer: the master weights are the fp32
                parameters, so there is no extra copy) + one 4-byte step counter per parameter
                tensor (per owned segment when sharded).

A rank holds its pipeline stage's layers (Megatron's interleaved assignment for vpp > 1), the
vocabulary-padded embedding (make_vocab_size_divisible_by × tp rows, split over tp) on the first
stage, the final norm and output layer on the last, and with tied embeddings a copy of the
embedding on the last stage when pp > 1. Row-parallel biases and norms are replicated over tp.

Activations: what autograd saves for backward, per layer and micro-batch, read off mlm's own
layers (measured with saved_tensors_hooks on one process and under tp/sp; tests/test_plan.py
checks the formula within 10 %). With e = micro-batch × sequence tokens, u = tp under sequence
parallelism (else 1), A the autocast dtype's bytes (4 in fp32), R = 4 (the residual stream stays
fp32), per layer:

    two norms          input e·h/u·R, RMSNorm's x̂ e·h/u·4, stats e/u·4 (LayerNorm: mean+rstd)
    linear inputs      e·h·A per input (q, k, v share one in fp32; autocast casts one copy per
                       linear: 3 for q/k/v, 2 for gate/up); under sequence parallelism the
                       all-gathered full sequence
    q, k, v after RoPE e·h/t·(1 + 2G/H)·A
    attention          output e·h/t·A (the out-projection's input) + logsumexp b·(H/t)·s·4: the
                       SDPA/flash kernels keep no s×s matrix
    MLP                SwiGLU: gate, up, silu(gate), product: 4·e·f/t·A; GeLU: up, gelu: 2·e·f/t·A
    dropout masks      e·h/u bytes after attention and after the MLP, when hidden_dropout > 0

Recompute: `full` keeps only each layer's input (e·h/u·R); `selective` re-runs the attention core
and so drops only the logsumexp (the core saves no s² term to begin with: the checkpoint then keeps
q, k, v, which RoPE's outputs already are). Differences from Korthikanti et al. 2022 (whose
formula `korthikanti_layer_bytes` gives, and tests pin for GPT-3 175B): no s² softmax and no
attention-dropout mask (flash attention), SwiGLU's four f-wide tensors instead of GeLU's two,
RMSNorm's extra x̂, no dropout masks at hidden_dropout = 0, and autocast's per-linear input casts.

Micro-batches in flight: the peak number of (chunk, micro-batch) forwards a rank holds in its
1F1B / interleaved schedule (`mlm.parallel.schedules.peak_in_flight`: pp − rank on rank r for
1F1B; more with interleaving). Under autocast each in-flight micro-batch also holds the bf16
copies of the stage's linear weights (2 B per weight), which the cast's consumer saves.
The last stage's logits and loss live for one micro-batch (its backward follows at once).

Communication buffers and headroom are estimates, not counts (see `component notes` in
docs/plan.md): bf16 gradient-reduction copies of the whole buffer (all buckets can be in flight),
pipeline send/receive buffers, one tp collective output; headroom 1 GB (CUDA context, cuBLAS
workspaces) + 5 % of HBM (caching-allocator fragmentation).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from mlm.config import Config, ModelConfig
from mlm.parallel.buckets import bucket_layout
from mlm.parallel.schedules import peak_in_flight, stage_layer_counts
from mlm.plan.layout import Layout

_AUTOCAST = ("bf16", "fp16")
_in_flight = functools.lru_cache(maxsize=4096)(peak_in_flight)


@dataclass(frozen=True)
class Param:
    name: str
    numel: int
    linear: bool = False
    """A linear layer's weight (cast to bf16/fp16 under autocast)."""


def _layer_params(cfg: ModelConfig, i: int, tp: int) -> list[Param]:
    h, f, K = cfg.hidden_size, cfg.ffn_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * K // tp, cfg.query_groups * K // tp
    out: list[Param] = []
    norm = ["weight", "bias"] if cfg.normalization == "layernorm" else ["weight"]

    def linear(name: str, rows: int, cols: int, bias: int) -> None:
        out.append(Param(f"layers.{i}.{name}.weight", rows * cols, linear=True))
        if cfg.add_bias:
            out.append(Param(f"layers.{i}.{name}.bias", bias))

    out += [Param(f"layers.{i}.attn_norm.{k}", h) for k in norm]
    linear("attn.q", q, h, q)
    linear("attn.k", kv, h, kv)
    linear("attn.v", kv, h, kv)
    linear("attn.out", h, q, h)  # row-parallel: the bias is replicated
    out += [Param(f"layers.{i}.mlp_norm.{k}", h) for k in norm]
    if cfg.activation == "swiglu":
        linear("mlp.gate", f // tp, h, f // tp)
    linear("mlp.up", f // tp, h, f // tp)
    linear("mlp.down", h, f // tp, h)
    return out


@dataclass(frozen=True)
class Stage:
    """What one pipeline rank holds."""

    layers: list[int]
    chunks: list[list[int]]
    first: bool
    last: bool
    params: list[Param] = field(repr=False)
    numels: tuple[int, ...] = field(init=False, repr=False)
    layer_linear: int = field(init=False)
    """Elements of the layers' linear weights."""
    output_linear: int = field(init=False)
    """Elements of the output layer's weight (or the tied embedding's) on the last stage."""

    def __post_init__(self):
        object.__setattr__(self, "numels", tuple(p.numel for p in self.params))
        layers = sum(p.numel for p in self.params if p.linear and p.name.startswith("layers."))
        object.__setattr__(self, "layer_linear", layers)
        object.__setattr__(self, "output_linear", sum(p.numel for p in self.params if p.linear) - layers)


def rank_stage(
    cfg: Config, tp: int, pp: int, vpp: int, pp_rank: int, first: int | None = None, last: int | None = None
) -> Stage:
    """The parameters of pipeline rank `pp_rank` in `model.named_parameters()` order (`first` /
    `last`: layers on the first / last virtual stage, as parallel.first_stage_layers / last_…)."""
    m = cfg.model
    counts = stage_layer_counts(m.num_layers, pp, vpp, first, last)
    starts = [sum(counts[:s]) for s in range(len(counts))]
    stages = list(range(pp_rank, len(counts), pp)) if pp > 1 else list(range(len(counts)))
    chunks = [list(range(starts[s], starts[s] + counts[s])) for s in stages]
    first, last = 0 in stages, len(counts) - 1 in stages
    V, h = m.padded_vocab_size(tp), m.hidden_size
    params: list[Param] = []
    if first or (last and m.tie_embeddings):
        params.append(Param("embed.weight", V // tp * h, linear=last and m.tie_embeddings))
    if first and m.position_embedding == "learned":
        params.append(Param("pos_embed.weight", m.max_position_embeddings * h))
    layers = sorted(i for c in chunks for i in c)
    for i in layers:
        params += _layer_params(m, i, tp)
    if last:
        norm = ["weight", "bias"] if m.normalization == "layernorm" else ["weight"]
        params += [Param(f"final_norm.{k}", h) for k in norm]
        if not m.tie_embeddings:
            params.append(Param("output.weight", V // tp * h, linear=True))
    return Stage(layers, chunks, first, last, params)


@functools.lru_cache(maxsize=4096)
def _state_bytes(numels: tuple[int, ...], bucket_elems: int, dp: int, distributed: bool, dp_rank: int):
    pad = math.lcm(dp, 128) if distributed else 1
    ranges, buckets = bucket_layout(list(numels), bucket_elems, pad)
    buffer = buckets[-1][1]
    if not distributed:
        return 4 * sum(numels), 4 * buffer, 8 * sum(numels) + 4 * len(numels)
    local = segments = 0
    for start, end, members in buckets:
        size = (end - start) // dp
        lo, hi = start + dp_rank * size, start + (dp_rank + 1) * size
        local += size
        segments += sum(1 for i in members if max(ranges[i][0], lo) < min(ranges[i][1], hi))
    return 4 * buffer, 4 * buffer, 8 * local + 4 * segments


def model_state_bytes(cfg: Config, stage: Stage, layout: Layout, dp_rank: int = 0) -> dict[str, int]:
    """{"weights", "gradients", "optimizer"} bytes of one rank, as allocated."""
    elems = max(1, int(cfg.parallel.bucket_size_mb * 2**20) // 4)
    w, g, o = _state_bytes(stage.numels, elems, layout.dp, layout.distributed_optimizer, dp_rank)
    return {"weights": w, "gradients": g, "optimizer": o}


# ---------------------------------------------------------------- activations


def layer_activation_bytes(cfg: Config, layout: Layout) -> dict[str, float]:
    """Bytes one transformer layer saves for backward per micro-batch, by part (see the module doc)."""
    m = cfg.model
    t, u = layout.tp, layout.tp if layout.sequence_parallel else 1
    e = layout.micro_batch * cfg.data.seq_length
    h, f, H, G = m.hidden_size, m.ffn_size, m.num_attention_heads, m.query_groups
    autocast = cfg.train.precision in _AUTOCAST
    A = 2 if autocast else 4
    if layout.recompute == "full":
        return {"layer input (full recompute)": e * h / u * 4}
    rms = m.normalization == "rmsnorm"
    norm = e * h / u * (4 + (4 if rms else 0)) + e / u * 4 * (1 if rms else 2)
    gated = m.activation == "swiglu"
    parts = {
        "norms": 2 * norm,
        "linear inputs": e * h * A * ((3 + (2 if gated else 1)) if autocast else 2),
        "q, k, v": e * h / t * (1 + 2 * G / H) * A,
        "attention output": e * h / t * A,
        "mlp": (4 if gated else 2) * e * f / t * A,
    }
    if layout.recompute != "selective":
        parts["attention logsumexp"] = layout.micro_batch * H / t * cfg.data.seq_length * 4
    if m.hidden_dropout > 0:
        parts["dropout masks"] = 2 * e * h / u
    return parts


def stage_extras(cfg: Config, layout: Layout, stage: Stage) -> dict[str, float]:
    """Per-micro-batch activations outside the layers: token ids and RoPE tables on every chunk,
    embedding on the first stage, final norm, output input and the loss's saved tensors on the last."""
    m = cfg.model
    t, u = layout.tp, layout.tp if layout.sequence_parallel else 1
    s, b = cfg.data.seq_length, layout.micro_batch
    e, h = b * s, m.hidden_size
    A = 2 if cfg.train.precision in _AUTOCAST else 4
    out: dict[str, float] = {}
    if m.position_embedding == "rope" and layout.recompute != "full":
        # under full recompute the checkpoint's closure holds them (a few MB), not autograd
        out["rope tables"] = sum(2 * s * m.head_dim * 4 for c in stage.chunks if c)
    if stage.first:
        out["embedding"] = e * 8 + (e if t > 1 else 0) + (e * h if m.hidden_dropout > 0 else 0)
    if stage.last:
        rms = m.normalization == "rmsnorm"
        out["final norm"] = e * h / u * (4 + (4 if rms else 0)) + e / u * 4 * (1 if rms else 2)
        out["output input"] = e * h * A
        V = m.padded_vocab_size(t)
        if t > 1:  # vocab-parallel cross-entropy: softmax shard, two masks
            out["loss"] = e * V / t * 4 + e * (1 + 8)
        else:  # F.cross_entropy: log-softmax over the real vocabulary + the flattened labels
            out["loss"] = e * m.vocab_size * 4 + e * 8
    return out


def weight_cast_bytes(cfg: Config, stage: Stage, layout: Layout) -> tuple[float, float]:
    """(bytes of the layers' bf16/fp16 weight copies per micro-batch, the output layer's), 0 in fp32."""
    if cfg.train.precision not in _AUTOCAST:
        return 0.0, 0.0
    return (0.0 if layout.recompute == "full" else 2.0 * stage.layer_linear), 2.0 * stage.output_linear


def micro_batch_activation_bytes(cfg: Config, layout: Layout, stage: Stage) -> float:
    """Everything one micro-batch's forward on this rank saves for backward (all its chunks): the
    number tests compare with saved_tensors_hooks."""
    per_layer = sum(layer_activation_bytes(cfg, layout).values())
    casts = sum(weight_cast_bytes(cfg, stage, layout))
    return per_layer * len(stage.layers) + sum(stage_extras(cfg, layout, stage).values()) + casts


@dataclass
class MemoryReport:
    """Per-GPU bytes by component, for the rank that needs the most."""

    pp_rank: int
    components: dict[str, float]
    in_flight: int
    per_layer: dict[str, float]
    hbm: float

    @property
    def total(self) -> float:
        return sum(self.components.values())


def report_ranks(pp: int) -> list[int]:
    """The pipeline ranks whose memory and time stand for all: first, second, last."""
    return sorted({0, min(1, pp - 1), pp - 1})


def headroom_bytes(hbm: float) -> float:
    return 1e9 + 0.05 * hbm


def rank_memory(
    cfg: Config, layout: Layout, pp_rank: int, hbm: float, stage: Stage | None = None
) -> MemoryReport:
    stage = stage or rank_stage(
        cfg, layout.tp, layout.pp, layout.vpp, pp_rank, layout.first_stage_layers, layout.last_stage_layers
    )
    comps: dict[str, float] = dict(model_state_bytes(cfg, stage, layout))
    chunk_layers = max(len(c) for c in stage.chunks)
    in_flight = _in_flight(layout.pp, pp_rank, layout.num_micro, layout.vpp) if layout.pp > 1 else 1
    per_layer = layer_activation_bytes(cfg, layout)
    extras = stage_extras(cfg, layout, stage)
    first_extra = extras.get("embedding", 0.0) + extras.get("rope tables", 0.0) / max(1, len(stage.chunks))
    last_extra = sum(v for k, v in extras.items() if k in ("final norm", "output input", "loss"))
    layer_casts, output_cast = weight_cast_bytes(cfg, stage, layout)
    comps["activations"] = in_flight * (chunk_layers * sum(per_layer.values()) + first_extra) + last_extra
    comps["weight casts"] = in_flight * layer_casts / len(stage.chunks) + output_cast
    e, h, t = layout.micro_batch * cfg.data.seq_length, cfg.model.hidden_size, layout.tp
    u = t if layout.sequence_parallel else 1
    if stage.last:
        A = 2 if cfg.train.precision in _AUTOCAST else 4
        comps["logits (transient)"] = e * cfg.model.padded_vocab_size(t) / t * (A + 4)
    comm = 0.0
    if cfg.parallel.grad_reduce_dtype == "bf16" and layout.dp > 1:
        comm += comps["gradients"] / 2
    if layout.pp > 1:
        comm += 2 * e * h / u * 4
    if t > 1:
        comm += 2 * e * h * 4
    comps["communication buffers"] = comm
    comps["headroom"] = headroom_bytes(hbm)
    return MemoryReport(pp_rank, comps, in_flight, per_layer, hbm)


def memory(cfg: Config, layout: Layout, hbm: float, stages: dict[int, Stage] | None = None) -> MemoryReport:
    """The report of the rank that needs the most: the first, second or last pipeline rank (the
    second has one micro-batch fewer in flight than the first but may hold more layers; `stages`:
    their `rank_stage`s, when the caller has them)."""
    stages = stages or {}
    ranks = report_ranks(layout.pp)
    return max((rank_memory(cfg, layout, r, hbm, stages.get(r)) for r in ranks), key=lambda r: r.total)


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, mode: str = "none") -> float:
    """Activation bytes per transformer layer from Korthikanti et al. 2022 (Table 2), fp16, GPT
    layers with dropout, no flash attention. `mode`: none (no parallelism when t = 1), tp, tp+sp,
    selective+sp, full."""
    sbh = s * b * h
    if mode == "none":
        return sbh * (34 + 5 * a * s / h)
    if mode == "tp":
        return sbh * (10 + 24 / t + 5 * a * s / (h * t))
    if mode == "tp+sp":
        return sbh / t * (34 + 5 * a * s / h)
    if mode == "selective+sp":
        return sbh * 34 / t
    if mode == "full":
        return 2 * sbh
    raise ValueError(f"mode={mode!r}")
