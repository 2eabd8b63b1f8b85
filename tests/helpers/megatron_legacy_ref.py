"""Megatron-core 0.16.1 writing Megatron-LM's legacy per-rank checkpoints (`--ckpt-format torch`),
the reference of tests/interop/megatron/test_megatron_legacy.py, in gloo rank processes (tests/helpers/distributed.py).

    logits = run_ranks(2, save_legacy, save_dir, moe, tp, pp, ep)  # logits on the last stage's tp rank 0

Each rank builds its part of the tiny GPTModel of tests/helpers/megatron_ref.py (its pipeline stage: the
first holds the embedding, the last the final norm and output layer; local layer numbers) and
saves what megatron/training/checkpointing.py's `generate_state_dict` writes (core_v0.16.1): `args`
(an argparse.Namespace holding Megatron's enums, as Megatron-LM's do), `checkpoint_version`,
`iteration`, `model` = `state_dict_for_save_checkpoint()`, `rng_state` (numpy arrays inside),
`opt_param_scheduler`, `num_floating_point_operations_so_far`, into
`iter_0000010/mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]/model_optim_rng.pt` (written by expert-data-
parallel rank 0) and `latest_checkpointed_iteration.txt`. The pipeline runs by hand: stage 0's
hidden states go to stage 1 (`set_input_tensor`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from tests.helpers.megatron_ref import (
    FFN,
    GROUPS,
    HEADS,
    HIDDEN,
    LAYERS,
    MOE_FFN,
    NUM_EXPERTS,
    SEQ,
    TOPK,
    VOCAB,
    _config,
    apply_cpu_patches,
    inputs,
    perturb,
    save_reference,
)

ITERATION, CONSUMED = 10, 640


def megatron_args(moe: bool, tp: int, pp: int, ep: int) -> argparse.Namespace:
    """The Namespace Megatron-LM saves for this run (the fields it re-reads with
    --use-checkpoint-args, the data position, and some that hold Megatron's enums)."""
    from megatron.core.enums import ModelType
    from megatron.core.transformer.enums import AttnBackend

    return argparse.Namespace(
        num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=HEADS,
        group_query_attention=True, num_query_groups=GROUPS, kv_channels=HIDDEN // HEADS,
        seq_length=SEQ, max_position_embeddings=SEQ, position_embedding_type="rope", rotary_base=10000,
        rotary_percent=1.0, rotary_interleaved=False, normalization="RMSNorm", norm_epsilon=1e-5,
        swiglu=True, add_bias_linear=False, add_qkv_bias=False, untie_embeddings_and_output_weights=True,
        apply_layernorm_1p=False, padded_vocab_size=VOCAB, make_vocab_size_divisible_by=128,
        vocab_size=None, num_experts=NUM_EXPERTS if moe else None, moe_router_topk=TOPK,
        moe_ffn_hidden_size=MOE_FFN if moe else None, moe_grouped_gemm=False,
        moe_token_dispatcher_type="allgather", tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=None,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=tp,
        decoder_first_pipeline_num_layers=None, decoder_last_pipeline_num_layers=None,
        params_dtype=torch.float32, bf16=False, fp16=False, ckpt_format="torch",
        use_distributed_optimizer=False, micro_batch_size=2, global_batch_size=64, iteration=ITERATION,
        consumed_train_samples=CONSUMED, consumed_valid_samples=0, skipped_train_samples=0,
        save=Path("/checkpoints/run"), attention_backend=AttnBackend.auto,
        model_type=ModelType.encoder_or_decoder,
    )  # fmt: skip


def save_legacy(rank: int, world: int, save: str, moe: bool, tp: int, pp: int, ep: int):
    """Build GPTModel (seed 0) at tp · pp · ep = world, save the legacy layout under `save`; the
    logits on `inputs()` from the last stage's tp rank 0 ([2, SEQ, VOCAB]), None elsewhere."""
    apply_cpu_patches()
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep
    )
    model_parallel_cuda_manual_seed(42)
    torch.manual_seed(0)
    stage, first, last = (
        ps.get_pipeline_model_parallel_rank(),
        ps.is_pipeline_first_stage(),
        ps.is_pipeline_last_stage(),
    )
    spec = get_gpt_layer_local_spec(
        num_experts=NUM_EXPERTS if moe else None, moe_grouped_gemm=False, normalization="RMSNorm"
    )
    model = GPTModel(
        config=dataclasses.replace(_config(moe, ep), pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32),
        transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ, pre_process=first,
        post_process=last, parallel_output=False, share_embeddings_and_output_weights=False,
        position_embedding_type="rope", rotary_base=10000,
    ).eval()  # fmt: skip
    perturb(model)
    ids = inputs()
    pos = torch.arange(SEQ).expand(2, SEQ)
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None].expand(2, 1, SEQ, SEQ)
    with torch.no_grad():
        if not first:  # stage 0 → stage 1 (pp = 2 at most here)
            hidden = torch.empty(SEQ, 2, HIDDEN)
            dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
        out = model(ids, pos, mask)  # causal mask: True = masked
        if not last:
            dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
    state = {
        "args": megatron_args(moe, tp, pp, ep),
        "checkpoint_version": 3.0,
        "iteration": ITERATION,
        "model": model.state_dict_for_save_checkpoint(),
        "rng_state": [
            {
                "random_rng_state": random.getstate(),
                "np_rng_state": np.random.get_state(),
                "torch_rng_state": torch.get_rng_state(),
                "cuda_rng_state": torch.get_rng_state(),
                "rng_tracker_states": {},
            }
        ],
        "opt_param_scheduler": {"max_lr": 3e-4, "lr_warmup_steps": 640, "num_steps": CONSUMED},
        "num_floating_point_operations_so_far": 1.5e12,
    }
    name = f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}"
    name += f"_{stage:03d}" if pp > 1 else ""
    name += f"_{ps.get_expert_model_parallel_rank():03d}" if ep > 1 else ""
    if ps.get_expert_data_parallel_rank() == 0:
        folder = Path(save) / f"iter_{ITERATION:07d}" / name
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(state, folder / "model_optim_rng.pt")
    if rank == 0:
        (Path(save) / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    keep = last and ps.get_tensor_model_parallel_rank() == 0
    ps.destroy_model_parallel()
    return out if keep else None


def save_torch_dist_with_args(rank: int, world: int, out: str) -> torch.Tensor:
    """tests/helpers/megatron_ref.py's torch_dist save (tp = world), then common.pt as Megatron-LM writes it
    beside the tensors: `args` (with Megatron's enums), `iteration`, `checkpoint_version`."""
    logits = save_reference(rank, world, out, False)
    if rank == 0:
        common = {
            "args": megatron_args(False, world, 1, 1),
            "iteration": ITERATION,
            "checkpoint_version": 3.0,
        }
        torch.save(common, os.path.join(out, "common.pt"))
    return logits
