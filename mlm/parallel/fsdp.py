"""Fully sharded data parallelism (ZeRO-3) with torch's FSDP2 (`fully_shard`), over dp × cp.

Applied to this rank's model once it is parallel, still on the meta device (`mlm.build`: only the
shards are then materialised and initialised, `mlm.model.init` drawing each shard's rows): each transformer
layer is one FSDP unit, the embedding another and the final norm with the output layer a third
(with tied embeddings, or under pipeline parallelism, the root holds the norm and output layer:
see below), the root the rest. FSDP2 treats each parameter as a whole tensor: here that is this
rank's tensor-parallel slice, split again along dim 0 over the dp × cp ranks (torch.chunk:
ceil(n / W) rows per rank, the last shorter or empty). So ZeRO-3 holds, per tensor-parallel
slice, 1 / (dp × cp) of the parameters, of the gradients and of Adam's state. HSDP
(`parallel.fsdp_shard_size` S) shards over groups of S consecutive dp × cp ranks and replicates
across the dp·cp / S groups: gradients are reduce-scattered in a group, then all-reduced across
the groups.

- Gradients reach every dp × cp rank's shard by reduce-scatter after each unit's last backward of
  the step (`FSDPGrads.set_last_microbatch` turns the reduction off for the micro-batches before).
- The reduction sums, then divides by dp × cp: FSDP2's averaging reduce-scatter silently sums on
  gloo (pytorch#162338), so the sum is forced and the division explicit (but for a one-rank shard
  group, HSDP's size 1 or experts at edp 1: there FSDP2 runs no reduce-scatter and divides by
  the factor itself, twice if the sum is forced).
- bf16 parameters (`train.param_dtype`): FSDP keeps the sharded parameters in fp32 (the main
  weights AdamW steps) and gathers them in bf16 for compute; gradients reduce in fp32.
- Prefetch: within a model chunk, each layer's forward starts the next layer's all-gather and
  each layer's backward the one before's (on a GPU, FSDP2's all-gather stream overlaps them
  with compute).
- The mesh's other groups work as without FSDP on the local shards: the sequence-parallel tp
  all-reduce, the global norm (each rank holds its shard: summed over dp × cp, and over pp).
- Pipeline parallelism: each stage shards its own layers; its model chunks share one root. The
  output layer belongs to the root there and `head_loss` is one of the root's forward methods:
  under interleaving a stage runs its last chunk's forward for the next micro-batch before the
  backward of the one before, and FSDP must gather the output layer again before the loss's
  backward reaches it (the pre-backward hook sits on the outputs of the unit's forward call).
  The tied embedding's two copies sum their sharded gradients (the same rows on both stages).
- Experts under expert parallelism are their own unit, inside their layer's, sharded over edp
  (the ranks holding the same experts); their reduction divides by dp × cp too, as their sum
  over edp counts each dp × cp replica once. At ep 1 they shard over dp × cp like any weight.
  The routers' expert bias (no gradient, its own update rule) is left whole on every rank.
- Not built yet, refused by the run config (`mlm.config.fsdp_refusals`): MTP layers, fp8,
  `train.compile`.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from mlm.errors import MlmError
from mlm.model.kinds.moe.experts import GroupedExperts
from mlm.parallel.mesh import Mesh


def fsdp_mesh(mesh: Mesh, device_type: str, shard_size: int | None = None):
    """The device mesh FSDP shards over: this rank's dp × cp ranks (1-D), or with `shard_size` S
    (HSDP) the same ranks as ("replicate", "shard") = (dp·cp / S, S), consecutive ranks sharding;
    None at dp × cp = 1 (nothing to shard). Collective: every rank calls it."""
    W = mesh.dp * mesh.cp
    if shard_size is not None and (W % shard_size or shard_size < 1):
        raise MlmError(
            f"parallel.fsdp_shard_size={shard_size} does not divide dp × cp = {W}; choose one of "
            f"{', '.join(str(d) for d in range(1, W + 1) if W % d == 0)}"
        )
    if W == 1:
        return None
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if shard_size is None or shard_size == W:
        return DeviceMesh.from_group(mesh.group("dp_cp"), device_type)
    # Megatron's rank order (tp fastest, then cp, dp, pp): a dp × cp group is one (pp, tp) column
    shape = (mesh.pp, W // shard_size, shard_size, mesh.tp)
    world = init_device_mesh(device_type, shape, mesh_dim_names=("pp", "replicate", "shard", "tp"))
    return world["replicate", "shard"]


def expert_mesh(mesh: Mesh, device_type: str):
    """The device mesh the experts shard over: this rank's edp group (the stage's ranks holding the
    same experts, `Mesh.expert_groups`), of size 1 where ep spans the stage. Collective."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = (mesh.pp, mesh.edp, mesh.ep)  # a stage's dp × cp × tp ranks folded as edp × ep, ep fastest
    return init_device_mesh(device_type, shape, mesh_dim_names=("pp", "edp", "ep"))["edp"]


