"""Pipeline parallelism: stage partitioning, p2p between stages, and the schedule executor.

    with torch.device("meta"):
        model = GPT(cfg, padded_vocab=...)
    split_for_pipeline(model, mesh, parallel)   # keep this rank's layers (model.keep_chunks)
    parallelize(model, mesh, sequence_parallel) # then tensor parallelism, as without pipelining
    ...
    pipe = Pipeline(model, mesh, parallel.vpp)
    losses = pipe.train_step(micro_batches, loss_scale, grads)   # one schedule
    pipe.sync_tied_embedding()                  # before grads.finish(): first + last stage copies

Layers are split into pp × vpp virtual stages of consecutive layers; rank r holds virtual
stages r, r + pp, … (its model chunks). The first virtual stage also holds the embedding, the
last the final norm and output layer (and the MTP depths); with tied embeddings or MTP the last
stage holds a copy of the embedding whose gradient is summed with the first stage's before the
data-parallel reduction.

Activations flow forward and gradients backward as tensors of one shape known in advance,
[micro_batch, seq_length / sequence_shards, hidden] (the sequence shard under sequence
parallelism), with batched isend/irecv. They travel on two communicators per pipeline (one for
activations, one for gradients), so that on each link the order messages are sent in is the
order they are received in (every rank runs its forwards, and its backwards, in the same
micro-batch order), which NCCL needs and gloo then matches without tags.

The executor knows the model only through what every stage model provides (`mlm.model.GPT`
does): `chunks` (its model chunks, each `first` / `last`), `forward(x, chunk=c)` (tokens or
hidden states in, hidden states or logits out), `hidden_states` and `head_loss(h, labels, weights)` (the
last stage's loss), `mtp_losses(h, targets, ...)` when `cfg.mtp_num_layers` > 0, `keep_chunks`,
`tied_weight()`, `sequence_shards`, `padded_vocab`, `cfg`, and optionally `aux_losses`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from mlm.config import ParallelConfig
from mlm.datasets.documents import PackedBatch
from mlm.errors import MlmError
from mlm.model import Chunk
from mlm.model.kinds.mtp.module import MTPTargets
from mlm.parallel.context import whole_sequences, zigzag_indices
from mlm.parallel.mesh import Mesh
from mlm.parallel.schedules import Action, forward_only, schedule, stage_layer_counts
from mlm.parallel.tensor import gather_from_tp


def _inputs_shape(batch) -> tuple[int, int]:
    """[B, T] of a micro-batch's inputs."""
    if isinstance(batch, PackedBatch):
        return tuple(batch.inputs.shape)
    return batch.shape[0], batch.shape[1] - 1


# ---------------------------------------------------------------- partitioning
# (stage_layer_counts, the layers per virtual stage, lives in the torch-free schedules module)


def rank_chunks(counts: list[int], pp: int, rank: int) -> list[Chunk]:
    """The model chunks (virtual stages rank, rank + pp, …) of pipeline rank `rank`."""
    starts = [sum(counts[:s]) for s in range(len(counts))]
    return [
        Chunk(
            [str(i) for i in range(starts[s], starts[s] + counts[s])],
            first=s == 0,
            last=s == len(counts) - 1,
        )
        for s in range(rank, len(counts), pp)
    ]


def split_for_pipeline(model: torch.nn.Module, mesh: Mesh, parallel: ParallelConfig) -> torch.nn.Module:
    """Keep only this pipeline rank's layers (and the embedding / output where they belong), in
    place, on a meta or materialised model (`model.keep_chunks`); parameter names stay those of
    the whole model."""
    counts = stage_layer_counts(
        model.cfg.num_layers, mesh.pp, parallel.vpp, parallel.first_stage_layers, parallel.last_stage_layers
    )
    if mesh.pp > 1:
        model.keep_chunks(rank_chunks(counts, mesh.pp, mesh.pp_rank))
    return model


# ---------------------------------------------------------------- the executor


