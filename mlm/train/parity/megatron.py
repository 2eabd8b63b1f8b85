"""The megatron-core side of `mlm parity --against megatron`: megatron-core's own GPTModel, DDP,
Adam (`get_megatron_optimizer`, its weight-decay groups and clipping), `OptimizerParamScheduler`
and loss, trained on mlm's batches from mlm's seed checkpoint.

The runner (`mlm.train.parity.runner`) exports the seed to torch_dist (`mlm export megatron`) and
starts this module under torchrun (one process) with a spec file:

    python -m torch.distributed.run --standalone --nproc-per-node=1 -m mlm.train.parity.megatron OUT/megatron/spec.json

It builds the model from `megatron_args` of the run config (the export's own translation), loads
the seed, trains `steps` steps on the global batches `mlm train` reads (the same datasets and
sampler), evaluates as `mlm train` does, writes `steps.json` (loss, lr, grad norm per step, eval
loss) and saves the final weights as Megatron-LM does (`dist_checkpointing.save`, torch_dist, with
its args) into `ckpt/`. On CPU it applies the patches of `mlm.train.parity.megatron_cpu` first.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

from mlm.config import Config, load_config
from mlm.convert.megatron.args import megatron_args, scheduler_arguments
from mlm.convert.megatron.exporter import unsupported as export_unsupported
from mlm.datasets.builder import is_chat, parse_blend, run_datasets
from mlm.errors import MlmError
from mlm.train.schedule import lengths

SETTINGS = {
    "optimizer.warmup_offset": 0,
    "optimizer.weight_decay_exempt": "1d",
    "model.train_padded_vocab": True,
}
"""mlm's settings with Megatron-LM's semantics (docs/train.md, "Megatron-LM's schedule"), forced on the
mlm side of the comparison: the first step at lr_warmup_init, weight decay on every matrix
(the embedding's included), the loss over every padded vocabulary row."""

_ACTIVATIONS = ("swiglu", "gelu")
"""The model.activation values megatron-core's MLP computes as mlm does (silu gated, exact GELU)."""


def available() -> bool:
    return (
        importlib.util.find_spec("megatron") is not None
        and importlib.util.find_spec("megatron.core") is not None
    )


def unsupported(cfg: Config) -> list[str]:
    """What of the run `cfg` the megatron-core reference does not train as mlm does, each naming the field."""
    m, t, d = cfg.model, cfg.train, cfg.data
    out = export_unsupported(m)
    if m.mtp_num_layers:
        out.append(f"model.mtp_num_layers={m.mtp_num_layers}: the reference has no multi-token prediction")
    if m.activation not in _ACTIVATIONS:
        out.append(
            f"model.activation={m.activation}: megatron-core's GPTModel computes exact GELU, not the tanh form"
        )
    if t.precision != "fp32":
        out.append(
            f"train.precision={t.precision}: the reference trains in fp32 only (Megatron's bf16 keeps bf16 "
            "weights and fp32 main copies, mlm autocasts fp32 weights); compare with --set train.precision=fp32"
        )
    if t.fp8.format:
        out.append(f"train.fp8.format={t.fp8.format!r}: the reference trains in fp32 only")
    if t.resilience.skip_iterations or t.resilience.loss_spike_zscore:
        out.append("train.resilience.skip_iterations / loss_spike_zscore: the reference trains every step")
    o = cfg.optimizer
    warmup, decay, _ = lengths(o, t.train_iters, t.global_batch_size)
    if warmup >= decay:
        out.append(
            f"optimizer: a warm-up of {warmup:g} steps, a decay of {decay:g}: Megatron's scheduler needs the "
            "warm-up shorter than the decay"
        )
    if d.reset_position_ids or d.reset_attention_mask:
        out.append(
            "data.reset_position_ids / reset_attention_mask: the reference trains on whole sequences "
            "(Megatron-LM builds those masks outside megatron-core)"
        )
    if d.data_path and is_chat([p for _, p in parse_blend(d.data_path)]):
        out.append(
            f"data.data_path={d.data_path}: chat datasets (packed conversations, loss masks); the reference "
            "trains on plain token streams"
        )
    return out


def transformer_config(args: argparse.Namespace):
    """megatron-core's TransformerConfig for Megatron-LM `args` (as `megatron_args` writes them), as
    Megatron-LM's `core_transformer_config_from_args` builds it: every arg named as a config field,
    the renamed ones, fp32 parameters, and its CUDA-only fusions off."""
    import dataclasses

    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    kw = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    kw.update(
        num_moe_experts=args.num_experts,
        layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else F.gelu,
        params_dtype=torch.float32,
        use_cpu_initialization=True,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
    )
    return TransformerConfig(**kw)


def gpt_model(args: argparse.Namespace):
    """The GPTModel of `args` on megatron-core's local layer specs (`get_gpt_decoder_block_spec`:
    dense and MoE layers by moe_layer_freq), in one process: no tensor or pipeline parallelism."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    config = transformer_config(args)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=args.normalization)
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        parallel_output=True,  # as pretrain_gpt.py trains: the loss takes the logits in place
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        rope_scaling_factor=args.rope_scaling_factor,
    )


def megatron_optimizer(model, cfg: Config, total_iters: int):
    """(DDP-wrapped model, Megatron's optimizer, its OptimizerParamScheduler in samples) for mlm's
    optimizer settings, as Megatron-LM's `setup_model_and_optimizer` builds them (Adam; the
    distributed optimizer, gradients reduced in fp32)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    o = cfg.optimizer
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
    ddp = DistributedDataParallel(model.config, ddp_config, model)
    opt = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay, adam_beta1=o.adam_beta1,
            adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, clip_grad=o.clip_grad, use_distributed_optimizer=True,
        ),
        [ddp],
    )  # fmt: skip
    schedule = scheduler_arguments(o, total_iters, cfg.train.global_batch_size)
    return ddp, opt, OptimizerParamScheduler(opt, **schedule)


