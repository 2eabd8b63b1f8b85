"""The distributed optimizer (ZeRO-1, Megatron's `--use-distributed-optimizer`): AdamW state sharded over dp.

Built on a `GradBuckets(..., reduce_scatter=True)`: after `finish()` rank r holds the reduced
gradient of its r-th contiguous 1/dp of every bucket. The parameters become views into one flat
parameter buffer with the same layout as the gradient buffer; Adam's moments are two flat tensors
of the shard's size. With fp32 parameters rank r's slice of that buffer is its fp32 main copy.
With bf16/fp16 parameters (Megatron's `--bf16`) the buffer is bf16/fp16 and the fp32 main
weights are a third flat tensor of the shard's size (`main`): per parameter 2 bytes of weights +
4 of fp32 gradient + (4 main + 8 moments) / dp, Megatron's 6 + 12/dp. `step()` runs AdamW
(torch's own kernel, with the caller's parameter groups and per-group weight decay) over the
shard, cut at parameter boundaries into 1-D segments, casts the main shard into the parameter
buffer when they differ, then all-gathers every bucket of the parameter buffer (in its dtype),
so each rank again holds the whole updated model.

Per rank this keeps 2/dp of the Adam state (8 bytes per parameter / dp) instead of all of it, for
one reduce-scatter and one all-gather per bucket — the same bytes as one all-reduce.

With `overlap_param_gather(model)` (as the trainer runs it: Megatron's `--overlap-param-gather`)
`step()` returns with the all-gathers in flight; a forward pre-hook on every module that owns
parameters waits for their buckets just before it first uses them, and `wait_for_params()`
waits for all of it (before a checkpoint, an evaluation or a sample read the parameters).

Per step:

    for i, batch in enumerate(micro_batches):
        grads.set_last_microbatch(i == n - 1)
        (loss_fn(model, batch) / n).backward()
    grads.finish()                        # reduce-scatter done: this rank's gradient shard is ready
    grad_norm = opt.clip_grad_norm(clip)  # the norm of the full gradient, from the shards
    opt.set_schedule(lr, wd)
    opt.step()                            # AdamW on the shard, then all-gather the parameters
    opt.zero_grad()
    opt.wait_for_params()                 # only with overlap_param_gather, before reading weights

Checkpoints keep one process's layout (`exp_avg.NAME`, `exp_avg_sq.NAME` in each parameter's
global shape, as `mlm.train.adamw.adam_state_tensors`), so they load under any dp and with the
optimizer sharded or not: `checkpoint_save_tensors()` gathers each parameter's state onto one dp
rank (round robin) which writes it whole; `checkpoint_load_targets()` reads, for each parameter,
the rows covering this rank's flat range, and `finish_load()` copies that range into the shard.
The fp32 main weights are the parameters themselves (stored in the model group); with bf16/fp16
parameters `checkpoint_save_tensors()` gathers the main shard with the moments, under the
parameters' own names, for the caller's model group.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mlm.checkpoint import ShardedTensor
from mlm.checkpoint.keys import MOMENTS, moment_key
from mlm.parallel.data_parallel import GradBuckets, all_gather
from mlm.parallel.grad_norm import clip_, global_grad_norm


@dataclass
class Segment:
    """This rank's part of one parameter: a flat range that is also a range of the shard."""

    index: int
    """The parameter's index in `GradBuckets.params`."""
    name: str
    offset: int
    """Where the range starts in the flattened parameter."""
    numel: int
    start: int
    """Where it starts in the flat parameter and gradient buffers."""
    local: int
    """Where it starts in this rank's flat moments."""


def owned_range(grads: GradBuckets, index: int, rank: int) -> tuple[int, int]:
    """The flat range [a, b) of parameter `index` that dp rank `rank` owns (a == b: none)."""
    s, e = grads.ranges[index]
    lo, hi = grads.shard_range(grads.buckets[grads.bucket_of[index]], rank)
    a, b = max(s, lo), min(e, hi)
    return (a - s, b - s) if a < b else (0, 0)


