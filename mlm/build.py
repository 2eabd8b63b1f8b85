"""This rank's part of the model: the plain GPT built on meta, then everything applied from
outside in a fixed order (torchtitan's `parallelize`):

    1. cut to this rank's pipeline stage        mlm.parallel.pipeline.split_for_pipeline
    2. tensor / sequence parallelism             mlm.parallel.parallelize (each module's tp_plan)
    3. expert parallelism (MoE layers)           mlm.parallel.expert
       context parallelism (attention)           mlm.parallel.context
    4. activation recompute, per layer           mlm.parallel.recompute
    5. materialise: only the local shards take memory

Used by training (then `init_weights`) and by serving (then `load_checkpoint` of `model_shards`).
Training then picks the kernels (`GPT.set_kernels`) and, with train.compile, compiles each layer
(`compile_layers`), last, as torchtitan does.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from mlm.config import ModelConfig, ParallelConfig
from mlm.model import GPT
from mlm.parallel.context import apply_context_parallel
from mlm.parallel.expert import apply_expert_parallel
from mlm.parallel.mesh import Mesh
from mlm.parallel.parallelize import parallelize
from mlm.parallel.pipeline import split_for_pipeline
from mlm.parallel.recompute import apply_recompute


def build_sharded(
    cfg: ModelConfig,
    parallel: ParallelConfig,
    mesh: Mesh,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
) -> GPT:
    """This rank's part of the plain GPT, allocated on `device` in `dtype` but not initialised."""
    with torch.device("meta"):
        model = GPT(cfg, padded_vocab=cfg.padded_vocab_size(mesh.tp)).to(dtype)
    split_for_pipeline(model, mesh, parallel)
    parallelize(model, mesh, parallel.sequence_parallel)
    apply_expert_parallel(model, mesh, parallel.sequence_parallel, cfg.moe.token_dispatcher)
    apply_context_parallel(model, mesh, parallel.cp_comm_type, parallel.sequence_parallel)
    apply_recompute(model, cfg.recompute)
    return model.to_empty(device=device)


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
def cast_trainable(model: nn.Module, dtype: torch.dtype) -> None:
    """Trainable parameters to `dtype` in place (train.param_dtype: after the fp32 init, so the
    weights are that init rounded); frozen ones (the MoE router's expert bias, updated by its own
    rule) and buffers stay as they are."""
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.to(dtype)
