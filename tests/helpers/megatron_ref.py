"""Megatron-core 0.16.1 as the reference for tests/interop/megatron/test_megatron_import.py: a tiny Llama-like
`GPTModel` (local spec, dense or MoE with the all-gather dispatcher) built on CPU with gloo, its
logits, and its weights saved with Megatron's own `dist_checkpointing.save` (torch_dist).

    logits = run_ranks(2, save_reference, out_dir, moe, ep)[0]   # tp = world / ep
    logits, common = run_ranks(2, load_reference, ckpt_dir, moe)[0]   # the same model, loaded from ckpt_dir

`train_and_save` also runs Megatron's DDP and DistributedOptimizer (Adam), which need the patches
of `apply_optimizer_cpu_patches` on CPU. `save_mla_reference` / `load_mla_reference` do the same
for a GPTModel with multi-latent attention (patches P7, P7b of `apply_mla_local_patch`),
`save_mtp_reference` for one with multi-token prediction depths (its token and MTP losses).

megatron-core runs on CPU given the patches of `mlm.train.parity.megatron_cpu` (each says why);
they change process-wide state (e.g. torch.cuda.current_device), so they run only in the rank
processes of tests/helpers/distributed.py, never in the pytest process. `init_and_train` steps as
`mlm parity --against megatron` does (`mlm.train.parity.megatron.train_steps`), from Megatron-LM's
own arguments rather than mlm's config.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

import torch
import torch.nn.functional as F

from mlm.train.parity.megatron import save_megatron, train_steps
from mlm.train.parity.megatron_cpu import apply_cpu_patches, apply_optimizer_cpu_patches

VOCAB, SEQ, HIDDEN, HEADS, GROUPS, FFN, LAYERS = 128, 16, 64, 4, 2, 96, 2
NUM_EXPERTS, TOPK, MOE_FFN, SHARED_FFN = 4, 2, 48, 32


def _config(moe: bool, ep: int, gpt2: bool = False, dtype: torch.dtype = torch.float32):
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        ffn_hidden_size=FFN,
        normalization="RMSNorm",
        layernorm_epsilon=1e-5,
        gated_linear_unit=True,  # SwiGLU: linear_fc1 = [gate; up]
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=True,
        bias_activation_fusion=False,  # the fusions are CUDA kernels
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
    )
    if ps.get_pipeline_model_parallel_world_size() > 1:  # stages talk by plain isend / irecv (no cuda sync)
        kw.update(
            pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
            pipeline_dtype=dtype,
            batch_p2p_comm=False,
        )
    if gpt2:  # LayerNorm, GeLU (erf), biases
        kw.update(
            normalization="LayerNorm", gated_linear_unit=False, activation_func=F.gelu, add_bias_linear=True
        )
    if moe:
        kw.update(
            num_moe_experts=NUM_EXPERTS,
            moe_router_topk=TOPK,
            moe_ffn_hidden_size=MOE_FFN,
            moe_token_dispatcher_type="allgather",
            moe_aux_loss_coeff=0.0,
            moe_grouped_gemm=False,
            moe_router_dtype="fp32",
            expert_model_parallel_size=ep,
        )
    return TransformerConfig(**kw)


def inputs() -> torch.Tensor:
    """The [2, SEQ] token ids both sides run."""
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1234))


def _gpt(
    moe: bool,
    ep: int,
    vocab: int = VOCAB,
    dtype: torch.dtype = torch.float32,
    mixed: bool = False,
    gpt2: bool = False,
):
    """GPTModel (local spec, seed 0, parameters in `dtype`) on the initialised model-parallel state.
    `mixed`: MoE in layer 1 only (moe_layer_freq [0, 1], a heterogeneous stack) with a gated shared
    expert of width SHARED_FFN. `gpt2`: a GPT-2-like model instead (LayerNorm, GeLU, biases,
    learned positions, tied output)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(42)
    torch.manual_seed(0)
    config = _config(moe, ep, gpt2, dtype)
    spec = get_gpt_layer_local_spec(
        num_experts=NUM_EXPERTS if moe else None,
        moe_grouped_gemm=False,
        normalization="LayerNorm" if gpt2 else "RMSNorm",
    )
    if mixed:
        config.moe_layer_freq, config.moe_shared_expert_gate = [0, 1], True
        config.moe_shared_expert_intermediate_size = SHARED_FFN
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=vocab,
        max_sequence_length=SEQ,
        parallel_output=False,
        share_embeddings_and_output_weights=gpt2,
        position_embedding_type="learned_absolute" if gpt2 else "rope",
        rotary_base=10000,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
    )


