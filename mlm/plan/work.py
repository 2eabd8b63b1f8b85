"""The work that does not run on tensor cores: bytes moved and kernels launched, per micro-batch.

A layer's GEMMs are compute-bound; everything between them — norms, the activation, RoPE, the
residual adds (with bias and dropout), the attention's layout copies, and without flash attention
the softmax over every s × s score matrix — reads and writes whole activations once or a few times
and is bound by memory bandwidth. So is the loss over the vocabulary, the cast of fp32 weights
under autocast, a gradient accumulation outside the GEMM, and the optimizer step. For a small
model these are a large share of the step; for a large one they vanish behind GEMMs.

Counts are passes over a tensor of the autocast dtype (A bytes an element), forward and backward,
for the kernels a `Software` profile uses (one fused kernel, or the torch ops of an unfused
version), per token of the rank's tensor (widths over tp where the tensor is split):

    norm (×2 per layer)     fused 2 + 3 (read x, write y; read x and dy, write dx), 1 + 2 kernels;
                            torch ops (fp32 statistics, casts, weight) 12 + 24, 6 + 10 kernels;
                            width h on e/u tokens (replicated over tp without sequence parallelism)
    residual add (×2)       3 + 3 (read two, write one; the gradient's sum), 1 + 1 kernels; with
                            biases or hidden dropout, fused bias-dropout-add +0.5 + 0.5 (the 1-byte
                            mask), as torch ops +4 + 3 and 2 + 1 kernels more; width h on e/u tokens
    attention output copy   2 + 2 ([b, s, heads, dim] to the projection's layout), 1 + 1 kernels
    RoPE                    q and k: fused 2 + 2, 2 + 2 kernels; torch ops 8 + 8, 10 + 10 kernels
    attention core          flash: reads q, k, v and writes the output (1 + 2 over each),
                            1 + 3 kernels; else the scores, (H/t)·S per token: softmax fused 2 + 3
                            (1 + 1 kernels) or as torch ops 6 + 6 (4 + 4), attention dropout
                            +2.5 + 2.5 (1 + 1), and the two batched GEMMs each way
    activation              GeLU fused 2 + 3, torch ops 4 + 8 (bias: +2 forward); SwiGLU fused
                            3 + 5, torch ops 5 + 10; width ffn/t (an MoE layer: its k experts'
                            width per token)
    MoE dispatch            the k copies of each routed token permuted and unpermuted, 4 + 4 over
                            k·h, plus the router's softmax and top-k over E (2 + 2); 8 + 8 kernels
    GEMMs                   1 + 2 kernels each (q, k, v in one, out, the MLP's two or three)

Forward passes repeat under recompute: full re-runs each layer's forward; selective by
`Software.selective`: "core" the attention core's, "elementwise" the norms' and activations'
(Megatron's --recompute-modules layernorm, moe_act), "op" every elementwise op's (fp8's casts
among them) and every other GEMM's.
Under train.fp8 each GEMM's input is cast forward and its output gradient backward: 2.5 passes
(read for the amax, read and write one byte) over the rows the GEMM computes (an MoE layer's
routed experts, where `Software.fp8_experts`: e/u · k rows at the expert width), and each weight
6 B per micro-batch. Per local parameter and micro-batch: `weight_casts` 6 B forward (read fp32,
write the compute dtype) and 6 B backward, under autocast of fp32 parameters; without
`grad_accumulation_fusion` 10 B (read the gradient and the fp32 accumulator, write it). The
loss: about 48 bytes per logit as the vocab-parallel cross-entropy's torch ops move them (fp32
copies, max, exp, sum, the softmax gradient and its cast), 12 fused; 20 kernels or 4.
"""

from __future__ import annotations

from dataclasses import replace

from mlm.config import Config, LayerSpec
from mlm.layout import Layout
from mlm.model import kinds
from mlm.model.kinds.spec import NORM, Passes, Work
from mlm.plan.memory import act_bytes, casts_weights, local_tokens, micro
from mlm.plan.software import Software

LOSS_BYTES = {True: 12, False: 48}
LOSS_KERNELS = {True: 4, False: 20}
CAST_BYTES = 6
FP8_PASSES = 2.5
"""fp8 (train.fp8): reading a GEMM input for its amax, then reading it and writing one byte."""
FP8_WEIGHT_BYTES = 6
"""fp8: each weight read twice (amax, cast) and written as fp8 and as its fp8 transpose."""
ACCUMULATE_BYTES = 10


