"""Per-GPU memory of a layout, component by component, counting what mlm allocates.

Model state (exact, to the byte, checked against the real objects in tests/plan/test_plan.py):

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

Under context parallelism (cp > 1) the dense gradient buffer is reduced over dp × cp (cp ranks hold
other tokens of the same sequences), so it is padded to lcm(dp·cp, 128) and Adam's state is
sharded 1/(dp·cp) under the distributed optimizer; the weights are replicated over cp.

Under FSDP (the layout's fsdp / hsdp<N>, `mlm.parallel.fsdp`) each tp-local tensor is split along
dim 0 over the S ranks of its shard group as torch.chunk splits it (`fsdp_bytes`; S = dp × cp, or
HSDP's N; the experts' over edp): weights and gradients fp32 (the shards are the main weights,
whatever train.param_dtype gathers them in), Adam's moments fp32, a step count per tensor; exact,
checked on real ranks in tests/plan/test_plan_fsdp.py. Beside them (`fsdp_transient_bytes`) the gathered
units and, with more than one micro-batch per step, every parameter's unsharded fp32 gradient.

Under expert parallelism (ep > 1) the routed experts' weights (E / ep whole experts per MoE layer;
expert tensor parallelism is 1, so at ep = 1 every tp rank holds all E) have a second gradient
buffer, laid out and padded the same way but reduced over edp = dp·cp·tp / ep (padding lcm(edp,
128), Adam state sharded 1/edp with the distributed optimizer); the router's selection-only
expert bias is a weight without gradient or optimizer state.

A rank holds its pipeline stage's layers (Megatron's interleaved assignment for vpp > 1), the
vocabulary-padded embedding (make_vocab_size_divisible_by × tp rows, split over tp) on the first
stage, the final norm, output layer and MTP depths on the last, and with tied embeddings or MTP a
copy of the embedding on the last stage when pp > 1. Row-parallel biases, norms, MLA's
down-projections and the MTP depths' eh_proj are replicated over tp.

Activations: what autograd saves for backward, per layer and micro-batch, read off mlm's own
layers (measured with saved_tensors_hooks on one process and under tp/sp/cp; tests/plan/test_plan.py
checks the formula within 10 %, dense MLA models on tp 2 ranks to the byte, and
tests/plan/test_activation_memory.py a Llama layer in bf16 to the byte). With s = seq_length / cp the tokens of each sequence a rank holds
(context parallelism's zigzag split; s = seq_length at cp = 1), e = micro-batch × s, u = tp under
sequence parallelism (else 1), A the autocast dtype's bytes (4 in fp32), R the residual stream's
(`residual_bytes`: A under autocast, 4 with model.fp32_residual_connection or in fp32), per layer
(the norms and SwiGLU are `kernels.lean`'s, which save only what their backward needs):

    two norms          input e·h/u·R (RMSNorm's backward recomputes its statistic; LayerNorm
                       also keeps fp32 mean and rstd, e/u·8)
    linear inputs      the norm's output, in the compute dtype, e·h·A: one shared by q, k, v and
                       one by gate, up; under sequence parallelism the all-gathered full sequence;
                       MLA's down-projections read the rank's own e/u tokens instead (`mla_input_bytes`)
    q, k, v after RoPE e·h/t·(1 + 2G/H)·A
    attention          output e·h/t·A (the out-projection's input) + logsumexp b·(H/t)·s·4: the
                       SDPA/flash kernels keep no s×s matrix
    MLA                (`mla_activation_bytes`) the latents' norms on the rank's e/u tokens, the
                       latents entering the tp region over e tokens (gathered under sequence
                       parallelism), q, k and kv_up's output per head, the output
    MLP                SwiGLU: gate, up (silu is recomputed in the backward), product:
                       3·e·f/t·A; GeLU: up, gelu: 2·e·f/t·A
    MoE MLP            N = e/u tokens routed on this rank, M = N·k copies (balanced routing; the
                       copies this rank's experts receive under ep): the router's fp32 input N·h·4,
                       scores N·E·4, top-k weights/indices and per-copy index/weight; the copies'
                       inputs M·h·A; the experts' 3·M·F·A (gated); their outputs M·h·(A + 4) (and
                       the fp32 weighted copy); shared experts as a dense MLP of their width. mlm's
                       grouped_mm / loop experts; `bmm` (CPU's auto) pads every expert to the
                       busiest, up to +25 % measured in bf16.
    dropout masks      e·h/u bytes after attention and after the MLP, when hidden_dropout > 0
    cp attention       (cp > 1, S = seq_length) all_gather: the keys and values of the other cp
                       ranks, 2·b·(S − s)·G/t·K·A (SDPA saves the gathered [b, S, G/t, K] pair),
                       and the global-position mask s·S·A (one per layer: it is built in each
                       call); p2p (`mlm.parallel.ring_attention`): the merged output e·h/t·A
                       (saved beside the out-projection's own input) and its logsumexp in A, not
                       fp32 (the ring's forward runs under autocast)

Recompute: `full` keeps only each layer's input (e·h/u·R); `selective` re-runs the attention core
and so drops only the logsumexp (the core saves no s² term to begin with: the checkpoint then keeps
q, k, v, which RoPE's outputs already are) and, under cp, the core's cp tensors above. Differences from Korthikanti et al. 2022 (whose
formula `korthikanti_layer_bytes` gives, and tests pin for GPT-3 175B): no s² softmax and no
attention-dropout mask (flash attention), SwiGLU's three f-wide tensors instead of GeLU's two,
and no dropout masks at hidden_dropout = 0. A Llama-3-8B layer (f = 3.5·h, H = 4G) in bf16 saves
4 + 4 + 3 + 2 + 21 = 34·s·b·h, Megatron's count (59 before the lean norms, the shared normed
inputs, SwiGLU saving its inputs and the bf16 residual stream).

Micro-batches in flight: the peak number of (chunk, micro-batch) forwards a rank holds in its
1F1B / interleaved schedule (`in_flight`, equal to `mlm.parallel.schedules.peak_in_flight`:
pp − rank on rank r for 1F1B; more with interleaving). Under autocast each in-flight micro-batch also holds the bf16
copies of the stage's linear weights (2 B per weight), which the cast's consumer saves.
The last stage's logits and loss live for one micro-batch (its backward follows at once), and so
do the MTP depths' activations (each a layer, never recomputed, its norms, eh_proj's input and
another loss: `stage_extras`).

Communication buffers and headroom are estimates, not counts (see `component notes` in
docs/plan-model.md): bf16 gradient-reduction copies of the whole buffer (all buckets can be in flight),
pipeline send/receive buffers, one tp collective output, one MoE layer's ep exchange buffers, one
layer's cp exchange (p2p: the key/value message in flight and its receive buffer, in the backward
also two fp32 dK/dV accumulators; all_gather: the gathered keys' and values' gradients before their
reduce-scatter); headroom 1 GB (CUDA context, cuBLAS workspaces) + 5 % of HBM (caching-allocator
fragmentation).

The p2p ring's attention workspace (transient, one layer at a time): `mlm.parallel.ring_attention`
computes each block of attention by hand (scores → logsumexp → exp → @ V), not in a flash kernel,
so a block's fp32 score matrices exist at once: at step 0 the s × s block over both local chunks,
in the backward (which runs outside autocast, in fp32) the probabilities, dP, and two temporaries
of dS: 4 · b · H/t · s² · 4 bytes, plus the s² boolean causal mask (measured on CPU with an
allocation tracker: 4.5 such blocks at s = 512, 5.0 at s = 256, the rest the per-token fp32 copies
of q, dO and dq counted beside it). all_gather's SDPA keeps no s × S matrix (CPU's flash kernel
takes the mask; see docs/plan-parallel.md for CUDA); under recompute its mask and gathered keys and values
are this workspace, built again for the one layer being recomputed.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from mlm.config import Config, LayerSpec, ModelConfig
from mlm.counts import ParameterCounts
from mlm.layout import Layout
from mlm.model import kinds
from mlm.model.kinds.mtp.spec import own_params as mtp_params
from mlm.model.kinds.spec import Micro, Param
from mlm.parallel.buckets import bucket_layout
from mlm.parallel.loss_chunks import chunk_tokens
from mlm.parallel.schedules import stage_layer_counts
from mlm.plan.memo import cached

_AUTOCAST = ("bf16", "fp16")


def act_bytes(cfg: Config) -> int:
    """Bytes of an activation element: the autocast dtype's (2 under bf16/fp16), else fp32's 4."""
    return 2 if cfg.train.precision in _AUTOCAST else 4


def casts_weights(cfg: Config) -> bool:
    """Whether autocast casts the weights in each forward: fp32 parameters under bf16/fp16 (not in
    fp32, nor with train.param_dtype in the compute dtype)."""
    return cfg.train.precision in _AUTOCAST and cfg.train.param_dtype == "fp32"


def in_flight(pp: int, rank: int, num_micro: int, vpp: int = 1) -> int:
    """`mlm.parallel.schedules.peak_in_flight` without walking the schedule (1 ms a call at 64
    micro-batches × vpp 8, 0.4 s of a 70B search): a 1F1B or interleaved rank runs its warm-up
    forwards, then one forward and one backward at a time, so it holds one more than the warm-up
    (all of its forwards when the warm-up covers them); tests/plan/test_plan_prune.py checks it against
    the schedule."""
    if pp == 1:
        return 1
    total = num_micro * vpp
    if vpp == 1:
        warmup = min(pp - rank - 1, num_micro)
    elif num_micro == pp:  # Megatron: every forward first when there are only pp micro-batches
        warmup = total
    else:
        warmup = min((pp - rank - 1) * 2 + (vpp - 1) * pp, total)
    return min(warmup + 1, total)


def _layer_params(cfg: ModelConfig, i: int | str, tp: int, ep: int, spec: LayerSpec) -> list[Param]:
    """One layer's parameters, named `layers.{i}.…` (or `{i}.…` for a prefix such as
    `mtp.0.layer`), as its kinds' specs list them: the mixer's norm and mixer (`attn_norm`,
    `attn`), the MLP's norm and MLP (`mlp_norm`, `mlp`)."""
    prefix = f"layers.{i}" if isinstance(i, int) else i
    norm = kinds.norm(spec.norm)
    out: list[Param] = []
    if spec.mixer is not None:
        out += norm.params(cfg, f"{prefix}.attn_norm") + kinds.mixer(spec.mixer).params(
            cfg, f"{prefix}.attn", tp
        )
    if spec.mlp is not None:
        out += norm.params(cfg, f"{prefix}.mlp_norm") + kinds.mlp(spec.mlp).params(
            cfg, f"{prefix}.mlp", tp, ep
        )
    return out