def _model(world: int, moe: bool, ep: int, mixed: bool = False, gpt2: bool = False):
    """`_gpt` at tp = world / ep (the model-parallel state initialised here), in eval mode."""
    apply_cpu_patches()
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=world // ep, expert_model_parallel_size=ep)
    return _gpt(moe, ep, mixed=mixed, gpt2=gpt2).eval()


def perturb(model) -> None:
    """Move every parameter off its initial value (norms start at 1 and biases at 0, so a swapped
    norm or bias would not show); the same noise on every tp rank for a replicated tensor."""
    with torch.no_grad():
        for i, (_, param) in enumerate(sorted(model.named_parameters())):
            param.add_(0.05 * torch.randn(param.shape, generator=torch.Generator().manual_seed(i)))


def _forward_inputs(ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """GPTModel's (ids, positions, causal mask: True = masked) for [2, SEQ] ids."""
    pos = torch.arange(SEQ).expand(2, SEQ)
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None].expand(2, 1, SEQ, SEQ)
    return ids, pos, mask


def _logits(model) -> torch.Tensor:
    """The model's logits on `inputs()` (gathered over tp), [2, SEQ, VOCAB]."""
    with torch.no_grad():
        return model(*_forward_inputs(inputs()))


def save_reference(
    rank: int, world: int, out: str, moe: bool, ep: int = 1, gpt2: bool = False
) -> torch.Tensor:
    """Build GPTModel (seed 0, then `perturb`ed) at tp = world / ep (`gpt2`: see `_gpt`), save it
    with dist_checkpointing.save (torch_dist) into `out`, return its logits on `inputs()` (gathered
    over tp), [2, SEQ, VOCAB]."""
    return _perturb_and_save(_model(world, moe, ep, gpt2=gpt2), out)


def _perturb_and_save(model, out: str) -> torch.Tensor:
    """`perturb` the model, save it with dist_checkpointing.save (torch_dist) into `out`, leave
    the model-parallel state; its logits on `inputs()`."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    perturb(model)
    logits = _logits(model)
    os.makedirs(out, exist_ok=True)
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1)
    dist_checkpointing.save(model.sharded_state_dict(), out, sharded_strategy=strategy)
    ps.destroy_model_parallel()
    return logits


def load_reference(
    rank: int, world: int, src: str, moe: bool, ep: int = 1, mixed: bool = False
) -> tuple[torch.Tensor, dict]:
    """Build the same GPTModel (`mixed`: see `_model`) at tp = world / ep, load the torch_dist directory `src` into it with
    dist_checkpointing.load (every key of its sharded state dict, strictly); return its logits on
    `inputs()`, [2, SEQ, VOCAB], and the entries of `src`'s common.pt (which the load merges in)."""

    model = _model(world, moe, ep, mixed)
    return _load_strictly(model, src)


