"""AdamW over the mesh behind one interface: replicated over dp, or the distributed optimizer.

Both keep gradients in `GradBuckets` (one flat buffer, reduced in buckets during the last
backward of a step): one for the dense parameters, reduced over dp, and under expert
parallelism a second for the expert weights, reduced over edp (`all_grads` drives both). `pieces()` gives the gradient this rank is responsible for, tagged
tensor-parallel or not, so that unscaling, inf checks and the global norm are written once.
The checkpoint holds the optimizer as one process would: `exp_avg.NAME`, `exp_avg_sq.NAME` in
each parameter's global shape, whatever the mesh.

With `train.param_dtype` bf16/fp16 (Megatron's mixed precision) the parameters are bf16/fp16,
gradients accumulate in the fp32 buffers, and the optimizer holds fp32 main weights: a copy of
every parameter when replicated (AdamW steps the copies, which are then cast into the
parameters), this rank's shard under the distributed optimizer. The checkpoint's model group then
holds the fp32 main weights under the parameters' names (`checkpoint_groups`), so checkpoints of
either dtype load into runs of either.

Under the distributed optimizer `step()` returns with the parameter all-gathers in flight (their
buckets are waited for by forward pre-hooks): call `wait_for_params()` before anything else reads
the parameters.
"""

from __future__ import annotations

import dataclasses
import types

import torch
from torch import nn

from mlm.checkpoint import ShardedTensor
from mlm.checkpoint.keys import param_of
from mlm.config import Config
from mlm.parallel.data_parallel import GradBuckets, GradBucketSet
from mlm.parallel.dist_optim import DistributedOptimizer
from mlm.parallel.grad_norm import any_nonfinite, clip_, global_grad_norm
from mlm.parallel.mesh import Mesh
from mlm.parallel.parallelize import model_shards
from mlm.parallel.placement import placements
from mlm.train.adamw import adam_state_tensors, make_optimizer, set_adam_step, set_schedule


class GradPieces:
    """What a mesh optimizer does with the gradient pieces it owns (`pieces()`, `device`): the fp16
    loss scaler's inf check and unscaling."""

    def found_inf(self) -> bool:
        return any_nonfinite([t for t, _ in self.pieces()], self.device)

    def unscale(self, factor: float) -> None:
        torch._foreach_mul_([t for t, _ in self.pieces()], factor)


