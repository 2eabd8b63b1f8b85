"""The [train] section: the loop, its precision (and fp8) and its resilience settings."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from mlm.config.checks import choice, ensure


@dataclass
class Fp8Config:
    """FP8 linears in the transformer layers and their scaling (Megatron's --fp8-format, --fp8-recipe,
    --fp8-margin, --fp8-amax-history-len, --fp8-amax-compute-algo; Transformer Engine's recipe)."""

    format: str = ""
    """FP8 linears in the transformer layers: "" off, e4m3, or hybrid (e4m3 forward, e5m2 gradients); needs bf16."""
    recipe: str = "delayed"
    """fp8 scaling: delayed (scale from an amax history) or tensorwise (from the tensor's own amax)."""
    margin: int = 0
    """fp8: scale = fp8 max / amax / 2^margin."""
    amax_history_len: int = 1024
    """fp8 delayed scaling: amax values (optimizer steps) kept per tensor."""
    amax_compute_algo: str = "max"
    """fp8 delayed scaling: the amax a scale comes from: max (of the history) or most_recent."""

    def __post_init__(self):
        s = "train.fp8"
        choice(s, "format", self.format, ("", "e4m3", "hybrid"))
        choice(s, "recipe", self.recipe, ("delayed", "tensorwise"))
        choice(s, "amax_compute_algo", self.amax_compute_algo, ("max", "most_recent"))
        ensure(self.margin >= 0, f"{s}.margin={self.margin}: must be 0 or more")
        ensure(
            self.amax_history_len >= 1,
            f"{s}.amax_history_len={self.amax_history_len}: must be at least 1",
        )


@dataclass
class ResilienceConfig:
    """What a long run does about hangs, slow ranks and bad steps (mlm.train.watchdog, stragglers,
    faults): a resume may change any of these (mlm.train.resume)."""

    hang_timeout: float = 900.0
    """Seconds without progress on a rank before the job is declared hung: stacks to RUN_DIR/hang/, exit 4; 0 disables."""
    straggler_window: int = 20
    """Compare the ranks' compute time every this many steps (one small all-gather); 0 disables."""
    straggler_threshold: float = 1.2
    """Name a rank whose compute per step is at least this multiple of its peers' median (> 1)."""
    fault_action: str = "skip"
    """On a NaN/Inf loss or gradient norm, or a loss spike: skip the update, rollback to the last checkpoint, or stop."""
    loss_spike_zscore: float = 0.0
    """A loss this many standard deviations above the last loss_spike_window applied steps' mean is a fault; 0: off."""
    loss_spike_window: int = 50
    """Applied steps the loss spike test compares with (it starts once this many have run)."""
    skip_iterations: list[int] = field(default_factory=list)
    """Steps (1-based, as logged) whose data is consumed without forward, backward or update (Megatron's --iterations-to-skip)."""

    def __post_init__(self):
        s = "train.resilience"
        ensure(
            0 <= self.hang_timeout <= 1e9,  # + 300 s, the process group's timeout: a timedelta
            f"{s}.hang_timeout={self.hang_timeout}: must be 0 (off) or a number of seconds up to 1e9, e.g. 900",
        )
        ensure(
            self.straggler_window >= 0,
            f"{s}.straggler_window={self.straggler_window}: must be 0 (off) or a number of steps",
        )
        ensure(
            self.straggler_threshold > 1,
            f"{s}.straggler_threshold={self.straggler_threshold}: must be above 1 (a multiple of the "
            "median compute time per step, e.g. 1.2)",
        )
        choice(s, "fault_action", self.fault_action, ("skip", "rollback", "stop"))
        ensure(
            0 <= self.loss_spike_zscore < math.inf,
            f"{s}.loss_spike_zscore={self.loss_spike_zscore}: must be 0 (off) or a positive number, e.g. 6",
        )
        ensure(
            self.loss_spike_window >= 2,
            f"{s}.loss_spike_window={self.loss_spike_window}: must be at least 2 (a standard deviation "
            "needs two losses)",
        )
        bad = [i for i in self.skip_iterations if i < 1]
        ensure(
            not bad,
            f"{s}.skip_iterations={self.skip_iterations}: steps count from 1 (as logged); remove {bad}",
        )


@dataclass
class TrainConfig:
    """The loop: batch sizes, length, precision (and fp8), evaluation, resilience."""

    micro_batch_size: int = 4
    """Samples per forward/backward on one rank."""
    global_batch_size: int = 8
    """Samples per optimizer step: micro × accumulation × dp."""
    train_iters: int | None = 100
    """Optimizer steps; give this or train_tokens."""
    train_tokens: int | None = None
    """Tokens to train on (steps = tokens / (global batch × seq length)); replaces train_iters."""
    precision: str = "fp32"
    """fp32, bf16 (autocast) or fp16 (autocast + dynamic loss scaling)."""
    param_dtype: str = "auto"
    """auto (bf16 when training in bf16 on CUDA without an fp32 residual stream, else fp32), fp32, or train.precision's bf16/fp16: low-precision parameters, fp32 main weights."""
    initial_loss_scale: float = 2.0**16
    """fp16: starting loss scale."""
    loss_scale_window: int = 1000
    """fp16: steps without overflow before the scale doubles."""
    eval_interval: int = 0
    """Evaluate on the validation split every this many steps; 0 disables."""
    eval_iters: int = 4
    """Global batches per evaluation (each split over the dp ranks as in training)."""
    seed: int = 1234
    """Seed of initialisation, dropout and data order."""
    device: str = "auto"
    """auto (cuda when available), cpu or cuda."""
    compile: bool = False
    """torch.compile each transformer layer (after parallelism, recompute and kernel choice)."""
    fp8: Fp8Config = field(default_factory=Fp8Config)
    """FP8 linears: the format (off by default) and the scaling recipe."""
    resilience: ResilienceConfig = field(default_factory=ResilienceConfig)
    """Hangs, stragglers, faults (NaN/Inf, loss spikes) and steps to skip."""

    def __post_init__(self):
        choice("train", "precision", self.precision, ("fp32", "bf16", "fp16"))
        ensure(
            not self.fp8.format or self.precision == "bf16",
            f"train.fp8.format={self.fp8.format!r} with train.precision={self.precision!r}: fp8 runs inside bf16 "
            "(everything outside the fp8 linears, as in Megatron); set train.precision=bf16",
        )
        ensure(
            not (self.fp8.format and self.compile),
            f"train.fp8.format={self.fp8.format!r} with train.compile=true: the fp8 linears record amaxes into shared "
            "state during forward and backward, which torch.compile's compiled backward cannot replay; "
            "set train.compile=false (or train.fp8.format='')",
        )
        choice("train", "device", self.device, ("auto", "cpu", "cuda"))
        ensure(
            self.param_dtype in ("auto", "fp32", self.precision),
            f"train.param_dtype={self.param_dtype}: must be fp32 or the compute dtype "
            f"train.precision={self.precision}; set --set train.param_dtype=fp32 or "
            f"--set train.precision={self.param_dtype}",
        )
        ensure(self.micro_batch_size > 0, f"train.micro_batch_size={self.micro_batch_size}: must be positive")
        ensure(
            self.global_batch_size % self.micro_batch_size == 0,
            f"train.global_batch_size={self.global_batch_size} is not divisible by "
            f"train.micro_batch_size={self.micro_batch_size}",
        )
        ensure(
            (self.train_iters is None) != (self.train_tokens is None),
            "train.train_iters and train.train_tokens: give exactly one (set the other to none with --set)",
        )
