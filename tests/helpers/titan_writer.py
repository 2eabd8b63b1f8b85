"""torchtitan's own trainer on CPU, writing the checkpoints tests/interop/torchtitan/test_convert_torchtitan.py imports.

    logits = run_ranks(2, train, out, corpus_jsonl, tokenizer_dir, 4, True, tokens)[0]
    # → out/checkpoint/step-3/ and step-6/ (model, AdamW state, lr_scheduler, train_state,
    #   dataloader), and rank 0's logits of torchtitan's model loaded back from step-6 on `tokens`
    moments = hf_moments(out / "checkpoint" / "step-6", 4, True)   # AdamW's moments, HF's layout

`train` runs torchtitan 0.3.0's `Trainer` on its llama3 `debugmodel` (6 layers, width 256, 16
heads, vocabulary 2048; `kv_heads` swaps in grouped-query attention with that many KV heads, `tied`
ties the output layer to the embedding, as torchtitan's Llama 3.2 1B and 3B do) for
6 steps of 2 × 64 tokens per rank, fused AdamW, checkpointing every 3 steps with the optimizer.
One rank uses torchtitan's default SPMD backend (`spmd_types`); more ranks shard the model with
FSDP under `full_dtensor`, since `spmd_types` hands plain tensors to torch 2.13's `fully_shard`
("all parameters must be DTensors on the full SPMD mesh").

torchtitan targets GPUs; `_cpu_patches` makes it run on CPU with gloo, in the rank processes only
(site-packages are not touched), each patch for a measured failure:
- the device: torchtitan.tools.utils takes `_get_available_device_type() or "cuda"`, and modules
  bind `device_type` / `device_module` at import: set to "cpu" / torch.cpu in every module;
- the memory monitor calls torch.cpu.get_device_name, which does not exist: a monitor of zeros;
- FlexAttention: torch's flex_attention refuses CPU inputs that need a gradient ("FlexAttention
  does not support backward on CPU"): attention is SDPA under the dense mask of the same BlockMask
  (`create_mask` of its mask_mod), the same function;
- `set_pg_timeouts` passes `device_ids=[torch.cpu.current_device()]` ("cpu") to a barrier, which
  takes ints: skipped (it only shortens the timeouts after the first step);
- FSDP: torchtitan sets the gradient divide factor to 1, which FSDP2 reduces with
  ReduceOp.PREMUL_SUM, which gloo lacks: force plain SUM (`set_force_sum_reduction_for_comms`).
The dataset is registered in torchtitan's DATASETS table (its documented way to add one), read
from the JSONL file into memory: no Hugging Face cache, no network.

The reference logits run torchtitan's model with `flex_attention` itself, uncompiled (forward
only, which flex_attention does on CPU), loaded as torchtitan's CheckpointManager loads: DCP into
`ModelWrapper.state_dict()` (the split wq / wk / wv), then `load_state_dict` (merged back).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy
import torch

STEPS, SEQ, BATCH = 6, 64, 2
HEADS, THETA = 16, 500000.0  # the debugmodel's n_heads and rope theta


def model_spec(kv_heads: int | None, tied: bool):
    """torchtitan's llama3 debugmodel spec; with `kv_heads`, its attention grouped into that many
    KV heads (make_gqa_config, fused as the debugmodel's); `tied`: enable_weight_tying."""
    from torchtitan.models import llama3
    from torchtitan.models.common.config_utils import make_gqa_config

    spec = llama3.model_registry("debugmodel")
    spec.model.enable_weight_tying = tied
    if kv_heads is not None:
        for layer in spec.model.layers:
            a = layer.attention
            layer.attention = make_gqa_config(
                dim=spec.model.dim,
                n_heads=a.n_heads,
                n_kv_heads=kv_heads,
                wqkv_param_init=llama3._LINEAR_INIT,
                wo_param_init=a.wo.param_init,
                inner_attention=a.inner_attention,
                rope=a.rope,
                fuse_qkv=True,
            )
    return spec


def _cpu_patches() -> None:
    import torch.nn.functional as F
    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.fsdp as fsdp
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.trainer  # noqa: F401  (imports the modules patched below)
    from torch.nn.attention.flex_attention import AuxOutput, create_mask
    from torchtitan.models.common.attention import FlexAttention

    for name, module in list(sys.modules.items()):
        if name.startswith("torchtitan") and getattr(module, "device_type", None) == "cuda":
            module.device_type, module.device_module = "cpu", torch.cpu

    class NoMemory:
        device_name = "cpu"

        def get_peak_stats(self):
            return metrics.DeviceMemStats(0, 0, 0, 0, 0, 0)

        def reset_peak_stats(self):
            pass

    metrics.build_device_memory_monitor = NoMemory

    def dense_attention(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux, kernel_options):
        assert score_mod is None and not return_aux.lse, "the debugmodel uses neither"
        mask = create_mask(block_mask.mask_mod, q.shape[0], 1, q.shape[2], k.shape[2], device=q.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
        return out, AuxOutput()

    FlexAttention._compiled_flex_attn = staticmethod(dense_attention)
    dist_utils.set_pg_timeouts = lambda **kwargs: None
    divide = fsdp.disable_fsdp_gradient_division

    def sum_reduction(model):
        divide(model)
        for m in model.modules():
            if isinstance(m, fsdp.FSDPModule):
                m.set_force_sum_reduction_for_comms(True)

    fsdp.disable_fsdp_gradient_division = sum_reduction


def _register_dataset(corpus_jsonl: Path) -> str:
    from datasets import Dataset
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS

    def load(path):
        return Dataset.from_list([json.loads(line) for line in Path(path).read_text().splitlines()])

    DATASETS["mlm_corpus"] = DatasetConfig(
        path=str(corpus_jsonl), loader=load, sample_processor=lambda sample: sample["text"]
    )
    return "mlm_corpus"


def train(
    rank: int,
    world_size: int,
    out: Path,
    corpus_jsonl: Path,
    tokenizer_dir: Path,
    kv_heads: int | None,
    tied: bool,
    tokens: torch.Tensor,
) -> numpy.ndarray | None:
    """One gloo rank of torchtitan's trainer (module docstring); rank 0 returns the logits of
    torchtitan's model loaded from the last checkpoint on `tokens` (1, T), as a numpy array (a
    tensor would travel as shared memory that dies with this process)."""
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    import torchtitan.models.llama3.config_registry as registry

    _cpu_patches()
    config = registry.llama3_debugmodel()
    config.model_spec = model_spec(kv_heads, tied)
    config.dump_folder = str(out)
    config.hf_assets_path = str(tokenizer_dir)
    config.dataloader.dataset = _register_dataset(corpus_jsonl)
    config.training.seq_len, config.training.local_batch_size, config.training.steps = SEQ, BATCH, STEPS
    config.checkpoint.enable, config.checkpoint.interval = True, 3  # last_save_model_only=False already
    config.validator.enable = False
    if world_size > 1:
        config.parallelism.spmd_backend = "full_dtensor"
    trainer = config.build()
    try:
        trainer.train()
    finally:
        trainer.close()
    if rank == 0:
        return logits(out / "checkpoint" / f"step-{STEPS}", kv_heads, tied, tokens).numpy()
    return None


def logits(step_dir: Path, kv_heads: int | None, tied: bool, tokens: torch.Tensor) -> torch.Tensor:
    """torchtitan's model on `tokens` (1, T), one document, with the weights of `step_dir`."""
    import torch.distributed.checkpoint as dcp
    from torch.nn.attention.flex_attention import flex_attention
    from torchtitan.components.checkpoint import ModelWrapper
    from torchtitan.models.common.attention import FlexAttention

    FlexAttention._compiled_flex_attn = flex_attention  # eager: torchtitan's own ROCm fallback
    with torch.device("meta"):
        model = model_spec(kv_heads, tied).model.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    wrapper = ModelWrapper(model)
    state = wrapper.state_dict()
    dcp.load(state, checkpoint_id=str(step_dir), no_dist=True)
    wrapper.load_state_dict(state)
    positions = torch.arange(tokens.shape[1]).unsqueeze(0)
    with torch.no_grad():
        masks = model.eval().get_attention_masks(positions=positions)
        return model(tokens, positions=positions, attention_masks=masks)


def hf_moments(
    step_dir: Path, kv_heads: int | None, tied: bool
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{HF name: (exp_avg, exp_avg_sq)} of the checkpoint's AdamW state, each fused wqkv moment
    split by torchtitan's FusedQKVLinear._split_qkv_on_save and every moment renamed and permuted
    by its Llama3StateDictAdapter.to_hf, as torchtitan takes the weights to Hugging Face."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torchtitan.models.common.attention import FusedQKVLinear
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

    md = dcp.FileSystemReader(str(step_dir)).read_metadata()
    state = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in md.state_dict_metadata.items()
        if k.startswith("optimizer.state.") and isinstance(m, TensorStorageMetadata) and len(m.size)
    }
    dcp.load(state, checkpoint_id=str(step_dir), no_dist=True)
    kv = kv_heads or HEADS
    fused = SimpleNamespace(head_dim=256 // HEADS, heads_per_kv=HEADS // kv, r_dim=HEADS // kv + 2)
    adapter = Llama3StateDictAdapter(model_spec(kv_heads, tied).model, None)
    out = {}
    for m in ("exp_avg", "exp_avg_sq"):
        moments = {
            k.removeprefix("optimizer.state.").removesuffix(f".{m}"): t
            for k, t in state.items()
            if k.endswith(f".{m}")
        }
        for key in [k for k in moments if k.endswith(".wqkv.weight")]:
            prefix = key.removesuffix("wqkv.weight")
            FusedQKVLinear._split_qkv_on_save(fused, moments, prefix, None)
        for name, t in adapter.to_hf(moments).items():
            out.setdefault(name, []).append(t)
    return {name: tuple(ts) for name, ts in out.items()}