def _load_strictly(model, src: str) -> tuple[torch.Tensor, dict]:
    """Load the torch_dist directory `src` into `model` (its weights first scrambled, so the loaded
    ones must give the logits; every key of its sharded state dict, strictly), leave the
    model-parallel state; (its logits on `inputs()`, the entries of `src`'s common.pt)."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    torch.manual_seed(1)
    for p in model.parameters():
        p.data.normal_()
    loaded = dist_checkpointing.load(model.sharded_state_dict(), src)
    common = {k: loaded.pop(k) for k in set(loaded) - set(model.state_dict())}
    model.load_state_dict(loaded, strict=True)
    logits = _logits(model)
    ps.destroy_model_parallel()
    return logits, common


def _tp_gathered(local: torch.Tensor, name: str, param, gated: bool) -> torch.Tensor:
    """The whole tensor of which `local` is this tp rank's shard, by megatron-core's own marks on
    parameter `name` (`tensor_model_parallel`, `partition_dim`); a gated linear_fc1's shards are
    [gate_r; up_r] (mc/transformer/mlp.py's swiglu sharding)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    if not getattr(param, "tensor_model_parallel", False) or dist.get_world_size(group) == 1:
        return local
    shards = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, local.contiguous(), group=group)
    if gated and name.endswith("mlp.linear_fc1.weight"):
        halves = [s.chunk(2) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(shards, dim=param.partition_dim)


def _global(core, name: str) -> str:
    """Parameter `name` of this pipeline stage with its layer's global number (stages count from 0)."""
    m = re.match(r"decoder\.layers\.(\d+)\.(.+)", name)
    return (
        f"decoder.layers.{core.decoder.layers[int(m.group(1))].layer_number - 1}.{m.group(2)}" if m else name
    )


def train_and_save(rank: int, world: int, save: str, sharding: str, args, gpt2: bool = False) -> None:
    """Megatron-LM's training step and save, tiny: GPTModel (seed 0, `gpt2`: see `_gpt`; tp
    `args.tensor_model_parallel_size`, pp `args.pipeline_model_parallel_size` (default 1 each),
    dp = the rest of the world; vocab `args.padded_vocab_size`; with `args.bf16` bf16 parameters in a
    Float16Module, as Megatron-LM wraps them, and fp32 main params in the optimizer) under DDP +
    DistributedOptimizer (Adam with `args`' lr, betas, eps, weight decay, clip_grad;
    OptimizerParamScheduler with `args.lr_decay_style`, no warm-up), one step on the loss
    mean(logits²) of `inputs()` (at pp > 1 through Megatron's 1F1B schedule, one micro-batch;
    gradients finished by Megatron's `finalize_model_grads`), saved into `save/iter_0000001` as
    Megatron-LM's save_checkpoint does (model and optimizer sharded state dicts with the optimizer
    in `sharding`, iteration, args, opt_param_scheduler, content_metadata; with `sharding` "legacy"
    as `--ckpt-format torch` does: per (tp, pp) rank `mp_rank_XX[_YYY]/model_optim_rng.pt` with the
    model's `state_dict_for_save_checkpoint()` and the optimizer's `state_dict()`, and its
    `save_parameter_state` in `distrib_optim.pt`); then a second step on
    `inputs()` flipped, whose weights are saved (model only) into `save/after_step_2`.
    `save/reference.pt`: {"moments": {parameter name with its global layer number: {"exp_avg",
    "exp_avg_sq"}} after step 1, whole (each dp rank's shard placed by the optimizer's own range
    maps, summed over dp; tp shards joined by `_tp_gathered`; every stage's), "scheduler": its
    saved state}."""
    apply_cpu_patches()
    apply_optimizer_cpu_patches()
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.module import Float16Module

    tp, pp = getattr(args, "tensor_model_parallel_size", 1), getattr(args, "pipeline_model_parallel_size", 1)
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    core = _gpt(False, 1, args.padded_vocab_size, dtype, gpt2=gpt2).train()
    model = Float16Module(core.config, core) if args.bf16 else core
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True,
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=args.overlap_grad_reduce,  # buckets of args.ddp_bucket_size parameters
        bucket_size=args.ddp_bucket_size,
    )
    ddp = DistributedDataParallel(model.config, ddp_config, model)
    opt = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
            adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
            clip_grad=args.clip_grad, use_distributed_optimizer=True, bf16=args.bf16, params_dtype=dtype,
        ),
        [ddp],
    )  # fmt: skip
    steps = args.train_iters * args.global_batch_size  # the scheduler counts samples
    scheduler = OptimizerParamScheduler(
        opt, init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr, lr_warmup_steps=0, lr_decay_steps=steps,
        lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay, end_wd=args.weight_decay,
        wd_incr_steps=steps, wd_incr_style="constant",
    )  # fmt: skip

    def forward_step(data, model):  # Megatron's pipeline schedule's step: (output, its loss function)
        return model(*_forward_inputs(next(data))), lambda out: (out.float().pow(2).mean(), {})

    def step(ids: torch.Tensor) -> None:
        ddp.zero_grad_buffer()
        opt.zero_grad()
        if pp == 1:
            ddp(*_forward_inputs(ids)).float().pow(2).mean().backward()
        else:  # one micro-batch of both sequences through the 1F1B schedule
            get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter([ids]), model=[ddp], num_microbatches=1,
                seq_length=SEQ, micro_batch_size=2, forward_only=False,
            )  # fmt: skip
        finalize_model_grads([ddp])  # dp reduce-scatter; a tied embedding's grads summed over its stages
        applied, _, _ = opt.step()
        assert applied
        scheduler.step(increment=args.global_batch_size)

    step(inputs())
    inner = opt.chained_optimizers[0] if hasattr(opt, "chained_optimizers") else opt
    moments = {}
    for name, p in core.named_parameters():
        if name == "output_layer.weight" and core.share_embeddings_and_output_weights:
            continue  # the last stage's copy of a tied embedding (pp > 1), not in the checkpoint
        whole = {m: torch.zeros(p.numel()) for m in ("exp_avg", "exp_avg_sq")}
        if p in inner.model_param_group_index_map:  # this dp rank holds a shard of p
            span = inner._get_model_param_range_map(p)["param"]
            state = inner._get_main_param_and_optimizer_states(p)
            for m, t in whole.items():
                t[span.start : span.end] = state[m]
        for m, t in whole.items():
            dist.all_reduce(t, group=ps.get_data_parallel_group())
            moments.setdefault(_global(core, name), {})[m] = _tp_gathered(
                t.view(p.shape), name, p, core.config.gated_linear_unit
            )
    if pp > 1:  # every stage's moments on rank 0
        stages = [None] * pp
        dist.all_gather_object(stages, moments, group=ps.get_pipeline_model_parallel_group())
        moments = {k: v for stage in stages for k, v in stage.items()}
    md = {
        "distrib_optim_sharding_type": sharding,
        "singleton_local_shards": False,
        "chained_optim_avoid_prefix": True,
        "distrib_optim_fully_reshardable_mem_efficient": True,  # gathers with gloo, not send_tensor.cuda()
    }
    state = {
        "iteration": 1,
        "checkpoint_version": 3.0,
        "args": args,
        "opt_param_scheduler": dict(scheduler.state_dict()),
        "num_floating_point_operations_so_far": 0,
    }
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1)
    if sharding == "legacy":  # --ckpt-format torch: a rank file per (tp, pp) rank, written by dp rank 0
        folder = f"{save}/iter_0000001/mp_rank_{ps.get_tensor_model_parallel_rank():02d}"
        folder += f"_{ps.get_pipeline_model_parallel_rank():03d}" if pp > 1 else ""
        os.makedirs(folder, exist_ok=True)
        state.update(model=core.state_dict_for_save_checkpoint(), optimizer=opt.state_dict())
        if ps.get_data_parallel_rank() == 0:
            torch.save(state, f"{folder}/model_optim_rng.pt")
        opt.save_parameter_state(f"{folder}/distrib_optim.pt")  # gathered over dp, saved by dp rank 0
    else:
        msd = core.sharded_state_dict(prefix="", metadata=md)
        state.update(model=msd, optimizer=opt.sharded_state_dict(msd, metadata=md))
        os.makedirs(f"{save}/iter_0000001", exist_ok=True)
        dist_checkpointing.save(state, f"{save}/iter_0000001", sharded_strategy=strategy, content_metadata=md)
    if rank == 0:
        with open(f"{save}/latest_checkpointed_iteration.txt", "w") as f:
            f.write("1")
    step(inputs().flip(1))
    os.makedirs(f"{save}/after_step_2", exist_ok=True)
    dist_checkpointing.save(core.sharded_state_dict(), f"{save}/after_step_2", sharded_strategy=strategy)
    ps.destroy_model_parallel()
    if rank == 0:  # a file: tensors through the result queue need the (exited) rank process
        torch.save({"moments": moments, "scheduler": state["opt_param_scheduler"]}, f"{save}/reference.pt")


