"""The training loop of `mlm train`.

One process in this version, written for N: the model is built on meta and materialised,
data is read through the resumable sampler at (dp_rank, dp_size), checkpoints hold every
tensor in its global shape through `mlm.checkpoint`, and the mesh will slot in where the
`world` dict is filled. Same seed and config give the same loss sequence, bit for bit, on
CPU; a resumed run continues that sequence exactly.
"""

from __future__ import annotations

import math
import random
import signal
import threading
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from mlm.checkpoint import ShardedTensor, load_checkpoint, read_manifest, resolve_checkpoint, save_checkpoint
from mlm.checkpoint.rng import rng_state_from_json, rng_state_to_json
from mlm.config import Config, config_from_dict, to_toml
from mlm.console import console
from mlm.datasets.builder import build_split_datasets, check_same_tokenizer, parse_blend
from mlm.datasets.gpt import GPTDatasetConfig
from mlm.datasets.indexed import IndexedDataset
from mlm.datasets.sampler import PretrainingSampler
from mlm.errors import MlmError
from mlm.model import build_model, flops_per_token
from mlm.parallel import Mesh
from mlm.parallel.launch import init_distributed
from mlm.train.metrics import MetricsLogger, memory_gib, peak_flops
from mlm.train.optim import adam_state_tensors, make_optimizer, set_adam_step
from mlm.train.scaler import LossScaler
from mlm.train.schedule import lr_at

_AMP = {"bf16": torch.bfloat16, "fp16": torch.float16}


def pick_device(requested: str) -> torch.device:
    if requested == "cuda" and not torch.cuda.is_available():
        raise MlmError("train.device='cuda' but no CUDA device is visible; use --set train.device=cpu")
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(requested)


PREEMPTED_EXIT_CODE = 3  # SIGTERM/SIGUSR1: the step finished, a checkpoint was saved, exit to be requeued


class Preempted(Exception):
    """Training stopped on a signal after saving a checkpoint."""

    def __init__(self, signum: int, iteration: int, checkpoint: Path | None):
        name = signal.Signals(signum).name
        where = f"saved {checkpoint}" if checkpoint else "nothing saved (checkpoint.save is empty)"
        super().__init__(f"stopped by {name} after step {iteration}; {where}")


def resume_path(cfg: Config, load: str | None, auto_resume: bool) -> str | None:
    """What to load: --load, else checkpoint.load, else (with --auto-resume) checkpoint.save's latest."""
    if load or cfg.checkpoint.load:
        return load or cfg.checkpoint.load
    if auto_resume and cfg.checkpoint.save and (Path(cfg.checkpoint.save) / "latest").is_file():
        return cfg.checkpoint.save
    return None


def check_single_process(mesh) -> None:
    if mesh.world_size != 1:
        raise MlmError(
            f"this mlm trains in one process, but the launcher started {mesh.world_size} ({mesh}); "
            "run `mlm train` without torchrun/srun"
        )


