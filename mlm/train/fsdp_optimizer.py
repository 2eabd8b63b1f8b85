"""AdamW over an FSDP-sharded model (`mlm.parallel.fsdp`), behind `TrainOptimizer`'s interface.

The parameters, their gradients and Adam's moments are DTensors sharded over dp × cp; AdamW steps
each rank's shards. Unscaling, the inf check and the global norm read the local shards (the norm
sums them over the shard group: dp × cp, as under the distributed optimizer, or HSDP's group). Checkpoints hold every tensor as one
process would: each one is gathered over dp × cp in turn (one tensor at a time) and written
through its tensor-parallel placement by the ranks that write without FSDP, so a checkpoint
moves freely between FSDP, the distributed optimizer and any mesh; loading reads each shard's
rows of the stored tensor straight into it.
"""

from __future__ import annotations

import torch
from torch import nn

from mlm.checkpoint import ShardedTensor
from mlm.checkpoint.keys import param_of
from mlm.config import Config
from mlm.parallel.fsdp import FSDPGrads, first_row, full, local
from mlm.parallel.grad_norm import clip_, global_grad_norm
from mlm.parallel.mesh import Mesh
from mlm.parallel.placement import placements
from mlm.train.adamw import adam_state_tensors, make_optimizer, set_adam_step, set_schedule
from mlm.train.optimizer import GradPieces


class FSDPOptimizer(GradPieces):
    """AdamW for this rank's FSDP shards (`step`, `clip`, `unscale`, `found_inf`) and the
    optimizer's checkpoint tensors, as `TrainOptimizer` has them."""

    def __init__(self, model: nn.Module, cfg: Config, mesh: Mesh, device: torch.device):
        self.model, self.mesh, self.device = model, mesh, device
        self.placements = placements(model, mesh)
        self.padded_rows = getattr(model, "padded_rows", ())
        self.copy = model.tied_copy()  # FSDP's parameter: it replaced the module's before this
        self.all_grads = FSDPGrads(model)
        sharded = next(
            p.device_mesh
            for n, p in model.named_parameters()
            if hasattr(p, "device_mesh") and not self.placements[n].expert_parallel
        )
        self.shard_group = sharded.get_group(sharded.ndim - 1)
        """The ranks holding the other shards of this rank's dense tensors (HSDP: the others of its
        group); the experts' are the edp group's."""
        self.dists: list = []  # no parameter all-gathers left in flight by `step`
        self.adamw = make_optimizer(model, cfg.optimizer, device)

    def pieces(self, counted_once: bool = False) -> list[tuple[torch.Tensor, bool | str]]:
        """(this rank's shard of a reduced gradient, kind: tensor-parallel, replicated or "expert");
        `counted_once` leaves out a tied embedding's last-stage copy (for the norm)."""
        places = self.placements
        return [
            (local(p.grad), "expert" if places[n].expert_parallel else places[n].tensor_parallel)
            for n, p in self.model.named_parameters()
            if p.grad is not None and not (counted_once and p is self.copy)
        ]

    def clip(self, max_norm: float) -> float:
        m = self.mesh
        experts = tuple(g for g in (m.group("edp"), m.group("ep")) if g)  # other shards, other experts
        norm = global_grad_norm(
            self.pieces(counted_once=True), m.tp_group, self.shard_group, self.device, m.group("pp"), experts
        )
        clip_([t for t, _ in self.pieces()], norm, max_norm)
        return float(norm)

    def step(self, lr: float, weight_decay: float) -> None:
        set_schedule(self.adamw, lr, weight_decay)
        self.adamw.step()

    def wait_for_params(self) -> None:
        """Nothing in flight: FSDP gathers each unit's parameters when it runs."""

    def zero_grad(self) -> None:
        self.all_grads.zero_grad()

    # ------------------------------------------------------------------ checkpoints

    def _tensor(self, key: str, t: torch.Tensor, for_load: bool) -> ShardedTensor:
        name = param_of(key)
        place = self.placements[name]
        offset = place.offset
        if for_load:  # this rank's rows of its tensor-parallel slice, read into the shard in place
            whole = local(t)
            if hasattr(t, "device_mesh"):
                offset = (offset[0] + min(first_row(t), place.shape[0]), *offset[1:])
        else:
            whole = full(t.detach()).cpu()
        return ShardedTensor(
            key,
            whole,
            place.global_shape,
            offset,
            writer=place.writer,
            padded_rows=name in self.padded_rows,
        )

    def checkpoint_groups(self, step: int, for_load: bool = False) -> dict[str, list[ShardedTensor]]:
        """{"model": every parameter, "optim": its moments}: to write, each whole over dp × cp as
        this rank's tensor-parallel slice (collective: every rank gathers every tensor in the same
        order); with `for_load`, this rank's shards to load into (then call `finish_load`)."""
        model = [self._tensor(n, p, for_load) for n, p in self.model.named_parameters()]
        moments = adam_state_tensors(self.model, self.adamw, step)
        optim = [self._tensor(k, t, for_load) for k, t in moments.items()]
        return {"model": model, "optim": optim}

    def finish_load(self, step: int | None) -> None:
        """After loading `checkpoint_groups(for_load=True)`: the moments' step (None: a weights-only
        checkpoint, the moments untouched)."""
        if step is not None:
            set_adam_step(self.adamw, step)