MLA = dict(q_lora_rank=24, kv_lora_rank=20, qk_head_dim=12, qk_pos_emb_head_dim=8, v_head_dim=10)
"""The tiny MLA of `save_mla_reference` (Megatron's names: qk_head_dim is the part without RoPE)."""
YARN = dict(rope_type="yarn", rotary_scaling_factor=4.0, original_max_position_embeddings=8, mscale=1.0)
"""Its YaRN: 4× over 8 original positions (SEQ = 16 reaches past them), mscale_all_dim as given."""


def apply_mla_local_patch() -> None:
    """Let megatron-core 0.16.1's multi-latent attention run on the local spec's core attention."""
    import megatron.core.transformer.multi_latent_attention as mla
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    # P7: MultiLatentAttention builds its core attention with k_channels / v_channels (query-key
    # and value head dims differ), which only Transformer Engine's attention accepts;
    # DotProductAttention sizes its output [s, b, heads · kv_channels]. Take them and size the
    # output by the value head dim (the scores follow the query and key tensors' own width).
    if getattr(DotProductAttention, "_mla_patched", False):
        return
    init = DotProductAttention.__init__

    def _init(self, *a, k_channels=None, v_channels=None, **k):
        init(self, *a, **k)
        if v_channels is not None:
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

    DotProductAttention.__init__ = _init
    DotProductAttention._mla_patched = True

    # P7b: without Transformer Engine its extension module still imports, with a MagicMock for
    # TELinear, so MultiLatentAttention's `HAVE_TE and isinstance(self.linear_proj, TELinear)` raises
    # TypeError: a class nothing is an instance of.
    if not isinstance(mla.TELinear, type):
        mla.TELinear = type("NoTELinear", (), {})