class DistributedOptimizer:
    """AdamW whose fp32 main weights and moments are sharded over dp.

    `param_groups` as for `torch.optim.AdamW` (`{"params": [...], "weight_decay": wd}`), covering
    exactly the parameters of `grads`; `from_adamw` takes them from `mlm.train.adamw.make_optimizer`.
    """

    def __init__(
        self,
        grads: GradBuckets,
        param_groups: list[dict],
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        fused: bool | None = None,
    ):
        assert grads.reduce_scatter, "the distributed optimizer needs GradBuckets(..., reduce_scatter=True)"
        self.grads = grads
        self.placements: dict = {}
        """Parameter name → `mlm.parallel.placement.Placement` (global shape and offset in checkpoints)."""
        wd_of = {}  # (weight decay, its multiplier) of each parameter's group
        for g in param_groups:
            for p in g["params"]:
                assert id(p) not in wd_of, "a parameter is in two param groups"
                wd_of[id(p)] = (float(g.get("weight_decay", 0.0)), float(g.get("wd_mult", 1.0)))
        missing = [n for n, p in zip(grads.names, grads.params, strict=True) if id(p) not in wd_of]
        assert not missing and len(wd_of) == len(grads.params), (
            f"param groups and gradient buffer differ (missing from the groups: {missing[:3]})"
        )

        # The parameters become views of one flat buffer laid out like the gradient buffer.
        dtypes = {p.dtype for p in grads.params}
        assert len(dtypes) == 1, f"one parameter dtype per gradient buffer, not {sorted(map(str, dtypes))}"
        self.buffer = torch.zeros(grads.numel, dtype=dtypes.pop(), device=grads.device)
        with torch.no_grad():
            for p, (s, e) in zip(grads.params, grads.ranges, strict=True):
                self.buffer[s:e].copy_(p.detach().flatten())
                p.data = self.buffer[s:e].view_as(p)

        # This rank's shard: its 1/dp of every bucket, concatenated; cut into per-parameter segments.
        self.shards = [grads.shard_range(b) for b in grads.buckets]
        self.segments: list[Segment] = []
        local = 0
        for b, (lo, hi) in zip(grads.buckets, self.shards, strict=True):
            for i in b.params:
                a, z = owned_range(grads, i, grads.dp_rank)
                if z > a:
                    start = grads.ranges[i][0] + a
                    self.segments.append(Segment(i, grads.names[i], a, z - a, start, local + start - lo))
            local += hi - lo
        self.exp_avg = torch.zeros(local, dtype=torch.float32, device=grads.device)
        self.exp_avg_sq = torch.zeros(local, dtype=torch.float32, device=grads.device)
        self.main: torch.Tensor | None = None
        """bf16/fp16 parameters: this rank's fp32 main weights (the shard, as the moments)."""
        if self.buffer.dtype != torch.float32:
            self.main = torch.zeros(local, dtype=torch.float32, device=grads.device)
            for seg in self.segments:  # the fp32 init rounded, as the parameters hold it
                self.main[seg.local : seg.local + seg.numel] = self.buffer[seg.start : seg.start + seg.numel]

        # torch's AdamW over the segments (1-D views of the main shard), with the moments as
        # views of the flat tensors: the exact update rule of the single-process optimizer.
        groups: dict[tuple[float, float], list[torch.Tensor]] = {}
        self._masters = []
        self._params = []  # the parameter buffer's segments (the masters themselves in fp32)
        for seg in self.segments:
            p = self.buffer[seg.start : seg.start + seg.numel]
            m = p if self.main is None else self.main[seg.local : seg.local + seg.numel]
            m.grad = grads.buffer[seg.start : seg.start + seg.numel]
            groups.setdefault(wd_of[id(grads.params[seg.index])], []).append(m)
            self._masters.append(m)
            self._params.append(p)
        if fused is None:
            fused = grads.device.type in ("cuda", "cpu")
        self._adam = None
        if self.segments:  # a rank may own only padding (a tiny model over many ranks)
            self._adam = torch.optim.AdamW(
                [{"params": ps, "weight_decay": wd, "wd_mult": mult} for (wd, mult), ps in groups.items()],
                lr=lr,
                betas=betas,
                eps=eps,
                fused=fused,
            )
            step_device = grads.device if fused else torch.device("cpu")
            for seg, m in zip(self.segments, self._masters, strict=True):
                self._adam.state[m] = {
                    "step": torch.tensor(0.0, dtype=torch.float32, device=step_device),
                    "exp_avg": self.exp_avg[seg.local : seg.local + seg.numel],
                    "exp_avg_sq": self.exp_avg_sq[seg.local : seg.local + seg.numel],
                }
        self.lr = lr
        self._load_targets: list[tuple[Segment, str | None, torch.Tensor, int]] = []
        self.overlap = False
        """Whether `step()` returns with the parameter all-gathers in flight (`overlap_param_gather`)."""
        self.gathers: dict[int, object] = {}
        """Bucket index → its parameter all-gather still in flight."""

    @classmethod
    def from_adamw(
        cls, opt: torch.optim.AdamW, grads: GradBuckets, subset: bool = False
    ) -> DistributedOptimizer:
        """The same groups and hyper-parameters as an AdamW that has not stepped yet; `subset`:
        only the parameters of `grads` (the AdamW may hold more, e.g. dense and expert weights
        whose gradients live in two buffers)."""
        assert not opt.state, "wrap the AdamW before its first step (its state would be lost)"
        g0 = opt.param_groups[0]
        assert all(g["betas"] == g0["betas"] and g["eps"] == g0["eps"] for g in opt.param_groups)
        mine = {id(p) for p in grads.params}
        return cls(
            grads,
            [
                {
                    "params": [p for p in g["params"] if not subset or id(p) in mine],
                    "weight_decay": g["weight_decay"],
                    "wd_mult": g.get("wd_mult", 1.0),
                }
                for g in opt.param_groups
            ],
            lr=g0["lr"],
            betas=g0["betas"],
            eps=g0["eps"],
            fused=bool(opt.defaults.get("fused")),
        )

    # ------------------------------------------------------------------ per step

    def local_grads(self) -> list[torch.Tensor]:
        """This rank's reduced gradient, one 1-D view per bucket (padding included, always zero)."""
        return [self.grads.buffer[lo:hi] for lo, hi in self.shards]

    def clip_grad_norm(self, max_norm: float) -> float:
        """Scale the gradient shards as `torch.nn.utils.clip_grad_norm_` would the full gradient;
        return the norm before clipping (dp only; the trainer's `TrainOptimizer` also sums over tp).
        `max_norm` <= 0 or inf: no clipping."""
        grads = self.local_grads()
        group = self.grads.group if self.grads.dp > 1 else None
        norm = global_grad_norm([(g, False) for g in grads], None, group, self.grads.device)
        clip_(grads, norm, max_norm)
        return float(norm)

    def set_schedule(self, lr: float, weight_decay: float) -> None:
        """This step's learning rate and weight decay (times each group's `wd_mult`)."""
        self.lr = lr
        for g in self._adam.param_groups if self._adam is not None else ():
            g["lr"], g["weight_decay"] = lr, weight_decay * g["wd_mult"]

    @torch.no_grad()
    def step(self) -> None:
        """AdamW on this rank's shard, then all-gather every bucket of the parameter buffer (left
        in flight with `overlap`)."""
        self.wait_for_params()  # the last step's gathers read the shard that AdamW now writes
        if self._adam is not None:
            self._adam.step()
        self._gather()
        if not self.overlap:
            self.wait_for_params()

    def _gather(self) -> None:
        """Cast the main shard into the parameter buffer (bf16/fp16) and start the all-gathers."""
        if self.main is not None and self._params:
            torch._foreach_copy_(self._params, self._masters)
        if self.grads.dp == 1:
            return
        # the last bucket first: the buffer is in reverse parameter order, so it holds what the next
        # forward reads first (the embedding, the first layers); collectives complete in issue order
        for b, (lo, hi) in reversed(list(zip(self.grads.buckets, self.shards, strict=True))):
            dst, src = self.buffer[b.start : b.end], self.buffer[lo:hi]
            self.gathers[b.index] = all_gather(dst, src, self.grads.group, async_op=True)

    def _pre_forward(self, buckets, module, args) -> None:
        self.wait_for_params(buckets)

    def wait_for_params(self, buckets=None) -> None:
        """Wait for the parameter all-gathers of `buckets` (bucket indices; default all) in flight."""
        for k in list(self.gathers) if buckets is None else buckets:
            work = self.gathers.pop(k, None)
            if work is not None:
                work.wait()

    def overlap_param_gather(self, model: torch.nn.Module) -> list:
        """From now on `step()` leaves the all-gathers in flight; each top-level part of `model`
        holding parameters of this buffer (the model's children and the entries of its module
        containers: `embed`, each `layers.K`, each `mtp.K`, ...) waits for the buckets of all the
        parameters under it in a forward pre-hook, so parameters read without their own module's
        forward (a router's weight, stacked expert weights) are covered too. The output layer and a
        tied embedding are read outside any forward: the model's `final_norm` (run just before
        them) waits for everything. The hooks are left out of torch.compile's graphs (a compiled
        layer breaks its graph once, at its start). Returns the hook handles."""
        self.overlap = True
        containers = (torch.nn.ModuleDict, torch.nn.ModuleList)
        tops = [(n, m) for n, m in model.named_children() if not isinstance(m, containers)]
        tops += [
            (f"{n}.{k}", m)
            for n, c in model.named_children()
            if isinstance(c, containers)
            for k, m in c.named_children()
        ]
        handles = []
        for name, module in tops:
            under = {self.grads._index[id(p)] for p in module.parameters() if id(p) in self.grads._index}
            if name == "final_norm":
                waits = None  # everything
            elif under:
                waits = sorted({self.grads.bucket_of[i] for i in under})
            else:
                continue
            hook = torch.compiler.disable(functools.partial(self._pre_forward, waits))
            handles.append(module.register_forward_pre_hook(hook))
        return handles

    def zero_grad(self) -> None:
        self.grads.zero_grad()

    # ------------------------------------------------------------------ state

    def set_step(self, step: int) -> None:
        """Adam's step count (bias correction), e.g. after loading a checkpoint."""
        if self._adam is not None:
            for state in self._adam.state.values():
                state["step"].fill_(float(step))

    def _global(self, index: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Global shape and offset of a parameter (from `placements`, name → Placement, set by the
        owner; a parameter not in it is whole)."""
        p, place = self.grads.params[index], self.placements.get(self.grads.names[index])
        return (place.global_shape, place.offset) if place else (tuple(p.shape), (0,) * p.ndim)

    def _flat_state(self) -> list[tuple[str | None, torch.Tensor]]:
        """(moment name, or None for the main weights; this rank's flat fp32 tensor) of every
        sharded state a checkpoint holds."""
        out: list[tuple[str | None, torch.Tensor]] = [(m, getattr(self, m)) for m in MOMENTS]
        return out + ([(None, self.main)] if self.main is not None else [])

    def _key(self, state: str | None, name: str) -> str:
        return name if state is None else moment_key(state, name)

    @torch.no_grad()
    def checkpoint_save_tensors(self) -> list[ShardedTensor]:
        """Collective over dp. Each parameter's moments (and with bf16/fp16 parameters its fp32
        main weights), whole, from the dp rank that writes them (parameter i: dp rank i % dp), on
        CPU; empty on the other ranks. Keys as one process's: `exp_avg.NAME`, `exp_avg_sq.NAME`
        (and `NAME` for the main weights: the caller's model group)."""
        g, out = self.grads, []
        states = self._flat_state()
        mine = {seg.index: seg for seg in self.segments}
        for i, p in enumerate(g.params):
            writer = i % g.dp
            if g.dp_rank == writer:
                full = torch.zeros(len(states), p.numel(), dtype=torch.float32, device=g.device)
                recvs = []
                for r in range(g.dp):
                    a, z = owned_range(g, i, r)
                    if z <= a:
                        continue
                    if r == g.dp_rank:
                        seg = mine[i]
                        for k, (_, t) in enumerate(states):
                            full[k, a:z] = t[seg.local : seg.local + seg.numel]
                    else:
                        buf = torch.empty(len(states), z - a, dtype=torch.float32, device=g.device)
                        recvs.append((dist.irecv(buf, dist.get_global_rank(g.group, r), g.group), buf, a, z))
                for work, buf, a, z in recvs:
                    work.wait()
                    full[:, a:z] = buf
                shape, offset = self._global(i)
                full = full.cpu()
                for k, (state, _) in enumerate(states):
                    out.append(ShardedTensor(self._key(state, g.names[i]), full[k].view_as(p), shape, offset))
            elif i in mine:
                seg = mine[i]
                piece = torch.stack([t[seg.local : seg.local + seg.numel] for _, t in states])
                dist.send(piece, dist.get_global_rank(g.group, writer), g.group)
        return out

    def checkpoint_load_targets(self) -> list[ShardedTensor]:
        """Targets for `load_checkpoint` (every moment of every parameter, so strict loading works,
        and the main weights as `checkpoint_save_tensors` names them): the rows covering this
        rank's flat range of each parameter (none where it owns nothing). Call `finish_load(step)`
        after loading."""
        g, out = self.grads, []
        mine = {seg.index: seg for seg in self.segments}
        self._load_targets = []
        for i, p in enumerate(g.params):
            shape, offset = self._global(i)
            seg = mine.get(i)
            for name, _ in self._flat_state():
                key = self._key(name, g.names[i])
                if p.ndim == 0:  # a scalar: every rank reads it
                    rows, at, start = torch.empty(()), offset, 0
                else:
                    row = math.prod(p.shape[1:])
                    r0, r1 = (seg.offset // row, -(-(seg.offset + seg.numel) // row)) if seg else (0, 0)
                    rows = torch.empty((r1 - r0, *p.shape[1:]), dtype=torch.float32)
                    at, start = (offset[0] + r0, *offset[1:]), (seg.offset - r0 * row if seg else 0)
                out.append(ShardedTensor(key, rows, shape, at))
                if seg:
                    self._load_targets.append((seg, name, rows, start))
        return out

    @torch.no_grad()
    def finish_load(self, step: int | None) -> None:
        """Copy the rows read through `checkpoint_load_targets()` into this rank's moments and main
        weights, and set the parameters from the main weights; `step` None: only the main weights
        were read (a weights-only checkpoint), the moments stay."""
        for seg, name, rows, start in self._load_targets:
            if step is None and name is not None:
                continue
            flat = (self.main if name is None else getattr(self, name))[seg.local : seg.local + seg.numel]
            flat.copy_(rows.flatten()[start : start + seg.numel])
        self._load_targets = []
        if step is not None:
            self.set_step(step)
        if self.main is not None:
            self.wait_for_params()
            self._gather()
            self.wait_for_params()