def layer_work(cfg: Config, layout: Layout, sw: Software, spec: LayerSpec, recompute: str) -> Work:
    """One layer of kinds `spec` for one micro-batch on one rank: the norm and the residual add of
    each half, what its mixer and MLP add (their specs' `work`), their GEMMs' kernels and fp8
    casts, and the tp collectives' kernels."""
    m = cfg.model
    mb = replace(micro(cfg, layout), recompute=recompute)
    e, A, u, h = mb.e, mb.A, mb.u, m.hidden_size
    selective = sw.selective if recompute == "selective" else None
    # the forward again: every op under full recompute and torchtitan's per-op policy, the norms and
    # activations under Megatron's elementwise modules, the attention core under "core"
    full = 2 if recompute == "full" or selective == "op" else 1
    times = Passes(
        full=full,
        norm_act=2 if full == 2 or selective == "elementwise" else 1,
        core=2 if recompute == "full" or selective == "core" else 1,
    )
    gemm_again = 1.0 if recompute == "full" else 0.5 if selective == "op" else 0.0  # every other matmul
    parts = []
    if spec.mixer is not None:
        parts.append(kinds.mixer(spec.mixer).work(m, mb, sw, times))
    if spec.mlp is not None:
        parts.append(kinds.mlp(spec.mlp).work(m, mb, sw, times))
    residual = (3, 3, 1, 1)
    if m.add_bias or m.hidden_dropout > 0:
        residual = (3.5, 3.5, 1, 1) if sw.fused_residual else (7, 6, 3, 2)
    w = Work()
    for _ in parts:
        w.add(NORM[sw.fused_norm], h, e / u, A, times.norm_act)
    for _ in parts:
        w.add(residual, h, e / u, A, full)
    for part in parts:
        w += part.work
    gemms = sum(part.gemms for part in parts)
    w.kernels += gemms * (1 + gemm_again + 2)
    if cfg.train.fp8.format:  # each GEMM's input cast forward (amax, scale) and its output gradient backward
        # the casts are elementwise ops: again where every elementwise op is (full, op)
        w.kernels += gemms * full + gemms
        for part in parts:
            for forward, backward, rows in part.fp8:
                w.add((FP8_PASSES, 0, 0, 0), forward, rows, A, full)
                w.add((0, FP8_PASSES, 0, 0), backward, rows, A)
    if layout.tp > 1:  # the tp collectives: a pair per half, the forward's again under full recompute
        w.kernels += len(parts) * (2 + (1 if recompute == "full" else 0))
    return w


def loss_work(cfg: Config, layout: Layout, sw: Software) -> Work:
    """The output layer's loss over the (padded) vocabulary for one micro-batch, last stage."""
    fused = sw.fused_cross_entropy or cfg.model.fused_cross_entropy
    e = layout.micro_batch * local_tokens(cfg, layout)
    logits = e * cfg.model.padded_vocab_size(layout.tp) / layout.tp
    return Work(LOSS_BYTES[fused] * logits, LOSS_KERNELS[fused] + 3)


def embedding_work(cfg: Config, layout: Layout) -> Work:
    """The embedding lookup and its scatter-add gradient for one micro-batch, first stage."""
    u = layout.tp if layout.sequence_parallel else 1
    e = layout.micro_batch * local_tokens(cfg, layout)
    w = Work()
    w.add((2, 3, 1, 2), cfg.model.hidden_size, e / u, act_bytes(cfg))
    return w


def parameter_work(cfg: Config, sw: Software, params: float, recompute: str) -> float:
    """Bytes per micro-batch over a rank's `params` local parameters: autocast's weight casts (of
    fp32 parameters under bf16/fp16 autocast), fp8's weight casts, and a gradient accumulation
    outside the GEMM."""
    casts = CAST_BYTES * (3 if recompute == "full" else 2) if sw.weight_casts and casts_weights(cfg) else 0
    casts += FP8_WEIGHT_BYTES if cfg.train.fp8.format else 0
    return params * (casts + (0 if sw.grad_accumulation_fusion else ACCUMULATE_BYTES))
