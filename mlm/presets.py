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
    rope_base=500000.0,
    rope_scaling_factor=8.0,
    rope_low_freq_factor=1.0,
    rope_high_freq_factor=4.0,
    rope_original_max_position_embeddings=8192,
    max_position_embeddings=131072,
)
_SWIGLU_ROPE = dict(normalization="rmsnorm", position_embedding="rope", activation="swiglu", add_bias=False)

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
            rope_scaling_factor=32.0,
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
    # Totals and active parameters per token (`mlm config list`, tests/test_presets_moe.py):
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
            rope_base=1e6,
            mlp_kind="moe",
            moe=dict(num_experts=8, router_topk=2),
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
            rope_base=1e6,
            qk_norm=True,
            mlp_kind="moe",
            moe=dict(num_experts=128, router_topk=8, ffn_hidden_size=768),
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
            rope_base=10000.0,
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
            rope_base=10000.0,
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
