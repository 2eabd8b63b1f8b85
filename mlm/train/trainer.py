"""The training loop of `mlm train`, on one process or a pp × dp × tp mesh.

The plain model is built on the meta device, cut to this rank's pipeline stage, parallelized
from outside (tensor and sequence parallel layers), materialised and initialised so that every
mesh starts from the weights of one process. Each dp rank reads its micro batches through the
resumable sampler; the pipeline schedule (1F1B, interleaved, or plain accumulation at pp = 1)
runs them; gradients are reduced in buckets during each chunk's last backward of a step
(optionally into the distributed optimizer's shards). Checkpoints hold every tensor once in its global shape, each rank
writing its slice. Same seed and config give the same loss sequence, bit for bit, on CPU; a
resumed run continues it exactly. A NaN/Inf loss or gradient norm, or a loss spike, is a fault that
skips the step, rolls back to the last checkpoint or stops (`mlm.train.faults`).
"""

from __future__ import annotations

import math
import signal
import threading
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from mlm.build import build_rank_model
from mlm.checkpoint import read_manifest, resolve_checkpoint
from mlm.checkpoint.rng import seed_everything
from mlm.config import Config, to_toml
from mlm.console import console
from mlm.datasets.builder import check_same_tokenizer, is_chat, parse_blend, run_datasets
from mlm.datasets.documents import DocumentLayout, PackedBatch
from mlm.datasets.indexed import IndexedDataset
from mlm.datasets.sampler import PretrainingSampler
from mlm.datasets.sft import packing_efficiency
from mlm.errors import MlmError
from mlm.model import flops_per_token, parameter_counts
from mlm.model.contract import declaring
from mlm.parallel import Mesh
from mlm.parallel.context import check_context_parallel
from mlm.parallel.expert import expert_load_step
from mlm.parallel.launch import detect, init_distributed, pick_device
from mlm.parallel.parallelize import allreduce_sequence_parallel_grads
from mlm.parallel.pipeline import Pipeline
from mlm.parallel.schedules import micro_batches_per_step
from mlm.train.checkpointing import TrainerCheckpoints
from mlm.train.faults import Fault, FaultMonitor, StepStart, expert_biases
from mlm.train.fsdp_optimizer import FSDPOptimizer
from mlm.train.metrics import MetricsLogger, memory_gib, peak_flops
from mlm.train.optimizer import TrainOptimizer
from mlm.train.scaler import LossScaler
from mlm.train.schedule import lr_at, weight_decay_at
from mlm.train.stragglers import StragglerDetector, WorkClock
from mlm.train.watchdog import Watchdog, pg_timeout
from mlm.units import DTYPES

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


def check_supported(mesh: Mesh, cfg: Config) -> None:
    check_context_parallel(cfg.data.seq_length, mesh.cp, mesh.tp if cfg.parallel.sequence_parallel else 1)
    t = cfg.train
    micro_batches_per_step(t.global_batch_size, t.micro_batch_size, mesh.dp, mesh.pp, cfg.parallel.vpp)


