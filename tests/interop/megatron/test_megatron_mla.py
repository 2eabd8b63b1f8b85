"""`mlm convert from-megatron` / `mlm export megatron` with multi-latent attention, against Megatron-core.

A tiny `GPTModel` with MLA (MLATransformerConfig: query latent 24 or none, kv latent 20, per head 12
dims without RoPE + 8 with, values 10; YaRN 4× over 8 original positions; the local spec with the
latent norms) is built by megatron-core 0.16.1 on CPU (tests/helpers/megatron_ref.py, patches P1–P7b) and
saved with Megatron's own `dist_checkpointing.save`; mlm imports it and its `GPT` must give
GPTModel's logits to 1e-5 (fp32, absolute; measured 4.2e-7 at tp 2 with the query latent, MoE
layers and Megatron-LM's args, 7.2e-7 dense without either; rotate-half instead of interleaved
RoPE moves them by 0.30 / 0.18, YaRN's original positions at 4096 by 0.03 / 0.04, mscale_all_dim 0
instead of 1 by 0.02). The other way, an mlm MLA checkpoint exported
with mlm export megatron loads (strictly) into that GPTModel with mlm's logits to 1e-5 (measured 1.5e-6
at tp 2, 1.6e-6 at tp 1; max |logit| ≈ 3), and a GPTModel save imported and exported again equals
it bitwise. Without megatron: the MLA args mlm follows or refuses, and the export's refusals.
"""

from __future__ import annotations

import argparse
import re

import pytest
import torch
import torch.nn.functional as F

from mlm.checkpoint import read_group
from mlm.config import config_from_dict
from mlm.convert.megatron.exporter import export_megatron
from mlm.convert.megatron.importer import args_overrides, import_megatron
from mlm.errors import MlmError
from mlm.model.gpt import GPT
from mlm.model.kinds.mtp.module import MTPTargets
from tests.helpers.distributed import run_ranks  # noqa: E402
from tests.helpers.megatron_helpers import dcp_entries, megatron, mlm_checkpoint, mlm_logits  # noqa: E402, F401 (megatron: the fixture)
from tests.helpers.megatron_ref import (  # noqa: E402
    FFN,
    HEADS,
    HIDDEN,
    LAYERS,
    MLA,
    SEQ,
    TOPK,
    VOCAB,
    YARN,
    load_mla_reference,
    samples,
    save_mla_reference,
    save_mtp_reference,
)

TOL = 1e-5  # fp32 logits, absolute (max |logit| ≈ 1.6 and 3); measured 4.2e-7 to 1.6e-6


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
    ids=["q_lora-moe-tp2", "q_proj-tp1"],
)
def test_import_mla_matches_gptmodel(
    megatron,  # noqa: F811
    tmp_path,
    q_lora,
    world,
    mscale_all_dim,
):
    """With Megatron-LM's args (query latent, MoE layers, tp 2), or without (a bare dist_checkpointing.save:
    the MLA dims from the shapes, the heads and YaRN with --set, the defaults named in a note)."""
    src = tmp_path / "megatron"
    ref = run_ranks(world, save_mla_reference, str(src), q_lora, mscale_all_dim, q_lora)[0]
    sets = [f"model.rope.original_max_position_embeddings={YARN['original_max_position_embeddings']}"]
    if q_lora:  # MoE layers too (4 experts, top-2), as DeepSeek's
        args = argparse.Namespace(**vars(_args(q_lora, mscale_all_dim)), moe_router_topk=TOPK)
        torch.save({"args": args, "iteration": 0}, src / "common.pt")
        sets.append("model.moe.token_dispatcher=allgather")
    else:
        sets += [f"model.num_attention_heads={HEADS}", f"model.max_position_embeddings={SEQ}"]
        sets += [f"model.rope.scaling_factor={YARN['rotary_scaling_factor']}", "model.rope.scaling_type=yarn"]
    report = import_megatron(src, tmp_path / "out", sets)
    if q_lora:
        assert report.notes == []
    else:
        (note,) = report.notes
        assert note.startswith("no Megatron-LM args in common.pt: rope.base=10000.0, norm_eps=1e-05"), note
    cfg = config_from_dict(read_group(tmp_path / "out")[1]["config"]).model
    assert cfg.attention_kind == "mla" and cfg.mla.rope_interleave
    dims = (cfg.mla.q_lora_rank, cfg.mla.kv_lora_rank, cfg.mla.qk_nope_head_dim, cfg.mla.qk_rope_head_dim)
    assert dims == (MLA["q_lora_rank"] if q_lora else None, 20, 12, 8)
    assert cfg.mlp_kind == ("moe" if q_lora else "dense") and cfg.moe.num_experts == (4 if q_lora else 0)
    assert (cfg.rope.scaling_type, cfg.rope.scaling_factor, cfg.rope.yarn_mscale_all_dim) == (
        "yarn",
        4.0,
        mscale_all_dim,
    )
    diff = (mlm_logits(tmp_path / "out") - ref).abs().max().item()
    assert diff <= TOL, diff


