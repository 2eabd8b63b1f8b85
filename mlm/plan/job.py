"""What the planner is given (a `Job`: the run config, the cluster, the software); what it chooses
is a `mlm.layout.Layout`."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from mlm.config import Config, LayerSpec, load_config
from mlm.errors import MlmError
from mlm.flops import flops_per_token
from mlm.hardware import Hardware
from mlm.plan.software import Software, default_software


@dataclass(frozen=True)
class Job:
    """The fixed inputs: model, sequence, batch, precision (all in `cfg`), the cluster, and the
    software whose kernels the time model counts (mlm's own by default, `mlm.plan.software`)."""

    cfg: Config
    gpus: int
    gpus_per_node: int
    hardware: Hardware
    software: Software | None = None

    def __post_init__(self):
        if self.software is None:
            object.__setattr__(self, "software", default_software(self.cfg))

    @property
    def seq(self) -> int:
        return self.cfg.data.seq_length

    @property
    def global_batch(self) -> int:
        return self.cfg.train.global_batch_size

    @functools.cached_property
    def layer_kinds(self) -> tuple[LayerSpec, ...]:
        """Each layer's kinds (`ModelConfig.layer_specs`), computed once per job."""
        return tuple(self.cfg.model.layer_specs())

    @functools.cached_property
    def flops_per_token(self) -> float:
        """Model training FLOPs per token (`mlm.flops`), computed once per job."""
        return flops_per_token(self.cfg.model, self.seq)


def make_job(
    config: str | Path | None,
    overrides: list[str],
    gpus: int,
    gpus_per_node: int,
    hardware: Hardware,
    seq_length: int | None = None,
    global_batch: int | None = None,
    tokens: int | None = None,
    precision: str = "bf16",
    software: Software | None = None,
) -> Job:
    """The job from a run config and/or `--set` items (a preset among them), with the command's
    sequence, batch and precision applied over them; MlmError on an impossible request."""
    if gpus < 1 or gpus_per_node < 1:
        raise MlmError(f"--gpus {gpus} and --gpus-per-node {gpus_per_node} must be at least 1")
    if gpus % gpus_per_node:
        lo, hi = gpus // gpus_per_node * gpus_per_node, (gpus // gpus_per_node + 1) * gpus_per_node
        raise MlmError(
            f"--gpus {gpus} is not a multiple of --gpus-per-node {gpus_per_node}: whole nodes only; "
            f"use --gpus {lo or hi}" + (f" or {hi}" if lo else "") + " (or the right --gpus-per-node)"
        )
    if global_batch is not None and tokens is not None:
        raise MlmError("give --global-batch or --tokens, not both")
    # a plan is for GPUs: train.param_dtype=auto resolves as on CUDA (bf16 parameters in bf16)
    sets = ["train.device=cuda", *overrides, f"train.precision={precision}"]
    if seq_length is not None:
        sets.append(f"data.seq_length={seq_length}")
    cfg = load_config(config, sets)
    if tokens is not None:
        if tokens % cfg.data.seq_length:
            raise MlmError(
                f"--tokens {tokens} is not a multiple of the sequence length {cfg.data.seq_length}"
            )
        global_batch = tokens // cfg.data.seq_length
    if global_batch is not None:
        cfg = load_config(
            config, sets + [f"train.global_batch_size={global_batch}", "train.micro_batch_size=1"]
        )
    return Job(cfg, gpus, gpus_per_node, hardware, software)
