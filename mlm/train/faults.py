"""Faults in the numbers during `mlm train`: a NaN/Inf loss or gradient norm and loss spikes, tested
every step; and `train.resilience.skip_iterations`, steps whose data is consumed without a forward, backward or
update (Megatron's `--iterations-to-skip`).

A step is faulty when its loss (the mean over dp and cp, summed over pipeline stages) or its global
gradient norm is not finite, or, with `train.resilience.loss_spike_zscore` z > 0, when its loss is more than z
standard deviations (population) above the mean of the last `train.resilience.loss_spike_window` applied
steps' losses; the spike test starts once that many steps have been applied. Each rank tests what it
holds and one all-reduce (MAX over the job) makes the decision the same everywhere: the loss and
the norm are global, but a NaN in a gradient replicated over tp (a norm weight) reaches only the norm
of the rank holding it, and a NaN produced after the vocabulary-parallel loss stays on its tp rank.

`train.resilience.fault_action` says what a fault does (the trainer acts, `Trainer.train`):
- skip: nothing of the step is applied: no optimizer update (Adam's step count stays), gradients
  zeroed, every RNG stream back where the step started (dropout drew from it), the MoE routers'
  expert biases (aux-loss-free balancing, updated before the test) restored, fp8 delayed scaling's
  amaxes of the step dropped, the fp16 loss scaler untouched. The iteration, the data position and
  the learning-rate schedule advance as for any step, so the run goes on as one that lists the step
  in `train.resilience.skip_iterations` (bitwise on CPU, same mesh: tests/distributed/test_faults.py).
- rollback: `checkpoint.save`'s latest checkpoint is loaded in-process, the faulty step joins the
  skip list, and training goes on from the checkpoint (the steps after it run again).
- stop: `MlmError` naming the step, the value and the setting; nothing of the step was applied.

The skip list in effect (the config's and the steps rolled back over), the spike test's losses and
the fault counts go into each checkpoint's manifest (`faults`), so a resumed run goes on skipping
and testing as the uninterrupted one would. Under fp16, a step whose gradients overflow is the loss
scaler's (skipped, the scale halved, `skipped` in the log), not a fault.
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from mlm.config import TrainConfig

COUNTS = ("nonfinite", "spikes", "skipped", "rollbacks")
"""The fault counts of the log (`faults.NAME`): non-finite steps, loss spikes, steps run without an
update (faults under skip, and the steps of the skip list), rollbacks."""


@dataclass
class Fault:
    """A faulty step: its number (1-based, as logged) and what was wrong, in words."""

    step: int
    what: str


class FaultMonitor:
    """The fault test of every step, the skip list, the spike test's window of losses and the
    counts; its `state_dict` goes into checkpoints."""

    def __init__(self, t: TrainConfig):
        self.zscore = t.resilience.loss_spike_zscore
        self.skip: set[int] = set(t.resilience.skip_iterations)
        """Steps whose data is consumed without forward, backward or update."""
        self.losses: deque[float] = deque(maxlen=t.resilience.loss_spike_window)
        """The losses of the last applied steps (the spike test's reference)."""
        self.counts = dict.fromkeys(COUNTS, 0)

    def spike_z(self, loss: float) -> float | None:
        """How many standard deviations `loss` is above the window's mean; None while the test is
        off, the window is not full yet, or its losses are all equal."""
        if not self.zscore or len(self.losses) < self.losses.maxlen:
            return None
        mean = sum(self.losses) / len(self.losses)
        std = math.sqrt(sum((x - mean) ** 2 for x in self.losses) / len(self.losses))
        return (loss - mean) / std if std > 0 else None

    def test(self, step: int, loss: float, grad_norm: float, device: torch.device) -> Fault | None:
        """Step `step`'s fault, the same on every rank (one all-reduce when there are several)."""
        z = self.spike_z(loss) if math.isfinite(loss) else None
        spike = z is not None and z > self.zscore
        flags = torch.tensor(
            [not math.isfinite(loss), not math.isfinite(grad_norm), spike], dtype=torch.float32, device=device
        )
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        bad_loss, bad_norm, spike = (bool(f) for f in flags.tolist())
        if bad_loss:
            what = f"{loss} loss" if not math.isfinite(loss) else "non-finite loss on another rank"
        elif bad_norm:
            what = (
                f"{grad_norm} gradient norm"
                if not math.isfinite(grad_norm)
                else "non-finite gradient norm on another rank"
            )
        elif spike and (z is None or z <= self.zscore):  # another rank's test (its own losses)
            what = f"loss spike on another rank (train.resilience.loss_spike_zscore={self.zscore:g})"
        elif spike:
            mean = sum(self.losses) / len(self.losses)
            what = (
                f"loss spike: {loss:.4f} is z={z:.1f} standard deviations above the mean {mean:.4f} of the "
                f"last {len(self.losses)} steps (train.resilience.loss_spike_zscore={self.zscore:g})"
            )
        else:
            return None
        self.counts["nonfinite" if bad_loss or bad_norm else "spikes"] += 1
        return Fault(step, what)

    def applied(self, loss: float) -> None:
        """A step's update was applied: its loss joins the spike test's window."""
        self.losses.append(loss)

    def state_dict(self) -> dict:
        return {
            "skip_iterations": sorted(self.skip),
            "losses": list(self.losses),
            "counts": dict(self.counts),
        }

    def load_state_dict(self, state: dict | None) -> None:
        """From a checkpoint's manifest (absent in checkpoints from before faults were recorded):
        its skip list joins the config's; the window and the counts are the checkpoint's."""
        if not state:
            return
        self.skip |= set(state["skip_iterations"])
        self.losses.clear()
        self.losses.extend(state["losses"][-self.losses.maxlen :])
        self.counts.update(state["counts"])


def expert_biases(model: nn.Module) -> list[torch.Tensor]:
    """The parameters that never train but a step updates by its own rule (the MoE routers'
    selection-only expert biases, aux-loss-free balancing): those without gradients."""
    return [p for p in model.parameters() if not p.requires_grad]


class StepStart:
    """What a step changes before its fault test, as it was at the step's start: every RNG stream
    (Python, numpy, torch's CPU generator and the CUDA device's) and the expert biases;
    `restore()` puts it back when the step is not applied."""

    def __init__(self, biases: list[torch.Tensor], device: torch.device):
        self.python, self.numpy, self.torch = random.getstate(), np.random.get_state(), torch.get_rng_state()
        self.device = device if device.type == "cuda" else None
        self.cuda = torch.cuda.get_rng_state(device) if self.device is not None else None
        self.biases = [(b, b.clone()) for b in biases]

    def restore(self) -> None:
        random.setstate(self.python)
        np.random.set_state(self.numpy)
        torch.set_rng_state(self.torch)
        if self.device is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)
        with torch.no_grad():
            for b, saved in self.biases:
                b.copy_(saved)