def _token_losses(model, tokens: torch.Tensor) -> torch.Tensor:
    """GPTModel's own per-token cross-entropy [b, s] for [b, s + 1] tokens (a causal mask: True = masked)."""
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    s = ids.shape[1]
    pos = torch.arange(s, device=ids.device).expand_as(ids)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=ids.device), diagonal=1)[None, None]
    return model(ids, pos, mask.expand(ids.shape[0], 1, s, s), labels=labels)


def _forward_step(data, model):
    """Megatron-LM's pretrain_gpt `forward_step`: the next micro-batch's per-token losses and its
    `loss_func` (the sum over every token, their number, and both to report)."""
    losses = _token_losses(model, next(data))

    def loss_func(output: torch.Tensor):
        loss = output.float().sum()
        tokens = torch.tensor(output.numel(), dtype=torch.int, device=output.device)
        return loss, tokens, {"lm loss": torch.cat([loss.detach().view(1), tokens.view(1)])}

    return losses, loss_func


def train_steps(ddp, opt, scheduler, steps, increment: int) -> dict[str, list[float]]:
    """Megatron-LM's `train_step`, once per entry of `steps` (each a list of [micro, s + 1] token
    micro-batches): megatron-core's own schedule (`get_forward_backward_func`: each micro-batch's
    loss over its tokens and their number, the MoE auxiliary losses scaled to match,
    `finalize_model_grads`), the optimizer step (clipping included), then the scheduler stepped by
    `increment` samples. {"loss" (over the global batch's tokens, as Megatron-LM logs it), "lr",
    "grad_norm"} per step."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ddp.config.finalize_model_grads_func = finalize_model_grads  # as Megatron-LM's train() sets them
    ddp.config.grad_scale_func = opt.scale_loss
    forward_backward = get_forward_backward_func()
    out = {"loss": [], "lr": [], "grad_norm": []}
    for micro in steps:
        ddp.zero_grad_buffer()
        opt.zero_grad()
        reports = forward_backward(
            forward_step_func=_forward_step, data_iterator=iter(micro), model=[ddp], num_microbatches=len(micro),
            seq_length=micro[0].shape[1] - 1, micro_batch_size=micro[0].shape[0], forward_only=False,
        )  # fmt: skip
        out["lr"].append(opt.param_groups[0]["lr"])
        applied, grad_norm, _ = opt.step()
        if not applied:
            raise MlmError("megatron-core's optimizer skipped a step (a non-finite gradient)")
        scheduler.step(increment=increment)
        loss, tokens = torch.stack([r["lm loss"] for r in reports]).sum(0).tolist()
        out["loss"].append(loss / tokens)
        out["grad_norm"].append(float(grad_norm))
    return out


def _evaluate(model, micro) -> float:
    """The mean over `micro` of each micro-batch's mean token loss, as `mlm train` evaluates."""
    model.eval()
    with torch.no_grad():
        losses = [float(_token_losses(model, tokens).float().mean()) for tokens in micro]
    model.train()
    return sum(losses) / len(losses)


