"""The mixture-of-experts presets against their published sizes: the total and active parameter
counts from the built model (MoE presets, and DeepSeek's deepseek-v3 and deepseek-v2-lite exactly,
on the meta device, against a count by hand from their config.json and DeepSeek's rounded
figures, the MTP depth counted apart), FLOPs per token by hand for a small MoE config, and
`mlm config show/list` printing the counts."""

from __future__ import annotations

import pytest
import torch

from mlm.config import load_config
from mlm.counts import ParameterCounts
from mlm.flops import flops_per_token, mlp_flops
from mlm.model import parameter_counts
from tests.helpers.common import ROOT, preset_rows


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


def _mla(D: int, H: int, q_lora: int | None, kv_lora=512, nope=128, rope=64, v=128) -> int:
    """One MLA block's parameters: q (or q_down, q_norm, q_up), kv_down, kv_norm, kv_up, out."""
    q = D * H * (nope + rope) if q_lora is None else D * q_lora + q_lora + q_lora * H * (nope + rope)
    return q + D * (kv_lora + rope) + kv_lora + kv_lora * H * (nope + v) + H * v * D


def test_deepseek_v3_counts_by_hand_and_published():
    D, H, V, E, k, F, F_dense = 7168, 128, 129280, 256, 8, 2048, 18432
    attention = _mla(D, H, 1536)
    assert attention == 187_107_328
    expert = 3 * D * F  # gate, up, down: 44,040,192
    dense = attention + 2 * D + 3 * D * F_dense  # 583,483,392
    # 256 routed experts, the shared one (width 2048), router [E, D], its selection-only bias [E]
    moe = attention + 2 * D + E * expert + expert + E * D + E  # 11,507,286,272
    assert (dense, moe) == (583_483_392, 11_507_286_272)
    embedding = V * D  # 129,280 = 1,010 × 128: no padding rows
    total = 3 * dense + 58 * moe + 2 * embedding + D  # untied embedding and output, final norm
    active = total - 58 * (E - k) * expert
    mtp = 2 * D + 2 * D * D + moe + D  # enorm, hnorm, eh_proj [D, 2D], one MoE layer, final norm
    mtp_active = mtp - (E - k) * expert
    counts = parameter_counts(load_config(overrides=["preset=deepseek-v3"]).model)
    assert counts == ParameterCounts(total, active, mtp, mtp_active)
    assert counts == ParameterCounts(671_026_419_200, 37_552_297_472, 11_610_068_224, 688_100_608)

    # Published (arXiv 2412.19437; README_WEIGHTS.md of deepseek-ai/DeepSeek-V3):
    # "671B total" is the main model without the MTP module.
    assert round(counts.total / 1e9) == 671
    # MTP "11.5B unique parameters" is its transformer layer alone (eh_proj's 0.10B and the norms
    # left out), and its "2.4B activated" that layer's active part plus the shared embedding and
    # head: 585,318,656 + 2 × 926,679,040.
    assert round(moe / 1e9, 1) == 11.5
    assert round((moe - (E - k) * expert + 2 * embedding) / 1e9, 1) == 2.4
    # "37B activated" (README_WEIGHTS: 36.7B "including 0.9B embedding and 0.9B output head"):
    # a token's forward uses 37.55B by the count above, 36.63B without the embedding (a lookup,
    # no FLOPs), which matches the paper's rounding; the README's 36.7B does not reconcile exactly.
    assert round((counts.active - embedding) / 1e9) == 37
    assert abs((counts.active - embedding) / 1e9 - 36.7) < 0.1
    # Hugging Face's "685B" counts the safetensors: the main model, the MTP layer (stored with its
    # own copies of the embedding and the head, model.layers.61.embed_tokens and
    # .shared_head.head) and the FP8 checkpoint's float32 scales, one per 128 × 128 block of every
    # FP8 linear weight (all of the layers' matmul weights but the router); "14B of MTP" is
    # 685 − 671 (13.46B stored).
    stored = counts.built + 2 * embedding
    assert round((counts.mtp + 2 * embedding) / 1e9, 2) == 13.46
    scales = _fp8_scales(load_config(overrides=["preset=deepseek-v3"]).model)
    assert 41e6 < scales < 42e6
    assert round((stored + scales) / 1e9) == 685