def _mlm_sets(q_lora: bool, mscale_all_dim: float) -> list[str]:
    """`megatron_ref._mla_gpt` as an mlm config (init_std 0.1: logits a misplaced tensor moves by O(1))."""
    q = [f"model.mla.q_lora_rank={MLA['q_lora_rank']}"] if q_lora else []
    return [
        f"model.num_layers={LAYERS}", f"model.hidden_size={HIDDEN}", f"model.num_attention_heads={HEADS}",
        f"model.ffn_hidden_size={FFN}", f"model.vocab_size={VOCAB}", f"model.max_position_embeddings={SEQ}",
        "model.init_std=0.1", f"data.seq_length={SEQ}", "model.attention_kind=mla", *q,
        f"model.mla.kv_lora_rank={MLA['kv_lora_rank']}", f"model.mla.qk_nope_head_dim={MLA['qk_head_dim']}",
        f"model.mla.qk_rope_head_dim={MLA['qk_pos_emb_head_dim']}", f"model.mla.v_head_dim={MLA['v_head_dim']}",
        f"model.rope.scaling_factor={YARN['rotary_scaling_factor']}", "model.rope.scaling_type=yarn",
        f"model.rope.original_max_position_embeddings={YARN['original_max_position_embeddings']}",
        f"model.rope.yarn_mscale={YARN['mscale']}", f"model.rope.yarn_mscale_all_dim={mscale_all_dim}",
    ]  # fmt: skip


@pytest.mark.parametrize(
    "q_lora, world, mscale_all_dim",
    [(True, 2, 1.0), (False, 1, 0.0)],
    ids=["q_lora-tp2", "q_proj-tp1"],
)
def test_export_mla_loads_into_gptmodel(megatron, tmp_path, q_lora, world, mscale_all_dim):  # noqa: F811
    """mlm's MLA model → mlm export megatron → dist_checkpointing.load into the MLA GPTModel: the same logits."""
    mlm_checkpoint(tmp_path / "mlm", _mlm_sets(q_lora, mscale_all_dim))
    report = export_megatron(tmp_path / "mlm", tmp_path / "megatron")
    assert "YaRN's original positions 8" in report.notes[-1]
    assert report.tensors == (
        14 if q_lora else 12
    )  # 3 + 2 norms, proj, fc1, fc2, MLA 6 (q_down, q_norm, q_up or q), kv 3
    it_dir = tmp_path / "megatron" / "iter_0000005"
    theirs, common = run_ranks(world, load_mla_reference, str(it_dir), q_lora, mscale_all_dim)[0]
    args = common["args"]
    assert args.multi_latent_attention and args.qk_layernorm and args.q_lora_rank == (24 if q_lora else None)
    ours = mlm_logits(tmp_path / "mlm")
    assert ours.abs().max() > 1.0
    diff = (theirs - ours).abs().max().item()
    assert diff <= TOL, diff


