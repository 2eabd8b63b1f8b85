"""What the Megatron tests share: the `megatron` fixture (a skip where megatron-core is absent),
the logit tolerance, the model's --set fields, mlm's logits on the reference's inputs, and small
checkpoints written without megatron (torch DCP, and mlm's own)."""

from __future__ import annotations

import importlib.util
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from mlm.checkpoint.manager import save_streaming
from mlm.config import load_config
from mlm.convert.megatron.dcp import MegatronCheckpoint, _Reader
from mlm.model.gpt import GPT
from tests.helpers.common import checkpoint_logits
from tests.helpers.megatron_ref import HEADS, SEQ, inputs

TOL = 1e-5  # fp32 logits, absolute (max |logit| ≈ 0.6); measured 1.6e-7 (dense), 1.2e-7 (MoE)
SETS = [f"model.num_attention_heads={HEADS}", f"model.max_position_embeddings={SEQ}"]

TINY = {  # the least a GPTModel checkpoint holds: embedding, one layer's qkv (4 heads of 1) and proj
    "embedding.word_embeddings.weight": torch.zeros(8, 4),
    "decoder.layers.self_attention.linear_qkv.weight": torch.zeros(1, 12, 4),
    "decoder.layers.self_attention.linear_proj.weight": torch.zeros(1, 4, 4),
}


@pytest.fixture
def megatron():
    """Skip where megatron-core is absent. Found, not imported: importing megatron.core registers
    its classes as torch.load safe globals in this process, which would hide a reader that needs
    them (the reference runs in rank processes only)."""
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        pytest.skip("megatron-core is not installed (pinned for Python 3.11: pip install -e '.[dev]')")


def mlm_logits(ckpt, tokens: torch.Tensor | None = None) -> torch.Tensor:
    """mlm's logits on `tokens` (default `inputs()`) from the checkpoint `ckpt`, every padded row."""
    return checkpoint_logits(ckpt, inputs() if tokens is None else tokens)


def write_dcp(path, tensors: dict) -> None:
    """`tensors` as a torch DCP checkpoint, written in this process."""
    with warnings.catch_warnings():  # "torch.distributed is disabled … save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(tensors, checkpoint_id=str(path), no_dist=True)


def mlm_checkpoint(path, sets: list[str], iteration: int = 5, extra_state: dict | None = None) -> dict:
    """An mlm checkpoint of GPT(sets) with random weights (init_weights(0)) at `iteration`, as
    `mlm train` would leave it for the model group (consumed_samples 40); returns its state."""
    config = load_config(None, sets)
    model = GPT(config.model, config.model.padded_vocab_size())
    model.init_weights(0)
    state = {**model.state_dict(), **(extra_state or {})}
    extra = {"config": config.to_dict(), "consumed_samples": 40}
    save_streaming(
        path, iteration, (("model", k, t, tuple(t.shape)) for k, t in state.items()), extra, ["model"]
    )
    return state


def dcp_entries(path) -> dict:
    """{key: the tensor, or 'bytes'} of a torch_dist directory, read with mlm's reader."""
    md = _Reader(path).read_metadata().state_dict_metadata
    ckpt = MegatronCheckpoint(path)
    return {k: "bytes" if isinstance(v, BytesStorageMetadata) else ckpt.read(k) for k, v in md.items()}
