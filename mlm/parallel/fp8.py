"""FP8 training of the transformer layers' linear layers, applied from outside (`apply_fp8`), with
per-tensor scaling by Transformer Engine's delayed recipe or by current scaling.

    model = build_rank_model(..., seed=seed, train=cfg.train)   # mlm.build: calls apply_fp8
    fp8 = model.fp8                                              # None when train.fp8.format is ""
    ... forward / backward of every micro-batch of a step ...
    fp8.finish_step()                                 # after the step's backward, before the next step

What runs in fp8: every `nn.Linear`, `ColumnParallelLinear` and `RowParallelLinear` inside the
transformer layers (`model.layers`: attention q/k/v/out, MLA's down/up projections, the MLP's
gate/up/down, MoE shared experts). What stays in the compute dtype (bf16): the embedding, the
output layer and loss, norms, attention itself, MoE routers and the shared-expert gate (one
output column), the routed MoE experts (grouped GEMMs), the MTP depths (projection and layer).
Each fp8 linear runs as one autograd Function (`_Fp8LinearFn`): forward quantises the input and
the weight to e4m3 and saves the quantised tensors (1 byte an element, + one fp32 scale each)
instead of the bf16 input and weight copy, as Transformer Engine does; backward quantises the
output gradient (e5m2 under "hybrid", e4m3 under "e4m3") and computes dgrad = g · W and
wgrad = gᵀ · x from the fp8 operands (`kernels.fp8.fp8_linear`); the bias gradient is summed
from the unquantised gradient.

Each fp8 linear has three slots, input, weight and grad, each with a scale.

**delayed** (TE's `DelayedScaling`): each slot keeps an amax history of `train.fp8.amax_history_len`
values, newest last, and the scale that the whole step uses, computed from the history before
the step: scale = fp8_max / algo(history) / 2^margin, algo "max" (of the history) or
"most_recent" (its last value); amax 0 → scale 1. During the
step each slot records the max |x| over its micro-batches; `finish_step()` (the trainer calls it
after the step's backward) reduces those with MAX over tp (the shards of a sharded tensor) and
over dp × cp (the other data), rolls them into the histories once per optimizer step and
computes the next step's scales. So every mesh uses the scales of one process. The first step,
with nothing in the histories yet, scales each tensor by its own amax as "tensorwise" does
(Transformer Engine starts at scale 1 instead: that flushes gradients below e5m2's 2^-16 to
zero, and makes the first step depend on the loss's 1 / micro-batches factor, i.e. on dp;
measured at dp 2 on the tiny test model: losses 2e-3 from one process's by step 4 with scale
1, bitwise equal with this).

**tensorwise** (current scaling): each tensor's scale comes from its own amax (fp8_max / amax /
2^margin), reduced with MAX over tp × cp, the ranks holding the other parts of the tensor one
process would see whole (a weight sharded over tp, an input or gradient split by features or
by the sequence). No state between steps.

Evaluation (grad disabled) uses the current scales and records nothing. Activation recompute
records the same amax twice (a max: no change).

The state (delayed: amax histories and scales) is this rank's `Fp8State`, saved in the
checkpoint group "fp8" (a run resumed from it has `started`) (`Fp8State.shards`: per linear `NAME.amax_history` [3, L] and
`NAME.scale` [3], rows input/weight/grad, replicated over tp, dp, cp), so a resumed run is
bitwise the uninterrupted one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from kernels.fp8 import MIN_CAPABILITY, amax, fp8_linear, quantize, scale_from_amax
from kernels.lean import autocast_dtype
from mlm.checkpoint import ShardedTensor
from mlm.config import TrainConfig
from mlm.errors import MlmError
from mlm.model.contract import declaring
from mlm.parallel.mesh import Mesh
from mlm.parallel.placement import replicated
from mlm.parallel.tensor import ColumnParallelLinear, OpLinear, RowParallelLinear

INPUT, WEIGHT, GRAD = range(3)


@dataclass(frozen=True)
class Fp8Recipe:
    """The fp8 settings of `TrainConfig` (train.fp8.*)."""

    fmt: str
    """"e4m3" (every tensor e4m3) or "hybrid" (e4m3 forward, e5m2 gradients)."""
    recipe: str
    """"delayed" (amax history) or "tensorwise" (current scaling)."""
    margin: int = 0
    history_len: int = 1024
    amax_compute_algo: str = "max"

    @classmethod
    def from_config(cls, t: TrainConfig) -> Fp8Recipe:
        return cls(t.fp8.format, t.fp8.recipe, t.fp8.margin, t.fp8.amax_history_len, t.fp8.amax_compute_algo)

    def format(self, slot: int) -> str:
        return "e5m2" if slot == GRAD and self.fmt == "hybrid" else "e4m3"


def _all_reduce_max(t: torch.Tensor, *groups) -> torch.Tensor:
    for group in groups:
        if group is not None:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t


class Fp8State:
    """The scaling state of this rank's fp8 linears, row i = `names[i]`, column = slot
    (input, weight, grad): `scale` [n, 3], under "delayed" also `amax_history` [n, 3, L] (newest
    last) and `amax` [n, 3] (this step's running max, zero between steps)."""

    def __init__(self, names: list[str], recipe: Fp8Recipe, mesh: Mesh, device: torch.device):
        self.names, self.recipe, self.mesh = names, recipe, mesh
        n = len(names)
        self.scale = torch.ones(n, 3, device=device)
        delayed = recipe.recipe == "delayed"
        self.amax_history = torch.zeros(n, 3, recipe.history_len, device=device) if delayed else None
        self.amax = torch.zeros(n, 3, device=device) if delayed else None
        self.started = False
        """Whether a step has been rolled into the histories (else: current scaling)."""

    def scale_for(self, i: int, slot: int, x: torch.Tensor, record: bool) -> torch.Tensor:
        """The scale to quantise `x` (linear i's `slot`) with; under "delayed" the step's scale,
        recording x's amax when `record`; under "tensorwise", and in the first step under
        "delayed", from x's amax (MAX over tp × cp)."""
        if self.amax is None or not self.started:
            a = _all_reduce_max(amax(x), self.mesh.group("tp_cp"))
            if record and self.amax is not None:
                self.amax[i, slot] = torch.maximum(self.amax[i, slot], a)
            return scale_from_amax(a, self.recipe.format(slot), self.recipe.margin)
        if record:
            self.amax[i, slot] = torch.maximum(self.amax[i, slot], amax(x))
        return self.scale[i, slot].clone()

    def finish_step(self) -> None:
        """Delayed scaling, once per optimizer step after its backward: the step's amaxes, MAX
        over tp and dp × cp, roll into the histories; the scales for the next step follow."""
        if self.amax is None:
            return
        step = _all_reduce_max(self.amax.clone(), self.mesh.group("tp"), self.mesh.group("dp_cp"))
        self.amax_history.copy_(torch.cat([self.amax_history[..., 1:], step.unsqueeze(-1)], dim=-1))
        self.amax.zero_()
        self.started = True
        if self.recipe.amax_compute_algo == "max":
            reference = self.amax_history.amax(dim=-1)
        else:
            reference = self.amax_history[..., -1]
        fmts = [self.recipe.format(s) for s in range(3)]
        for s, fmt in enumerate(fmts):
            self.scale[:, s] = scale_from_amax(reference[:, s], fmt, self.recipe.margin)

    def discard_step(self) -> None:
        """A step that is not applied (a fault, `mlm.train.faults`): the amaxes it recorded are
        dropped, the histories and scales stay as before it."""
        if self.amax is not None:
            self.amax.zero_()

    def shards(self) -> list[ShardedTensor]:
        """The checkpoint group "fp8": per linear its scales (and histories), written by replica 0."""
        if self.amax_history is None:
            return []
        out = []
        for i, name in enumerate(self.names):
            for key, t in ((f"{name}.amax_history", self.amax_history[i]), (f"{name}.scale", self.scale[i])):
                writer = replicated(self.mesh, tuple(t.shape)).writer
                out.append(ShardedTensor(key, t, tuple(t.shape), (0,) * t.dim(), writer=writer))
        return out

    def __repr__(self) -> str:
        r = self.recipe
        return f"Fp8State({len(self.names)} linears, {r.fmt}, {r.recipe})"


class _Fp8LinearFn(torch.autograd.Function):
    """y = x Wᵀ (+ b) from e4m3 x and W; saves the quantised x and W; backward from the
    quantised output gradient (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias, op: Fp8LinearOp, record: bool, dtype: torch.dtype):
        state, i, recipe = op.state, op.index, op.state.recipe
        x_MK = x.reshape(-1, x.shape[-1])
        sx = state.scale_for(i, INPUT, x_MK, record)
        sw = state.scale_for(i, WEIGHT, weight, record)
        xq = quantize(x_MK, sx, recipe.format(INPUT))
        wq = quantize(weight, sw, recipe.format(WEIGHT))
        y_MN = fp8_linear(xq, sx, wq, sw, dtype)
        if bias is not None:
            y_MN = y_MN + bias.to(dtype)
        ctx.save_for_backward(xq, sx, wq, sw)
        ctx.op, ctx.record, ctx.x_meta = op, record, (x.shape, x.dtype)
        ctx.w_dtype, ctx.b_dtype = weight.dtype, None if bias is None else bias.dtype
        return y_MN.view(*x.shape[:-1], y_MN.shape[-1])

    @staticmethod
    def backward(ctx, grad_y):
        xq, sx, wq, sw = ctx.saved_tensors
        op = ctx.op
        x_shape, x_dtype = ctx.x_meta
        g_MN = grad_y.reshape(-1, grad_y.shape[-1])
        sg = op.state.scale_for(op.index, GRAD, g_MN, ctx.record)
        gq = quantize(g_MN, sg, op.state.recipe.format(GRAD))
        dx = fp8_linear(gq, sg, wq.t(), sw, x_dtype).view(x_shape)  # g · W
        dw = fp8_linear(gq.t(), sg, xq.t(), sx, ctx.w_dtype)  # gᵀ · x
        db = None if ctx.b_dtype is None else g_MN.float().sum(0).to(ctx.b_dtype)
        return dx, dw, db, None, None, None


class Fp8LinearOp:
    """The `linear_op` of one fp8 linear: `op(x, weight, bias)` like `F.linear`, in fp8."""

    def __init__(self, state: Fp8State, index: int):
        self.state, self.index = state, index

    def __call__(self, x, weight, bias=None):
        return _Fp8LinearFn.apply(
            x, weight, bias, self, torch.is_grad_enabled(), autocast_dtype(x) or x.dtype
        )

    def __repr__(self) -> str:
        return f"Fp8LinearOp({self.state.names[self.index]})"


def check_fp8_device(device: torch.device, capability: tuple[int, int] | None = None) -> None:
    """Raise `MlmError` where fp8 cannot run: a CUDA device below compute capability 8.9
    (`capability`: the device's, or given, e.g. by a test). CPU always runs (emulated)."""
    if device.type != "cuda":
        return
    cap = tuple(capability) if capability is not None else torch.cuda.get_device_capability(device)
    if cap < MIN_CAPABILITY:
        raise MlmError(
            f"train.fp8.format needs fp8 tensor cores (CUDA compute capability ≥ 8.9: Ada, Hopper, Blackwell); "
            f"{device} has {cap[0]}.{cap[1]}; set train.fp8.format='' (bf16) or train on an sm_89+ GPU"
        )


def fp8_linears(model: nn.Module) -> list[str]:
    """The names of the linears `apply_fp8` runs in fp8 (in module order): every linear of the
    model's layers (`model.layers`: not the embedding, the output layer or the MTP depths) but
    those a module keeps in the compute dtype (its `fp8_exempt`, `mlm.model.contract`)."""
    linear = (nn.Linear, ColumnParallelLinear, RowParallelLinear)
    exempt = {
        id(getattr(m, attr))
        for _, m, attrs in declaring(model.layers, "fp8_exempt")
        for attr in attrs
        if getattr(m, attr, None) is not None
    }
    return [
        name
        for name, m in model.layers.named_modules(prefix="layers")
        if isinstance(m, linear) and id(m) not in exempt
    ]


def apply_fp8(model: nn.Module, t: TrainConfig, mesh: Mesh, device: torch.device) -> Fp8State | None:
    """Make the transformer layers' linears of `model` (this rank's part, after `parallelize`)
    run in fp8 per `t.fp8*`, in place; return their state, or None when `t.fp8.format` is ""."""
    if not t.fp8.format:
        return None
    check_fp8_device(device)
    names = fp8_linears(model)
    state = Fp8State(names, Fp8Recipe.from_config(t), mesh, device)
    for i, name in enumerate(names):
        op = Fp8LinearOp(state, i)
        module = model.get_submodule(name)
        if isinstance(module, ColumnParallelLinear | RowParallelLinear):
            module.linear_op = op
        else:
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, OpLinear(module, op))
    return state