def test_mla_gptmodel_save_round_trips(megatron, tmp_path):  # noqa: F811
    """Megatron (MLA) → mlm → Megatron equals GPTModel's own save bitwise (keys, tensors, _extra_state
    objects), and the exported args import to the same mlm model."""
    src = tmp_path / "gptmodel"
    run_ranks(1, save_mla_reference, str(src), True, 1.0)
    torch.save({"args": _args(True, 1.0)}, src / "common.pt")
    sets = [f"model.rope.original_max_position_embeddings={YARN['original_max_position_embeddings']}"]
    import_megatron(src, tmp_path / "mlm", sets)
    export_megatron(tmp_path / "mlm", tmp_path / "back")
    theirs, ours = dcp_entries(src), dcp_entries(tmp_path / "back" / "iter_0000000")
    assert theirs.keys() == ours.keys()
    assert sum(v == "bytes" for v in ours.values()) == 14  # _extra_state: 7 linear layers, 2 layers
    for key, tensor in theirs.items():
        assert isinstance(tensor, str) or torch.equal(tensor, ours[key]), key
    import_megatron(tmp_path / "back", tmp_path / "again", sets)
    first, manifest = read_group(tmp_path / "mlm")[:2]
    again, manifest_again = read_group(tmp_path / "again")[:2]
    assert manifest_again["config"]["model"] == manifest["config"]["model"]
    assert again.keys() == first.keys() and all(torch.equal(again[k], first[k]) for k in first)


def test_mla_args_defaults():
    """Megatron-LM's MLA defaults (--rope-type unset: yarn, --rotary-scaling-factor 1): no scaling;
    kv_channels (saved for every run) is not taken."""
    args = argparse.Namespace(
        num_attention_heads=4, kv_channels=16, multi_latent_attention=True, q_lora_rank=None,
        kv_lora_rank=32, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128, rope_type=None,
        rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0, position_embedding_type="none",
    )  # fmt: skip
    sets = args_overrides({"args": args})
    assert set(sets) == {
        "model.num_attention_heads=4", 'model.position_embedding="rope"', 'model.attention_kind="mla"',
        "model.mla.kv_lora_rank=32", "model.mla.qk_nope_head_dim=128", "model.mla.qk_rope_head_dim=64",
        "model.mla.v_head_dim=128", "model.mla.rope_interleave=true",
    }  # fmt: skip


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"qk_layernorm": False}, "qk_layernorm=False: that MLA has no latent norms"),
        ({"rope_type": "rope", "mscale_all_dim": 1.0}, "Megatron scales that MLA's softmax by YaRN's mscale"),
        ({"mscale": 0.5}, "mlm's fields give that for both set, or mscale 1 with mscale_all_dim 0, only"),
    ],
    ids=["no-latent-norms", "rope-with-mscale", "mscale-alone"],
)
def test_mla_args_refused(changes, message):
    args = {**vars(_args(True, 0.0)), **changes}
    with pytest.raises(MlmError, match=re.escape(message)):
        args_overrides({"args": argparse.Namespace(**args)})


def test_mla_export_refuses_rotate_half(tmp_path):
    mlm_checkpoint(tmp_path / "mlm", [*_mlm_sets(True, 1.0), "model.mla.rope_interleave=false"])
    with pytest.raises(
        MlmError, match=r"model\.mla\.rope_interleave=false: Megatron's multi-latent attention"
    ):
        export_megatron(tmp_path / "mlm", tmp_path / "out")


def _mlm_losses(ckpt, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """mlm's (cross-entropy of every token [B, T], each MTP depth's loss) on samples [B, T + 1]."""
    state, manifest, _ = read_group(ckpt)
    cfg = config_from_dict(manifest["config"]).model
    model = GPT(cfg, state["embed.weight"].shape[0])
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        logits = model.eval()(tokens[:, :-1])
        ce = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(), reduction="none")
        h = model.hidden_states(tokens[:, :-1])
        return ce.view(tokens.shape[0], -1), model.mtp_losses(h, MTPTargets.of(tokens, cfg.mtp_num_layers))


