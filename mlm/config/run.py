"""A whole run (`Config`): the sections besides [model] and [train], and the checks across sections."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from mlm.config.checks import choice, ensure
from mlm.config.model import ModelConfig
from mlm.config.train import TrainConfig
from mlm.hardware import ALIASES, PROFILES, profile_name


@dataclass
class DataConfig:
    """Where samples come from (datasets made by `mlm data build`)."""

    data_path: list[str] = field(default_factory=list)
    """A dataset prefix, or weight-prefix pairs as strings: ["0.3", "a", "0.7", "b"]."""
    split: str = "969,30,1"
    """Shares of documents for train, valid, test."""
    seq_length: int = 256
    """Tokens per sample."""
    tokenizer: str = ""
    """Tokenizer for generated samples; default: the one recorded in the dataset's PREFIX.json."""
    cache_dir: str = ""
    """Sample-index cache; default: cache/ beside the first dataset."""
    reset_position_ids: bool = False
    """Positions restart after each end-of-document token (Megatron's --reset-position-ids)."""
    reset_attention_mask: bool = False
    """Attention stays within each document packed in a sequence (Megatron's --reset-attention-mask)."""
    packing: str = "first_fit"
    """Chat datasets: first_fit (conversations share sequences, each in the first with room) or
    none (one conversation per sequence, padded)."""

    def __post_init__(self):
        ensure(self.seq_length > 0, f"data.seq_length={self.seq_length}: must be positive")
        ensure(
            self.packing in ("first_fit", "none"),
            f"data.packing={self.packing!r}: must be first_fit or none",
        )