class Pipeline:
    """Runs the schedule of one pipeline rank: its model chunks, p2p to its neighbours.

    At pp = 1 the same code runs the no-pipelining schedule (gradient accumulation), with no p2p."""

    def __init__(self, model: torch.nn.Module, mesh: Mesh, vpp: int = 1):
        self.model, self.mesh, self.vpp = model, mesh, vpp
        self.pp, self.rank = mesh.pp, mesh.pp_rank
        self.stages = mesh.pp * vpp
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.hidden = model.cfg.hidden_size
        self.trace: list[tuple[Action, float, float]] = []
        """The last step's actions with their start and end (perf_counter seconds)."""
        self.peak_in_flight = 0
        """The most micro-batches whose activations this rank held at once during the last step."""
        self.work_clock = None
        """Optional timer of this rank's own work (`start()` / `stop()` around each training
        action, after its inputs arrived): `mlm.train.stragglers.WorkClock`."""
        self._positions: tuple[int, torch.Tensor] | None = None
        self.mtp_total: torch.Tensor | None = None
        """The last step's MTP losses per depth, summed over micro-batches (last stage; training)."""
        self.documents: Callable | None = None
        """Packed documents (`mlm.datasets.documents.DocumentLayout`): inputs → (document index,
        position) of every token; None: one document per sequence."""
        if mesh.pp == 1:
            return
        ranks = mesh.pipeline_ranks()
        self.prev, self.next = ranks[(self.rank - 1) % self.pp], ranks[(self.rank + 1) % self.pp]
        self.last_rank = ranks[-1]
        self.act_group = mesh.group("pp")
        self.grad_group = mesh.group("pp_grad")

    # ------------------------------------------------------------------ stage roles

    def _stage(self, chunk: int) -> int:
        return chunk * self.pp + self.rank

    def _context_positions(self, seq_length: int) -> torch.Tensor | None:
        """Under context parallelism, the positions of this rank's tokens (the zigzag split,
        `mlm.parallel.context`); else None."""
        if self.mesh.cp == 1:
            return None
        if self._positions is None or self._positions[0] != seq_length:
            idx = zigzag_indices(seq_length, self.mesh.cp, self.mesh.cp_rank, self.device)
            self._positions = (seq_length, idx)
        return self._positions[1]

    def _p2p_shape(self, seq_length: int, batch: int) -> tuple[int, int, int]:
        return (batch, seq_length // self.model.sequence_shards, self.hidden)

    # ------------------------------------------------------------------ p2p

    def _recv_op(self, a: Action, shape) -> tuple[torch.Tensor, dist.P2POp] | None:
        """The irecv that action `a` needs (activation from the previous stage for F, gradient
        from the next for B), or None."""
        s = self._stage(a.chunk)
        if self.pp == 1 or (s == 0 if a.kind == "F" else s == self.stages - 1):
            return None
        buf = torch.empty(shape, dtype=self.dtype, device=self.device)
        if a.kind == "F":
            return buf, dist.P2POp(dist.irecv, buf, self.prev, self.act_group)
        return buf, dist.P2POp(dist.irecv, buf, self.next, self.grad_group)

    @staticmethod
    def _start(ops: list[dist.P2POp], recv: dist.P2POp | None) -> tuple[list, list]:
        """Batched isend/irecv, one batch per communicator (torch batches within one group); the
        handles to wait on before using `recv`'s buffer, and those of the sends (waited at the end
        of the step). A backend that coalesces a batch (NCCL) gives one handle for all of it."""
        recv_works, send_works = [], []
        for group in {id(op.group): op.group for op in ops}.values():
            batch = [op for op in ops if op.group is group]
            works = dist.batch_isend_irecv(batch)
            if len(works) == len(batch):
                for op, w in zip(batch, works, strict=True):
                    (recv_works if op is recv else send_works).append(w)
            else:
                (recv_works if recv in batch else send_works).extend(works)
        return recv_works, send_works

    # ------------------------------------------------------------------ one step

    def run(
        self,
        actions: list[Action],
        micro_batches: list[torch.Tensor],
        loss_scale: float = 1.0,
        grads=None,
        autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        aux_scale: float | None = None,
    ) -> torch.Tensor:
        """Execute `actions` over `micro_batches` (tokens [B, T + 1] each, whose inputs are [:, :-1]
        and labels [:, 1:]; or `PackedBatch`es, whose loss is the weighted sum over their targets);
        return the sum of the micro-batch losses on the last stage (zero elsewhere), each
        computed by the model (`model.head_loss` of the last chunk's hidden states; in training,
        the multi-token prediction losses are added to the gradients and kept in `mtp_total`). With
        backwards, each loss is multiplied by `loss_scale` before its backward (auxiliary losses
        that the model's modules attach get `aux_scale`, by default the same factor:
        `model.aux_losses.scale`), and `grads` (GradBuckets) is told which backward is a chunk's
        last of the step."""
        num_micro = len(micro_batches)
        # context parallelism: this rank's tokens of each sequence, at their global positions
        B, T = _inputs_shape(micro_batches[0])
        positions = self._context_positions(T)
        T = T if positions is None else positions.numel()
        shape = self._p2p_shape(T, B)
        training = any(a.kind == "B" for a in actions)
        total = torch.zeros((), device=self.device)
        stash: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        sends: list = []
        self.trace, self.peak_in_flight = [], 0
        clock = self.work_clock if training else None
        aux = getattr(self.model, "aux_losses", None)
        if aux is not None:
            aux.scale = loss_scale if aux_scale is None else aux_scale
        depths = self.model.cfg.mtp_num_layers
        mtp_weight = self.model.cfg.mtp_loss_scaling_factor / max(depths, 1)
        self.mtp_total = torch.zeros(depths, device=self.device)

        def post(ops: list[dist.P2POp], recv_for: Action | None):
            pending = self._recv_op(recv_for, shape) if recv_for is not None else None
            recv_works, send_works = self._start(
                ops + [pending[1]] if pending else ops, pending and pending[1]
            )
            sends[:] = [w for w in sends if not w.is_completed()] + send_works  # a handle holds its tensor
            return (pending[0] if pending else None), recv_works

        buf, waits = post([], actions[0] if actions else None)
        for i, a in enumerate(actions):
            for w in waits:  # this action's input
                w.wait()
            start = time.perf_counter()
            if clock is not None:
                clock.start()
            s = self._stage(a.chunk)
            first, last = s == 0, s == self.stages - 1
            tokens = micro_batches[a.micro]
            weights = None
            if isinstance(tokens, PackedBatch):
                inputs, labels, weights = tokens.inputs, tokens.labels, tokens.weights
                documents, rope_positions = tokens.documents, tokens.positions
            else:
                inputs, labels = tokens[:, :-1], tokens[:, 1:]
                documents, rope_positions = self.documents(inputs) if self.documents else (None, None)
            # the tokens ahead for multi-token prediction, shifted before the cp split
            ahead = MTPTargets.of(tokens, depths, self.mesh.cp) if depths and last and training else None
            if positions is not None:  # this cp rank's share
                inputs, labels = inputs[:, positions], labels[:, positions]
                weights = weights[:, positions] if weights is not None else None
                ahead = ahead.split(positions) if ahead is not None else None
                documents = documents[:, positions] if documents is not None else None
                rope_positions = rope_positions[:, positions] if rope_positions is not None else positions
            ops: list[dist.P2POp] = []
            if a.kind == "F":
                x = inputs if first else buf
                if training and not first:
                    x.requires_grad_(True)
                with autocast(), contextlib.nullcontext() if training else torch.no_grad():
                    if last:
                        h = self.model.hidden_states(x, rope_positions, chunk=a.chunk, documents=documents)
                        loss = self.model.head_loss(h, labels, weights)
                        total += loss.detach()
                        if ahead is not None:
                            mtp = self.model.mtp_losses(h, ahead, rope_positions, documents)
                            self.mtp_total += mtp.detach()
                            loss = loss + mtp_weight * mtp.sum()
                        out = loss * loss_scale
                    else:
                        out = self.model(x, rope_positions, chunk=a.chunk, documents=documents)
                if not last:
                    if out.dtype != self.dtype or tuple(out.shape) != shape:
                        raise MlmError(
                            f"pipeline stage {s} produced {out.dtype} {tuple(out.shape)}, but stages pass "
                            f"{self.dtype} {shape}; keep the residual stream in the parameters' dtype"
                        )
                    ops.append(dist.P2POp(dist.isend, out.detach(), self.next, self.act_group))
                if training:
                    stash[(a.chunk, a.micro)] = (x, out)
                    self.peak_in_flight = max(self.peak_in_flight, len(stash))
            else:
                x, out = stash.pop((a.chunk, a.micro))
                if grads is not None:
                    grads.set_last_microbatch(a.micro == num_micro - 1)
                torch.autograd.backward(out, None if last else buf)
                if not first:
                    ops.append(dist.P2POp(dist.isend, x.grad, self.prev, self.grad_group))
            if clock is not None:
                clock.stop()
            self.trace.append((a, start, time.perf_counter()))
            buf, waits = post(ops, actions[i + 1] if i + 1 < len(actions) else None)
        for w in sends + waits:
            w.wait()
        assert not stash, f"pipeline schedule left {sorted(stash)} without a backward"
        return total

    def train_step(
        self, micro_batches, loss_scale=1.0, grads=None, autocast=contextlib.nullcontext, aux_scale=None
    ):
        actions = schedule(self.pp, self.rank, len(micro_batches), self.vpp)
        return self.run(actions, micro_batches, loss_scale, grads, autocast, aux_scale)

    def eval_step(self, micro_batches, autocast=contextlib.nullcontext):
        actions = forward_only(len(micro_batches), self.vpp)
        return self.run(actions, micro_batches, autocast=autocast)

    # ------------------------------------------------------------------ after backward

    def sync_tied_embedding(self, grad_of=None) -> None:
        """Sum the tied embedding's gradient over its first- and last-stage copies (before the
        data-parallel reduction: the copies are held out of it until `GradBuckets.finish`).
        `grad_of`: parameter → its fp32 gradient (`GradBucketSet.grad_of`; default `.grad`, which
        a bf16 parameter does not keep)."""
        tied = self.model.tied_weight()
        if tied is not None:  # middle stages hold no copy
            grad = grad_of(tied) if grad_of is not None else tied.grad
            dist.all_reduce(grad, group=self.mesh.group("embedding"))

    def sum_over_stages(self, t: torch.Tensor) -> torch.Tensor:
        """All-reduce (sum) over the pipeline: e.g. the loss, which only the last stage computes."""
        if self.pp > 1:
            dist.all_reduce(t, group=self.act_group)
        return t

    # ------------------------------------------------------------------ inference

    @torch.no_grad()
    def logits(self, tokens_BT: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits [B, T, V] of `tokens_BT` on every rank (gathered over tp, sent from
        the last stage to the others), in eval mode (no dropout): for sampling during training."""
        was_training = self.model.training
        self.model.eval()
        try:
            return self._logits(tokens_BT)
        finally:
            self.model.train(was_training)

    def _logits(self, tokens_BT: torch.Tensor) -> torch.Tensor:
        with whole_sequences(self.model):  # every rank runs the whole prompt, even under cp
            return self._whole_logits(tokens_BT)

    def _whole_logits(self, tokens_BT: torch.Tensor) -> torch.Tensor:
        x: torch.Tensor = tokens_BT
        shape = self._p2p_shape(tokens_BT.shape[1], tokens_BT.shape[0])
        sends = []
        for chunk in range(self.vpp):
            s = self._stage(chunk)
            if s > 0:
                x = torch.empty(shape, dtype=self.dtype, device=self.device)
                dist.recv(x, self.prev, group=self.act_group)
            x = self.model(x, chunk=chunk)
            if s < self.stages - 1:
                sends.append(dist.isend(x, self.next, group=self.act_group))
        for w in sends:
            w.wait()
        if self.pp == 1:
            return gather_from_tp(x, self.mesh)
        B, T = tokens_BT.shape
        out = gather_from_tp(x, self.mesh) if self.rank == self.pp - 1 else None
        if out is None:
            out = torch.empty((B, T, self.model.padded_vocab), dtype=self.dtype, device=self.device)
        dist.broadcast(out, self.last_rank, group=self.act_group)
        return out