def test_import_mtp_matches_gptmodel(megatron, tmp_path):  # noqa: F811
    """GPTModel with 2 MTP depths at tp 2: mlm's token losses and each depth's MTP loss equal
    GPTModel's to 1e-5 (measured 4.8e-7 both, losses ≈ 5; eh_proj's halves swapped moves depth 0's
    by 0.16, the depths swapped by 0.27); exported again, it equals GPTModel's save bitwise."""
    src = tmp_path / "megatron"
    ce, mtp = run_ranks(2, save_mtp_reference, str(src), 2)[0]
    args = argparse.Namespace(
        num_attention_heads=HEADS, group_query_attention=True, num_query_groups=2, kv_channels=16,
        max_position_embeddings=SEQ, norm_epsilon=1e-5, rotary_base=10000, swiglu=True,
        position_embedding_type="rope", mtp_num_layers=2, mtp_loss_scaling_factor=0.3,
    )  # fmt: skip
    torch.save({"args": args}, src / "common.pt")
    report = import_megatron(src, tmp_path / "out")
    assert report.tensors == 21 + 2 * 13  # the model's, and per depth: 3 norms, eh_proj, a layer's 9
    cfg = config_from_dict(read_group(tmp_path / "out")[1]["config"]).model
    assert (cfg.mtp_num_layers, cfg.mtp_loss_scaling_factor) == (2, 0.3)
    ours_ce, ours_mtp = _mlm_losses(tmp_path / "out", samples())
    assert (ours_ce - ce).abs().max().item() <= TOL
    assert mtp.shape == (2,) and (ours_mtp - mtp).abs().max().item() <= TOL, (ours_mtp, mtp)
    export_megatron(tmp_path / "out", tmp_path / "back")
    theirs, ours = dcp_entries(src), dcp_entries(tmp_path / "back" / "iter_0000000")
    assert theirs.keys() == ours.keys()
    assert sum(v == "bytes" for v in ours.values()) == 8 + 2 * 5  # _extra_state: + eh_proj, 4 linear layers
    for key, tensor in theirs.items():
        assert isinstance(tensor, str) or torch.equal(tensor, ours[key]), key


def test_legacy_mla_at_tp2_is_refused(tmp_path):
    """The legacy reader does not join MLA's tp shards: refused, with the way forward."""
    for t in range(2):
        state = {
            "args": argparse.Namespace(tensor_model_parallel_size=2, num_layers=1, swiglu=True),
            "model": {
                "embedding.word_embeddings.weight": torch.zeros(4, 8),
                "decoder.layers.0.self_attention.linear_kv_down_proj.weight": torch.zeros(6, 8),
                "decoder.layers.0.self_attention.linear_proj.weight": torch.zeros(8, 4),
            },
        }
        (tmp_path / "ckpt" / f"mp_rank_0{t}").mkdir(parents=True)
        torch.save(state, tmp_path / "ckpt" / f"mp_rank_0{t}" / "model_optim_rng.pt")
    with pytest.raises(
        MlmError, match=r"saved at tp 2 with decoder\.layers\.0\.self_attention\.linear_kv_down_proj"
    ):
        import_megatron(tmp_path / "ckpt", tmp_path / "out", ["model.num_attention_heads=2"])


def test_import_mla_with_mtp_matches_gptmodel(megatron, tmp_path):  # noqa: F811
    """MLA and an MTP depth together (the depth's layer is an MLA layer, DeepSeek-V3's shape), tp 1:
    token and MTP losses equal GPTModel's (measured 4.8e-7 and 0, loss ≈ 4.7); exported again,
    bitwise equal to its save."""
    src = tmp_path / "megatron"
    ce, mtp = run_ranks(1, save_mtp_reference, str(src), 1, True)[0]
    args = argparse.Namespace(**vars(_args(True, 1.0)), mtp_num_layers=1, mtp_loss_scaling_factor=0.3)
    torch.save({"args": args}, src / "common.pt")
    sets = [f"model.rope.original_max_position_embeddings={YARN['original_max_position_embeddings']}"]
    import_megatron(src, tmp_path / "out", sets)
    ours_ce, ours_mtp = _mlm_losses(tmp_path / "out", samples())
    assert (ours_ce - ce).abs().max().item() <= TOL
    assert mtp.shape == (1,) and (ours_mtp - mtp).abs().max().item() <= TOL, (ours_mtp, mtp)
    export_megatron(tmp_path / "out", tmp_path / "back")
    theirs, ours = dcp_entries(src), dcp_entries(tmp_path / "back" / "iter_0000000")
    assert theirs.keys() == ours.keys()
    for key, tensor in theirs.items():
        assert isinstance(tensor, str) or torch.equal(tensor, ours[key]), key