class Trainer(TrainerCheckpoints):
    """`mlm train` on this rank: builds the mesh, this rank's model and optimizer, the data and the
    pipeline executor, then runs steps, evaluations, samples and checkpoints (see `train`)."""

    def __init__(self, cfg: Config, load: str | None = None, watchdog: Watchdog | None = None):
        """`watchdog`: the job's (`Watchdog.for_job`, as `mlm train` passes it); else one of this
        process alone (hang detection, stop signals)."""
        self.cfg = cfg
        t = cfg.train
        if watchdog is None:
            watchdog = Watchdog(None, rank=detect().rank)
            watchdog.start()
        self.watchdog = watchdog
        self.device = pick_device(t.device)
        self.launch = init_distributed(self.device, watchdog.store, pg_timeout(t.resilience.hang_timeout))
        self.mesh = Mesh.build(cfg.parallel, self.device.type, gloo_group=cfg.checkpoint.async_save)
        check_supported(self.mesh, cfg)
        self.rank0 = self.mesh.rank == 0
        self._pending_save: threading.Thread | None = None
        self._save_errors: list[BaseException] = []
        self.dp_rank, self.dp_size = self.mesh.dp_rank, self.mesh.dp
        self.num_micro = t.global_batch_size // (t.micro_batch_size * self.dp_size)
        tokens_per_step = t.global_batch_size * cfg.data.seq_length
        self.total_iters = (
            t.train_iters if t.train_iters is not None else math.ceil(t.train_tokens / tokens_per_step)
        )
        seed_everything(t.seed)
        self.model = build_rank_model(cfg.model, cfg.parallel, self.mesh, self.device, seed=t.seed, train=t)
        self.fp8 = self.model.fp8  # None unless train.fp8
        self.attention_backend, self.kernels = self.model.ops.attention_backend, self.model.ops.kernels
        optimizer = FSDPOptimizer if self.model.fsdp else TrainOptimizer
        self.optimizer = optimizer(self.model, cfg, self.mesh, self.device)
        self.pipeline = Pipeline(self.model, self.mesh, cfg.parallel.vpp)
        # own work: stragglers.py
        self.work_clock = WorkClock(self.device, enabled=t.resilience.straggler_window > 0)
        self.pipeline.work_clock = self.work_clock
        # whether any stage has modules with auxiliary losses (then every step gathers them)
        has_aux = bool(declaring(self.model, "aux_losses"))
        self.has_aux = bool(self._max_over_ranks(has_aux))
        self.scaler = LossScaler(t.initial_loss_scale, t.loss_scale_window) if t.precision == "fp16" else None
        self.iteration = 0
        self.consumed_samples = 0
        self.optimizer_step = 0
        """Adam's step count: the updates applied (a skipped step or an fp16 overflow applies none)."""
        self.faults = FaultMonitor(t)
        self._expert_biases = expert_biases(self.model)
        self.tokenizer_meta = self._open_data()
        self.pipeline.documents = self._document_layout()
        if load:
            self.load(load)
        self.flops_per_step = flops_per_token(cfg.model, cfg.data.seq_length) * tokens_per_step

    # ------------------------------------------------------------------ setup

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
        if self.rank0:  # rank 0 builds the index cache; the others wait, then load it
            splits = run_datasets(cfg, self.total_iters)
        self._barrier()
        if not self.rank0:
            splits = run_datasets(cfg, self.total_iters, build=False)
        self.train_data, self.valid_data = splits["train"], splits.get("valid")
        self.sft = is_chat(prefixes)
        if self.sft:
            self._check_sft()
        return tok

    def _check_sft(self) -> None:
        """Packed conversations: the loss is per target token, and their boundaries are the data's."""
        d, m = self.cfg.data, self.cfg.model
        if d.reset_position_ids or d.reset_attention_mask:
            raise MlmError(
                f"{d.data_path}: chat datasets keep their packed conversations apart themselves; unset "
                "data.reset_position_ids and data.reset_attention_mask"
            )
        if m.mtp_num_layers:
            raise MlmError(
                f"model.mtp_num_layers={m.mtp_num_layers}: multi-token prediction is not built for chat "
                "datasets (its targets would cross the loss mask); set --set model.mtp_num_layers=0"
            )

    def _document_layout(self) -> DocumentLayout | None:
        d = self.cfg.data
        if not (d.reset_position_ids or d.reset_attention_mask):
            return None
        eod = (self.tokenizer_meta or {}).get("eod_id")
        if eod is None:
            raise MlmError(
                f"data.reset_position_ids / reset_attention_mask need the end-of-document token id, but "
                f"{d.data_path} records no tokenizer eod_id; rebuild the dataset with `mlm data build`"
            )
        return DocumentLayout(eod, d.reset_position_ids, d.reset_attention_mask)

    # ------------------------------------------------------------------ steps

    def _batch(self, dataset, indices) -> torch.Tensor | PackedBatch:
        samples = [dataset[int(i)] for i in indices]
        if self.sft:
            return PackedBatch.of(samples, self.device)
        tokens = np.stack(samples)
        return torch.from_numpy(tokens).to(self.device, non_blocking=True)

    def _print(self, *args, **kw) -> None:
        if self.rank0:
            console.print(*args, **kw)

    def _barrier(self) -> None:
        if self.mesh.world_size > 1:
            dist.barrier()

    def _autocast(self):
        precision = self.cfg.train.precision
        return torch.autocast(self.device.type, dtype=DTYPES[precision], enabled=precision != "fp32")

    def _max_over_ranks(self, value: float) -> float:
        if self.mesh.world_size == 1:
            return value
        t = torch.tensor([float(value)], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    def _dp_mean(self, t: torch.Tensor) -> float:
        """The mean over dp (each replica's batch) and cp (each rank's share of the sequences)."""
        return float(self._dp_average(t))

    def _dp_average(self, t: torch.Tensor) -> torch.Tensor:
        return self._dp_sum(t) / (self.dp_size * self.mesh.cp)

    def _dp_sum(self, t: torch.Tensor, dim: str = "dp_cp") -> torch.Tensor:
        group = self.mesh.group(dim)
        if group is not None:
            dist.all_reduce(t, group=group)
        return t

    def _targets(self, micro: list[PackedBatch]) -> int:
        """The targets of the global batch these micro-batches are this dp rank's share of."""
        count = torch.stack([b.targets for b in micro]).sum()
        return max(int(self._dp_sum(count, "dp")), 1)

    def train_step(self, batches) -> dict:
        """One optimizer step over `num_micro` micro batches through the pipeline schedule; the
        gradients are reduced over dp during each model chunk's last backward. A faulty step
        (`mlm.train.faults`) applies nothing: the returned "fault" says what was wrong."""
        self._beat("forward-backward")
        self.model.train()
        opt = self.optimizer
        start = StepStart(self._expert_biases, self.device)
        scale = self.scaler.scale if self.scaler else 1.0
        micro = [self._batch(self.train_data, indices) for indices in batches]
        # the loss is the mean over the global batch's sequences, or (chat) over its target tokens;
        # the dp (and cp) reduction averages the gradients
        targets = self._targets(micro) if self.sft else 0
        per = targets / (self.dp_size * self.mesh.cp) if self.sft else self.num_micro
        total = self.pipeline.train_step(
            micro, scale / per, opt.all_grads, self._autocast, aux_scale=scale / self.num_micro
        )
        self._beat("gradient reduction")
        self.pipeline.sync_tied_embedding(opt.all_grads.grad_of)
        opt.all_grads.finish()
        allreduce_sequence_parallel_grads(self.model, self.mesh, opt.placements, opt.all_grads.grad_of)
        load = expert_load_step(
            self.model, self.mesh, self.cfg.parallel.sequence_parallel
        )  # and the aux-loss-free bias update
        # the logged values first: their collectives would queue behind the distributed
        # optimizer's parameter all-gathers, which step() leaves in flight for the next forward
        self._beat("loss and metrics")
        loss = self._dp_mean(self.pipeline.sum_over_stages(total) / per)
        extra = self._step_metrics(load)
        if self.sft:
            extra["targets"] = targets
        mtp = self.pipeline.mtp_total
        if mtp.numel():  # each depth's loss, averaged as the main loss is
            mtp = self._dp_average(self.pipeline.sum_over_stages(mtp) / self.num_micro)
            extra.update({f"mtp_loss.{k}": float(v) for k, v in enumerate(mtp.tolist(), start=1)})
        overflow = bool(self.scaler) and opt.found_inf()
        if self.scaler and not overflow:
            opt.unscale(1.0 / scale)
        self._beat("optimizer step")
        lr = lr_at(self.iteration, self.cfg.optimizer, self.total_iters, self.cfg.train.global_batch_size)
        grad_norm = float("nan")
        fault = None
        if not overflow:  # the norm is computed (and tested) whether or not it clips
            grad_norm = opt.clip(self.cfg.optimizer.clip_grad)
            fault = self.faults.test(self.iteration + 1, loss, grad_norm, self.device)
        if fault is not None:
            if self.fp8:
                self.fp8.discard_step()
            start.restore()
        else:
            if self.fp8:  # delayed scaling: this step's amaxes into the histories, the next scales
                self.fp8.finish_step()
            if not overflow:
                # AdamW's arithmetic is own work (the distributed one also waits for its all-gathers)
                with self.work_clock.span(on=not opt.dists):
                    opt.step(lr, weight_decay_at(self.iteration, self.cfg.optimizer, self.total_iters))
                self.optimizer_step += 1
                self.faults.applied(loss)
            if self.scaler:
                self.scaler.update(overflow)
        opt.zero_grad()
        return {
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "skipped": overflow,
            "extra": extra,
            "fault": fault,
        }

    def listed_step(self) -> dict:
        """A step of the skip list (`train.resilience.skip_iterations`, and steps rolled back over): its data
        was drawn by the caller; nothing runs and nothing changes but the iteration."""
        self._print(
            f"[dim]step {self.iteration + 1}: skipped (train.resilience.skip_iterations): its data is consumed, not trained on[/]",
            highlight=False,
        )
        self.faults.counts["skipped"] += 1
        lr = lr_at(self.iteration, self.cfg.optimizer, self.total_iters, self.cfg.train.global_batch_size)
        nan = float("nan")
        return {
            "loss": nan,
            "lr": lr,
            "grad_norm": nan,
            "skipped": False,
            "extra": {},
            "fault": None,
            "listed": True,
        }

    def _step_metrics(self, load: dict[str, float]) -> dict[str, float]:
        """This step's auxiliary losses (`model.aux_losses`: e.g. MoE balancing) as `aux.NAME`, each
        the mean per micro-batch, summed over tp where each tp rank holds its share (sequence
        parallelism), over pipeline stages, and averaged over dp; with the expert `load` metrics
        of every stage (already the same on the stage's ranks)."""
        aux = self.model.aux_losses
        partial = set(aux.partial)
        values = {f"aux.{k}": v / self.num_micro for k, v in aux.pop().items()}
        values.update(load)
        if not self.has_aux:
            return values
        shards = self.mesh.sequence_group(self.cfg.parallel.sequence_parallel)
        if shards is not None and partial:
            parts: list[dict] = [{}] * dist.get_world_size(shards)
            dist.all_gather_object(parts, values, group=shards)
            for k in values:
                if k.removeprefix("aux.") in partial:
                    values[k] = sum(p[k] for p in parts)
        for dim, combine in (("pp", sum), ("dp", lambda vs: sum(vs) / len(vs))):
            group = self.mesh.group(dim)
            if group is not None:
                parts: list[dict] = [{}] * getattr(self.mesh, dim)
                dist.all_gather_object(parts, values, group=group)
                values = {
                    k: combine([p.get(k, 0.0) for p in parts]) for k in sorted({k for p in parts for k in p})
                }
        return values

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over `eval_iters` global batches of the validation split (Megatron's meaning:
        the same samples, and so the same loss, whatever the mesh; the same at every evaluation).
        Each dp rank runs its micro batches of each global batch through the pipeline."""
        self.model.eval()
        self.optimizer.wait_for_params()
        t = self.cfg.train
        m, G = t.micro_batch_size, t.global_batch_size
        micro = [
            self._batch(self.valid_data, range(start, start + m))
            for i in range(t.eval_iters)
            for start in range(i * G + self.dp_rank * m, (i + 1) * G, m * self.dp_size)
        ]
        total = self.pipeline.eval_step(micro, self._autocast)
        self.model.aux_losses.pop()  # training's to log
        per = self._targets(micro) / (self.dp_size * self.mesh.cp) if self.sft else len(micro)
        return self._dp_mean(self.pipeline.sum_over_stages(total) / per)

    def sample(self) -> str | None:
        prompt = self.cfg.logging.sample_prompt
        tok_path = self.cfg.data.tokenizer or (self.tokenizer_meta or {}).get("path")
        if not prompt or not tok_path:
            return None
        from mlm.model.generate import greedy
        from mlm.tokenizer import load_tokenizer

        tok = load_tokenizer(tok_path)
        self.optimizer.wait_for_params()
        # every rank runs the forward of its stage; the logits are gathered over tp and sent from
        # the last pipeline stage to all
        logits_fn = self.pipeline.logits
        ids = greedy(self.model, tok.encode(prompt), self.cfg.logging.sample_tokens, tok.eod_id, logits_fn)
        return prompt + tok.decode(ids)

    # ------------------------------------------------------------------ loop

    def train(self) -> list[float]:
        """Train to `total_iters`; return the loss of every step from the start (a faulty step's
        value where a fault skipped it, NaN for a step of the skip list; after a rollback the steps
        run again replace the ones rolled back). Raises
        `Preempted` when a SIGTERM/SIGUSR1 arrived (after finishing the step and saving a
        checkpoint), and `MlmError` on a fault under train.resilience.fault_action=stop."""
        cfg = self.cfg
        log = MetricsLogger(cfg.run_dir, cfg.logging.tensorboard, enabled=self.rank0)
        if self.rank0:
            (Path(cfg.run_dir) / "config.toml").write_text(to_toml(cfg))
        self._peak = peak_flops(cfg.logging.hardware) * self.mesh.world_size  # MFU is per GPU
        sampler = self._sampler()
        micro_batches = iter(sampler)
        counts = parameter_counts(cfg.model)
        self._print(
            f"[bold]mlm train[/] {self.total_iters} steps from {self.iteration}, device {self.device}, "
            f"mesh {self.mesh}{f' vpp={cfg.parallel.vpp}' if cfg.parallel.vpp > 1 else ''}, attention {self.attention_backend}, "
            f"{f'kernels {self.kernels}, ' if self.kernels != 'torch' else ''}"
            f"{'compiled layers, ' if cfg.train.compile else ''}"
            f"{f'fp8 {cfg.train.fp8.format} ({cfg.train.fp8.recipe}) in ' if cfg.train.fp8.format else ''}{cfg.train.precision}"
            f"{f' ({cfg.train.param_dtype} parameters, fp32 main weights)' if cfg.train.param_dtype != 'fp32' else ''}, "
            f"{counts.total / 1e6:.2f}M parameters"
            + (f" ({counts.active / 1e6:.2f}M active per token)" if counts.active != counts.total else "")
            + (f" + MTP {counts.mtp / 1e6:.2f}M" if counts.mtp else ""),
            highlight=False,
        )
        if self.sft:
            self._print(
                f"chat data: loss over the target tokens, data.packing={cfg.data.packing}: "
                f"{packing_efficiency(self.train_data):.1%} of sequence positions hold tokens",
                highlight=False,
            )
        stragglers = StragglerDetector(
            cfg, self.work_clock, self.mesh.pp_rank, self.device, report=self.rank0
        )
        losses: list[float] = []
        window: list[dict] = []
        t_start = t_log = time.perf_counter()
        saved_at = -1
        first = self.iteration
        self.watchdog.watch_hangs(cfg.run_dir, cfg.train.resilience.hang_timeout)
        try:
            while self.iteration < self.total_iters:
                t_step = time.perf_counter()
                batches = [next(micro_batches) for _ in range(self.num_micro)]
                listed = self.iteration + 1 in self.faults.skip
                r = self.listed_step() if listed else self.train_step(batches)
                if r["fault"] is not None and self._on_fault(r["fault"]):  # rolled back
                    sampler = self._sampler()
                    micro_batches = iter(sampler)
                    first = min(first, self.iteration)
                    del losses[self.iteration - first :]
                    window, saved_at, t_log = [], self.iteration, time.perf_counter()
                    stragglers.restart()
                    continue
                self.iteration += 1
                self.watchdog.beat("straggler window")
                stragglers.step(self.iteration, time.perf_counter() - t_step, log)
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
                if (signum := self._agreed_stop()) is not None:
                    stop = Preempted(signum, self.iteration, self._final_save(saved_at))
                    self._print(f"[bold yellow]{stop}[/]; exit code {PREEMPTED_EXIT_CODE}", highlight=False)
                    raise stop
            if cfg.train.eval_interval and self.iteration % cfg.train.eval_interval != 0:
                self._evaluate_and_sample(log)
            elif not cfg.train.eval_interval:
                self._print_sample()
            self._final_save(saved_at)
            self.optimizer.wait_for_params()  # the model holds the final weights on return
        finally:
            self.watchdog.unwatch_hangs()
            log.close()
        return losses

    def _sampler(self) -> PretrainingSampler:
        """This dp rank's micro batches from the data position `consumed_samples` on."""
        t = self.cfg.train
        return PretrainingSampler(
            self.total_iters * t.global_batch_size,
            self.consumed_samples,
            t.micro_batch_size,
            self.dp_rank,
            self.dp_size,
        )

    def _on_fault(self, fault: Fault) -> bool:
        """Act on a faulty step (nothing of it was applied) as train.resilience.fault_action says: go on
        (skip: False), roll back to checkpoint.save's latest checkpoint (True), or raise (stop)."""
        action = self.cfg.train.resilience.fault_action
        self._print(
            f"[yellow]step {fault.step}: {fault.what}; train.resilience.fault_action={action}[/]",
            highlight=False,
        )
        if action == "skip":
            self.faults.counts["skipped"] += 1
            return False
        if action == "rollback":
            self._roll_back(fault)
            return True
        raise MlmError(
            f"step {fault.step}: {fault.what} (train.resilience.fault_action=stop: nothing of the step was applied); "
            f"go on past faults with --set train.resilience.fault_action=skip, or resume from the last checkpoint with "
            f"--set 'train.resilience.skip_iterations=[{fault.step}]' to skip this step's data"
        )

    def _roll_back(self, fault: Fault) -> None:
        """Load checkpoint.save's latest checkpoint (weights, optimizer, data position, RNG) and add
        the faulty step to the skip list; a stop if there is none before the step."""
        root = self.cfg.checkpoint.save
        self.watchdog.beat("rollback")
        self.wait_for_save()
        self._barrier()  # rank 0 has moved `latest` (an async save's last act)
        at = (
            int(read_manifest(resolve_checkpoint(root))["iteration"])
            if (Path(root) / "latest").is_file()
            else None
        )
        if at is None or at >= fault.step:
            where = (
                f"its latest checkpoint is step {at}'s" if at is not None else "it holds no checkpoint yet"
            )
            raise MlmError(
                f"step {fault.step}: {fault.what}; train.resilience.fault_action=rollback, but checkpoint.save={root}: "
                f"{where}, none before the fault to roll back to (nothing of the step was applied); save "
                "earlier (checkpoint.save_interval), or set train.resilience.fault_action=skip"
            )
        counts, skip = dict(self.faults.counts), set(self.faults.skip)
        self.load(root)
        self.faults.skip |= skip | {fault.step}
        self.faults.counts.update(counts, rollbacks=counts["rollbacks"] + 1)
        self._print(
            f"[yellow]rolled back to step {at}: the steps after it run again, step {fault.step}'s data is skipped[/]",
            highlight=False,
        )

    def _final_save(self, saved_at: int) -> Path | None:
        root = self.cfg.checkpoint.save
        if not root:
            return None
        if saved_at != self.iteration:
            self.save(root)
        self.wait_for_save()
        return resolve_checkpoint(root)

    def _log_train(self, log: MetricsLogger, window: list[dict], seconds: float, s_per_step: float) -> None:
        cfg = self.cfg
        dt = seconds / len(window)
        # the loss of the steps that ran and were not faults (NaN if none did)
        ran = [r for r in window if r["fault"] is None and not r.get("listed")]
        rec = {
            "loss": sum(r["loss"] for r in ran) / len(ran) if ran else float("nan"),
            "lr": window[-1]["lr"],
            "grad_norm": window[-1]["grad_norm"],
            "tokens_per_s": cfg.train.global_batch_size * cfg.data.seq_length / dt,
            "mfu": self.flops_per_step / dt / self._peak,
            "step_time_s": dt,
            "memory_gib": memory_gib(self.device),
            "skipped": self.scaler.skipped if self.scaler else 0,
            "consumed_samples": self.consumed_samples,
            "eta_s": (self.total_iters - self.iteration) * s_per_step,
            **{f"faults.{k}": v for k, v in self.faults.counts.items()},
        }
        if self.scaler:
            rec["loss_scale"] = self.scaler.scale
        # auxiliary losses (aux.NAME), MTP losses (mtp_loss.K) and expert load (moe.*): JSONL and
        # TensorBoard (train/NAME)
        for name in dict.fromkeys(k for r in ran for k in r["extra"]):
            rec[name] = sum(r["extra"].get(name, 0.0) for r in ran) / len(ran)
        log.train_line(self.iteration, self.total_iters, rec)
        log.log(self.iteration, rec)

    def _agreed_stop(self) -> int | None:
        """The stop signal if any rank got one (ranks may receive it a step apart: all stop
        together). SIGTERM and SIGUSR1 (SLURM's warning before the time limit), caught by the
        watchdog, stop after the current step."""
        self._beat("stop check")
        return int(self._max_over_ranks(self.watchdog.stop_signal or 0)) or None

    def _beat(self, phase: str) -> None:
        """Progress for the hang detector: this rank enters `phase` of the coming step."""
        self.watchdog.beat(phase, self.iteration + 1)

    def _evaluate_and_sample(self, log: MetricsLogger) -> None:
        self.watchdog.beat("evaluation")
        loss = self.evaluate()
        self._print(
            f"[bold]eval[/] step {self.iteration}: loss {loss:.4f}, ppl {math.exp(min(loss, 50)):.2f}"
        )
        log.log(self.iteration, {"loss": loss, "ppl": math.exp(min(loss, 50))}, prefix="valid")
        self._print_sample()

    def _print_sample(self) -> None:
        text = self.sample()
        if text is not None:
            self._print(f"[bold]sample[/] step {self.iteration}: {text!r}", highlight=False)
