"""`mlm convert --from-megatron` / `--to-megatron` with multi-latent attention, against Megatron-core.

A tiny `GPTModel` with MLA (MLATransformerConfig: query latent 24 or none, kv latent 20, per head 12
dims without RoPE + 8 with, values 10; YaRN 4× over 8 original positions; the local spec with the
latent norms) is built by megatron-core 0.16.1 on CPU (tests/megatron_ref.py, patches P1–P7b) and
saved with Megatron's own `dist_checkpointing.save`; mlm imports it and its `GPT` must give
GPTModel's logits to 1e-5 (fp32, absolute; measured 6.4e-7 at tp 2 with the query latent,
7.2e-7 without; rotate-half instead of interleaved RoPE, YaRN's original positions at 4096 or
mscale_all_dim 0 move them by 0.17, 0.04, 0.04).
"""

from __future__ import annotations

import argparse

import pytest
import torch

from mlm.checkpoint import read_group
from mlm.config import config_from_dict
from mlm.convert.megatron import import_megatron

from distributed import run_ranks  # noqa: E402
from megatron_ref import HEADS, MLA, SEQ, YARN, save_mla_reference  # noqa: E402
from test_convert_megatron import megatron, mlm_logits  # noqa: E402, F401 (megatron: the fixture)

TOL = 1e-5  # fp32 logits, absolute (max |logit| ≈ 1.6); measured 6.4e-7, 7.2e-7


def _args(q_lora: bool, mscale_all_dim: float) -> argparse.Namespace:
    """Megatron-LM's saved args of that run (its argument names; no original_max_position_embeddings:
    Megatron-LM has no such argument, so the test passes it with --set)."""
    return argparse.Namespace(
        num_attention_heads=HEADS, group_query_attention=False, num_query_groups=1, kv_channels=16,
        max_position_embeddings=SEQ, norm_epsilon=1e-5, rotary_base=10000, swiglu=True,
        position_embedding_type="rope", multi_latent_attention=True, qk_layernorm=True,
        **{**MLA, "q_lora_rank": MLA["q_lora_rank"] if q_lora else None},
        rope_type=YARN["rope_type"], rotary_scaling_factor=YARN["rotary_scaling_factor"],
        mscale=YARN["mscale"], mscale_all_dim=mscale_all_dim,
    )  # fmt: skip


@pytest.mark.parametrize(
    "q_lora, world, mscale_all_dim",
    [(True, 2, 1.0), (False, 1, 0.0)],
    ids=["q_lora-tp2", "q_proj-tp1"],
)
def test_import_mla_matches_gptmodel(
    megatron,  # noqa: F811
    tmp_path,
    q_lora,
    world,
    mscale_all_dim,
):
    src = tmp_path / "megatron"
    ref = run_ranks(world, save_mla_reference, str(src), q_lora, mscale_all_dim)[0]
    torch.save({"args": _args(q_lora, mscale_all_dim), "iteration": 0}, src / "common.pt")
    sets = [f"model.rope_original_max_position_embeddings={YARN['original_max_position_embeddings']}"]
    report = import_megatron(src, tmp_path / "out", sets)
    assert report.notes == []
    cfg = config_from_dict(read_group(tmp_path / "out")[1]["config"]).model
    assert cfg.attention_kind == "mla" and cfg.mla.rope_interleave
    dims = (cfg.mla.q_lora_rank, cfg.mla.kv_lora_rank, cfg.mla.qk_nope_head_dim, cfg.mla.qk_rope_head_dim)
    assert dims == (MLA["q_lora_rank"] if q_lora else None, 20, 12, 8)
    assert (cfg.rope_scaling_type, cfg.rope_scaling_factor, cfg.rope_yarn_mscale_all_dim) == (
        "yarn",
        4.0,
        mscale_all_dim,
    )
    diff = (mlm_logits(tmp_path / "out") - ref).abs().max().item()
    assert diff <= TOL, diff