@dataclass
class OptimizerConfig:
    """AdamW and the learning-rate and weight-decay schedules (Megatron-LM's OptimizerParamScheduler
    formulas; docs/train.md sets mlm's defaults beside Megatron-LM's)."""

    lr: float = 3e-4
    """Peak learning rate."""
    min_lr: float = 3e-5
    """Learning rate at the end of the decay."""
    weight_decay: float = 0.1
    """AdamW weight decay (constant; see weight_decay_incr_style)."""
    weight_decay_exempt: str = "1d_and_embeddings"
    """Parameters without weight decay: 1d_and_embeddings (norms, biases, embeddings), 1d (norms and
    biases: Megatron-LM's rule) or none."""
    weight_decay_incr_style: str = "constant"
    """constant (weight_decay), or linear / cosine from start_weight_decay to end_weight_decay over
    the run (Megatron-LM's --weight-decay-incr-style)."""
    start_weight_decay: float | None = None
    """Weight decay at the first step, with an increasing style."""
    end_weight_decay: float | None = None
    """Weight decay at the last step, with an increasing style."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.95
    """AdamW beta2."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    clip_grad: float = 1.0
    """Clip gradients to this global L2 norm; 0 disables."""
    warmup_iters: int = 0
    """Linear warm-up iterations."""
    warmup_samples: int | None = None
    """Warm-up over this many samples instead, a fraction of a step included (Megatron-LM's
    --lr-warmup-samples; its scheduler counts samples)."""
    warmup_fraction: float | None = None
    """Warm-up over this fraction of the decay iterations instead (Megatron-LM's --lr-warmup-fraction)."""
    lr_warmup_init: float = 0.0
    """The learning rate the warm-up starts from (Megatron-LM's --lr-warmup-init)."""
    warmup_offset: int = 1
    """Warm-up step s (from 0) runs at lr_warmup_init + (lr - lr_warmup_init) * (s + warmup_offset) /
    warmup: 1 (mlm: the first step trains) or 0 (Megatron-LM, which steps its scheduler after the
    optimizer: the first step runs at lr_warmup_init)."""
    decay_style: str = "cosine"
    """cosine, linear, constant, inverse-square-root or wsd (warmup-stable-decay)."""
    decay_iters: int | None = None
    """Iterations over which the LR decays; unset means the whole run."""
    decay_samples: int | None = None
    """Samples over which the LR decays instead (Megatron-LM's --lr-decay-samples)."""
    wsd_decay_iters: int = 0
    """wsd: iterations of the final decay, which ends at decay_iters."""
    wsd_decay_samples: int | None = None
    """wsd: the final decay in samples instead (Megatron-LM's --lr-wsd-decay-samples)."""
    wsd_decay_style: str = "linear"
    """wsd: the final decay's shape: linear, cosine, exponential or minus_sqrt (Megatron-LM's
    --lr-wsd-decay-style)."""

    def __post_init__(self):
        styles = ("cosine", "linear", "constant", "inverse-square-root", "wsd")
        choice("optimizer", "decay_style", self.decay_style, styles)
        choice(
            "optimizer",
            "wsd_decay_style",
            self.wsd_decay_style,
            ("linear", "cosine", "exponential", "minus_sqrt"),
        )
        choice(
            "optimizer", "weight_decay_exempt", self.weight_decay_exempt, ("1d_and_embeddings", "1d", "none")
        )
        choice(
            "optimizer",
            "weight_decay_incr_style",
            self.weight_decay_incr_style,
            ("constant", "linear", "cosine"),
        )
        choice("optimizer", "warmup_offset", self.warmup_offset, (0, 1))
        ensure(self.lr > 0, f"optimizer.lr={self.lr}: must be positive")
        ensure(
            0 <= self.min_lr <= self.lr, f"optimizer.min_lr={self.min_lr}: must be within [0, lr={self.lr}]"
        )
        ensure(
            0 <= self.lr_warmup_init <= self.lr,
            f"optimizer.lr_warmup_init={self.lr_warmup_init}: must be within [0, lr={self.lr}]",
        )
        ensure(self.warmup_iters >= 0, f"optimizer.warmup_iters={self.warmup_iters}: must be >= 0")
        if self.warmup_fraction is not None:
            ensure(
                0 <= self.warmup_fraction < 1 and not self.warmup_iters,
                f"optimizer.warmup_fraction={self.warmup_fraction}: must be within [0, 1), with "
                "optimizer.warmup_iters=0 (give one or the other)",
            )
        ensure(self.wsd_decay_iters >= 0, f"optimizer.wsd_decay_iters={self.wsd_decay_iters}: must be >= 0")
        for name, other, unset in (
            ("warmup_samples", "warmup_iters", 0),
            ("decay_samples", "decay_iters", None),
            ("wsd_decay_samples", "wsd_decay_iters", 0),
        ):
            samples = getattr(self, name)
            if samples is None:
                continue
            ensure(samples > 0, f"optimizer.{name}={samples}: must be positive")
            ensure(
                getattr(self, other) == unset and (name != "warmup_samples" or self.warmup_fraction is None),
                f"optimizer.{name}={samples} with optimizer.{other}={getattr(self, other)}"
                f"{' or warmup_fraction' if name == 'warmup_samples' else ''}: give one length, in samples or "
                "in iterations",
            )
        ends = (self.start_weight_decay, self.end_weight_decay)
        if self.weight_decay_incr_style == "constant":
            ensure(
                ends == (None, None),
                f"optimizer.start_weight_decay / end_weight_decay = {ends}: they are for an increasing "
                "weight decay; set optimizer.weight_decay_incr_style=linear or cosine, or unset them",
            )
        else:
            ensure(
                None not in ends and 0 <= ends[0] <= ends[1],
                f"optimizer.weight_decay_incr_style={self.weight_decay_incr_style} needs "
                f"0 <= start_weight_decay <= end_weight_decay, got {ends}",
            )

    @staticmethod
    def legacy(data: dict) -> dict:
        """Keys of configs written before their replacement, translated (a checkpoint's manifest)."""
        data = dict(data)
        if "no_decay_norms_biases_embeddings" in data:
            old = data.pop("no_decay_norms_biases_embeddings")
            data.setdefault("weight_decay_exempt", "1d_and_embeddings" if old else "none")
        return data