def _mla_gpt(q_lora: bool, mscale_all_dim: float, depths: int = 0, moe: bool = False):
    """GPTModel with multi-latent attention (MLATransformerConfig of `MLA` and `YARN`, the local
    spec with qk_layernorm: q_layernorm / kv_layernorm on the latents, as DeepSeek's), otherwise as
    `_gpt`'s dense model; `q_lora` False: queries straight from the hidden state (linear_q_proj);
    `depths` MTP depths as `_mtp_gpt`'s (vocabulary-parallel output then); `moe`: `_gpt`'s MoE MLP."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    model_parallel_cuda_manual_seed(42)
    torch.manual_seed(0)
    base = vars(_config(False, 1))
    fields = {k: base[k] for k in (
        "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "normalization",
        "layernorm_epsilon", "gated_linear_unit", "activation_func", "add_bias_linear", "hidden_dropout",
        "attention_dropout", "params_dtype", "use_cpu_initialization", "bias_activation_fusion",
        "masked_softmax_fusion", "persist_layer_norm", "bias_dropout_fusion", "apply_rope_fusion",
        "gradient_accumulation_fusion", "tensor_model_parallel_size",
    )}  # fmt: skip
    mla = {**MLA, "q_lora_rank": MLA["q_lora_rank"] if q_lora else None}
    mtp = dict(mtp_num_layers=depths, mtp_loss_scaling_factor=0.3) if depths else {}
    experts = {
        k: v for k, v in vars(_config(True, 1)).items() if k.startswith("moe_") or k == "num_moe_experts"
    }
    config = MLATransformerConfig(
        **fields, **mla, **YARN, **mtp, **(experts if moe else {}), mscale_all_dim=mscale_all_dim,
        qk_layernorm=True, rotary_base=10000,
    )  # fmt: skip
    assert config.tensor_model_parallel_size == ps.get_tensor_model_parallel_world_size()
    spec = get_gpt_layer_local_spec(
        num_experts=NUM_EXPERTS if moe else None, multi_latent_attention=True, qk_layernorm=True,
        normalization="RMSNorm",
    )  # fmt: skip
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        parallel_output=bool(depths),
        position_embedding_type="rope",
        mtp_block_spec=get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False) if depths else None,
    )


def save_mla_reference(
    rank: int, world: int, out: str, q_lora: bool, mscale_all_dim: float, moe: bool = False
) -> torch.Tensor:
    """`_mla_gpt` (`moe`: see there) at tp = world (seed 0, then `perturb`ed), saved with dist_checkpointing.save into
    `out`; its logits on `inputs()`, [2, SEQ, VOCAB]."""
    from megatron.core import parallel_state as ps

    apply_cpu_patches()
    apply_mla_local_patch()
    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    return _perturb_and_save(_mla_gpt(q_lora, mscale_all_dim, moe=moe).eval(), out)


def load_mla_reference(
    rank: int, world: int, src: str, q_lora: bool, mscale_all_dim: float
) -> tuple[torch.Tensor, dict]:
    """`_mla_gpt` at tp = world with the torch_dist directory `src` loaded (every key, strictly, as
    `load_reference`); its logits on `inputs()` and the entries of `src`'s common.pt."""
    from megatron.core import parallel_state as ps

    apply_cpu_patches()
    apply_mla_local_patch()
    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    model = _mla_gpt(q_lora, mscale_all_dim).eval()
    return _load_strictly(model, src)