def _mtp_params(cfg: ModelConfig, tp: int, ep: int, spec: LayerSpec) -> list[Param]:
    """The MTP depths (`mlm.model.kinds.mtp.module`, on the last stage): enorm, hnorm, eh_proj [D, 2D] (all
    replicated over tp), a layer of the last layer's kinds, a final norm."""
    out = []
    for d in range(cfg.mtp_num_layers):
        before, after = mtp_params(cfg, f"mtp.{d}")
        out += before + _layer_params(cfg, f"mtp.{d}.layer", tp, ep, spec) + after
    return out


class _Numels(tuple):
    """A tuple that hashes once: `_state_bytes` is cached on a stage's (long) numel tuples, looked
    up for every layout the search evaluates."""

    def __hash__(self) -> int:
        if "_hash" not in self.__dict__:
            self.__dict__["_hash"] = tuple.__hash__(self)
        return self.__dict__["_hash"]


@dataclass(frozen=True, eq=False)
class Stage:
    """What one pipeline rank holds (equal and hashed by identity: a search's memo keys on it)."""

    layers: list[int]
    chunks: list[list[int]]
    first: bool
    last: bool
    params: list[Param] = field(repr=False)
    kinds: tuple[LayerSpec, ...] = ()
    """The kinds of each of the model's layers (`ModelConfig.layer_specs`)."""
    mtp: int = 0
    """MTP depths on this rank (the last stage's; each one layer of the last layer's kind)."""
    numels: tuple[int, ...] = field(init=False, repr=False)
    """The trainable parameters of the dense gradient buffer (reduced over dp)."""
    expert_numels: tuple[int, ...] = field(init=False, repr=False)
    """The expert-parallel parameters (their own buffer, reduced over edp); empty at ep = 1."""
    frozen: int = field(init=False)
    """Elements of parameters that never train (no gradient, no optimizer state)."""
    layer_linear: int = field(init=False)
    """Elements of the layers' linear weights."""
    output_linear: int = field(init=False)
    """Elements of the output layer's weight (or the tied embedding's) and the MTP depths' linear
    weights on the last stage (their casts live one micro-batch: the backward follows at once)."""
    kind_counts: tuple[tuple[LayerSpec, int], ...] = field(init=False, repr=False)
    """(layer kinds, layers of those kinds on this rank)."""
    chunk_kind_counts: tuple[tuple[tuple[str, int], ...], ...] = field(init=False, repr=False)
    """The same per model chunk, each distinct one once (the largest is what a rank holds)."""
    held_kinds: tuple[LayerSpec, ...] = field(init=False, repr=False)
    """The kinds whose activations this rank holds: its layers' (the last layer's where it has none)."""
    shape: tuple = field(init=False, repr=False)
    """What `stage_extras` reads of the stage: its ends, MTP depths, chunks and non-empty chunks."""

    def __post_init__(self):
        ps = self.params
        put = functools.partial(object.__setattr__, self)
        put("numels", _Numels(p.numel for p in ps if p.trainable and not p.expert_parallel))
        put("expert_numels", _Numels(p.numel for p in ps if p.trainable and p.expert_parallel))
        count = lambda layers: tuple(Counter(self.kinds[i] for i in layers).items())  # noqa: E731
        put("kind_counts", count(self.layers))
        put("chunk_kind_counts", tuple(dict.fromkeys(count(c) for c in self.chunks)))
        put("held_kinds", tuple({k for k, _ in self.kind_counts} or {self.kinds[-1]}))
        nonempty = sum(1 for c in self.chunks if c)
        put("shape", (self.first, self.last, self.mtp, len(self.chunks), nonempty))
        put("frozen", sum(p.numel for p in ps if not p.trainable))
        layers = sum(p.numel for p in ps if p.linear and p.name.startswith("layers."))
        put("layer_linear", layers)
        put("output_linear", sum(p.numel for p in ps if p.linear) - layers)

    # what FSDP layouts read, computed on first use (most stages of a search never need them)
    @functools.cached_property
    def shapes(self) -> tuple[tuple[int, int], ...]:
        """(elements, dim 0) of the dense trainable parameters: what FSDP splits (`fsdp_bytes`)."""
        return _Numels(
            (p.numel, p.rows or p.numel) for p in self.params if p.trainable and not p.expert_parallel
        )

    @functools.cached_property
    def expert_shapes(self) -> tuple[tuple[int, int], ...]:
        """The same of the expert-parallel parameters (FSDP splits them over edp)."""
        return _Numels((p.numel, p.rows or p.numel) for p in self.params if p.trainable and p.expert_parallel)

    @functools.cached_property
    def fsdp_units(self) -> tuple[int, int]:
        """Elements FSDP gathers at once (`mlm.parallel.fsdp`'s units): (the largest layer's, the
        larger of the embedding's and the final norm's with the output layer's + the root's rest)."""
        per_layer: Counter = Counter()
        embed = out = root = 0
        for p in self.params:
            if p.name.startswith("layers."):
                per_layer[p.name.split(".")[1]] += p.numel
            elif p.name.startswith("embed."):
                embed += p.numel
            elif p.name.startswith(("final_norm.", "output.")):
                out += p.numel
            else:
                root += p.numel
        return max(per_layer.values(), default=0), max(embed, out) + root


