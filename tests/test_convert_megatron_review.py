"""Review of issue 22's Megatron / torchtitan interop: bad input that once crashed with a traceback,
args whose meaning was dropped, bytes entries read outside the checkpoint reader. No megatron
import (the files are written with plain torch DCP)."""

from __future__ import annotations

import argparse
import datetime
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from mlm.convert.megatron import _args_overrides, import_megatron
from mlm.convert.megatron_dcp import MegatronCheckpoint
from mlm.errors import MlmError

TINY = {  # embedding, one layer's qkv (4 heads of 1) and proj
    "embedding.word_embeddings.weight": torch.zeros(8, 4),
    "decoder.layers.self_attention.linear_qkv.weight": torch.zeros(1, 12, 4),
    "decoder.layers.self_attention.linear_proj.weight": torch.zeros(1, 4, 4),
}
SETS = ["model.num_attention_heads=4"]


def _write_dcp(path, state: dict) -> None:
    with warnings.catch_warnings():  # "torch.distributed is disabled … save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=str(path), no_dist=True)


def test_truncated_metadata_is_an_mlm_error(tmp_path):
    _write_dcp(tmp_path / "ckpt", TINY)
    meta = tmp_path / "ckpt" / ".metadata"
    meta.write_bytes(meta.read_bytes()[:100])
    with pytest.raises(MlmError, match=r"\.metadata: not a readable torch DCP metadata file .*copy it again"):
        import_megatron(tmp_path / "ckpt", tmp_path / "out", SETS)
    assert not (tmp_path / "out").exists()


def test_common_pt_not_a_dict_is_an_mlm_error(tmp_path):
    _write_dcp(tmp_path / "ckpt", TINY)
    torch.save([1, 2], tmp_path / "ckpt" / "common.pt")
    with pytest.raises(MlmError, match=r"common\.pt: holds a list, not the dict Megatron's dist_checkpointing"):
        import_megatron(tmp_path / "ckpt", tmp_path / "out", SETS)
    assert not (tmp_path / "out").exists()
