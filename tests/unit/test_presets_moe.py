"""MoE presets: the published parameter counts (total and active per token) from the built
model, FLOPs per token by hand for a small MoE config, and `mlm config show/list` printing both
counts."""

from __future__ import annotations

import pytest

from mlm.config import load_config
from mlm.counts import ParameterCounts
from mlm.flops import flops_per_token, mlp_flops
from mlm.model import parameter_counts
from tests.helpers.common import preset_rows


def test_published_moe_parameter_counts():
    # Mixtral-8x7B: per layer attention 2·4096·(4096 + 1024) = 41,943,040, 8 experts × 3 × 4096 ×
    # 14336 = 1,409,286,144, router 8 × 4096, two norms; × 32 + 2 × 32000 × 4096 + 4096 =
    # 46,702,792,704 (Mistral's "46.7B"). Active: 6 of 8 experts skipped per layer,
    # 32 × 6 × 3 × 4096 × 14336 = 33,822,867,456 fewer: 12,879,925,248 ("12.9B").
    mixtral = load_config(overrides=["preset=mixtral-8x7b"]).model
    assert parameter_counts(mixtral) == ParameterCounts(46_702_792_704, 12_879_925_248)
    # Qwen3-30B-A3B: per layer attention 2·2048·(4096 + 512) = 18,874,368 + q/k norms 2 × 128,
    # 128 experts × 3 × 2048 × 768 = 603,979,776, router 128 × 2048, two norms: 623,120,640;
    # × 48 + 2 × 151936 × 2048 + 2048 = 30,532,122,624 ("30.5B"); active: 120 of 128 experts
    # skipped, 48 × 120 × 3 × 2048 × 768 fewer = 3,353,032,704 ("3.3B").
    qwen = load_config(overrides=["preset=qwen3-30b-a3b"]).model
    assert parameter_counts(qwen) == ParameterCounts(30_532_122_624, 3_353_032_704)
    # a dense model's active count is its total
    llama = load_config(overrides=["preset=llama3-8b"]).model
    assert parameter_counts(llama) == ParameterCounts(8_030_261_248, 8_030_261_248)
    # dense Qwen3-8B: per layer attention 2·4096·(4096 + 1024) = 41,943,040 + q/k norms 2 × 128,
    # MLP 3 × 4096 × 12288 = 150,994,944, two norms: 192,946,432; × 36 + 2 × 151936 × 4096 + 4096
    # = 8,190,735,360 ("8.2B"). Qwen2.5-7B: attention 2·3584·(3584 + 512) + q/k/v biases 4608 =
    # 29,364,736, MLP 3 × 3584 × 18944 = 203,685,888, two norms: 233,057,792; × 28 + 2 × 152064 ×
    # 3584 + 3584 = 7,615,616,512 ("7.61B"; 6.53B without the embeddings)
    for preset, n in (("qwen3-8b", 8_190_735_360), ("qwen2.5-7b", 7_615_616_512)):
        assert parameter_counts(load_config(overrides=[f"preset={preset}"]).model) == ParameterCounts(n, n)
    tiny = load_config(overrides=["preset=tiny-moe"]).model
    assert [s.mlp for s in tiny.layer_specs()] == ["dense", "moe", "moe", "moe"]
    c = parameter_counts(tiny)
    assert c.total - c.active == 3 * 6 * 3 * 128 * 96  # 3 MoE layers, 6 of 8 experts of 3 × D × F skipped


def test_moe_flops_per_token_by_hand():
    cfg = load_config(
        overrides=[
            "model.num_layers=2",
            "model.hidden_size=8",
            "model.num_attention_heads=2",
            "model.num_query_groups=1",
            "model.kv_channels=4",
            "model.ffn_hidden_size=32",
            "model.vocab_size=128",
            "model.max_position_embeddings=16",
            "data.seq_length=16",
            "model.mlp_kind=moe",
            "model.first_k_dense=1",
            "model.moe.num_experts=4",
            "model.moe.router_topk=2",
            "model.moe.ffn_hidden_size=12",
            "model.moe.shared_expert_ffn_hidden_size=8",
            "model.moe.shared_expert_gate=true",
        ]
    ).model
    attention = 6 * (2 * 8 * 4 * (2 + 1) + 2 * 16 * 2 * 4)  # 2688
    dense = 6 * 3 * 8 * 32  # 4608
    routed, shared, router = 6 * 3 * 8 * 2 * 12, 6 * 3 * 8 * 8, 6 * 8 * 4 + 6 * 8  # 3456, 1152, 240
    logits = 6 * 8 * 128  # 6144
    assert (attention, dense, routed + shared + router, logits) == (2688, 4608, 4848, 6144)
    assert flops_per_token(cfg, 16) == 2 * attention + dense + routed + shared + router + logits == 20976
    parts = mlp_flops(cfg, "moe")
    assert (parts.tp, parts.routed, parts.router) == (shared, routed, router)
    # a dense model keeps Megatron's count
    dense_cfg = load_config(overrides=["preset=llama3-8b"]).model
    D, F_, L = 4096, 14336, 32
    attn = 6 * (2 * D * 128 * (32 + 8) + 2 * 8192 * 32 * 128)
    assert flops_per_token(dense_cfg, 8192) == L * (attn + 6 * 3 * D * F_) + 6 * D * 128256


def test_flops_follow_active_parameters():
    """Without the attention-over-sequence term, MoE FLOPs per token are 6 × the active matmul
    weights (every parameter a token uses once is a multiply-add, forward and backward)."""
    cfg = load_config(overrides=["preset=mixtral-8x7b"]).model
    active = parameter_counts(cfg).active
    D, L, V = cfg.hidden_size, cfg.num_layers, cfg.padded_vocab_size()
    seq_term = L * 6 * 2 * 4096 * cfg.num_attention_heads * cfg.head_dim
    norms = L * 2 * D + D
    embedding = V * D  # a lookup, no FLOPs
    assert flops_per_token(cfg, 4096) - seq_term == pytest.approx(6 * (active - norms - embedding), rel=1e-12)


def test_config_show_and_list_print_total_and_active(capsys):
    from cli.config import show

    show(preset="mixtral-8x7b", config=None, overrides=[])
    out = capsys.readouterr().out
    assert "# parameters: total 46,702,792,704 (46.703 B), active 12,879,925,248 (12.880 B) per token" in out
    assert "# layers: 0-31: gqa + moe (rmsnorm)" in out
    show(preset="tiny-llama", config=None, overrides=[])
    assert "active" not in capsys.readouterr().out.splitlines()[1]
    rows = preset_rows()
    assert "total 46.70G, active 12.88G" in rows["mixtral-8x7b"]
    assert "total 30.53G, active 3.35G" in rows["qwen3-30b-a3b"]
    assert "active" not in rows["llama3-8b"]