def rank_stage(
    cfg: Config,
    tp: int,
    pp: int,
    vpp: int,
    pp_rank: int,
    first: int | None = None,
    last: int | None = None,
    ep: int = 1,
    memo: dict | None = None,
) -> Stage:
    """The parameters of pipeline rank `pp_rank` in `model.named_parameters()` order (`first` /
    `last`: layers on the first / last virtual stage, as parallel.first_stage_layers / last_…;
    `ep`: the expert-parallel size, over which each MoE layer's experts are split; `memo`: a
    search's, which keeps each layer's parameters at a tp and ep for the other stages)."""
    m = cfg.model
    counts = stage_layer_counts(m.num_layers, pp, vpp, first, last)
    starts = [sum(counts[:s]) for s in range(len(counts))]
    stages = list(range(pp_rank, len(counts), pp)) if pp > 1 else list(range(len(counts)))
    chunks = [list(range(starts[s], starts[s] + counts[s])) for s in stages]
    first, last = 0 in stages, len(counts) - 1 in stages
    V, h = m.padded_vocab_size(tp), m.hidden_size
    specs = tuple(m.layer_specs())
    params: list[Param] = []
    # the last stage holds a copy of the embedding when it is the output layer (tied) or MTP's input
    if first or (last and (m.tie_embeddings or m.mtp_num_layers)):
        params.append(Param("embed.weight", V // tp * h, linear=last and m.tie_embeddings, rows=V // tp))
    if first and m.position_embedding == "learned":
        params.append(
            Param("pos_embed.weight", m.max_position_embeddings * h, rows=m.max_position_embeddings)
        )
    layers = sorted(i for c in chunks for i in c)
    for i in layers:
        params += cached(memo, ("layer params", i, tp, ep), _layer_params, m, i, tp, ep, specs[i])
    if last:
        params += kinds.norm(m.normalization).params(m, "final_norm")
        if not m.tie_embeddings:
            params.append(Param("output.weight", V // tp * h, linear=True, rows=V // tp))
        params += cached(memo, ("mtp params", tp, ep), _mtp_params, m, tp, ep, specs[-1])
    return Stage(layers, chunks, first, last, params, specs, m.mtp_num_layers if last else 0)


def parameter_counts(cfg: Config) -> ParameterCounts:
    """The model's parameter counts from the planner's parameter list (torch-free; equal to
    `mlm.model.parameter_counts` of the built model): one rank holding everything."""
    stage = rank_stage(cfg, 1, 1, 1, 0)
    counts = {False: [0, 0], True: [0, 0]}  # MTP? → [total, active]
    for p in stage.params:
        c = counts[p.name.startswith("mtp.")]
        c[0] += p.numel
        c[1] += p.active_numel
    (total, active), (mtp, mtp_active) = counts[False], counts[True]
    return ParameterCounts(total, active, mtp, mtp_active)


@functools.lru_cache(maxsize=4096)
def _state_bytes(
    numels: tuple[int, ...], bucket_elems: int, dp: int, distributed: bool, dp_rank: int, weight: int = 4
):
    """(weights, gradients, optimizer) bytes of one gradient buffer's parameters, reduced over `dp`
    ranks (this one `dp_rank`); the buffer's elements are gradients / 4. `weight`: bytes per
    parameter, 4 (fp32: the parameters are the main weights) or 2 (bf16/fp16, train.param_dtype:
    the optimizer adds 4-byte fp32 main weights, sharded like the moments under the distributed
    optimizer — Megatron's 2 + 4 + (4 + 8) / dp). The optimizer's 4 bytes per segment: AdamW's
    step counts."""
    if not numels:
        return 0, 0, 0
    main = 4 if weight != 4 else 0
    pad = math.lcm(dp, 128) if distributed else 1
    ranges, buckets = bucket_layout(list(numels), bucket_elems, pad)
    buffer = buckets[-1][1]
    if not distributed:
        return weight * sum(numels), 4 * buffer, (8 + main) * sum(numels) + 4 * len(numels)
    local = segments = 0
    for start, end, members in buckets:
        size = (end - start) // dp
        lo, hi = start + dp_rank * size, start + (dp_rank + 1) * size
        local += size
        segments += sum(1 for i in members if max(ranges[i][0], lo) < min(ranges[i][1], hi))
    return weight * buffer, 4 * buffer, (8 + main) * local + 4 * segments


def fsdp_rows(numel: int, rows: int, shards: int, rank: int) -> int:
    """Elements of a tensor of `numel` elements and `rows` rows (dim 0) that shard `rank` of
    `shards` holds under FSDP2: torch.chunk's split of dim 0, ceil(rows / shards) rows per rank, the
    last shorter or empty."""
    per = -(-rows // shards)
    return max(0, min(per, rows - rank * per)) * (numel // rows)


@functools.lru_cache(maxsize=4096)
def fsdp_bytes(shapes: tuple[tuple[int, int], ...], shards: int, rank: int) -> tuple[int, int, int]:
    """(weights, gradients, optimizer) bytes that shard `rank` of `shards` holds of parameters of
    (elements, rows) `shapes` under FSDP (`mlm.parallel.fsdp`): its rows of each, fp32 (the main
    weights AdamW steps, whatever train.param_dtype gathers them in), their fp32 gradients, Adam's
    two fp32 moments and one 4-byte step count per tensor (its state exists where its rows are none)."""
    if not shapes:
        return 0, 0, 0
    local = sum(fsdp_rows(n, rows, shards, rank) for n, rows in shapes)
    return 4 * local, 4 * local, 8 * local + 4 * len(shapes)


def sharding_key(layout: Layout) -> tuple:
    """What the model state depends on beyond the stage and dp × cp: the distributed optimizer,
    or FSDP's shard group (0 without FSDP)."""
    return layout.distributed_optimizer, layout.fsdp_shard_size if layout.fsdp else 0


def buffer_bytes(cfg: Config, stage: Stage, layout: Layout, dp_rank: int = 0, edp_rank: int = 0):
    """{"dense": (weights, gradients, optimizer), "expert": (...)} bytes of one rank: the dense
    buffer reduced over dp × cp (`dp_rank`: this rank's index among them, dp_rank · cp + cp_rank),
    the expert-parallel one over edp (zeros at ep = 1). Under FSDP (`fsdp_bytes`) the dense
    parameters are split over the shard group (dp × cp, or HSDP's groups of consecutive ranks:
    shard rank dp_rank mod S), the experts' over edp."""
    if layout.fsdp:
        S = layout.fsdp_shard_size
        return {
            "dense": fsdp_bytes(stage.shapes, S, dp_rank % S),
            "expert": fsdp_bytes(stage.expert_shapes, layout.edp, edp_rank),
        }
    elems = max(1, int(cfg.parallel.bucket_size_mb * 2**20) // 4)
    dist = layout.distributed_optimizer
    w = param_bytes(cfg)
    return {
        "dense": _state_bytes(stage.numels, elems, layout.dp_cp, dist, dp_rank, w),
        "expert": _state_bytes(stage.expert_numels, elems, layout.edp, dist, edp_rank, w),
    }


def param_bytes(cfg: Config) -> int:
    """Bytes of one trainable parameter as the model holds it: 4 (fp32), 2 (train.param_dtype bf16/fp16)."""
    return 4 if cfg.train.param_dtype == "fp32" else 2


def model_state_bytes(
    cfg: Config, stage: Stage, layout: Layout, dp_rank: int = 0, edp_rank: int = 0
) -> dict[str, int]:
    """{"weights", "gradients", "optimizer"} bytes of one rank, as allocated: the dense gradient
    buffer over dp × cp, the experts' over edp (each with its own padding and, with the distributed
    optimizer, its own 1/dp or 1/edp shard of Adam state), plus any frozen parameters' weights.
    With bf16/fp16 parameters "optimizer" includes the fp32 main weights (Megatron counts them there)."""
    return _state(buffer_bytes(cfg, stage, layout, dp_rank, edp_rank), stage)


def _state(parts: dict[str, tuple[int, int, int]], stage: Stage) -> dict[str, int]:
    w, g, o = (sum(x) for x in zip(*parts.values(), strict=True))
    return {"weights": w + 4 * stage.frozen, "gradients": g, "optimizer": o}


# ---------------------------------------------------------------- activations


def local_tokens(cfg: Config, layout: Layout) -> int:
    """Tokens of each sequence on one rank: seq_length / cp (context parallelism's zigzag split)."""
    return cfg.data.seq_length // layout.cp


def micro(cfg: Config, layout: Layout) -> Micro:
    """One micro-batch on one rank of `layout`, as the kinds' specs take it."""
    return Micro(
        b=layout.micro_batch,
        s=local_tokens(cfg, layout),
        S=cfg.data.seq_length,
        tp=layout.tp,
        u=layout.tp if layout.sequence_parallel else 1,
        cp=layout.cp,
        cp_comm_type=layout.cp_comm_type,
        ep=layout.ep,
        A=act_bytes(cfg),
        R=residual_bytes(cfg),
        recompute=layout.recompute,
    )


def micro_key(layout: Layout) -> tuple:
    """The fields of `layout` that its `micro` reads (the config gives the rest): a search's memo
    key for the terms of one micro-batch (`mlm.plan.memo`), cheaper to build and hash than `Micro`."""
    return (
        layout.micro_batch,
        layout.tp,
        layout.sequence_parallel,
        layout.cp,
        layout.cp_comm_type,
        layout.ep,
        layout.recompute,
    )


def _mixers(cfg: Config) -> list:
    """The specs of the mixers the model's layers use."""
    return [kinds.mixer(k) for k in cfg.model.mixer_kinds()]


def cp_workspace_bytes(cfg: Config, layout: Layout) -> float:
    """The transient attention workspace of one layer under cp (see the module doc and the mixers'
    `cp_workspace`), the largest of the model's mixers'; 0 at cp = 1."""
    mb = micro(cfg, layout)
    return max((spec.cp_workspace(cfg.model, mb) for spec in _mixers(cfg)), default=0.0)


def cp_buffer_bytes(cfg: Config, layout: Layout) -> float:
    """One layer's cp exchange buffers (estimated, the mixers' `cp_buffers`), the largest."""
    mb = micro(cfg, layout)
    return max((spec.cp_buffers(cfg.model, mb) for spec in _mixers(cfg)), default=0.0)


def _merge(parts: dict[str, float], more: dict[str, float]) -> None:
    for key, value in more.items():
        parts[key] = parts.get(key, 0.0) + value


def layer_activation_bytes(cfg: Config, layout: Layout, spec: LayerSpec | None = None) -> dict[str, float]:
    """Bytes one layer of kinds `spec` (default: the first layer's) saves for backward per
    micro-batch, by part (see the module doc): the norm before each half, what its mixer and MLP
    save (their specs' `saved`; the projections' inputs summed as "linear inputs"), the dropout
    masks; under full recompute the layer's input alone."""
    m = cfg.model
    spec = spec or m.layer_specs()[0]
    mb = micro(cfg, layout)
    e, h = mb.e, m.hidden_size
    if layout.recompute == "full":
        return {"layer input (full recompute)": e * h / mb.u * mb.R}
    halves = [k for k in (spec.mixer, spec.mlp) if k is not None]
    parts = {"norms": len(halves) * kinds.norm(spec.norm).saved(m, e / mb.u, mb.R)}
    if spec.mixer is not None:
        _merge(parts, kinds.mixer(spec.mixer).saved(m, mb))
    if spec.mlp is not None:
        _merge(parts, kinds.mlp(spec.mlp).saved(m, mb))
    if m.hidden_dropout > 0:
        parts["dropout masks"] = len(halves) * e * h / mb.u
    return parts


def residual_bytes(cfg: Config) -> int:
    """Bytes per element of the residual stream: autocast's dtype (2) under bf16/fp16, unless
    model.fp32_residual_connection; 4 in fp32."""
    autocast = cfg.train.precision in _AUTOCAST
    return 2 if autocast and not cfg.model.fp32_residual_connection else 4


def _norm_bytes(cfg: Config, tokens: float) -> float:
    """What one norm over `tokens` tokens of the residual stream saves (its kind's spec)."""
    return kinds.norm(cfg.model.normalization).saved(cfg.model, tokens, residual_bytes(cfg))


def stage_extras(cfg: Config, layout: Layout, stage: Stage) -> dict[str, float]:
    """Per-micro-batch activations outside the layers: token ids and RoPE tables on every chunk,
    embedding on the first stage, final norm, output input and the loss's saved tensors on the last
    (all over the rank's seq_length / cp tokens)."""
    m = cfg.model
    t, u = layout.tp, layout.tp if layout.sequence_parallel else 1
    s, b = local_tokens(cfg, layout), layout.micro_batch
    e, h = b * s, m.hidden_size
    A = act_bytes(cfg)
    out: dict[str, float] = {}
    rope = 2 * s * (m.rope_dim or 0) * 4  # cos and sin
    if m.position_embedding == "rope" and layout.recompute != "full":
        # under full recompute the checkpoint's closure holds them (a few MB), not autograd
        out["rope tables"] = sum(rope for c in stage.chunks if c)
    embedding = e * 8 + (e if t > 1 else 0) + (e * h if m.hidden_dropout > 0 else 0)
    if stage.first:
        out["embedding"] = embedding
    if stage.last:
        out["final norm"] = _norm_bytes(cfg, e / u)
        out["output input"] = e * h * A
        V = m.padded_vocab_size(t)
        if m.fused_cross_entropy:  # mlm.parallel.cross_entropy: no input saved; the fp32
            # gradients of h and of the weight's shard, computed in forward, and the token scales
            out["output input"] = 0.0
            out["loss"] = e * h * 4 + V / t * h * 4 + e * 4
        elif t > 1:  # vocab-parallel cross-entropy: softmax shard, two masks
            out["loss"] = e * V / t * 4 + e * (1 + 8)
        else:  # F.cross_entropy: log-softmax over the real vocabulary + the flattened labels
            out["loss"] = e * m.vocab_size * 4 + e * 8
    if stage.mtp:
        # the main model's final norm again (its statistics: its input is saved already) and its
        # output, depth 1's hnorm input; RoPE tables; per depth the embedding of the tokens
        # ahead, enorm, hnorm's statistics, eh_proj's input [e, 2h], one layer (never recomputed:
        # `mlm.parallel.recompute` wraps model.layers), its final norm, the output layer's input
        # and the loss (per-token, weighted: + 8 bytes). Depth k > 1's hnorm input is depth
        # k − 1's output: the output layer's input too, unless the loss is fused or under sequence
        # parallelism (the output layer then reads a gathered copy)
        stats = _norm_bytes(cfg, e / u) - e * h / u * residual_bytes(cfg)
        normed = e * h / u * A
        whole = replace(layout, recompute="none")
        layer = sum(layer_activation_bytes(cfg, whole, stage.kinds[-1]).values())
        depth = embedding + 2 * _norm_bytes(cfg, e / u) + stats + e * 2 * h / u * A + layer
        depth += out["output input"] + out["loss"] + 8 * e
        own = normed if m.fused_cross_entropy or u > 1 else 0.0
        rope_again = rope if m.position_embedding == "rope" else 0
        out["mtp depths"] = stats + normed + rope_again + stage.mtp * depth + (stage.mtp - 1) * own
    return out


def weight_cast_bytes(cfg: Config, stage: Stage, layout: Layout) -> tuple[float, float]:
    """(bytes of the layers' bf16/fp16 weight copies per micro-batch, the output layer's), 0 in fp32
    and with bf16/fp16 parameters (train.param_dtype: autocast has nothing to cast)."""
    if not casts_weights(cfg):
        return 0.0, 0.0
    return (0.0 if layout.recompute == "full" else 2.0 * stage.layer_linear), 2.0 * stage.output_linear


def micro_batch_activation_bytes(cfg: Config, layout: Layout, stage: Stage) -> float:
    """Everything one micro-batch's forward on this rank saves for backward (all its chunks): the
    number tests compare with saved_tensors_hooks."""
    per_kind = kind_activation_bytes(cfg, layout, stage)
    layers = sum(per_kind[k] * n for k, n in stage.kind_counts)
    casts = sum(weight_cast_bytes(cfg, stage, layout))
    return layers + sum(stage_extras(cfg, layout, stage).values()) + casts


def kind_activation_bytes(cfg: Config, layout: Layout, stage: Stage) -> dict[LayerSpec, float]:
    """{layer kinds: bytes one such layer saves per micro-batch} for the kinds on `stage`."""
    return {k: sum(layer_activation_bytes(cfg, layout, k).values()) for k in stage.held_kinds}


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


@functools.lru_cache(maxsize=256)
def report_ranks(pp: int) -> tuple[int, ...]:
    """The pipeline ranks whose memory and time stand for all: first, second, last."""
    return tuple(sorted({0, min(1, pp - 1), pp - 1}))


def headroom_bytes(hbm: float) -> float:
    return 1e9 + 0.05 * hbm


class _LayerMemory(NamedTuple):
    """A rank's memory terms at one micro-batch (`micro`) that do not depend on its stage, dp or
    optimizer: computed once per micro in a search (`mlm.plan.memo`)."""

    parts: dict[LayerSpec, dict[str, float]]
    """`layer_activation_bytes` of each of the model's layer kinds."""
    totals: dict[LayerSpec, float]
    """Their sums (`kind_activation_bytes`)."""
    ep_buffers: dict[LayerSpec, float]
    """One layer's ep exchange buffers, per kind with an MLP (empty at ep = 1)."""
    logits: float
    """The last stage's transient logits."""
    workspace: float
    """cp's transient attention workspace (`cp_workspace_bytes`)."""
    cp_buffers: float


def _layer_memory(cfg: Config, layout: Layout) -> _LayerMemory:
    mb = micro(cfg, layout)
    specs = dict.fromkeys(cfg.model.layer_specs())
    parts = {k: layer_activation_bytes(cfg, layout, k) for k in specs}
    ep = {}
    if layout.ep > 1:  # one expert-parallel layer's exchange buffers
        ep = {k: kinds.mlp(k.mlp).ep_buffers(cfg.model, mb) for k in specs if k.mlp is not None}
    e, t, A = layout.micro_batch * local_tokens(cfg, layout), layout.tp, act_bytes(cfg)
    v = cfg.model.padded_vocab_size(t) // t
    if cfg.model.fused_cross_entropy:  # a chunk's logits, fp32 softmax and gradient
        logits = min(e, chunk_tokens(v)) * v * (A + 4 + A)
    else:
        logits = e * v * (A + 4)
    totals = {k: sum(p.values()) for k, p in parts.items()}
    return _LayerMemory(
        parts, totals, ep, logits, cp_workspace_bytes(cfg, layout), cp_buffer_bytes(cfg, layout)
    )


def _extras(cfg: Config, layout: Layout, stage: Stage) -> tuple[float, float]:
    """(per micro-batch and chunk: the embedding and a chunk's RoPE tables; once: the final norm,
    the output layer's input, the loss, the MTP depths) of `stage_extras`."""
    extras = stage_extras(cfg, layout, stage)
    first_extra = extras.get("embedding", 0.0) + extras.get("rope tables", 0.0) / max(1, len(stage.chunks))
    last_extra = sum(
        v for k, v in extras.items() if k in ("final norm", "output input", "loss", "mtp depths")
    )
    return first_extra, last_extra


def state_parts(cfg: Config, stage: Stage, layout: Layout, memo: dict | None = None):
    """`buffer_bytes` of the rank's first dp rank, kept in `memo` (`mlm.plan.memo`)."""
    key = ("state", stage, layout.dp_cp, layout.edp, sharding_key(layout))
    return cached(memo, key, buffer_bytes, cfg, stage, layout)


def state_floor(cfg: Config, layout: Layout, stage: Stage, hbm: float, memo: dict | None = None) -> float:
    """A lower bound of `rank_memory(...).total` from the model state and the headroom alone, which
    every other component only adds to (summed in the same order, so the bound holds to the bit):
    where it exceeds the GPU, no micro-batch or recompute of this mesh and optimizer fits. Under
    FSDP also its transients (`fsdp_transient_bytes`), which depend on no micro-batch, only on
    whether there is more than one per step (`floor_key`)."""

    def floor() -> float:
        state = _state(state_parts(cfg, stage, layout, memo), stage)
        fsdp = fsdp_transient_bytes(cfg, layout, stage) if layout.fsdp else {}
        return sum((*state.values(), *fsdp.values(), headroom_bytes(hbm)))

    return cached(memo, ("floor", stage, *floor_key(layout), hbm), floor)


def floor_key(layout: Layout) -> tuple:
    """What `state_floor` depends on beyond the stage: dp × cp, edp, the sharding, and under FSDP
    whether gradients accumulate over micro-batches."""
    return layout.dp_cp, layout.edp, sharding_key(layout), bool(layout.fsdp) and layout.num_micro > 1


def rank_memory(
    cfg: Config,
    layout: Layout,
    pp_rank: int,
    hbm: float,
    stage: Stage | None = None,
    memo: dict | None = None,
) -> MemoryReport:
    """The memory report of pipeline rank `pp_rank` (`stage`: its `rank_stage`, when the caller has
    it; `memo`: a search's shared terms, `mlm.plan.memo`)."""
    stage = stage or rank_stage(
        cfg,
        layout.tp,
        layout.pp,
        layout.vpp,
        pp_rank,
        layout.first_stage_layers,
        layout.last_stage_layers,
        layout.ep,
    )
    sharding = sharding_key(layout)
    key = ("model state", stage, layout.dp_cp, layout.edp, sharding)
    parts, state = cached(memo, key, _parts_and_state, cfg, stage, layout, memo)
    # what does not depend on the sharding: a search generates a mesh's shardings one after the
    # other, so the rank's last one is kept (a slot per rank, not a growing memo)
    key = (stage, micro_key(layout), layout.num_micro)
    slot = ("rank activations", pp_rank)
    last = memo.get(slot) if memo is not None else None
    if last is not None and last[0] == key:
        acts, comm, flight, per_layer = last[1]
    else:
        value = _rank_activations(cfg, layout, stage, pp_rank, memo)
        if memo is not None:
            memo[slot] = (key, value)
        acts, comm, flight, per_layer = value
    comps: dict[str, float] = {**state, **acts}
    if layout.fsdp:
        key = ("fsdp transient", stage, sharding, layout.num_micro > 1)
        comps.update(cached(memo, key, fsdp_transient_bytes, cfg, layout, stage))
    elif cfg.parallel.grad_reduce_dtype == "bf16":  # a bf16 copy of every bucket, all may be in flight
        comm += (parts["dense"][1] if layout.dp_cp > 1 else 0) / 2
        comm += (parts["expert"][1] if layout.edp > 1 else 0) / 2
    comps["communication buffers"] = comm
    comps["headroom"] = headroom_bytes(hbm)
    return MemoryReport(pp_rank, comps, flight, per_layer, hbm)


def _parts_and_state(cfg: Config, stage: Stage, layout: Layout, memo: dict | None):
    parts = state_parts(cfg, stage, layout, memo)
    return parts, _state(parts, stage)


def _rank_activations(cfg: Config, layout: Layout, stage: Stage, pp_rank: int, memo: dict | None):
    """(activations, weight casts and transients by component, the communication buffers but the
    bf16 gradient copies, micro-batches in flight, the biggest layer kind's parts) of a rank."""
    flight = in_flight(layout.pp, pp_rank, layout.num_micro, layout.vpp)
    mk = micro_key(layout)
    lm = cached(memo, ("layer memory", mk), _layer_memory, cfg, layout)
    per_kind = {k: lm.totals[k] for k in stage.held_kinds}  # `kind_activation_bytes`
    chunk_bytes = max(sum(per_kind[k] * n for k, n in c) for c in stage.chunk_kind_counts)
    # the parts of the layer kind that needs the most (an MoE layer where there is one), for --explain
    big = max(per_kind, key=per_kind.__getitem__)
    first_extra, last_extra = cached(memo, ("extras", mk, stage.shape), _extras, cfg, layout, stage)
    layer_casts, output_cast = weight_cast_bytes(cfg, stage, layout)
    comps: dict[str, float] = {}
    comps["activations"] = flight * (chunk_bytes + first_extra) + last_extra
    comps["weight casts"] = flight * layer_casts / len(stage.chunks) + output_cast
    e, h, t = layout.micro_batch * local_tokens(cfg, layout), cfg.model.hidden_size, layout.tp
    u = t if layout.sequence_parallel else 1
    if stage.last:
        comps["logits (transient)"] = lm.logits
    if stage.layers and lm.workspace:
        comps["attention workspace (transient)"] = lm.workspace
    comm = 0.0
    if layout.ep > 1:  # one expert-parallel layer's exchange buffers
        comm += max((lm.ep_buffers[k] for k in per_kind if k.mlp is not None), default=0.0)
    if layout.pp > 1:  # hidden states travel between stages in the parameters' dtype
        comm += 2 * e * h / u * param_bytes(cfg)
    if t > 1:
        comm += 2 * e * h * 4
    if stage.layers:
        comm += lm.cp_buffers
    return comps, comm, flight, lm.parts[big]


def fsdp_transient_bytes(cfg: Config, layout: Layout, stage: Stage) -> dict[str, float]:
    """What FSDP holds beside its shards (`mlm.parallel.fsdp`): with more than one micro-batch per
    step the gradient sync is off until the last (`set_requires_gradient_sync`), so FSDP2 keeps
    every parameter's unsharded gradient, accumulated in fp32 (its reduce dtype; measured with
    bf16 parameters too), from the first micro-batch's backward to the last's reduce-scatter. The
    gathered units in the parameters' dtype: resharded after forward, two layers at once (one
    running, the next prefetched) beside the larger end unit (embedding, or final norm + output
    layer, kept to its backward) and the root; otherwise every unit from its forward to its
    backward. A layer's unsharded gradient (parameters' dtype) and its fp32 reduce-scatter input."""
    trainable = sum(stage.numels) + sum(stage.expert_numels)
    layer, ends = stage.fsdp_units
    pb = param_bytes(cfg)
    if cfg.parallel.fsdp_reshard_after_forward:
        gathered = pb * (2 * layer + ends)
    else:
        gathered = pb * (trainable + stage.frozen)
    out = {"gathered parameters (transient)": gathered + (pb + 4) * layer}
    if layout.num_micro > 1:
        out["unsharded gradients (accumulating)"] = 4.0 * trainable
    return out


def memory(
    cfg: Config,
    layout: Layout,
    hbm: float,
    stages: dict[int, Stage] | None = None,
    memo: dict | None = None,
    cap: float | None = None,
) -> MemoryReport:
    """The report of the rank that needs the most: the first, second or last pipeline rank (the
    second has one micro-batch fewer in flight than the first but may hold more layers; `stages`:
    their `rank_stage`s, when the caller has them; `memo`: a search's shared terms). `cap`: stop at
    the first rank needing more than `cap` bytes and return its report (the layout needs more too)."""
    stages = stages or {}
    reports = []
    for r in report_ranks(layout.pp):
        report = rank_memory(cfg, layout, r, hbm, stages.get(r), memo)
        if cap is not None and report.total > cap:
            return report
        reports.append(report)
    return max(reports, key=lambda r: r.total)


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
