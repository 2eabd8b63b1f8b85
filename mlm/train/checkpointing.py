"""The trainer's checkpoints: what a step's state is (weights, optimizer moments and Adam's step
count, data position, scheduler, loss scaler, RNG per pipeline stage, the fault monitor's skip list,
spike window and counts), saving it (in the step, or from a background thread after a copy to CPU)
and resuming from it on any mesh.

Each rank writes the slices it holds that are its to write (replica 0 of each slice: see
`mlm.parallel.placement`); `DIR/latest` moves only after every rank has finished. The weights
written are the fp32 main weights (the parameters themselves in fp32; the optimizer's main copy
with train.param_dtype bf16/fp16).
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import torch.distributed as dist

from mlm.checkpoint import (
    ShardedTensor,
    checkpoint_config,
    load_checkpoint,
    read_manifest,
    resolve_checkpoint,
    save_checkpoint,
)
from mlm.checkpoint.manager import keep_tokenizer
from mlm.checkpoint.rng import rng_state_from_json, rng_state_to_json
from mlm.errors import MlmError
from mlm.train.resume import check_resume, saved_total_iters


class TrainerCheckpoints:
    """Mixed into `Trainer` (which provides cfg, mesh, model, optimizer, scaler, fp8, iteration,
    optimizer_step, consumed_samples, faults, total_iters, watchdog, tokenizer_meta, `_print` and
    `_barrier`)."""

    def _groups(self, for_load: bool = False) -> dict[str, list[ShardedTensor]]:
        """Every parameter and its Adam moments as this rank's slices of the global tensors, each
        written by its replica 0; with bf16/fp16 parameters the model group holds the fp32 main
        weights (`TrainOptimizer.checkpoint_groups`); under fp8 delayed scaling, the amax histories
        and scales ("fp8")."""
        groups = self.optimizer.checkpoint_groups(self.optimizer_step, for_load)
        if self.fp8 and self.fp8.recipe.recipe == "delayed":
            groups["fp8"] = self.fp8.shards()
        return groups

    def save(self, root: str) -> Path:
        """Save this step's state (every rank its slices). With `checkpoint.async_save` the
        tensors are copied to CPU here and written by a background thread; `latest` moves when
        that is done, and the next save (or the end of training) waits for it."""
        self.watchdog.beat("checkpoint save")
        self.wait_for_save()
        extra = {
            "config": self.cfg.to_dict(),
            "mesh": self.mesh.describe(),
            "consumed_samples": self.consumed_samples,
            "optimizer_step": self.optimizer_step,  # Adam's: below the iteration after skipped steps
            "scheduler": {"total_iters": self.total_iters, "decay_style": self.cfg.optimizer.decay_style},
            "loss_scaler": self.scaler.state_dict() if self.scaler else None,
            "rng": rng_state_to_json(),
            "rng_per_stage": self._stage_rng_states(),
            "faults": self.faults.state_dict(),
            "tokenizer": self._keep_tokenizer(root),
        }
        groups = self._groups()
        iteration = self.iteration
        if not self.cfg.checkpoint.async_save:
            return self._write(root, iteration, groups, extra, barrier=self._barrier)
        snapshot = {
            name: [dataclasses.replace(t, local=t.local.detach().to("cpu", copy=True)) for t in tensors]
            for name, tensors in groups.items()
        }
        group = self.mesh.group("gloo")  # its barriers never interleave with training's collectives

        def barrier() -> None:
            if group is not None:
                dist.barrier(group=group)

        def worker() -> None:
            try:
                self._write(root, iteration, snapshot, extra, barrier=barrier)
            except BaseException as e:  # re-raised on the training thread by wait_for_save
                self._save_errors.append(e)

        self._pending_save = threading.Thread(target=worker, name="mlm-checkpoint", daemon=True)
        self._pending_save.start()
        return Path(root) / f"iter_{iteration:07d}"

    def _keep_tokenizer(self, root: str) -> dict | None:
        """Rank 0: the checkpoint's own copy of the run's tokenizer, beside the iter dirs (copied
        at the first save), so that `mlm export hf` finds it inside the checkpoint."""
        if self.mesh.rank != 0:
            return None
        Path(root).mkdir(parents=True, exist_ok=True)
        return keep_tokenizer(Path(root), self.cfg.data.tokenizer or (self.tokenizer_meta or {}).get("path"))

    def _write(self, root, iteration, groups, extra, barrier) -> Path:
        path = save_checkpoint(
            root,
            iteration,
            groups,
            extra,
            rank=self.mesh.rank,
            barrier=barrier,
            keep_last=self.cfg.checkpoint.keep_last,
        )
        self._print(f"[bold]saved[/] {path}", highlight=False)
        return path

    def wait_for_save(self) -> None:
        """Block until a background save has finished (and raise its error, if any)."""
        if self._pending_save is not None:
            self._pending_save.join()
            self._pending_save = None
        if self._save_errors:
            raise self._save_errors.pop()

    def _stage_rng_states(self) -> list[dict] | None:
        """Every pipeline stage's RNG state (stages draw dropout masks for different layers, so
        their generators differ; tp and dp ranks of one stage draw alike); None at pp 1."""
        if self.mesh.pp == 1:
            return None
        states: list[dict] = [{}] * self.mesh.pp
        dist.all_gather_object(states, rng_state_to_json(), group=self.mesh.group("pp"))
        return states

    def _pipeline_keys(self, groups: dict[str, list[ShardedTensor]]) -> dict[str, set[str]] | None:
        """Group → the keys every stage of this pipeline loads (each holds some layers); None at pp 1."""
        if self.mesh.pp == 1:
            return None
        mine = {name: [t.key for t in tensors] for name, tensors in groups.items()}
        stages: list[dict] = [{}] * self.mesh.pp
        dist.all_gather_object(stages, mine, group=self.mesh.group("pp"))
        return {name: {k for stage in stages for k in stage[name]} for name in groups}

    def load(self, path: str) -> None:
        self.watchdog.beat("checkpoint load")  # a rollback's: as long as a save
        iter_dir = resolve_checkpoint(path)
        stored = read_manifest(iter_dir)  # the one read of it before the tensors
        saved_run = checkpoint_config(stored, iter_dir)
        saved = saved_run.model
        diffs = [
            f"model.{k}: {v!r} in the checkpoint, {getattr(self.cfg.model, k)!r} here"
            for k, v in vars(saved).items()
            if v != getattr(self.cfg.model, k)
            and k not in ("attention_backend", "kernels", "recompute", "train_padded_vocab")
        ]
        if diffs:
            raise MlmError(f"{iter_dir} was saved from another model: " + "; ".join(diffs))
        groups = self._groups(for_load=True)
        if not any(k.startswith("optim/") for k in stored["tensors"]):
            # weights only (e.g. imported from Hugging Face): a new run starting from them
            load_checkpoint(iter_dir, {"model": groups["model"]}, job_keys=self._pipeline_keys(groups))
            self.optimizer.finish_load(None)  # the parameters from the loaded (main) weights
            self._print(f"[bold]initialised from[/] {iter_dir} (weights only: a new run)", highlight=False)
            return
        step = int(stored["iteration"])
        total = saved_total_iters(stored, saved_run)
        if stored.get("source"):  # an import: only its model is the source run's for certain
            self._print("[bold]imported[/] checkpoint: the run settings are this run's", highlight=False)
        else:
            for line in check_resume(saved_run, self.cfg, total, self.total_iters, step, str(iter_dir)):
                self._print(f"[bold yellow]changed[/] {line}", highlight=False)
        if "fp8" in groups and not any(k.startswith("fp8/") for k in stored["tensors"]):
            del groups["fp8"]  # saved without fp8 delayed scaling: the histories start empty
            self._print("[bold]fp8[/] the checkpoint has no amax histories: they start empty")
        manifest = load_checkpoint(iter_dir, groups, job_keys=self._pipeline_keys(groups))
        if "fp8" in groups:
            self.fp8.started = True
        self.iteration = int(manifest["iteration"])
        self.optimizer_step = int(manifest["optimizer_step"])
        self.optimizer.finish_load(self.optimizer_step)
        self.faults.load_state_dict(manifest.get("faults"))
        self.consumed_samples = int(manifest["consumed_samples"])
        if self.scaler and manifest.get("loss_scaler"):
            self.scaler.load_state_dict(manifest["loss_scaler"])
        per_stage = manifest.get("rng_per_stage")
        same_pipeline = per_stage is not None and len(per_stage) == self.mesh.pp
        # rng null: a run imported by mlm convert from-megatron; the generators stay as train.seed set them
        if same_pipeline or manifest.get("rng") is not None:
            rng_state_from_json(per_stage[self.mesh.pp_rank] if same_pipeline else manifest["rng"])
        self._print(f"[bold]resumed[/] {iter_dir} at step {self.iteration}", highlight=False)