def _mtp_gpt(depths: int):
    """`_gpt`'s dense model with `depths` multi-token prediction depths (the local spec's
    MultiTokenPredictionBlock: each depth a copy of the decoder's layer spec)."""
    import dataclasses

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(42)
    torch.manual_seed(0)
    config = dataclasses.replace(_config(False, 1), mtp_num_layers=depths, mtp_loss_scaling_factor=0.3)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        parallel_output=True,  # the losses take vocabulary-parallel logits (gathered ones count tp times)
        position_embedding_type="rope",
        rotary_base=10000,
        mtp_block_spec=get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False),
    )


def samples() -> torch.Tensor:
    """[2, SEQ + 1] tokens: `inputs()` and the token after (the labels are the sample shifted by one)."""
    return torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(1234))


def save_mtp_reference(
    rank: int, world: int, out: str, depths: int, mla: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_mtp_gpt` (`mla`: `_mla_gpt` with the query latent, mscale_all_dim 1) at tp = world (seed 0, then `perturb`ed), saved with dist_checkpointing.save into
    `out`; (its cross-entropy of every token of `samples()` [2, SEQ] and each depth's MTP loss
    [depths]: the mean cross-entropy over the positions with a label, as GPTModel's training
    forward logs it in MTPLossLoggingHelper's tracker; GPTModel with MTP needs labels, so it gives
    losses, not logits)."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    apply_cpu_patches()
    apply_mla_local_patch()
    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    model = _mla_gpt(True, 1.0, depths) if mla else _mtp_gpt(depths)
    perturb(model)
    tokens = samples()
    with torch.no_grad():  # training mode (the tracker logs then) without dropout
        loss = model.train()(*_forward_inputs(tokens[:, :SEQ]), labels=tokens[:, 1:])
    losses = MTPLossLoggingHelper.tracker["values"].clone()
    os.makedirs(out, exist_ok=True)
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1)
    dist_checkpointing.save(model.sharded_state_dict(), out, sharded_strategy=strategy)
    ps.destroy_model_parallel()
    return loss, losses


def init_and_train(
    rank: int,
    world: int,
    out: str,
    vocab: int,
    batches: list | None,
    args,
    save_at: int = 0,
    gpt2: bool = False,
) -> dict | None:
    """The tiny Llama-like GPTModel (`_gpt`, seed 0, `vocab` rows; `gpt2`: the GPT-2-like one) of
    Megatron-LM's pretraining:
    with `batches` None, its initial weights saved (torch_dist) into `out`; else those weights
    loaded from `out` and trained one step per entry of `batches` (each a list of [micro, SEQ + 1]
    token micro-batches) as Megatron-LM's `train_step` does at dp 1 (`mlm.train.parity.megatron.
    train_steps`: megatron-core's schedule and pretrain_gpt's loss function), DDP + Adam from
    `get_megatron_optimizer` (its weight-decay groups), clipping, and the OptimizerParamScheduler
    of `args` in samples, stepped after the optimizer. With `save_at`, after that many steps the run
    is saved as Megatron-LM's save_checkpoint saves it into `out`-resumed/iter_N (torch_dist, the
    distributed optimizer's state fully_reshardable, `args` with its consumed samples, the
    scheduler). Returns {"loss", "lr", "grad_norm"} per step."""
    apply_cpu_patches()
    apply_optimizer_cpu_patches()
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    core = _gpt(False, 1, vocab, gpt2=gpt2).train()
    if batches is None:
        os.makedirs(out, exist_ok=True)
        strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1)
        dist_checkpointing.save(core.sharded_state_dict(), out, sharded_strategy=strategy)
        ps.destroy_model_parallel()
        return None
    dist_checkpointing.load(core.sharded_state_dict(), out)
    core.output_layer.gather_output = (
        False  # parallel output, as pretrain_gpt.py trains (the loss works in place)
    )
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
    ddp = DistributedDataParallel(core.config, ddp_config, core)
    opt = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
            adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
            clip_grad=args.clip_grad, use_distributed_optimizer=True,
        ),
        [ddp],
    )  # fmt: skip
    gbs = args.global_batch_size
    scheduler = OptimizerParamScheduler(
        opt, init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * gbs, lr_decay_steps=args.lr_decay_iters * gbs,
        lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay, end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters * gbs, wd_incr_style="constant",
        wsd_decay_steps=args.lr_wsd_decay_iters * gbs, lr_wsd_decay_style=args.lr_wsd_decay_style,
    )  # fmt: skip
    first = train_steps(ddp, opt, scheduler, batches[:save_at], gbs)
    if save_at:
        consumed = argparse.Namespace(**{**vars(args), "consumed_train_samples": save_at * gbs})
        save_megatron(core, consumed, save_at, Path(f"{out}-resumed"), opt, scheduler)
    rest = train_steps(ddp, opt, scheduler, batches[save_at:], gbs)
    out_steps = {k: first[k] + rest[k] for k in first}
    ps.destroy_model_parallel()
    return out_steps


def scheduler_values(
    rank: int, world: int, cases: list[dict], steps: int, increment: int
) -> list[list[tuple]]:
    """megatron-core's OptimizerParamScheduler for each of `cases` (its keyword arguments, an
    optimizer of two groups with wd_mult 1 and 0 given here): (lr, the groups' weight decays)
    before each of `steps` optimizer steps, stepped by `increment` samples after each."""
    from types import SimpleNamespace

    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    out = []
    for kwargs in cases:
        groups = [{"wd_mult": 1.0}, {"wd_mult": 0.0}]
        scheduler = OptimizerParamScheduler(SimpleNamespace(param_groups=groups), **kwargs)
        values = []
        for _ in range(steps):
            values.append((groups[0]["lr"], groups[0]["weight_decay"], groups[1]["weight_decay"]))
            scheduler.step(increment)
        out.append(values)
    return out


def gdn_layer_outputs(rank: int, world: int, megatron_dir: str, mlm_dir: str, layer: int) -> tuple:
    """megatron-core 0.16.1's GatedDeltaNet (local spec: ColumnParallelLinear in_proj, torch RMSNorm
    out_norm, RowParallelLinear out_proj; SiLU, the model's --swiglu activation) holding the tensors
    of HybridModel layer `layer` as mlm's export wrote them (in_proj and conv1d joined from their
    pieces, as dist_checkpointing's split factory joins them), and mlm's `gdn` layer from the mlm
    checkpoint: their outputs on one input [37, 2, hidden], (Megatron's, mlm's). Megatron's gated delta
    rule runs its torch path (deterministic_mode); FLA's l2norm, absent on CPU, is x / √(Σx² + 1e-6)."""
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm import gated_delta_net as mg
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import TransformerConfig

    from mlm.checkpoint import read_group
    from mlm.config import config_from_dict
    from mlm.convert.megatron.dcp import MegatronCheckpoint
    from mlm.model.kinds.gdn.module import GatedDeltaNet

    apply_cpu_patches()
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    model_parallel_cuda_manual_seed(42)
    mg.HAVE_FLA, mg.l2norm = True, lambda x, eps=1e-6: x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)
    state, manifest, _ = read_group(mlm_dir)
    cfg = config_from_dict(manifest["config"]).model
    g = cfg.gdn
    config = TransformerConfig(
        num_layers=1, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        linear_num_key_heads=g.num_key_heads, linear_num_value_heads=g.num_value_heads,
        linear_key_head_dim=g.key_head_dim, linear_value_head_dim=g.value_head_dim,
        linear_conv_kernel_dim=g.conv_kernel, experimental_attention_variant="gated_delta_net",
        linear_attention_freq=1, activation_func=F.silu, normalization="RMSNorm", layernorm_epsilon=cfg.norm_eps,
        deterministic_mode=True, use_cpu_initialization=True, params_dtype=torch.float32,
    )  # fmt: skip
    sub = mg.GatedDeltaNetSubmodules(
        in_proj=ColumnParallelLinear, out_norm=WrappedTorchNorm, out_proj=RowParallelLinear
    )
    theirs = mg.GatedDeltaNet(
        config, sub, layer_number=1, pg_collection=ProcessGroupCollection.use_mpu_process_groups()
    )
    ckpt = MegatronCheckpoint(megatron_dir)
    prefix = f"decoder.layers.{layer}.self_attention."
    joined = {
        "in_proj.weight": torch.cat([ckpt.read(f"{prefix}in_proj.weight.{p}") for p in ("query", "key", "value", "z", "beta", "alpha")]),
        "conv1d.weight": torch.cat([ckpt.read(f"{prefix}conv1d.weight.{p}") for p in ("query", "key", "value")]),
        **{k: ckpt.read(prefix + k) for k in ("A_log", "dt_bias", "out_norm.weight", "out_proj.weight")},
    }  # fmt: skip
    theirs.load_state_dict(joined, strict=False)
    missing = {n for n, _ in theirs.named_parameters()} - set(joined)
    assert not missing, missing
    ours = GatedDeltaNet(cfg, layer)
    ours.load_state_dict(
        {
            k.removeprefix(f"layers.{layer}.attn."): v
            for k, v in state.items()
            if k.startswith(f"layers.{layer}.attn.")
        }
    )
    x = torch.randn(37, 2, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        # numpy: a tensor sent from a rank process lives in shared memory that goes with the process
        return theirs(x, attention_mask=None)[0].numpy(), ours(x.transpose(0, 1)).transpose(0, 1).numpy()
