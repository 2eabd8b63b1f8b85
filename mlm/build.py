"""This rank's model, built one way for training, evaluation, serving, `mlm generate`, dry runs
and benches (`build_rank_model`), in one order:

    1. the plain GPT on the meta device      nothing is allocated before the rank's shapes are known
    2. cut to this rank's pipeline stage     the layers it drops are never parallelized or allocated
    3. tensor / sequence parallelism         each module's tp_plan (`mlm.parallel.parallelize`):
                                             the layers the next steps see are the sharded ones
    4. expert parallelism                    its ep_plan (`mlm.parallel.expert`): needs tp's
                                             sequence split, and shards the experts still on meta
    5. context parallelism                   its cp_attention (`mlm.parallel.context`); it also
                                             overrides the sp_group tp set, so it comes after tp
    6. activation recompute                  wraps each layer's forward (`mlm.parallel.recompute`):
                                             a checkpointed forward reruns whatever the layer runs,
                                             the parallel layers' collectives included
    7. fsdp                                  parallel.fsdp: the parameters sharded over dp × cp,
                                             the experts over edp, still on meta
                                             (`mlm.parallel.fsdp`; fp32, gathered in param_dtype)
       materialise                           only the local shards take memory (`to_empty`), then
                                             each rank draws its own slices (`init_weights`) or the
                                             caller loads a checkpoint; train.param_dtype's cast
    8. fp8                                   the layers' linears, once parallel and initialised (its
                                             scaling state lives on the device)
    9. ops                                   the kernels and attention backend (`Ops`): one choice
                                             every module shares, made once the modules exist
   10. compile                               last (`compile_layers`): it traces what all of the
                                             above made, as torchtitan compiles after parallelize

(torchtitan's `parallelize` order; Megatron builds the parallel layers into the model instead.)
"""

from __future__ import annotations

import os

import torch
from torch import nn

from mlm.config import ModelConfig, ParallelConfig, TrainConfig
from mlm.model import GPT
from mlm.parallel.context import apply_context_parallel
from mlm.parallel.expert import apply_expert_parallel
from mlm.parallel.fp8 import apply_fp8
from mlm.parallel.fsdp import apply_fsdp
from mlm.parallel.mesh import Mesh
from mlm.parallel.parallelize import parallelize
from mlm.parallel.pipeline import split_for_pipeline
from mlm.parallel.recompute import apply_recompute
from mlm.units import DTYPES


def build_rank_model(
    cfg: ModelConfig,
    parallel: ParallelConfig,
    mesh: Mesh,
    device: torch.device,
    *,
    dtype: torch.dtype = torch.float32,
    seed: int | None = None,
    train: TrainConfig | None = None,
) -> GPT:
    """This rank's part of the model (see the module doc for the order and why).

    `device` "meta": shapes only (dry runs, the planner's checks, benches); else allocated there
    in `dtype`. `seed`: initialise (each rank its own slices of one process's init); None: leave
    the weights empty for the caller to load. `train`: training's choices (train.param_dtype,
    train.fp8, train.compile); its fp8 state is `model.fp8` (None without fp8). Parameters in
    train.param_dtype are built in it: the init draws in fp32 and rounds each block as it copies
    it (the fp32 init rounded, without ever holding it), and the frozen ones (the MoE routers'
    expert bias, updated by its own rule) stay fp32."""
    fsdp = train is not None and parallel.fsdp
    if train is not None and train.param_dtype != "fp32" and not fsdp:
        dtype = DTYPES[train.param_dtype]
    with torch.device("meta"):
        model = GPT(cfg, padded_vocab=cfg.padded_vocab_size(mesh.tp)).to(dtype)
    split_for_pipeline(model, mesh, parallel)
    parallelize(model, mesh, parallel.sequence_parallel)
    apply_expert_parallel(model, mesh, parallel.sequence_parallel, cfg.moe.token_dispatcher)
    apply_context_parallel(model, mesh, parallel.cp_comm_type, parallel.sequence_parallel)
    apply_recompute(model, cfg.recompute)
    model.fp8, model.fsdp = None, False
    if device.type == "meta":  # shapes only: nothing to materialise, run or compile
        return model
    model.fsdp = fsdp and apply_fsdp(  # on meta: only the shards are materialised
        model,
        mesh,
        device,
        DTYPES[train.param_dtype],
        parallel.fsdp_reshard_after_forward,
        parallel.fsdp_shard_size,
    )
    model.to_empty(device=device)
    if seed is not None:
        model.init_weights(seed)
    keep_frozen_fp32(model)
    model.fp8 = apply_fp8(model, train, mesh, device) if train is not None else None
    model.set_attention_backend(cfg.attention_backend, device)
    model.set_kernels(cfg.kernels, device)
    if train is not None and train.compile:
        compile_layers(model)
    return model


def compile_layers(model: GPT) -> list[str]:
    """torch.compile each transformer layer of `model` (and each MTP depth's layer) in place, as
    torchtitan does: `module.compile()` compiles the module's call, its hooks included, and leaves
    its parameters, their names and their gradient hooks untouched, so checkpoints and the
    data-parallel reduction see the same model. Layers of one kind share their compiled code
    (the parameters are graph inputs). Compilation happens at the first call; call this after
    parallelism, recompute and the kernel choice. Returns the names of the compiled modules.

    Two settings make the pieces compose:
    - activation recompute (`mlm.parallel.recompute`) counts its calls to tell the rerun from the
      forward; traced by dynamo, the checkpoint becomes part of the graph and the rerun happens in
      the compiled backward without running Python again, so the counting side effect need not
      be replayed there (`skip_fwd_side_effects_in_bwd_under_checkpoint`; without it dynamo
      gives up on the whole layer and it runs eagerly);
    - Triton kernels under the interpreter (TRITON_INTERPRET=1, CPU tests) run as Python that
      dynamo cannot trace: their launches are left out of the graphs (a graph break each). On a
      GPU dynamo captures the launches of the compiled kernels itself.
    """
    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    if os.environ.get("TRITON_INTERPRET") == "1" and model.ops.kernels == "triton":
        from triton.runtime.interpreter import InterpretedFunction

        if not hasattr(InterpretedFunction.run, "_torchdynamo_disable"):
            InterpretedFunction.run = torch.compiler.disable(InterpretedFunction.run)
    compiled = []
    for key, layer in model.layers.items():
        layer.compile()
        compiled.append(f"layers.{key}")
    for key, depth in (model.mtp or {}).items():
        depth.layer.compile()
        compiled.append(f"mtp.{key}.layer")
    return compiled


@torch.no_grad()
def keep_frozen_fp32(model: nn.Module) -> None:
    """The parameters that never train (the MoE router's selection-only expert bias, updated by its
    own rule in fp32) back to fp32 in place, whatever the others' dtype."""
    for p in model.parameters():
        if not p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()
