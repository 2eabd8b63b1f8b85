"""What a resumed run may change from the run it continues: the check behind `mlm train --load`
and `--auto-resume` (Megatron-LM's `--use-checkpoint-args`, as a check rather than a silent copy).

A checkpoint's manifest records the whole run config. A resume compares the new run's config
with it, setting by setting (the model is checked first, by `TrainerCheckpoints.load`):

- **allowed** (`ALLOWED`): the mesh and its choices (resharding loads any layout), outputs
  (logging, checkpoints, run_dir), the number of steps, evaluation, fault handling, the device;
- **compared as a schedule**: the learning-rate and weight-decay settings count only through the
  values they give at each step from the resume on (`SCHEDULE`); a longer run whose decay follows
  `train.train_iters` changes them, so it is refused like any other change of schedule;
- **refused**: everything else (precision, parameter dtype, the optimizer's other settings, the
  global batch, the data, the seed), unless `checkpoint.resume_changes` names the setting.

The error names each setting, its saved value and the new one, and both ways on: the `--set`
values that resume the saved run as it was, or `checkpoint.resume_changes` to change them on purpose.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass

from mlm.config import Config, flat_keys
from mlm.errors import MlmError
from mlm.train.schedule import lr_at, weight_decay_at

ALLOWED = (
    "preset",  # the model's fields are compared instead
    "run_dir",
    "parallel",  # a checkpoint loads on any mesh
    "logging",
    "checkpoint",
    "data.cache_dir",
    "data.tokenizer",  # names the tokens' vocabulary; the data decide the tokens
    "train.micro_batch_size",  # the global batch is compared; micro-batches are the layout's choice
    "train.train_iters",  # train longer or stop earlier (the schedule is compared as a schedule)
    "train.train_tokens",
    "train.eval_interval",
    "train.eval_iters",
    "train.device",
    "train.compile",
    "train.initial_loss_scale",  # the loss scaler's state is the checkpoint's
    "train.resilience",  # hangs, stragglers, faults, and the steps a run resumes past
)
"""Settings (or whole sections) a resume may change without saying so."""

SCHEDULE = (
    "lr",
    "min_lr",
    "lr_warmup_init",
    "warmup_iters",
    "warmup_samples",
    "warmup_fraction",
    "warmup_offset",
    "decay_style",
    "decay_iters",
    "decay_samples",
    "wsd_decay_iters",
    "wsd_decay_samples",
    "wsd_decay_style",
    "weight_decay",
    "weight_decay_incr_style",
    "start_weight_decay",
    "end_weight_decay",
)
"""The `optimizer` settings that only set the learning rate and weight decay of each step."""

_EXACT_STEPS = 20_000
"""Schedules are compared at every step up to this many steps past the resume, else at as many
evenly spaced steps (each value costs about a microsecond)."""


@dataclass(frozen=True)
class Change:
    key: str
    saved: object
    new: object
    why: str = ""

    def __str__(self) -> str:
        return f"{self.key}: {self.saved!r} in the checkpoint, {self.new!r} here{self.why}"


def _under(key: str, names) -> bool:
    return any(key == n or key.startswith(n + ".") for n in names)


def _schedule_step(saved: Config, cfg: Config, saved_total: int, total: int, step: int) -> int | None:
    """The first step from `step` on (up to the longer run's end) whose learning rate or weight
    decay differs between the saved run and this one; None when none does."""
    end = max(saved_total, total, step + 1)
    stride = max(1, (end - step) // _EXACT_STEPS)
    for s in [*range(step, end, stride), end - 1]:
        a = (lr_at(s, saved.optimizer, saved_total, saved.train.global_batch_size),)
        b = (lr_at(s, cfg.optimizer, total, cfg.train.global_batch_size),)
        a += (weight_decay_at(s, saved.optimizer, saved_total),)
        b += (weight_decay_at(s, cfg.optimizer, total),)
        if a != b:
            return s
    return None


def resume_changes(
    saved: Config, cfg: Config, saved_total: int, total: int, step: int
) -> tuple[list[Change], list[Change]]:
    """(the refused changes, the allowed or accepted ones) of a run `cfg` of `total` steps
    resuming at `step` from a checkpoint of the run `saved` of `saved_total` steps."""
    old, new = flat_keys(saved.to_dict()), flat_keys(cfg.to_dict())
    diffs = [
        Change(k, old.get(k), new.get(k))
        for k in sorted(old.keys() | new.keys())
        if old.get(k) != new.get(k) and not k.startswith("model.")
    ]
    schedule = [f"optimizer.{k}" for k in SCHEDULE]
    changed_at = _schedule_step(saved, cfg, saved_total, total, step)
    refused, allowed = [], []
    for c in diffs:
        if _under(c.key, schedule):
            (refused if changed_at is not None else allowed).append(c)
        elif _under(c.key, ALLOWED) or (c.key == "data.data_path" and not c.saved):
            # (a checkpoint converted from another framework names no data: the run gives them)
            allowed.append(c)
        else:
            refused.append(c)
    # the run's length is to blame where the saved settings alone, run longer, give another schedule
    length = saved_total != total and _schedule_step(saved, saved, saved_total, total, step) is not None
    if changed_at is not None and length:
        s = changed_at
        lr_a = lr_at(s, saved.optimizer, saved_total, saved.train.global_batch_size)
        lr_b = lr_at(s, cfg.optimizer, total, cfg.train.global_batch_size)
        why = (
            f": the schedule follows the run's length (learning rate at step {s}: {lr_a:.3g} in the "
            f"checkpoint's run, {lr_b:.3g} here); to train longer on the saved schedule, set "
            f"optimizer.decay_iters={saved_total} (or optimizer.decay_style=constant)"
            if not any(_under(c.key, schedule) for c in refused)
            else f" (learning rate at step {s}: {lr_a:.3g} in the checkpoint's run, {lr_b:.3g} here)"
        )
        key = (
            "train.train_iters"
            if old.get("train.train_iters") != new.get("train.train_iters")
            else "train.train_tokens"
        )
        refused.append(Change(key, saved_total, total, why))
        allowed = [c for c in allowed if c.key != key]
    accept = cfg.checkpoint.resume_changes
    sections = {k.rsplit(".", 1)[0] for k in new} | {k.split(".")[0] for k in new}
    unknown = [a for a in accept if a not in new and a not in sections]
    if unknown:
        raise MlmError(
            f"checkpoint.resume_changes={accept}: {', '.join(map(repr, unknown))} is not a setting or a section "
            "of the run config; name settings as `mlm config show` prints them, e.g. optimizer.lr"
        )
    allowed += [c for c in refused if _under(c.key, accept)]
    refused = [c for c in refused if not _under(c.key, accept)]
    return refused, allowed


def _toml(value: object) -> str:
    """`value` as `--set` reads it (a plain word is a string)."""
    if value is None:
        return "none"
    if isinstance(value, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]*", value):
        if value not in ("true", "false", "none", "inf", "nan"):
            return value
    return json.dumps(value)


def check_resume(
    saved: Config, cfg: Config, saved_total: int, total: int, step: int, where: str
) -> list[str]:
    """MlmError naming every setting of `cfg` that a resume may not change from `saved` (see the
    module); else the lines that name the changes made (allowed, or accepted by
    `checkpoint.resume_changes`), outputs and layout left out."""
    refused, allowed = resume_changes(saved, cfg, saved_total, total, step)
    if refused:
        as_saved = " ".join("--set " + shlex.quote(f"{c.key}={_toml(c.saved)}") for c in refused)
        keys = json.dumps(sorted({c.key for c in refused}))
        raise MlmError(
            f"{where} was saved by a run with other settings, and a resume continues it exactly only with "
            f"its own: {'; '.join(map(str, refused))}. To resume it as saved, add {as_saved} (or train with "
            f"--config RUN_DIR/config.toml, the saved run's whole config); to change them on purpose, add "
            f"--set {shlex.quote(f'checkpoint.resume_changes={keys}')}"
        )
    quiet = ("logging", "checkpoint", "run_dir", "preset", "parallel")
    return [str(c) for c in allowed if not _under(c.key, quiet)]


def saved_total_iters(manifest: dict, saved: Config) -> int:
    """The number of steps of the run that saved `manifest` (its scheduler record, else its config)."""
    recorded = (manifest.get("scheduler") or {}).get("total_iters")
    if isinstance(recorded, int):
        return recorded
    t = saved.train
    if t.train_iters is not None:
        return t.train_iters
    return -(-t.train_tokens // (t.global_batch_size * saved.data.seq_length))