def _batches(cfg: Config, steps: int, device: torch.device) -> tuple[list, list]:
    """([per step: its micro-batches], [the evaluation's micro-batches]) as `mlm train` reads them at dp 1."""
    from mlm.datasets.sampler import PretrainingSampler

    t = cfg.train
    splits = run_datasets(cfg, steps, build=False)
    per_step = t.global_batch_size // t.micro_batch_size

    def batch(dataset, indices):  # int64, as Megatron-LM's get_batch reads the tokens
        return torch.from_numpy(np.stack([dataset[int(i)] for i in indices]).astype(np.int64)).to(device)

    sampler = iter(PretrainingSampler(steps * t.global_batch_size, 0, t.micro_batch_size, 0, 1))
    train = [[batch(splits["train"], next(sampler)) for _ in range(per_step)] for _ in range(steps)]
    valid = splits.get("valid")
    m, g = t.micro_batch_size, t.global_batch_size
    evaluation = [] if valid is None else [
        batch(valid, range(start, start + m)) for i in range(t.eval_iters) for start in range(i * g, (i + 1) * g, m)
    ]  # fmt: skip
    return train, evaluation


def save_megatron(
    model, args: argparse.Namespace, iteration: int, save: Path, opt=None, scheduler=None
) -> None:
    """The run at `iteration` as Megatron-LM's save_checkpoint writes it (torch_dist, `args` in
    common.pt) into the save folder `save`: the model's weights, and with `opt` the distributed
    optimizer's state (fully_reshardable) and the scheduler's."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    folder = save / f"iter_{iteration:07d}"
    folder.mkdir(parents=True)
    md = None
    if opt is not None:
        md = {"distrib_optim_sharding_type": "fully_reshardable", "singleton_local_shards": False,
              "chained_optim_avoid_prefix": True, "distrib_optim_fully_reshardable_mem_efficient": True}  # fmt: skip
    msd = model.sharded_state_dict(prefix="", metadata=md)
    state = {"iteration": iteration, "checkpoint_version": 3.0, "model": msd,
             "args": argparse.Namespace(**{**vars(args), "iteration": iteration})}  # fmt: skip
    if opt is not None:
        state |= {"optimizer": opt.sharded_state_dict(msd, metadata=md), "num_floating_point_operations_so_far": 0,
                  "opt_param_scheduler": dict(scheduler.state_dict())}  # fmt: skip
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1)
    dist_checkpointing.save(state, str(folder), sharded_strategy=strategy, content_metadata=md)
    (save / "latest_checkpointed_iteration.txt").write_text(str(iteration))


def run(spec: dict) -> None:
    """Train the reference as `spec` says ({"config", "seed", "steps", "out"}), in this process."""
    import torch.distributed as dist

    cfg = load_config(spec["config"])
    device = torch.device("cuda" if cfg.train.device != "cpu" and torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        from mlm.train.parity.megatron_cpu import apply_cpu_patches, apply_optimizer_cpu_patches

        apply_cpu_patches()
        apply_optimizer_cpu_patches()
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method="env://")
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    model_parallel_cuda_manual_seed(cfg.train.seed)
    steps, out = int(spec["steps"]), Path(spec["out"])
    args = megatron_args(cfg, cfg.model.padded_vocab_size(), 0, 0)
    if device.type == "cpu" and getattr(args, "moe_token_dispatcher_type", None) == "alltoall":
        # its all-to-all dispatcher needs CUDA streams; in one process no token leaves the rank, and
        # the all-gather dispatcher computes the same token-expert pairs
        args.moe_token_dispatcher_type = "allgather"
    model = gpt_model(args)
    dist_checkpointing.load(model.sharded_state_dict(), spec["seed"])
    model = model.to(device).train()
    ddp, opt, scheduler = megatron_optimizer(model, cfg, steps)
    train, evaluation = _batches(cfg, steps, device)
    result = train_steps(ddp, opt, scheduler, train, cfg.train.global_batch_size)
    result["eval_loss"] = _evaluate(model, evaluation) if evaluation else None
    save_megatron(model, args, steps, out / "ckpt")
    (out / "steps.json").write_text(json.dumps(result, indent=1) + "\n")
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    run(json.loads(Path(sys.argv[1]).read_text()))
