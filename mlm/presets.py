"""Model presets: a table of published architectures plus tiny ones for tests and the demo.

Each row gives its source; parameter counts are computed from the built model on the meta
device (`mlm config list`), so they can never disagree with what trains.
"""

from __future__ import annotations

import copy

from mlm.errors import MlmError

_GPT2 = dict(
    vocab_size=50257,
    max_position_embeddings=1024,
    normalization="layernorm",
    position_embedding="learned",
    activation="gelu_tanh",
    add_bias=True,
    tie_embeddings=True,
    norm_eps=1e-5,
)
_LLAMA3 = dict(
    vocab_size=128256,
    normalization="rmsnorm",
    position_embedding="rope",
    activation="swiglu",
    add_bias=False,
    norm_eps=1e-5,
    rope=dict(
        base=500000.0,
        scaling_factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    ),
    max_position_embeddings=131072,
)
_SWIGLU_ROPE = dict(normalization="rmsnorm", position_embedding="rope", activation="swiglu", add_bias=False)
# DeepSeek-V2/V3's rope_scaling (model.rope): YaRN, factor 40 over the 4096-token pretraining context
_DEEPSEEK_YARN = dict(
    scaling_type="yarn",
    scaling_factor=40.0,
    original_max_position_embeddings=4096,
    yarn_beta_fast=32.0,
    yarn_beta_slow=1.0,
)