@dataclass
class ParallelConfig:
    """The mesh. dp is inferred from the world size."""

    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size (stages; 1F1B schedule)."""
    vpp: int = 1
    """Virtual pipeline size: model chunks per pipeline rank (interleaved 1F1B when > 1)."""
    first_stage_layers: int | None = None
    """Layers on the first (virtual) pipeline stage, which also holds the embedding; unset: an even share."""
    last_stage_layers: int | None = None
    """Layers on the last (virtual) pipeline stage, which also holds the output layer; unset: an even share."""
    cp: int = 1
    """Context-parallel size: each sequence split over cp ranks (2·cp chunks, load-balanced)."""
    cp_comm_type: str = "p2p"
    """Attention under cp (Megatron's cp_comm_type): p2p (a ring of key/value exchanges) or all_gather."""
    ep: int = 1
    """Expert-parallel size."""
    sequence_parallel: bool = False
    """Shard norms and dropout over the sequence across tp ranks (all-gather/reduce-scatter around tp layers)."""
    distributed_optimizer: bool = False
    """Shard fp32 master weights and Adam state over dp (ZeRO-1, Megatron's --use-distributed-optimizer)."""
    bucket_size_mb: float = 25.0
    """Gradient bucket size for the overlapped data-parallel reduction."""
    grad_reduce_dtype: str = "fp32"
    """Data-parallel gradient reduction in fp32 or bf16."""
    fsdp: bool = False
    """Shard parameters, gradients and Adam state over dp × cp (ZeRO-3, torch's FSDP2 `fully_shard`)."""
    fsdp_shard_size: int | None = None
    """FSDP: shard over groups of this many of the dp × cp ranks and replicate across the groups
    (HSDP: reduce-scatter in a group, all-reduce across); unset: shard over all dp × cp ranks."""
    fsdp_reshard_after_forward: bool = True
    """FSDP: free each layer's gathered parameters after its forward and gather them again for its
    backward (ZeRO-3); false keeps them until the backward (ZeRO-2-like memory, one gather less)."""

    def __post_init__(self):
        for name in ("tp", "pp", "vpp", "cp", "ep"):
            ensure(getattr(self, name) >= 1, f"parallel.{name}={getattr(self, name)}: must be at least 1")
        ensure(
            self.vpp == 1 or self.pp > 1,
            f"parallel.vpp={self.vpp} needs pipeline parallelism: set parallel.pp >= 2 or parallel.vpp=1",
        )
        for name in ("first_stage_layers", "last_stage_layers"):
            n = getattr(self, name)
            ensure(n is None or n >= 1, f"parallel.{name}={n}: must be at least 1 (or unset)")
            ensure(n is None or self.pp > 1, f"parallel.{name}={n}: only meaningful with parallel.pp > 1")
        choice("parallel", "grad_reduce_dtype", self.grad_reduce_dtype, ("fp32", "bf16"))
        choice("parallel", "cp_comm_type", self.cp_comm_type, ("p2p", "all_gather"))
        ensure(self.bucket_size_mb > 0, f"parallel.bucket_size_mb={self.bucket_size_mb}: must be positive")
        ensure(
            self.fsdp_shard_size is None or (self.fsdp and self.fsdp_shard_size >= 1),
            f"parallel.fsdp_shard_size={self.fsdp_shard_size}: needs parallel.fsdp=true and a size of at "
            "least 1 (unset: shard over all dp × cp ranks)",
        )
        ensure(
            not (self.fsdp and self.distributed_optimizer),
            "parallel.fsdp and parallel.distributed_optimizer: FSDP already shards the optimizer state "
            "(and the parameters and gradients); set one of them",
        )


def _cuda_visible() -> bool:
    """Whether torch sees a CUDA device (False without torch: the planner runs without it)."""
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@dataclass
class LoggingConfig:
    """Where and how often metrics go."""

    log_interval: int = 10
    """Print and record metrics every this many steps."""
    tensorboard: bool = True
    """Write TensorBoard event files to RUN_DIR/tensorboard."""
    hardware: str = "cpu"
    """MFU peak: cpu (measured) or a plan-file profile: a100-40g, a100-80g, h100-80g, h200, b200."""
    sample_prompt: str = ""
    """Print a greedy sample from this prompt after each evaluation and at the end; empty: none."""
    sample_tokens: int = 48
    """Tokens to generate for the sample."""

    def __post_init__(self):
        choice("logging", "hardware", self.hardware, ("cpu", *PROFILES, *ALIASES))
        self.hardware = profile_name(self.hardware)


@dataclass
class CheckpointConfig:
    """Saving and resuming."""

    save: str = ""
    """Checkpoint directory (DIR/iter_NNNNNNN, DIR/latest); empty disables saving."""
    save_interval: int = 0
    """Save every this many steps (and at the end); 0 saves only at the end."""
    keep_last: int | None = None
    """Keep only the newest K checkpoints; unset keeps all."""
    async_save: bool = False
    """Write checkpoints from a background thread (tensors are copied to CPU first); training goes on."""
    load: str = ""
    """Resume from this checkpoint directory (its latest) or iter_ directory."""
    resume_changes: list[str] = field(default_factory=list)
    """Settings (or sections) this run changes on purpose from the checkpoint it resumes, e.g.
    ["optimizer.lr"]; other differences are refused (docs/train.md, "Resuming")."""


@dataclass
class Config:
    """A whole run."""

    preset: str = ""
    """Model preset the [model] table starts from (see `mlm config list`)."""
    run_dir: str = "runs/default"
    """Where metrics.jsonl, TensorBoard files and the resolved config go."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def __post_init__(self):
        t = self.train
        if t.param_dtype == "auto":  # Megatron's bf16 parameters with fp32 main weights where they pay
            on_cuda = t.device.startswith("cuda") or (t.device == "auto" and _cuda_visible())
            bf16 = t.precision == "bf16" and on_cuda and not self.model.fp32_residual_connection
            self.train = dataclasses.replace(t, param_dtype="bf16" if bf16 else "fp32")
        ensure(
            self.data.seq_length <= self.model.max_position_embeddings,
            f"data.seq_length={self.data.seq_length} exceeds "
            f"model.max_position_embeddings={self.model.max_position_embeddings}",
        )
        ensure(
            self.data.seq_length > self.model.mtp_num_layers,
            f"model.mtp_num_layers={self.model.mtp_num_layers} with data.seq_length={self.data.seq_length}: "
            "the deepest MTP depth would have no token to predict; use fewer depths or longer sequences",
        )
        ensure(
            not (self.model.fp32_residual_connection and self.train.param_dtype != "fp32"),
            f"model.fp32_residual_connection=true with train.param_dtype={self.train.param_dtype!r}: the "
            "residual stream follows bf16/fp16 parameters (the embedding's output is in their dtype); "
            "set train.param_dtype=fp32 to keep an fp32 residual stream, or model.fp32_residual_connection=false",
        )
        if self.parallel.cp > 1:
            check_context_parallel_kinds(self.model, self.parallel.cp)
        refused = fsdp_refusals(self.model, self.train) if self.parallel.fsdp else []
        ensure(
            not refused,
            f"parallel.fsdp with {', '.join(refused)}: FSDP is not built with these yet; unset them, "
            "or train with parallel.distributed_optimizer instead of parallel.fsdp",
        )
        ensure(
            self.train.resilience.fault_action != "rollback" or bool(self.checkpoint.save),
            "train.resilience.fault_action=rollback with checkpoint.save empty: a rollback reloads "
            "checkpoint.save's latest checkpoint; set --set checkpoint.save=DIR (and checkpoint.save_interval), "
            "or train.resilience.fault_action=skip",
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def fsdp_refusals(model: ModelConfig, train: TrainConfig) -> list[str]:
    """The settings `parallel.fsdp` is not built with yet, each as `name=value` (empty: none).
    Torch-free: a run config refuses them (`Config`), the planner offers no FSDP layout with them."""
    refused = [
        (bool(train.fp8.format), f"train.fp8.format={train.fp8.format!r}"),
        (train.compile, "train.compile=true"),
        (model.mtp_num_layers > 0, f"model.mtp_num_layers={model.mtp_num_layers}"),
    ]
    return [what for bad, what in refused if bad]


def check_context_parallel_kinds(m: ModelConfig, cp: int) -> None:
    """MlmError when a layer's mixer does not run under context parallelism (its spec says)."""
    from mlm.model import kinds

    refused = [k for k in m.mixer_kinds() if not kinds.mixer(k).context_parallel]
    ensure(
        not refused,
        f"parallel.cp={cp} with the mixer kind(s) {', '.join(refused)}: they are not built for context "
        "parallelism (each rank would need the state of the tokens before its own); set parallel.cp=1",
    )
