"""Data parallelism: gradients in one flat buffer, reduced over dp in buckets overlapped with backward.

Megatron's DistributedDataParallel idea. Every fp32 `param.grad` is a view into one contiguous fp32
buffer (autograd accumulates into it in place, micro-batch after micro-batch). A bf16/fp16
parameter (Megatron's `--bf16`: mixed precision with fp32 main weights) keeps no `.grad`: its
post-accumulate-grad hook adds each micro-batch's low-precision gradient into its fp32 view of the
buffer (Megatron's `main_grad`) and frees it. Whatever reads gradients after `finish()` reads
`grad(i)` / `grad_of(param)`, the fp32 views, whatever the parameters' dtype. The buffer is
laid out in reverse parameter order, the order backward produces gradients, and cut into buckets
of about `bucket_size_bytes`. On the last micro-batch of a step a post-accumulate-grad hook per
parameter notices when a bucket is complete and starts its asynchronous reduction while backward
goes on with the earlier layers; `finish()` starts whatever is left (buckets holding parameters
that got no gradient this step) and waits for all of it.

Buckets are launched strictly in index order on every rank, so all ranks issue the same sequence
of collectives even when they see gradients in different orders or use different parameters.

Per step, with `n` micro-batches:

    for i, batch in enumerate(micro_batches):
        grads.set_last_microbatch(i == n - 1)     # no communication before the last one
        (loss_fn(model, batch) / n).backward()
    grads.finish()                                # every bucket reduced and averaged over dp
    ... clip, optimizer step ...
    grads.zero_grad()                             # never optimizer.zero_grad(set_to_none=True)

With `reduce_scatter=True` (for `mlm.parallel.dist_optim.DistributedOptimizer`) each bucket is
padded to a multiple of lcm(dp, 128) elements and reduce-scattered: rank r then holds the reduced
gradient only in its r-th contiguous 1/dp of every bucket (`shard_range`); the rest of the buffer
keeps this rank's unreduced gradient and must not be read.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from mlm.errors import MlmError
from mlm.parallel.buckets import bucket_layout

# torch 2.13 renamed the tensor collectives and deprecated the old names; use whichever exists.
REDUCE_SCATTER = (
    "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
)
ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"

REDUCE_DTYPES = (torch.float32, torch.bfloat16)
PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group, async_op: bool = False):
    """`dist.reduce_scatter_tensor` under its current name (looked up at call time, for test counters)."""
    return getattr(dist, REDUCE_SCATTER)(output, input, group=group, async_op=async_op)


def all_gather(output: torch.Tensor, input: torch.Tensor, group, async_op: bool = False):
    """`dist.all_gather_into_tensor` under its current name (looked up at call time, for test counters)."""
    return getattr(dist, ALL_GATHER)(output, input, group=group, async_op=async_op)


@dataclass
class Bucket:
    """A contiguous range of the flat buffer, reduced with one collective."""

    index: int
    start: int
    end: int
    """Buffer range [start, end), padding included (a multiple of dp in reduce-scatter mode)."""
    params: list[int] = field(default_factory=list)
    """Indices into `GradBuckets.params` of the parameters whose gradients lie in this range."""

    @property
    def numel(self) -> int:
        return self.end - self.start


class GradBuckets:
    """One fp32 gradient buffer for `model`'s trainable parameters (fp32, bf16 or fp16), reduced over
    `dp_group` in buckets.

    `dp_group` None means dp = 1 (as `Mesh.dp_group` gives): nothing is communicated, and the
    buffer still backs `param.grad`, so the trainer runs the same code at any dp.
    `reduce_dtype` bfloat16 halves the traffic: a bucket is scaled by 1/dp, cast, reduced and cast
    back (Megatron's `--grad-reduce-in-bf16`). `average` divides by dp (the loss is a mean over
    this rank's share of the global batch, so the average is the global-batch gradient);
    `divisor` replaces the group size there (expert gradients are reduced over the expert-data-
    parallel group but averaged over all dp replicas). `names`: only these parameters (default
    every trainable one).
    """

    def __init__(
        self,
        model: nn.Module,
        dp_group=None,
        bucket_size_bytes: float = 25e6,
        reduce_dtype: torch.dtype = torch.float32,
        average: bool = True,
        reduce_scatter: bool = False,
        held: tuple[nn.Parameter, ...] = (),
        names: set[str] | None = None,
        divisor: int | None = None,
    ):
        if reduce_dtype not in REDUCE_DTYPES:
            raise MlmError(
                f"gradient reduce dtype {reduce_dtype}: must be one of "
                f"{', '.join(str(d) for d in REDUCE_DTYPES)}; use torch.float32 (exact) or torch.bfloat16"
            )
        if bucket_size_bytes <= 0:
            raise MlmError(
                f"bucket_size_bytes={bucket_size_bytes}: must be positive (Megatron uses 25e6–40e6)"
            )
        self.group = dp_group
        self.dp = dist.get_world_size(dp_group) if dp_group is not None else 1
        self.dp_rank = dist.get_rank(dp_group) if dp_group is not None else 0
        self.reduce_dtype = reduce_dtype
        self.average = average
        self.reduce_scatter = reduce_scatter
        self.divisor = divisor or self.dp

        named = [
            (n, p) for n, p in model.named_parameters() if p.requires_grad and (names is None or n in names)
        ]
        if not named:
            raise MlmError("the model has no trainable parameters; there is nothing to reduce")
        odd = [f"{n} ({p.dtype})" for n, p in named if p.dtype not in PARAM_DTYPES]
        if odd:
            raise MlmError(
                f"data parallelism keeps fp32, bf16 or fp16 parameters, but {', '.join(odd[:3])} "
                f"{'is' if len(odd) == 1 else 'are'} not; build the model in fp32 (train.param_dtype)"
            )
        devices = {p.device for _, p in named}
        if len(devices) != 1:
            raise MlmError(
                f"parameters on several devices {sorted(map(str, devices))}: move the model to one"
            )
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.device = devices.pop()
        self.held = {i for i, p in enumerate(self.params) if any(p is h for h in held)}
        self.low = {i for i, p in enumerate(self.params) if p.dtype != torch.float32}
        """Parameters in bf16/fp16: their fp32 gradient is only the buffer view (`grad(i)`)."""
        self._index = {id(p): i for i, p in enumerate(self.params)}

        # Layout: reverse parameter order (backward order); a bucket closes once it reaches the size.
        pad = math.lcm(self.dp, 128) if reduce_scatter else 1
        limit = max(1, int(bucket_size_bytes) // 4)  # fp32 elements
        self.ranges, layout = bucket_layout([p.numel() for p in self.params], limit, pad)
        self.buckets = [Bucket(k, s, e, members) for k, (s, e, members) in enumerate(layout)]
        self.numel = self.buckets[-1].end
        self.bucket_of = [0] * len(self.params)
        for b in self.buckets:
            for i in b.params:
                self.bucket_of[i] = b.index

        self.buffer = torch.zeros(self.numel, dtype=torch.float32, device=self.device)
        self.views = [self.buffer[s:e].view_as(p) for p, (s, e) in zip(self.params, self.ranges, strict=True)]
        self._attach_grads()
        self._hooks = [
            p.register_post_accumulate_grad_hook(functools.partial(self._grad_ready, i))
            for i, p in enumerate(self.params)
        ]
        self._last = True
        self._reset()

    # ------------------------------------------------------------------ layout

    def shard_range(self, bucket: Bucket, rank: int | None = None) -> tuple[int, int]:
        """Buffer range [lo, hi) of `rank`'s (default: this rank's) 1/dp of `bucket`."""
        rank = self.dp_rank if rank is None else rank
        size = bucket.numel // self.dp
        return bucket.start + rank * size, bucket.start + (rank + 1) * size

    def bucket_view(self, bucket: Bucket) -> torch.Tensor:
        return self.buffer[bucket.start : bucket.end]

    def grad(self, i: int) -> torch.Tensor:
        """The fp32 gradient of parameter `i` (its view of the buffer; `params[i].grad` too when the
        parameter is fp32)."""
        return self.views[i]

    def grad_of(self, p: torch.Tensor) -> torch.Tensor | None:
        """`grad(i)` of parameter `p`; None when `p` is not in this buffer."""
        i = self._index.get(id(p))
        return None if i is None else self.views[i]

    # ------------------------------------------------------------------ per step

    def set_last_microbatch(self, is_last: bool) -> None:
        """Whether the next backward is the step's last micro-batch (only then do buckets launch)."""
        self._last = is_last

    def finish(self) -> None:
        """Reduce every bucket not yet launched, wait for all, and leave the averaged gradients."""
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
            self._next += 1
        for work, tmp, target in self._inflight:
            if work is not None:
                work.wait()
            if tmp is not None:
                target.copy_(tmp)
        self._reset()

    def zero_grad(self) -> None:
        """Zero the buffer (and re-point any `param.grad` that something else replaced)."""
        assert not self._inflight, "zero_grad() during a reduction: call finish() first"
        self.buffer.zero_()
        self._attach_grads()

    # ------------------------------------------------------------------ internals

    def _attach_grads(self) -> None:
        for i, (p, v) in enumerate(zip(self.params, self.views, strict=True)):
            if i in self.low:  # torch refuses an fp32 .grad on a bf16 parameter: the hook adds into v
                p.grad = None
            elif p.grad is None or p.grad.data_ptr() != v.data_ptr():
                p.grad = v

    def _reset(self) -> None:
        self._pending = [set(b.params) for b in self.buckets]
        self._next = 0  # every bucket below this index has been launched
        self._inflight: list[tuple[object, torch.Tensor | None, torch.Tensor | None]] = []

    def _grad_ready(self, i: int, p: torch.Tensor) -> None:
        if i in self.low:  # this micro-batch's bf16/fp16 gradient, accumulated in fp32
            self.views[i].add_(p.grad)
            p.grad = None
        else:
            self._check_view(i, p)
        if not self._last or i in self.held:
            return
        b = self.bucket_of[i]
        assert b >= self._next, (
            f"the gradient of {self.names[i]} arrived after its bucket {b} was reduced: call "
            "set_last_microbatch(False) for all but the last micro-batch, "
            "and finish() once per step"
        )
        self._pending[b].discard(i)
        while self._next < len(self.buckets) and not self._pending[self._next]:
            self._launch(self.buckets[self._next])
            self._next += 1

    def _check_view(self, i: int, p: torch.Tensor) -> None:
        assert p.grad is not None and p.grad.data_ptr() == self.views[i].data_ptr(), (
            f"{self.names[i]}.grad is no longer a view of the gradient buffer (was it set to None by "
            "optimizer.zero_grad()?); zero gradients with GradBuckets.zero_grad()"
        )

    def _launch(self, bucket: Bucket) -> None:
        """Start the asynchronous reduction of one bucket (pre-scaled by 1/dp, as Megatron does)."""
        g = self.bucket_view(bucket)
        if self.average and self.divisor != 1:
            g.mul_(1.0 / self.divisor)
        if self.dp == 1:
            return
        lo, hi = self.shard_range(bucket)
        if self.reduce_dtype == torch.float32:
            if self.reduce_scatter:  # in place: the output is this rank's shard of the input
                work = reduce_scatter(self.buffer[lo:hi], g, self.group, async_op=True)
            else:
                work = dist.all_reduce(g, group=self.group, async_op=True)
            self._inflight.append((work, None, None))
            return
        low = g.to(self.reduce_dtype)
        if self.reduce_scatter:
            out = torch.empty(hi - lo, dtype=self.reduce_dtype, device=g.device)
            work = reduce_scatter(out, low, self.group, async_op=True)
            self._inflight.append((work, out, self.buffer[lo:hi]))
        else:
            work = dist.all_reduce(low, group=self.group, async_op=True)
            self._inflight.append((work, low, g))


class GradBucketSet:
    """Several `GradBuckets` driven as one by the pipeline and the trainer (dense gradients over
    dp, expert gradients over edp)."""

    def __init__(self, *buckets: GradBuckets | None):
        self.buckets = [b for b in buckets if b is not None]

    def set_last_microbatch(self, is_last: bool) -> None:
        for b in self.buckets:
            b.set_last_microbatch(is_last)

    def finish(self) -> None:
        for b in self.buckets:
            b.finish()

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.zero_grad()

    def grad_of(self, p: torch.Tensor) -> torch.Tensor | None:
        """The fp32 gradient of parameter `p` from whichever buffer holds it (None: none does)."""
        for b in self.buckets:
            if (g := b.grad_of(p)) is not None:
                return g
        return None