# name: (source, model fields, data fields)
PRESETS: dict[str, tuple[str, dict, dict]] = {
    "gpt2-124m": (
        "HF openai-community/gpt2 config.json",
        dict(_GPT2, num_layers=12, hidden_size=768, num_attention_heads=12),
        {"seq_length": 1024},
    ),
    "gpt2-350m": (
        "HF openai-community/gpt2-medium config.json",
        dict(_GPT2, num_layers=24, hidden_size=1024, num_attention_heads=16),
        {"seq_length": 1024},
    ),
    "gpt2-1.5b": (
        "HF openai-community/gpt2-xl config.json",
        dict(_GPT2, num_layers=48, hidden_size=1600, num_attention_heads=25),
        {"seq_length": 1024},
    ),
    "llama3-1b": (
        "HF meta-llama/Llama-3.2-1B config.json",
        dict(
            _LLAMA3,
            num_layers=16,
            hidden_size=2048,
            num_attention_heads=32,
            num_query_groups=8,
            ffn_hidden_size=8192,
            tie_embeddings=True,
            rope=dict(_LLAMA3["rope"], scaling_factor=32.0),
        ),
        {"seq_length": 8192},
    ),
    "llama3-8b": (
        "HF meta-llama/Llama-3.1-8B config.json",
        dict(
            _LLAMA3,
            num_layers=32,
            hidden_size=4096,
            num_attention_heads=32,
            num_query_groups=8,
            ffn_hidden_size=14336,
        ),
        {"seq_length": 8192},
    ),
    "llama3-70b": (
        "HF meta-llama/Llama-3.1-70B config.json",
        dict(
            _LLAMA3,
            num_layers=80,
            hidden_size=8192,
            num_attention_heads=64,
            num_query_groups=8,
            ffn_hidden_size=28672,
        ),
        {"seq_length": 8192},
    ),
    "llama3-405b": (
        "HF meta-llama/Llama-3.1-405B config.json",
        dict(
            _LLAMA3,
            num_layers=126,
            hidden_size=16384,
            num_attention_heads=128,
            num_query_groups=8,
            ffn_hidden_size=53248,
        ),
        {"seq_length": 8192},
    ),
    # MoE: every layer's MLP is the routed experts; top-k then a softmax over the k (Megatron's
    # default router; HF's softmax → top-k → renormalise, norm_topk_prob=true, is the same).
    # Balancing losses are a training choice, left off here: set model.moe.aux_loss_coeff.
    # Totals and active parameters per token (`mlm config list`, tests/unit/test_presets.py):
    # Mixtral-8x7B 46,702,792,704 / 12,879,925,248 (Mistral's "46.7B / 12.9B"); Qwen3-30B-A3B
    # 30,532,122,624 / 3,353,032,704 ("30.5B / 3.3B"). Sequence length: 4096, a common
    # pretraining length (both models support longer, see max_position_embeddings).
    "mixtral-8x7b": (
        "HF mistralai/Mixtral-8x7B-v0.1 config.json",
        dict(
            _SWIGLU_ROPE,
            num_layers=32,
            hidden_size=4096,
            num_attention_heads=32,
            num_query_groups=8,
            ffn_hidden_size=14336,
            vocab_size=32000,
            max_position_embeddings=32768,
            norm_eps=1e-5,
            rope=dict(base=1e6),
            mlp_kind="moe",
            moe=dict(num_experts=8, router_topk=2),
        ),
        {"seq_length": 4096},
    ),
    # Dense Qwen (tests/unit/test_presets.py counts them): Qwen3-8B 8,190,735,360 parameters
    # (q/k norms, head_dim 128, untied), Qwen2.5-7B 7,615,616,512 (q/k/v biases, untied)
    "qwen3-8b": (
        "HF Qwen/Qwen3-8B config.json",
        dict(
            _SWIGLU_ROPE,
            num_layers=36,
            hidden_size=4096,
            num_attention_heads=32,
            num_query_groups=8,
            kv_channels=128,
            ffn_hidden_size=12288,
            vocab_size=151936,
            max_position_embeddings=40960,
            norm_eps=1e-6,
            rope=dict(base=1e6),
            qk_norm=True,
        ),
        {"seq_length": 4096},
    ),
    "qwen2.5-7b": (
        "HF Qwen/Qwen2.5-7B config.json",
        dict(
            _SWIGLU_ROPE,
            num_layers=28,
            hidden_size=3584,
            num_attention_heads=28,
            num_query_groups=4,
            ffn_hidden_size=18944,
            vocab_size=152064,
            max_position_embeddings=131072,
            norm_eps=1e-6,
            rope=dict(base=1e6),
            qkv_bias=True,
        ),
        {"seq_length": 4096},
    ),
    "qwen3-30b-a3b": (
        "HF Qwen/Qwen3-30B-A3B config.json",
        dict(
            _SWIGLU_ROPE,
            num_layers=48,
            hidden_size=2048,
            num_attention_heads=32,
            num_query_groups=4,
            kv_channels=128,
            ffn_hidden_size=6144,  # intermediate_size: unused (decoder_sparse_step 1, no mlp_only_layers)
            vocab_size=151936,
            max_position_embeddings=40960,
            norm_eps=1e-6,
            rope=dict(base=1e6),
            qk_norm=True,
            mlp_kind="moe",
            moe=dict(num_experts=128, router_topk=8, ffn_hidden_size=768),
        ),
        {"seq_length": 4096},
    ),
    # DeepSeek: Multi-Latent Attention (model.mla) in every layer, the first layers dense, then
    # routed experts plus always-on shared experts (their total width: n_shared × moe width); YaRN
    # RoPE as the released config.json sets it (factor 40 over the 4096 pretraining context,
    # max_position_embeddings 163840; mscale_all_dim also scales MLA's softmax). Sequence length:
    # 4096, the pretraining context. The counts (tests/unit/test_presets.py) are the main
    # model's, as DeepSeek publishes them; `mlm config list` adds the MTP depth's apart:
    # V3 671,026,419,200 total / 37,552,297,472 active (+ MTP 11,610,068,224); V2-Lite
    # 15,706,484,224 / 2,661,150,208.
    "deepseek-v3": (
        "HF deepseek-ai/DeepSeek-V3 config.json (MTP: num_nextn_predict_layers); arXiv 2412.19437",
        dict(
            _SWIGLU_ROPE,
            num_layers=61,
            hidden_size=7168,
            num_attention_heads=128,
            ffn_hidden_size=18432,
            vocab_size=129280,
            max_position_embeddings=163840,
            norm_eps=1e-6,
            rope=dict(_DEEPSEEK_YARN, base=10000.0, yarn_mscale=1.0, yarn_mscale_all_dim=1.0),
            attention_kind="mla",
            mla=dict(
                q_lora_rank=1536,
                kv_lora_rank=512,
                qk_nope_head_dim=128,
                qk_rope_head_dim=64,
                v_head_dim=128,
                rope_interleave=True,
            ),
            mlp_kind="moe",
            first_k_dense=3,
            # sigmoid scores, top-8 from the best 4 of 8 groups, weights renormalised then ×2.5;
            # aux-loss-free balancing (the selection-only expert bias, γ = 0.001 in the paper);
            # the paper's sequence-wise loss (α = 1e-4) is a training choice, left off here
            moe=dict(
                num_experts=256,
                ffn_hidden_size=2048,
                router_topk=8,
                router_score_function="sigmoid",
                router_enable_expert_bias=True,
                router_num_groups=8,
                router_group_topk=4,
                router_topk_scaling_factor=2.5,
                shared_expert_ffn_hidden_size=2048,
            ),
            mtp_num_layers=1,
        ),
        {"seq_length": 4096},
    ),
    "deepseek-v2-lite": (
        "HF deepseek-ai/DeepSeek-V2-Lite config.json",
        dict(
            _SWIGLU_ROPE,
            num_layers=27,
            hidden_size=2048,
            num_attention_heads=16,
            ffn_hidden_size=10944,
            vocab_size=102400,
            max_position_embeddings=163840,
            norm_eps=1e-6,
            rope=dict(_DEEPSEEK_YARN, base=10000.0, yarn_mscale=0.707, yarn_mscale_all_dim=0.707),
            attention_kind="mla",
            # q_lora_rank null: queries straight from the hidden state
            mla=dict(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
            mlp_kind="moe",
            first_k_dense=1,
            # softmax over all 64 experts, top-6, not renormalised (norm_topk_prob false);
            # n_group 1 / topk_group 1 and routed_scaling_factor 1.0 are no-ops; 2 shared experts
            moe=dict(
                num_experts=64,
                ffn_hidden_size=1408,
                router_topk=6,
                router_pre_softmax=True,
                shared_expert_ffn_hidden_size=2 * 1408,
            ),
        ),
        {"seq_length": 4096},
    ),
    "nemotron-h-8b": (
        "HF nvidia/Nemotron-H-8B-Base-8K config.json: 24 Mamba-2, 4 attention (no positions) and 24 "
        "squared-ReLU MLP blocks; 8,100,852,736 parameters as published",
        dict(
            num_layers=28,
            hidden_size=4096,
            num_attention_heads=32,
            num_query_groups=8,
            kv_channels=128,
            ffn_hidden_size=21504,
            vocab_size=131072,
            max_position_embeddings=8192,
            normalization="rmsnorm",
            norm_eps=1e-5,
            position_embedding="none",
            activation="squared_relu",
            layer_pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
            # dt_limit_min: transformers clamps Nemotron-H's time step at time_step_min
            mamba=dict(
                num_heads=128, head_dim=64, state_dim=128, num_groups=8, chunk_size=128, dt_limit_min=0.001
            ),
        ),
        {"seq_length": 8192},
    ),
    "qwen3-next-80b-a3b": (
        "HF Qwen/Qwen3-Next-80B-A3B-Instruct config.json: 12 × (3 Gated DeltaNet + 1 gated attention), "
        "every layer MoE (512 experts, top-10, a gated shared expert); 79B parameters without the "
        "embeddings, as published (rope_theta not checked here: imports read it from config.json)",
        dict(
            num_layers=48,
            hidden_size=2048,
            num_attention_heads=16,
            num_query_groups=2,
            kv_channels=256,
            ffn_hidden_size=5120,
            vocab_size=151936,
            max_position_embeddings=262144,
            normalization="rmsnorm",
            norm_eps=1e-6,
            norm_zero_centered=True,
            position_embedding="rope",
            rotary_percent=0.25,
            activation="swiglu",
            qk_norm=True,
            attention_output_gate=True,
            layer_pattern="GEGEGE*E" * 12,
            gdn=dict(num_key_heads=16, num_value_heads=32, key_head_dim=128, value_head_dim=128),
            moe=dict(
                num_experts=512,
                router_topk=10,
                ffn_hidden_size=512,
                shared_expert_ffn_hidden_size=512,
                shared_expert_gate=True,
                aux_loss_coeff=0.001,
            ),
        ),
        {"seq_length": 4096},
    ),
    "tiny-llama": (
        "mlm: CPU demo and tests (GQA, RoPE, SwiGLU)",
        dict(
            num_layers=4,
            hidden_size=128,
            num_attention_heads=4,
            num_query_groups=2,
            ffn_hidden_size=352,
            vocab_size=4096,
            max_position_embeddings=256,
            normalization="rmsnorm",
            position_embedding="rope",
            activation="swiglu",
            rope=dict(base=10000.0),
        ),
        {"seq_length": 256},
    ),
    "tiny-moe": (
        "mlm: CPU demo and tests (MoE: first layer dense, 8 experts top-2, a gated shared expert; Qwen2-MoE's layout)",
        dict(
            _SWIGLU_ROPE,
            num_layers=4,
            hidden_size=128,
            num_attention_heads=4,
            num_query_groups=2,
            ffn_hidden_size=352,
            vocab_size=4096,
            max_position_embeddings=256,
            rope=dict(base=10000.0),
            mlp_kind="moe",
            first_k_dense=1,
            moe=dict(
                num_experts=8,
                router_topk=2,
                ffn_hidden_size=96,
                shared_expert_ffn_hidden_size=96,
                shared_expert_gate=True,
                aux_loss_coeff=1e-2,
            ),
        ),
        {"seq_length": 256},
    ),
    "tiny-deepseek": (
        "mlm: CPU demo and tests (DeepSeek-V3's layout: MLA with a query latent, YaRN, layer 0 dense, "
        "8 experts top-4 from 2 of 4 groups, sigmoid + expert bias, a shared expert, one MTP depth)",
        dict(
            _SWIGLU_ROPE,
            num_layers=3,
            hidden_size=64,
            num_attention_heads=4,
            ffn_hidden_size=176,
            vocab_size=4096,
            max_position_embeddings=256,
            norm_eps=1e-6,
            # YaRN over a 64-token "pretraining" context, as V3's factor 40 over 4096
            rope=dict(
                base=10000.0,
                scaling_factor=4.0,
                scaling_type="yarn",
                original_max_position_embeddings=64,
                yarn_mscale_all_dim=1.0,
            ),
            attention_kind="mla",
            mla=dict(q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
            mlp_kind="moe",
            first_k_dense=1,
            # top-4 over 2 groups: 2 experts per group, the group score HF's top-2 sum uses too
            moe=dict(
                num_experts=8,
                ffn_hidden_size=32,
                router_topk=4,
                router_score_function="sigmoid",
                router_enable_expert_bias=True,
                router_num_groups=4,
                router_group_topk=2,
                router_topk_scaling_factor=2.5,
                shared_expert_ffn_hidden_size=32,
                seq_aux_loss_coeff=1e-3,
                # 10× V3's bias step: a demo run is 80 steps, not 14.8T tokens (at 1e-3 the busiest
                # expert still takes every token at step 80; at 1e-2 max/mean load is 1.25)
                router_bias_update_rate=1e-2,
            ),
            mtp_num_layers=1,
        ),
        {"seq_length": 256},
    ),
    "tiny-hybrid": (
        "mlm: CPU demo and tests (Nemotron-H's layout: Mamba-2, attention without positions, squared-ReLU MLPs)",
        dict(
            num_layers=4,
            hidden_size=128,
            num_attention_heads=4,
            num_query_groups=2,
            ffn_hidden_size=352,
            vocab_size=4096,
            max_position_embeddings=256,
            normalization="rmsnorm",
            position_embedding="none",
            activation="squared_relu",
            layer_pattern="M-*-M-M-",
            mamba=dict(head_dim=16, state_dim=16, num_groups=2, chunk_size=64),
        ),
        {"seq_length": 256},
    ),
    "tiny-qwen3-next": (
        "mlm: CPU demo and tests (Qwen3-Next's layout: Gated DeltaNet and gated attention, MoE with a gated shared expert)",
        dict(
            num_layers=4,
            hidden_size=128,
            num_attention_heads=4,
            num_query_groups=2,
            kv_channels=32,
            ffn_hidden_size=352,
            vocab_size=4096,
            max_position_embeddings=256,
            normalization="rmsnorm",
            norm_zero_centered=True,
            position_embedding="rope",
            rotary_percent=0.25,
            activation="swiglu",
            qk_norm=True,
            attention_output_gate=True,
            layer_pattern="GEGE*EG-",
            gdn=dict(num_key_heads=2, num_value_heads=4, key_head_dim=32, value_head_dim=32),
            moe=dict(
                num_experts=8,
                router_topk=2,
                ffn_hidden_size=64,
                shared_expert_ffn_hidden_size=64,
                shared_expert_gate=True,
            ),
        ),
        {"seq_length": 256},
    ),
    "tiny-gpt2": (
        "mlm: CPU tests (LayerNorm, learned positions, GeLU, biases, tied)",
        dict(
            _GPT2,
            num_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            vocab_size=4096,
            max_position_embeddings=256,
        ),
        {"seq_length": 256},
    ),
}


def preset_tables(name: str) -> dict[str, dict]:
    """{"model": {...}, "data": {...}} for a preset name."""
    if name not in PRESETS:
        raise MlmError(
            f"unknown preset {name!r}; known presets: {', '.join(PRESETS)} (see `mlm config list`)"
        )
    _, model, data = PRESETS[name]
    return copy.deepcopy({"model": model, "data": data})  # nested tables (moe) are the caller's