class TrainOptimizer(GradPieces):
    """AdamW for this rank's parameters (`step`, `clip`, `unscale`, `found_inf`), replicated or
    sharded over dp, with the gradient buffer and the optimizer's checkpoint tensors."""

    def __init__(self, model: nn.Module, cfg: Config, mesh: Mesh, device: torch.device):
        p = cfg.parallel
        self.model, self.mesh, self.device = model, mesh, device
        self.distributed = p.distributed_optimizer
        self.placements = placements(model, mesh)
        self.padded_rows = getattr(model, "padded_rows", ())
        tied = model.tied_weight()
        trainable = {n for n, q in model.named_parameters() if q.requires_grad}
        experts = {n for n in trainable if self.placements[n].expert_parallel}
        common = dict(
            bucket_size_bytes=p.bucket_size_mb * 2**20,
            reduce_dtype=torch.bfloat16 if p.grad_reduce_dtype == "bf16" else torch.float32,
            reduce_scatter=self.distributed,
        )
        self.grads = GradBuckets(
            model,
            mesh.group("dp_cp"),  # cp ranks hold other tokens of the same sequences: like dp
            held=(tied,) if tied is not None else (),  # reduced once both pipeline copies are summed
            names=trainable - experts,
            **common,
        )
        # expert weights (sharded over ep): reduced over edp, averaged over all dp replicas
        self.expert_grads = (
            GradBuckets(model, mesh.group("edp"), names=experts, divisor=mesh.dp * mesh.cp, **common)
            if experts
            else None
        )
        self.all_grads = GradBucketSet(self.grads, self.expert_grads)
        """Every gradient buffer, driven as one (by the pipeline and `finish`)."""
        # the last pipeline stage's copy of a tied embedding: updated like the original, counted once
        self.copy = model.tied_copy()
        self.adamw = make_optimizer(model, cfg.optimizer, device)
        self.low_precision = cfg.train.param_dtype != "fp32"
        """bf16/fp16 parameters with fp32 main weights in the optimizer."""
        self.mains: dict[str, torch.Tensor] = {}
        """Replicated optimizer, bf16/fp16 parameters: name → fp32 main weight (its .grad: the buffer)."""
        self.dists: list[DistributedOptimizer] = []
        if self.distributed:
            for g in self.all_grads.buckets:
                self.dists.append(DistributedOptimizer.from_adamw(self.adamw, g, subset=True))
                self.dists[-1].placements = self.placements
                self.dists[-1].overlap_param_gather(model)
        elif self.low_precision:
            self._make_mains()

    def _make_mains(self) -> None:
        """An fp32 main copy of every trainable parameter, which AdamW steps in its place."""
        main_of = {}
        for g in self.all_grads.buckets:
            for i, (n, p) in enumerate(zip(g.names, g.params, strict=True)):
                main = p.detach().float().requires_grad_(True)
                main.grad = g.grad(i)
                self.mains[n] = main_of[id(p)] = main
        for group in self.adamw.param_groups:  # before any step: AdamW holds no state yet
            group["params"] = [main_of[id(p)] for p in group["params"]]
        self._pairs = [(p, main_of[id(p)]) for g in self.all_grads.buckets for p in g.params]

    def _kind(self, name: str) -> bool | str:
        place = self.placements[name]
        return "expert" if place.expert_parallel else place.tensor_parallel

    # ------------------------------------------------------------------ one step

    def pieces(self, counted_once: bool = False) -> list[tuple[torch.Tensor, bool | str]]:
        """(gradient this rank owns, kind: tensor-parallel, replicated or "expert") after
        `finish()`; `counted_once` leaves out the gradient of a tied embedding's last-stage copy
        (for the norm)."""
        out = []
        if not self.dists:
            for g in self.all_grads.buckets:
                out += [
                    (g.grad(i), self._kind(n))
                    for i, (n, p) in enumerate(zip(g.names, g.params, strict=True))
                    if not (counted_once and p is self.copy)
                ]
            return out
        for d in self.dists:
            g = d.grads
            out += [
                (g.buffer[s.start : s.start + s.numel], self._kind(s.name))
                for s in d.segments
                if not (counted_once and g.params[s.index] is self.copy)
            ]
        return out

    def clip(self, max_norm: float) -> float:
        m = self.mesh
        dp_shards = m.group("dp_cp") if self.distributed else None
        experts = ()
        if self.expert_grads is not None:
            experts = tuple(g for g in (m.group("edp") if self.distributed else None, m.group("ep")) if g)
        norm = global_grad_norm(
            self.pieces(counted_once=True), m.tp_group, dp_shards, self.device, m.group("pp"), experts
        )
        clip_([t for t, _ in self.pieces()], norm, max_norm)
        return float(norm)

    def step(self, lr: float, weight_decay: float) -> None:
        """AdamW at `lr`, each group's `weight_decay` times its `wd_mult`; under the distributed
        optimizer the parameters' all-gathers are left in flight."""
        if self.dists:
            for d in self.dists:
                d.set_schedule(lr, weight_decay)
                d.step()
            return
        set_schedule(self.adamw, lr, weight_decay)
        self.adamw.step()
        self._params_from_mains()

    @torch.no_grad()
    def _params_from_mains(self) -> None:
        if self.mains:
            torch._foreach_copy_([p for p, _ in self._pairs], [m for _, m in self._pairs])

    def wait_for_params(self) -> None:
        """Wait for the parameter all-gathers `step()` left in flight (before reading weights)."""
        for d in self.dists:
            d.wait_for_params()

    def zero_grad(self) -> None:
        self.all_grads.zero_grad()

    # ------------------------------------------------------------------ checkpoints

    def _placed(self, tensors: list[ShardedTensor]) -> list[ShardedTensor]:
        """Each moment written by its parameter's replica 0 (and by the dp × cp rank that gathered
        it under the distributed optimizer); vocabulary rows padded per tp, as the weights."""
        for t in tensors:
            name, place = param_of(t.key), self.placements[param_of(t.key)]
            sharded_over = ("edp",) if place.expert_parallel else ("dp", "cp")
            t.writer = t.writer and (
                place.writer_without(self.mesh, *sharded_over) if self.dists else place.writer
            )
            t.padded_rows = name in self.padded_rows
        return tensors

    def checkpoint_groups(self, step: int, for_load: bool = False) -> dict[str, list[ShardedTensor]]:
        """{"model": every parameter, "optim": its moments} as this rank's slices (to write, or
        with `for_load` to load into; then call `finish_load`). With bf16/fp16 parameters the model
        group holds the fp32 main weights under the parameters' names. Collective under the
        distributed optimizer."""
        self.wait_for_params()
        model = model_shards(self.model, self.mesh)
        if self.dists:
            tensors = [
                t
                for d in self.dists
                for t in (d.checkpoint_load_targets() if for_load else d.checkpoint_save_tensors())
            ]
            optim = self._placed([t for t in tensors if t.key != param_of(t.key)])
            if self.low_precision:  # the gathered main weights replace the parameters
                mains = self._placed([t for t in tensors if t.key == param_of(t.key)])
                held = set(self.placements) - {n for g in self.all_grads.buckets for n in g.names}
                model = [t for t in model if t.key in held] + mains
            return {"model": model, "optim": optim}
        if self.mains:
            model = [
                dataclasses.replace(t, local=self.mains[t.key]) if t.key in self.mains else t for t in model
            ]
        # adam_state_tensors reads the parameters AdamW steps: the main copies when there are some
        named = types.SimpleNamespace(named_parameters=lambda: iter(self.mains.items()))
        out = []
        for key, t in adam_state_tensors(named if self.mains else self.model, self.adamw, step).items():
            place = self.placements[param_of(key)]
            out.append(ShardedTensor(key, t, place.global_shape, place.offset))
        return {"model": model, "optim": self._placed(out)}

    def finish_load(self, step: int | None) -> None:
        """After loading `checkpoint_groups(for_load=True)`: the moments' step, and the parameters
        from the loaded main weights; `step` None: a weights-only checkpoint (the model group)."""
        if self.dists:
            for d in self.dists:
                d.finish_load(step)
            return
        if step is not None:
            set_adam_step(self.adamw, step)
        self._params_from_mains()