class Trainer:
    def __init__(self, cfg: Config, load: str | None = None):
        self.cfg = cfg
        t = cfg.train
        self.device = pick_device(t.device)
        self.launch = init_distributed(self.device)
        self.mesh = Mesh.build(cfg.parallel, self.device.type)
        check_single_process(self.mesh)
        self._stop_signal: int | None = None
        self.dp_rank, self.dp_size = 0, 1
        self.num_micro = t.global_batch_size // (t.micro_batch_size * self.dp_size)
        tokens_per_step = t.global_batch_size * cfg.data.seq_length
        self.total_iters = (
            t.train_iters if t.train_iters is not None else math.ceil(t.train_tokens / tokens_per_step)
        )
        self._seed_everything(t.seed)
        self.model = build_model(cfg.model, self.device, t.seed)
        self.attention_backend = self.model.set_attention_backend(cfg.model.attention_backend, self.device)
        self.optimizer = make_optimizer(self.model, cfg.optimizer, self.device)
        self.scaler = LossScaler(t.initial_loss_scale, t.loss_scale_window) if t.precision == "fp16" else None
        self.iteration = 0
        self.consumed_samples = 0
        self.tokenizer_meta = self._open_data()
        if load:
            self.load(load)
        self.flops_per_step = flops_per_token(cfg.model, cfg.data.seq_length) * tokens_per_step

    # ------------------------------------------------------------------ setup

    @staticmethod
    def _seed_everything(seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)

    def _open_data(self) -> dict | None:
        cfg = self.cfg
        if not cfg.data.data_path:
            raise MlmError("data.data_path is empty: set it to a dataset prefix from `mlm data build`")
        blend = parse_blend(cfg.data.data_path)
        prefixes = [p for _, p in blend]
        tok = check_same_tokenizer(prefixes)
        if tok and tok["vocab_size"] > cfg.model.vocab_size:
            raise MlmError(
                f"{prefixes[0]} was tokenized with a vocabulary of {tok['vocab_size']} but "
                f"model.vocab_size={cfg.model.vocab_size}; set --set model.vocab_size={tok['vocab_size']}"
            )
        for p in prefixes:
            top = int(np.asarray(IndexedDataset(p)._bin[:1_000_000]).max(initial=0))
            if top >= cfg.model.vocab_size:
                raise MlmError(f"{p} holds token id {top}, beyond model.vocab_size={cfg.model.vocab_size}")
        t = cfg.train
        n_train = self.total_iters * t.global_batch_size
        n_valid = t.eval_iters * t.micro_batch_size * self.dp_size if t.eval_interval else 0
        gcfg = GPTDatasetConfig(cfg.data.seq_length, t.seed, cfg.data.split, cfg.data.cache_dir or None)
        splits = build_split_datasets(blend, gcfg, {"train": n_train, "valid": n_valid})
        self.train_data, self.valid_data = splits["train"], splits.get("valid")
        return tok

    # ------------------------------------------------------------------ steps

    def _batch(self, dataset, indices) -> torch.Tensor:
        tokens = np.stack([dataset[int(i)] for i in indices])
        return torch.from_numpy(tokens).to(self.device, non_blocking=True)

    def _loss(self, tokens_BT1: torch.Tensor) -> torch.Tensor:
        precision = self.cfg.train.precision
        with torch.autocast(
            self.device.type, dtype=_AMP.get(precision, torch.float32), enabled=precision != "fp32"
        ):
            logits = self.model(tokens_BT1[:, :-1])
        logits = logits[..., : self.cfg.model.vocab_size].float()
        return F.cross_entropy(logits.flatten(0, 1), tokens_BT1[:, 1:].flatten())

    def train_step(self, batches) -> dict:
        """One optimizer step over `num_micro` micro batches (gradient accumulation)."""
        self.model.train()
        scale = self.scaler.scale if self.scaler else 1.0
        total = torch.zeros((), device=self.device)
        for indices in batches:
            loss = self._loss(self._batch(self.train_data, indices))
            (loss * (scale / self.num_micro)).backward()
            total += loss.detach()
        params = [p for p in self.model.parameters() if p.grad is not None]
        overflow = False
        if self.scaler:
            overflow = self.scaler.found_inf(params)
            if not overflow:
                torch._foreach_mul_([p.grad for p in params], 1.0 / scale)
        lr = lr_at(self.iteration, self.cfg.optimizer, self.total_iters)
        grad_norm = float("nan")
        if not overflow:
            clip = self.cfg.optimizer.clip_grad
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf")))
            for g in self.optimizer.param_groups:
                g["lr"] = lr
            self.optimizer.step()
        if self.scaler:
            self.scaler.update(overflow)
        self.optimizer.zero_grad(set_to_none=True)
        return {"loss": float(total) / self.num_micro, "lr": lr, "grad_norm": grad_norm, "skipped": overflow}

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        m = self.cfg.train.micro_batch_size
        losses = [
            float(self._loss(self._batch(self.valid_data, range(i * m, (i + 1) * m))))
            for i in range(self.cfg.train.eval_iters)
        ]
        return sum(losses) / len(losses)

    def sample(self) -> str | None:
        prompt = self.cfg.logging.sample_prompt
        tok_path = self.cfg.data.tokenizer or (self.tokenizer_meta or {}).get("path")
        if not prompt or not tok_path:
            return None
        from mlm.model.generate import greedy
        from mlm.tokenizer import load_tokenizer

        tok = load_tokenizer(tok_path)
        ids = greedy(self.model, tok.encode(prompt), self.cfg.logging.sample_tokens, stop_id=tok.eod_id)
        return prompt + tok.decode(ids)

    # ------------------------------------------------------------------ loop

    def train(self) -> list[float]:
        """Train to `total_iters`; return the loss of every step run. Raises `Preempted` when a
        SIGTERM/SIGUSR1 arrived (after finishing the step and saving a checkpoint)."""
        cfg = self.cfg
        log = MetricsLogger(cfg.run_dir, cfg.logging.tensorboard)
        Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
        (Path(cfg.run_dir) / "config.toml").write_text(to_toml(cfg))
        self._peak = peak_flops(cfg.logging.hardware)
        sampler = PretrainingSampler(
            self.total_iters * cfg.train.global_batch_size,
            self.consumed_samples,
            cfg.train.micro_batch_size,
            self.dp_rank,
            self.dp_size,
        )
        micro_batches = iter(sampler)
        console.print(
            f"[bold]mlm train[/] {self.total_iters} steps from {self.iteration}, device {self.device}, "
            f"attention {self.attention_backend}, {cfg.train.precision}, "
            f"{sum(p.numel() for p in self.model.parameters()) / 1e6:.2f}M parameters",
            highlight=False,
        )
        self._install_signal_handlers()
        losses: list[float] = []
        window: list[dict] = []
        t_start = t_log = time.perf_counter()
        saved_at = -1
        try:
            while self.iteration < self.total_iters:
                r = self.train_step([next(micro_batches) for _ in range(self.num_micro)])
                self.iteration += 1
                self.consumed_samples = sampler.consumed_samples
                losses.append(r["loss"])
                window.append(r)
                if self.iteration % cfg.logging.log_interval == 0 or self.iteration == self.total_iters:
                    now = time.perf_counter()
                    self._log_train(log, window, now - t_log, (now - t_start) / len(losses))
                    window, t_log = [], now
                if cfg.train.eval_interval and self.iteration % cfg.train.eval_interval == 0:
                    self._evaluate_and_sample(log)
                interval = cfg.checkpoint.save_interval
                if cfg.checkpoint.save and interval and self.iteration % interval == 0:
                    self.save(cfg.checkpoint.save)
                    saved_at = self.iteration
                if self._stop_signal is not None:
                    raise Preempted(self._stop_signal, self.iteration, self._final_save(saved_at))
            if cfg.train.eval_interval and self.iteration % cfg.train.eval_interval != 0:
                self._evaluate_and_sample(log)
            elif not cfg.train.eval_interval:
                self._print_sample()
            self._final_save(saved_at)
        finally:
            log.close()
        return losses

    def _final_save(self, saved_at: int) -> Path | None:
        root = self.cfg.checkpoint.save
        if not root:
            return None
        return resolve_checkpoint(root) if saved_at == self.iteration else self.save(root)

    def _log_train(self, log: MetricsLogger, window: list[dict], seconds: float, s_per_step: float) -> None:
        cfg = self.cfg
        dt = seconds / len(window)
        rec = {
            "loss": sum(r["loss"] for r in window) / len(window),
            "lr": window[-1]["lr"],
            "grad_norm": window[-1]["grad_norm"],
            "tokens_per_s": cfg.train.global_batch_size * cfg.data.seq_length / dt,
            "mfu": self.flops_per_step / dt / self._peak,
            "step_time_s": dt,
            "memory_gib": memory_gib(self.device),
            "skipped": self.scaler.skipped if self.scaler else 0,
            "consumed_samples": self.consumed_samples,
            "eta_s": (self.total_iters - self.iteration) * s_per_step,
        }
        if self.scaler:
            rec["loss_scale"] = self.scaler.scale
        log.train_line(self.iteration, self.total_iters, rec)
        log.log(self.iteration, rec)

    def _install_signal_handlers(self) -> None:
        """SIGTERM and SIGUSR1 (SLURM's warning before the time limit) stop after the current step."""
        if threading.current_thread() is not threading.main_thread():
            return

        def request_stop(signum, frame):
            self._stop_signal = signum

        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, request_stop)

    def _evaluate_and_sample(self, log: MetricsLogger) -> None:
        loss = self.evaluate()
        console.print(
            f"[bold]eval[/] step {self.iteration}: loss {loss:.4f}, ppl {math.exp(min(loss, 50)):.2f}"
        )
        log.log(self.iteration, {"loss": loss, "ppl": math.exp(min(loss, 50))}, prefix="valid")
        self._print_sample()

    def _print_sample(self) -> None:
        text = self.sample()
        if text is not None:
            console.print(f"[bold]sample[/] step {self.iteration}: {text!r}", highlight=False)

    # ------------------------------------------------------------------ checkpoints

    def _groups(self) -> dict[str, list[ShardedTensor]]:
        model = [ShardedTensor.full(k, v) for k, v in self.model.state_dict().items()]
        optim = adam_state_tensors(self.model, self.optimizer, self.iteration)
        return {"model": model, "optim": [ShardedTensor.full(k, v) for k, v in optim.items()]}

    def save(self, root: str) -> Path:
        extra = {
            "config": self.cfg.to_dict(),
            "mesh": {"tp": 1, "pp": 1, "dp": self.dp_size, "cp": 1, "ep": 1, "world_size": 1},
            "consumed_samples": self.consumed_samples,
            "optimizer_step": self.iteration,
            "scheduler": {"total_iters": self.total_iters, "decay_style": self.cfg.optimizer.decay_style},
            "loss_scaler": self.scaler.state_dict() if self.scaler else None,
            "rng": rng_state_to_json(),
        }
        path = save_checkpoint(
            root, self.iteration, self._groups(), extra, keep_last=self.cfg.checkpoint.keep_last
        )
        console.print(f"[bold]saved[/] {path}", highlight=False)
        return path

    def load(self, path: str) -> None:
        iter_dir = resolve_checkpoint(path)
        saved = config_from_dict(read_manifest(iter_dir)["config"]).model
        diffs = [
            f"model.{k}: {v!r} in the checkpoint, {getattr(self.cfg.model, k)!r} here"
            for k, v in vars(saved).items()
            if v != getattr(self.cfg.model, k) and k not in ("attention_backend", "recompute")
        ]
        if diffs:
            raise MlmError(f"{iter_dir} was saved from another model: " + "; ".join(diffs))
        manifest = load_checkpoint(iter_dir, self._groups())
        self.iteration = int(manifest["iteration"])
        set_adam_step(self.optimizer, manifest["optimizer_step"])
        self.consumed_samples = int(manifest["consumed_samples"])
        if self.scaler and manifest.get("loss_scaler"):
            self.scaler.load_state_dict(manifest["loss_scaler"])
        rng_state_from_json(manifest["rng"])
        console.print(f"[bold]resumed[/] {iter_dir} at step {self.iteration}", highlight=False)
