"""Megatron-core 0.16.1 as the reference for tests/test_convert_megatron.py: a tiny Llama-like
`GPTModel` (local spec, dense or MoE with the all-gather dispatcher) built on CPU with gloo, its
logits, and its weights saved with Megatron's own `dist_checkpointing.save` (torch_dist).

    logits = run_ranks(2, save_reference, out_dir, moe, ep)[0]   # tp = world / ep
    logits, common = run_ranks(2, load_reference, ckpt_dir, moe)[0]   # the same model, loaded from ckpt_dir

megatron-core runs on CPU given the patches of `apply_cpu_patches` (each says why); they change
process-wide state (e.g. torch.cuda.current_device), so they run only in the rank processes of
tests/distributed.py, never in the pytest process.
"""

from __future__ import annotations

import os
import queue
import warnings

import torch
import torch.nn.functional as F

VOCAB, SEQ, HIDDEN, HEADS, GROUPS, FFN, LAYERS = 128, 16, 64, 4, 2, 96, 2
NUM_EXPERTS, TOPK, MOE_FFN, SHARED_FFN = 4, 2, 48, 32


def apply_cpu_patches() -> None:
    """Make megatron-core 0.16.1's GPTModel forward and dist_checkpointing.save run without CUDA."""
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    import megatron.core.tensor_parallel.random as mrandom
    import megatron.core.transformer.moe.moe_utils as moe_utils
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fsa

    # P1: the RNG tracker (CudaRNGStatesTracker.add, and fork() around attention dropout in every
    # forward) reads and sets torch.cuda RNG states ("Torch not compiled with CUDA enabled"); keep
    # its logic on the CPU generator.
    def _add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_ or name in self.states_:
            raise Exception(f"rng state {name} / seed {seed} already exists")
        self.seeds_.add(seed)
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    mrandom._get_cuda_rng_state = lambda *_a, **_k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *_a, **_k: torch.set_rng_state(state)
    mrandom.CudaRNGStatesTracker.add = _add

    # P2: buffers all over the forward path (RoPE's inv_freq, the attention-score buffer, the tp
    # all-gathers, the MoE router and experts) are allocated on torch.cuda.current_device():
    # answer "cpu" (torch.cuda.is_available() stays False).
    torch.cuda.current_device = lambda: "cpu"

    # P3: the MoE router tests `te_general_gemm is not None`, a name moe_utils defines only when
    # Transformer Engine imports (NameError otherwise); None selects the torch matmul path.
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None

    # P4: every torch_dist save goes through FileSystemWriterAsync.preload_tensors(non_blocking=True),
    # which ends in torch.cuda.synchronize(); plain blocking copies need no synchronize.
    preload = fsa.FileSystemWriterAsync.preload_tensors
    fsa.FileSystemWriterAsync.preload_tensors = staticmethod(
        lambda write_buckets, non_blocking=True: preload(write_buckets, non_blocking=False)
    )

    # P5: the writer's results queue comes from a spawn-context multiprocessing.Manager, whose server
    # re-imports __main__ and dies under a test runner (EOFError). A synchronous save uses the queue
    # only in this process (the forked per-bucket writers report on their own queue): a queue.Queue.
    if fsa._results_queue is None:
        fsa._results_queue = queue.Queue()

    # P6: the forked writer measures its memory with psutil, not a megatron-core dependency; without
    # it the writer raises and the parent waits forever. Report 0 bytes instead.
    if not fsa.HAVE_PSUTIL:
        fsa._process_memory = lambda: 0


def _config(moe: bool, ep: int, gpt2: bool = False):
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
        params_dtype=torch.float32,
        use_cpu_initialization=True,
        bias_activation_fusion=False,  # the fusions are CUDA kernels
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
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


def _model(world: int, moe: bool, ep: int, mixed: bool = False, gpt2: bool = False):
    """GPTModel (seed 0) at tp = world / ep, in eval mode (model parallel state initialised).
    `mixed`: MoE in layer 1 only (moe_layer_freq [0, 1], a heterogeneous stack) with a gated shared
    expert of width SHARED_FFN. `gpt2`: a GPT-2-like model instead (LayerNorm, GeLU, biases,
    learned positions, tied output)."""
    apply_cpu_patches()
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    ps.initialize_model_parallel(tensor_model_parallel_size=world // ep, expert_model_parallel_size=ep)
    model_parallel_cuda_manual_seed(42)
    torch.manual_seed(0)
    config = _config(moe, ep, gpt2)
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
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        parallel_output=False,
        share_embeddings_and_output_weights=gpt2,
        position_embedding_type="learned_absolute" if gpt2 else "rope",
        rotary_base=10000,
    ).eval()


def perturb(model) -> None:
    """Move every parameter off its initial value (norms start at 1 and biases at 0, so a swapped
    norm or bias would not show); the same noise on every tp rank for a replicated tensor."""
    with torch.no_grad():
        for i, (_, param) in enumerate(sorted(model.named_parameters())):
            param.add_(0.05 * torch.randn(param.shape, generator=torch.Generator().manual_seed(i)))


def _logits(model) -> torch.Tensor:
    """The model's logits on `inputs()` (gathered over tp), [2, SEQ, VOCAB]."""
    pos = torch.arange(SEQ).expand(2, SEQ)
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None].expand(2, 1, SEQ, SEQ)
    with torch.no_grad():
        return model(inputs(), pos, mask)  # causal mask: True = masked


def save_reference(
    rank: int, world: int, out: str, moe: bool, ep: int = 1, gpt2: bool = False
) -> torch.Tensor:
    """Build GPTModel (seed 0, then `perturb`ed) at tp = world / ep (`gpt2`: see `_model`), save it
    with dist_checkpointing.save (torch_dist) into `out`, return its logits on `inputs()` (gathered
    over tp), [2, SEQ, VOCAB]."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    model = _model(world, moe, ep, gpt2=gpt2)
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
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    model = _model(world, moe, ep, mixed)
    torch.manual_seed(1)  # the loaded weights, not the seed-0 init, must give the logits
    for p in model.parameters():
        p.data.normal_()
    loaded = dist_checkpointing.load(model.sharded_state_dict(), src)
    common = {k: loaded.pop(k) for k in set(loaded) - set(model.state_dict())}
    model.load_state_dict(loaded, strict=True)
    logits = _logits(model)
    ps.destroy_model_parallel()
    return logits, common
