"""Software profiles for the planner's time model: which kernels a run uses (`mlm plan --software`).

A published throughput was measured with the kernels of its day — Megatron-LM in 2021 had no
flash attention and wrote every s × s score matrix to memory; Megatron-core runs Transformer
Engine's fused norms and cuDNN attention; torchtitan compiles its elementwise work — so the time
model takes them as an input instead of assuming today's (`mlm.plan.work` turns a profile into
bytes moved and kernels launched per layer). The built-in profiles:

    mlm             mlm's own layers on a GPU (model.kernels = torch): attention in one fused
                    kernel (SDPA's flash/cuDNN, flash-attn or TE), norms, SwiGLU and RoPE as torch
                    ops (`kernels.lean`), fp32 weights cast per micro-batch under autocast,
                    weight gradients accumulated outside the GEMM, gradient reduce-scatter and the
                    distributed optimizer's parameter all-gather overlapped (`mlm.parallel`)
    mlm-triton      the same with model.kernels = triton or auto: the Triton norms, SwiGLU and RoPE
                    of `kernels/`, one kernel each way
    megatron-2021   Megatron-LM as Narayanan et al. 2021 ran it: fused scale-mask-softmax over
                    s × s scores (no flash attention), fused bias-GeLU and bias-dropout-add, apex
                    LayerNorm, vocab-parallel cross-entropy in torch ops, no overlap of the
                    gradient all-reduce, no fused weight-gradient accumulation
    megatron-2022   as 2021 plus the fused weight-gradient accumulation into fp32 main gradients
                    (Korthikanti et al. 2022 add sequence parallelism and selective recompute,
                    which are layout choices here)
    megatron-core   Megatron-core with Transformer Engine (2024-2025): fused norms (into the
                    following linear layer), fused RoPE, bias-activation and cross-entropy, cuDNN
                    fused attention, fused weight-gradient accumulation, overlapped gradient
                    reduce-scatter and parameter all-gather, fp8 grouped GEMMs for the routed
                    experts under fp8 (the published H100 and MoE runs)
    torchtitan      torchtitan with torch.compile: compiled (fused) norms, SwiGLU and RoPE, SDPA
                    attention, per-op selective recompute; its runs shard with FSDP2, which is
                    the layout's `fsdp` / `hsdp<N>` (`mlm.plan.timing.fsdp_seconds`), as mlm's

A custom profile is a TOML file with the same keys, optionally starting from a built-in one with
`base = "megatron-core"` (as hardware profiles do, `mlm.plan.hardware`). Torch-free.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from mlm.errors import MlmError
from mlm.fileio import read_toml

SELECTIVE = ("core", "elementwise", "op")


@dataclass(frozen=True)
class Software:
    """The kernels and overlaps a training run uses (see the module doc)."""

    name: str
    """Profile name."""
    flash_attention: bool = True
    """Attention core in one fused kernel: no s × s matrix in memory, the causal half skipped."""
    attention_efficiency: float = 0.35
    """Fraction of peak the fused attention kernel reaches on the work it does (the causal half),
    forward and backward: FlashAttention-2 about 0.35 on an H100 (Shah et al. 2024, FlashAttention-3,
    arXiv 2407.08608: "only 35% utilization on H100"), which is what torch's SDPA runs there;
    Hopper-specific kernels (FlashAttention-3, cuDNN's, which TE uses) about 0.5 forward and
    backward together; FlashAttention-2 on an A100 0.5-0.7 (Dao 2023, arXiv 2307.08691)."""
    fused_norm: bool = True
    """Each norm one kernel forward and one backward (apex, TE, Triton, compiled); else torch ops."""
    fused_activation: bool = True
    """Bias + GeLU or SwiGLU in one kernel each way; else torch ops."""
    fused_rope: bool = True
    """RoPE in one kernel per tensor each way; else torch ops."""
    fused_residual: bool = True
    """Bias + dropout + residual add in one kernel (matters with biases or hidden dropout)."""
    fused_softmax: bool = True
    """Without flash attention: scale, causal mask and softmax over the scores in one kernel."""
    fused_cross_entropy: bool = False
    """The loss over the vocabulary in a fused kernel (about two passes over the logits instead of
    the vocab-parallel cross-entropy's dozen); model.fused_cross_entropy also turns it on."""
    grad_accumulation_fusion: bool = False
    """Weight gradients accumulated into the fp32 main gradients inside the GEMM; else a separate
    read-add-write of every local parameter's gradient per micro-batch."""
    weight_casts: bool = True
    """fp32 weights cast to the compute dtype in every micro-batch's forward (autocast, mlm's way),
    and their gradients cast back; off where the model holds weights in the compute dtype
    (Megatron's bf16 parameters with fp32 main copies, FSDP's mixed precision). Counted only under
    bf16/fp16 autocast of fp32 parameters (train.param_dtype fp32)."""
    overlap_grad_reduce: bool = True
    """The data-parallel gradient reduce overlapped with the backward (only the excess counts)."""
    overlap_param_gather: bool = True
    """The distributed optimizer's parameter all-gather overlapped with the next forward."""
    tp_overlap: bool = False
    """The tensor-parallel collectives split into tp chunks and pipelined with the GEMMs (TE's
    --tp-comm-overlap, torch's async TP): all but the first chunk hide behind the layer's GEMMs."""
    ep_overlap: bool = False
    """The expert-parallel all-to-all of one micro-batch hidden behind another's compute
    (Megatron's 1F1B all-to-all overlap, DualPipe): only its excess over the compute counts."""
    selective: str = "core"
    """What selective recompute re-runs: `core`, Megatron's default and mlm's (the attention core);
    `elementwise`, Megatron's --recompute-modules of norms and activations (their forward again,
    no GEMM); or `op`, torchtitan's per-op policy (every other matmul and every elementwise op of
    the forward again; the attention output is kept)."""
    fp8_experts: bool = False
    """Under train.fp8 the routed experts' grouped GEMMs run in fp8 too (Transformer Engine's, in
    Megatron-core); mlm's fp8 leaves them in the compute dtype, with the routers, the output layer
    and the MTP depths (`mlm.parallel.fp8`)."""
    launch_s: float = 10e-6
    """Host time to launch one kernel (eager PyTorch's dispatch; a GPU waits when its kernels are
    shorter)."""

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.type == "bool" and not isinstance(v, bool):
                raise MlmError(f"software {self.name}: {f.name}={v!r} must be true or false")
            if f.type == "float" and (isinstance(v, bool) or not isinstance(v, int | float)):
                raise MlmError(f"software {self.name}: {f.name}={v!r} must be a number")
        if not 0 < self.attention_efficiency <= 1:
            raise MlmError(
                f"software {self.name}: attention_efficiency={self.attention_efficiency} must be in (0, 1]"
            )
        if self.selective not in SELECTIVE:
            raise MlmError(
                f"software {self.name}: selective={self.selective!r} must be one of {', '.join(SELECTIVE)}"
            )
        if self.launch_s < 0:
            raise MlmError(f"software {self.name}: launch_s={self.launch_s} must be >= 0")


_EAGER_MEGATRON = dict(
    flash_attention=False,
    fused_rope=False,
    weight_casts=False,
    overlap_grad_reduce=False,
    overlap_param_gather=False,
)
PROFILES: dict[str, Software] = {
    "mlm": Software("mlm", fused_norm=False, fused_activation=False, fused_rope=False),
    "mlm-triton": Software("mlm-triton"),
    "megatron-2021": Software("megatron-2021", **_EAGER_MEGATRON),
    "megatron-2022": Software("megatron-2022", grad_accumulation_fusion=True, **_EAGER_MEGATRON),
    "megatron-core": Software(
        "megatron-core",
        attention_efficiency=0.5,
        fused_cross_entropy=True,
        grad_accumulation_fusion=True,
        weight_casts=False,
        fp8_experts=True,
    ),
    "torchtitan": Software("torchtitan", weight_casts=False, selective="op"),
}


def default_software(cfg) -> Software:
    """mlm's own kernels as the run config chooses them (model.kernels)."""
    return PROFILES["mlm-triton" if cfg.model.kernels in ("triton", "auto") else "mlm"]


def load_software(spec: str, cfg=None) -> Software:
    """A built-in profile by name, a custom TOML profile by path, or (spec "auto") mlm's own for
    `cfg` (its model.kernels)."""
    if spec == "auto":
        return default_software(cfg) if cfg is not None else PROFILES["mlm"]
    if spec in PROFILES:
        return PROFILES[spec]
    path = Path(spec)
    if not path.is_file():
        raise MlmError(
            f"--software {spec!r}: not a known profile (auto, {', '.join(PROFILES)}) nor a TOML file; "
            "see docs/plan-validation.md for the keys"
        )
    return software_from_dict(read_toml(path), str(path), path.stem)


def software_from_dict(data: dict, where: str, name: str | None = None) -> Software:
    """A profile from TOML keys, optionally over `base = NAME`; named `name`, or after its base and
    the keys it changes ("megatron-core (tp_overlap)"); MlmError naming `where`."""
    data = dict(data)
    base = data.pop("base", None)
    known = {f.name for f in dataclasses.fields(Software)} - {"name"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise MlmError(f"{where}: unknown software keys {unknown}; known: {sorted(known)}")
    if base is not None and base not in PROFILES:
        raise MlmError(f"{where}: base={base!r} is not a built-in profile ({', '.join(PROFILES)})")
    if name is None:
        name = f"{base} ({', '.join(data)})" if base and data else (base or where)
    start = PROFILES[base] if base is not None else Software(name)
    try:
        return dataclasses.replace(start, name=name, **data)
    except (TypeError, MlmError) as e:  # a value the profile refuses: name the file it came from
        raise MlmError(f"{where}: {e}") from None