def _fp8_scales(cfg) -> int:
    """weight_scale_inv elements of DeepSeek-V3's FP8 checkpoint: ceil(out/128) × ceil(in/128) per
    matmul weight of the layers and the MTP layer (per expert for the stacked experts)."""
    from mlm.model.gpt import GPT

    with torch.device("meta"):
        model = GPT(cfg)
    n = 0
    for name, p in model.named_parameters():
        if not name.startswith(("layers.", "mtp.")) or p.ndim < 2 or "router" in name:
            continue
        experts = p.shape[0] if p.ndim == 3 else 1
        n += experts * -(-p.shape[-2] // 128) * -(-p.shape[-1] // 128)
    return n


def test_deepseek_v2_lite_counts_by_hand_and_published():
    D, H, V, E, k, F, F_dense = 2048, 16, 102400, 64, 6, 1408, 10944
    attention = _mla(D, H, None)  # q_lora_rank null: q [H·192, D]
    assert attention == 13_763_072
    expert = 3 * D * F  # 8,650,752
    dense = attention + 2 * D + 3 * D * F_dense
    moe = attention + 2 * D + E * expert + 3 * D * 2 * F + E * D  # 2 shared experts: width 2816; no bias
    total = dense + 26 * moe + 2 * V * D + D  # 102,400 = 800 × 128: no padding
    active = total - 26 * (E - k) * expert
    counts = parameter_counts(load_config(overrides=["preset=deepseek-v2-lite"]).model)
    assert counts == ParameterCounts(total, active) == ParameterCounts(15_706_484_224, 2_661_150_208)
    # Published (DeepSeek-V2 paper, appendix; the HF model card): "15.7B total, 2.4B activated";
    # as for V3 the activated figure matches the count without the embedding (2.45B), truncated.
    assert round(counts.total / 1e9, 1) == 15.7
    assert abs((counts.active - V * D) / 1e9 - 2.4) < 0.06


def test_tiny_deepseek_and_printed_counts(capsys):
    tiny = load_config(overrides=["preset=tiny-deepseek"]).model
    assert [s.mlp for s in tiny.layer_specs()] == ["dense", "moe", "moe"]
    c = parameter_counts(tiny)
    expert = 3 * 64 * 32
    assert c.total - c.active == 2 * (8 - 4) * expert and c.mtp - c.mtp_active == (8 - 4) * expert
    assert c.describe() == "total 708,704, active 659,552 (+ MTP 77,176, 52,600 active)"

    from cli.config import show

    show(preset="deepseek-v3", config=None, overrides=[])
    out = capsys.readouterr().out
    assert (
        "# parameters: total 671,026,419,200 (671.026 B), active 37,552,297,472 (37.552 B) per token" in out
    )
    assert "# MTP depths (1): 11,610,068,224 (11.610 B) more, 688,100,608 active per token" in out
    assert "# layers: 0-2: mla + dense (rmsnorm); 3-60: mla + moe (rmsnorm)" in out
    rows = preset_rows()
    assert "total 671.03G, active 37.55G (+ MTP 11.61G, 688.10M active)" in rows["deepseek-v3"]
    assert "total 15.71G, active 2.66G" in rows["deepseek-v2-lite"]
    assert "MTP" not in rows["deepseek-v2-lite"]


def test_mla_and_mtp_flops_by_hand():
    from mlm.flops import flops_per_token, mixer_flops

    cfg = load_config(
        overrides=[
            "model.num_layers=2",
            "model.hidden_size=8",
            "model.num_attention_heads=2",
            "model.ffn_hidden_size=32",
            "model.vocab_size=128",
            "model.max_position_embeddings=16",
            "data.seq_length=16",
            "model.attention_kind=mla",
            "model.mla.q_lora_rank=4",
            "model.mla.kv_lora_rank=6",
            "model.mla.qk_nope_head_dim=4",
            "model.mla.qk_rope_head_dim=2",
            "model.mla.v_head_dim=3",
            "model.mtp_num_layers=1",
        ]
    ).model
    # D 8, H 2, Q 4, C 6, N 4, R 2, E 3, T 16, V 128; 6 = 3 passes × 2 FLOPs per multiply-add
    q_down, kv_down = 6 * 8 * 4, 6 * 8 * (6 + 2)  # 192, 384: replicated over tp
    q_up, kv_up, out = 6 * 4 * 2 * (4 + 2), 6 * 6 * 2 * (4 + 3), 6 * 2 * 3 * 8  # 288, 504, 288
    core = 6 * 16 * 2 * ((4 + 2) + 3)  # scores over nope + rope dims, values of 3: 1728
    parts = mixer_flops(cfg, "mla", 16)
    assert (parts.replicated, parts.tp, parts.core) == (q_down + kv_down, q_up + kv_up + out, core)
    layer = q_down + kv_down + q_up + kv_up + out + core + 6 * 3 * 8 * 32  # 3384 + 4608
    logits = 6 * 8 * 128
    mtp = layer + 6 * 2 * 8 * 8 + logits  # its layer, eh_proj [8, 16], its logits
    assert flops_per_token(cfg, 16) == 2 * layer + logits + mtp == 37032
    # without the query latent: q [H·(N + R), D], split over tp
    cfg.mla.q_lora_rank = None
    assert mixer_flops(cfg, "mla", 16).tp == 6 * 8 * 2 * (4 + 2) + kv_up + out
    assert mixer_flops(cfg, "mla", 16).replicated == kv_down


def test_deepseek_v3_flops_follow_active_parameters():
    """Without the attention-over-sequence term, FLOPs per token are 6 × the matmul weights a
    token uses: the main model's and the MTP depth's (the embedding is a lookup, norms are left
    out), plus the MTP depth's second pass through the shared output layer."""
    from mlm.flops import flops_per_token

    cfg = load_config(overrides=["preset=deepseek-v3"]).model
    c = parameter_counts(cfg)
    D, H, T, V = 7168, 128, 4096, 129280
    seq = (61 + 1) * 6 * T * H * ((128 + 64) + 128)  # every layer and the MTP depth's
    norms = 61 * (2 * D + 1536 + 512) + D  # two per layer, the two latent norms, the final norm
    mtp_norms = 3 * D + 2 * D + 1536 + 512  # enorm, hnorm, final norm; its layer's four
    bias = 59 * 256  # the experts' selection-only bias: no FLOPs (58 layers and the MTP depth)
    matmuls = c.active - norms - V * D + c.mtp_active - mtp_norms - bias
    assert flops_per_token(cfg, T) == 6 * (matmuls + V * D) + seq


def test_tiny_deepseek_recipe_config():

    recipe = ROOT / "pipelines" / "tiny" / "deepseek.toml"
    cfg = load_config(recipe)
    m = cfg.model
    assert (m.attention_kind, m.mtp_num_layers, m.moe.router_topk, m.vocab_size) == ("mla", 1, 4, 4096)
    assert cfg.data.data_path == ["runs/tiny/data/stdlib"]  # the tiny pipeline's dataset (run.sh)


def test_deepseek_v3_preset_is_its_config_json():
    """The preset equals what the Hugging Face importer makes of DeepSeek-V3's config.json (its
    architecture fields, as published in deepseek-ai/DeepSeek-V3)."""
    from mlm.convert.hf.deepseek_v3 import DEEPSEEK_V3

    config_json = {
        "model_type": "deepseek_v3",
        "attention_bias": False,
        "first_k_dense_replace": 3,
        "hidden_act": "silu",
        "hidden_size": 7168,
        "initializer_range": 0.02,
        "intermediate_size": 18432,
        "kv_lora_rank": 512,
        "max_position_embeddings": 163840,
        "moe_intermediate_size": 2048,
        "moe_layer_freq": 1,
        "n_group": 8,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_attention_heads": 128,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 61,
        "num_key_value_heads": 128,
        "num_nextn_predict_layers": 1,
        "q_lora_rank": 1536,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 40,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
        "rope_theta": 10000,
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "tie_word_embeddings": False,
        "topk_group": 4,
        "topk_method": "noaux_tc",
        "v_head_dim": 128,
        "vocab_size": 129280,
    }
    assert load_config(overrides=["preset=deepseek-v3"]).model == DEEPSEEK_V3.config_from_hf(config_json)