def apply_fsdp(
    model: nn.Module,
    mesh: Mesh,
    device: torch.device,
    param_dtype: torch.dtype,
    reshard_after_forward: bool,
    shard_size: int | None = None,
) -> bool:
    """Shard `model` (fp32 parameters; on meta, to be materialised on `device` after, or already
    there) over dp × cp in place (or HSDP: over groups of `shard_size`, replicated across them),
    its experts under expert parallelism over edp; `param_dtype`: the compute dtype its units
    gather in. False (nothing done) at dp × cp = 1."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    device_type = device.type
    device_mesh = fsdp_mesh(mesh, device_type, shard_size)
    if device_mesh is None:
        return False
    policy = MixedPrecisionPolicy(
        param_dtype=None if param_dtype == torch.float32 else param_dtype, reduce_dtype=torch.float32
    )
    # the routers' selection-only expert bias: no gradient, updated whole by its own rule
    frozen = {p for p in model.parameters() if not p.requires_grad}

    def shard(module, reshard=reshard_after_forward, on=device_mesh):
        fully_shard(module, mesh=on, reshard_after_forward=reshard, mp_policy=policy, ignored_params=frozen)

    experts = expert_mesh(mesh, device_type) if mesh.ep > 1 else None
    expert_units = []
    for layer in model.layers.values():
        for module in layer.modules() if experts is not None else ():
            if isinstance(module, GroupedExperts):  # its own unit, inside the layer's
                shard(module, on=experts)
                expert_units.append(module)
        shard(layer)
    if not model.cfg.tie_embeddings and model.embed is not None:  # a pipeline stage may hold none
        shard(model.embed)
    if not model.cfg.tie_embeddings and model.output is not None and mesh.pp == 1:
        shard([model.final_norm, model.output], reshard=False)  # its backward follows at once
    shard(model, reshard=False)
    for method in ("hidden_states", "head_loss"):  # the pipeline's entries besides forward
        register_fsdp_forward_method(model, method)
    # prefetch: a layer's forward starts the next one's gather, its backward the one before's
    for chunk in model.chunks:
        layers = [model.layers[k] for k in chunk.layers]
        for before, after in itertools.pairwise(layers):
            before.set_modules_to_forward_prefetch([after])
            after.set_modules_to_backward_prefetch([before])
    W = mesh.dp * mesh.cp  # the experts' too: their sum over edp covers every dp × cp replica once
    for module in model.modules():
        if hasattr(module, "set_force_sum_reduction_for_comms"):
            shards = mesh.edp if module in expert_units else shard_size or W
            # a one-rank shard group runs no reduce-scatter, and forcing the sum there divides by
            # the factor twice (torch 2.13's single-rank path): it divides once by itself
            module.set_force_sum_reduction_for_comms(shards > 1)
            module.set_gradient_divide_factor(float(W))
    return True


class FSDPGrads:
    """The gradient interface the pipeline and the trainer drive (`GradBucketSet`'s), for FSDP:
    the reduction is FSDP's own, after each unit's backward of the step's last micro-batch."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.buckets: list = []

    def set_last_microbatch(self, last: bool) -> None:
        self.model.set_requires_gradient_sync(last)

    def finish(self) -> None:
        """Nothing left: each unit's reduce-scatter ran in its post-backward."""

    @staticmethod
    def grad_of(p: torch.Tensor) -> torch.Tensor | None:
        """This rank's shard of `p`'s reduced gradient (a view: in-place changes reach it)."""
        return None if p.grad is None else p.grad.to_local()

    def zero_grad(self) -> None:
        for p in self.model.parameters():
            p.grad = None


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a plain tensor as it is)."""
    return t.to_local() if hasattr(t, "to_local") else t


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole (tensor-parallel-local) tensor of an FSDP-sharded DTensor, gathered over dp × cp
    (collective); a plain tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def first_row(t: torch.Tensor) -> int:
    """The first row of the DTensor `t`'s shard in the whole tensor, as FSDP2 cut it (torch.chunk
    along dim 0 over the shard dim, the mesh's last: ceil(n / W) rows per rank)."""
    dim = t.device_mesh.ndim - 1  # HSDP's replicate dim comes first
    return t.device_mesh.get_local_rank(dim) * -(-t.shape[0] // t.device_mesh.size(dim))
