"""Tiny random Hugging Face transformers models, one builder per architecture mlm converts.

Each builder makes the transformers model in fp32 with eager attention and random weights of
order 0.1 (norm gains around 1: `randomize`), so that logits are O(1) and a swapped or
mis-transposed tensor shows. `ARCHS` names every case the adapter tests run over
(tests/interop/hf/test_hf_adapters.py): each supported architecture, plus the variants that take
another path through its adapter (tied embeddings, head_dim ≠ hidden / heads, MoE layer rules,
DeepSeek's YaRN, no q_lora_rank, rotate-half RoPE). Callers skip first where transformers is
absent (`pytest.importorskip("transformers")`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
import transformers

from mlm.convert.hf import io as hf_io

VOCAB = 300  # not a multiple of 128: exercises the padding of the embedding rows
SEQ = 64  # > original_max_position_embeddings (32), so llama3 scaling changes the frequencies
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}

_GAINS = ("norm.weight", "layernorm.weight", "ln_1.weight", "ln_2.weight", "ln_f.weight", "norm_f.weight")


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights of order 0.1 and norm gains around 1, so that logits are O(1) and a swapped or
    mis-transposed tensor shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = 0.1 * torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + noise if name.endswith(_GAINS) else noise)


def _build(cls: str, config: transformers.PretrainedConfig, seed: int) -> torch.nn.Module:
    """A transformers model of class `cls` with random weights; skipped where this transformers
    lacks the class (Mixtral came in 4.36, Qwen2-MoE in 4.40, Qwen3-MoE and DeepSeek-V3 in 4.51)."""
    if not hasattr(transformers, cls):
        pytest.skip(f"transformers {transformers.__version__} has no {cls}")
    torch.manual_seed(0)
    model = getattr(transformers, cls)(config).float().eval()
    randomize(model, seed)
    return model


# ---------------------------------------------------------------- dense


TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    attn_implementation="eager",
)
"""The shape of the tiny Llama-family models (GQA: 4 heads over 2 key-value heads)."""


def llama(tie: bool, seed: int = 1, **config) -> torch.nn.Module:
    """A tiny random LlamaForCausalLM (GQA, llama3 RoPE scaling); `config` overrides fields."""
    defaults = dict(TINY, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=dict(LLAMA3_ROPE))
    cfg = transformers.LlamaConfig(**{**defaults, **config, "tie_word_embeddings": tie})
    return _build("LlamaForCausalLM", cfg, seed)


def mistral(sliding_window: int | None) -> torch.nn.Module:
    """A tiny random MistralForCausalLM (Llama's layout); mlm computes it where the sliding window
    is absent or covers the whole context."""
    return _build("MistralForCausalLM", transformers.MistralConfig(**TINY, sliding_window=sliding_window), 3)


def gpt2(tie: bool) -> torch.nn.Module:
    cfg = transformers.GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=128,
        tie_word_embeddings=tie,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="eager",
    )
    return _build("GPT2LMHeadModel", cfg, 2)


def qwen(version: int, tie: bool, seed: int = 3) -> torch.nn.Module:
    """A tiny random dense Qwen2 (q/k/v biases) or Qwen3 (q/k norms, head_dim 32 ≠ hidden / heads)."""
    common = dict(TINY, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=tie)
    if version == 2:
        return _build("Qwen2ForCausalLM", transformers.Qwen2Config(**common), seed)
    return _build("Qwen3ForCausalLM", transformers.Qwen3Config(**common, head_dim=32), seed)


# ---------------------------------------------------------------- mixtures of experts


MOE_SEQ = 48
MOE_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    num_experts_per_tok=2,
    router_aux_loss_coef=0.0,  # balancing losses off
    output_router_logits=False,
    attn_implementation="eager",
)


def _moe(cls: str, config_cls: str, **config) -> torch.nn.Module:
    if not hasattr(transformers, config_cls):
        pytest.skip(f"transformers {transformers.__version__} has no {cls}")
    return _build(cls, getattr(transformers, config_cls)(**{**MOE_COMMON, **config}), 7)


def mixtral(**config) -> torch.nn.Module:
    defaults = dict(num_hidden_layers=2, intermediate_size=48, num_local_experts=4)
    return _moe("MixtralForCausalLM", "MixtralConfig", **{**defaults, **config})


def qwen2_moe(**config) -> torch.nn.Module:
    defaults = dict(
        num_hidden_layers=3,
        intermediate_size=96,
        moe_intermediate_size=48,
        shared_expert_intermediate_size=80,
        num_experts=4,
    )
    return _moe("Qwen2MoeForCausalLM", "Qwen2MoeConfig", **{**defaults, **config})


def qwen3_moe(**config) -> torch.nn.Module:
    defaults = dict(
        num_hidden_layers=2,
        intermediate_size=96,
        moe_intermediate_size=48,
        num_experts=4,
        head_dim=32,  # ≠ hidden / heads (16): kv_channels
        norm_topk_prob=True,
    )
    return _moe("Qwen3MoeForCausalLM", "Qwen3MoeConfig", **{**defaults, **config})


# ---------------------------------------------------------------- DeepSeek-V3


DS_VOCAB, DS_SEQ, DS_LAYERS = 100, 40, 3
YARN = {  # copied for every use: transformers adds rope_theta to the dict it is given
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 32,  # < DS_SEQ (and × factor = max_position_embeddings)
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,  # also scales the softmax, as DeepSeek-V3's config does
}


def deepseek(seed: int = 7, **config) -> torch.nn.Module:
    """A tiny random DeepseekV3ForCausalLM (vocab 100, hidden 32, 3 layers: one dense, two MoE
    with 8 experts in 4 groups, top-4 from 2 groups so that k / topk_group = 2 as transformers
    hard-codes, a shared expert, MLA with q_lora_rank 16, kv_lora_rank 12, nope 8, rope 4, v 6),
    with random non-negative expert biases (transformers initialises them to zero); `config`
    overrides fields."""
    if not hasattr(transformers, "DeepseekV3Config"):
        pytest.skip(f"transformers {transformers.__version__} has no DeepseekV3ForCausalLM (it came in 4.51)")
    defaults = dict(
        vocab_size=DS_VOCAB,
        hidden_size=32,
        intermediate_size=40,
        moe_intermediate_size=16,
        num_hidden_layers=DS_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=4,
        first_k_dense_replace=1,
        n_routed_experts=8,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=4,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        q_lora_rank=16,
        kv_lora_rank=12,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=6,
        max_position_embeddings=128,
        num_nextn_predict_layers=0,  # transformers' model holds no MTP layers
        attn_implementation="eager",
    )
    model = _build("DeepseekV3ForCausalLM", transformers.DeepseekV3Config(**{**defaults, **config}), seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # a buffer, zero in transformers: random, ≥ 0 (see mlm/convert/hf/deepseek_v3.py)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.2 * torch.rand(buf.shape, generator=gen))
    return model


# ---------------------------------------------------------------- hybrid


MAMBA_SEQ = 40  # not a multiple of the chunk (16)


def mamba2(**config) -> torch.nn.Module:
    """Mamba-2: 8 heads of 8 channels in 2 groups, state 16, chunks of 16 (the scan crosses chunks)."""
    base = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_heads=8,
        head_dim=8,
        expand=2,
        state_size=16,
        n_groups=2,
        conv_kernel=4,
        chunk_size=16,
        num_hidden_layers=3,
        tie_word_embeddings=False,
    )
    return _build("Mamba2ForCausalLM", transformers.Mamba2Config(**(base | config)), seed=11)


def nemotron_h(**config) -> torch.nn.Module:
    """Nemotron-H: Mamba-2 blocks (as mamba2's), attention (GQA 4/2, no positions), squared-ReLU
    MLPs, blocks M - * - M M - (mlm's layers M-, *-, M, M-)."""
    base = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        layers_block_type=["mamba", "mlp", "attention", "mlp", "mamba", "mamba", "mlp"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=48,
        mamba_num_heads=8,
        mamba_head_dim=8,
        ssm_state_size=16,
        n_groups=2,
        conv_kernel=4,
        chunk_size=16,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    model = _build("NemotronHForCausalLM", transformers.NemotronHConfig(**(base | config)), seed=13)
    gen = torch.Generator().manual_seed(14)
    with torch.no_grad():  # the router's correction bias is a buffer, zero in transformers: random here
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.2 * torch.rand(buf.shape, generator=gen))
    return model


NEMOTRON_MOE = dict(
    layers_block_type=["mamba", "moe", "attention", "mlp", "mamba", "moe"],
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=24,
    moe_shared_expert_intermediate_size=20,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
)
"""Nemotron-H's MoE blocks: 4 non-gated experts in 2 groups, top-2 from 1 group (k = 2 × topk_group,
as transformers' top-2 group scores need), a shared expert, scaled weights."""


def qwen3_next(**config) -> torch.nn.Module:
    """Qwen3-Next: Gated DeltaNet (2 key heads, 4 value heads of 8) and gated attention layers (4
    heads of 16, 2 KV heads, RoPE on 4 of each head's 16 dims) alternating; MoE layers (4 experts,
    top-2, a gated shared expert) but the last, which is dense (mlp_only_layers)."""
    base = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=4,
        full_attention_interval=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=48,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=20,
        mlp_only_layers=[3],
        max_position_embeddings=128,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    return _build("Qwen3NextForCausalLM", transformers.Qwen3NextConfig(**(base | config)), seed=17)


# ---------------------------------------------------------------- the cases


@dataclass(frozen=True)
class Arch:
    """One case of the adapter tests: `build` makes the transformers model."""

    build: Callable[[], torch.nn.Module]
    family: str  # "dense", "moe" or "mla"
    seq: int = SEQ
    saved_keys: tuple[str, ...] = ()
    """Fragments some key of the saved files holds (the experts one by one, as the files hold them)."""
    toml: tuple[str, ...] = ()
    """Lines the imported config.toml holds."""
    exported: dict = field(default_factory=dict)
    """Fields of the exported config.json."""

    @property
    def relative(self) -> bool:
        """Logits compared within 1e-5 of the largest |logit| (MoE, MLA), not 1e-5 absolute (dense)."""
        return self.family != "dense"

    @property
    def cli_relative(self) -> bool:
        """The CLI's verified logits compared within 1e-5 of the largest |logit| (MLA, hybrid)."""
        return self.family in ("mla", "hybrid")


_MOE = dict(family="moe", seq=MOE_SEQ, saved_keys=(".experts.3.",))
_MLA = dict(family="mla", seq=DS_SEQ, saved_keys=(".experts.7.", "e_score_correction_bias"))
_HYBRID = dict(family="hybrid", seq=MAMBA_SEQ)
ARCHS: dict[str, Arch] = {
    "llama": Arch(lambda: llama(tie=False), "dense"),
    "llama-tied": Arch(lambda: llama(tie=True), "dense"),
    "llama-head-dim": Arch(lambda: llama(tie=False, head_dim=32), "dense"),  # kv_channels
    "mistral": Arch(lambda: mistral(None), "dense", exported={"sliding_window": None}),
    # a window as long as the context is full attention
    "mistral-window-128": Arch(lambda: mistral(128), "dense", exported={"sliding_window": None}),
    "gpt2": Arch(lambda: gpt2(tie=True), "dense"),
    "gpt2-untied": Arch(lambda: gpt2(tie=False), "dense"),
    "qwen2-tied": Arch(lambda: qwen(2, tie=True), "dense"),
    "qwen3": Arch(lambda: qwen(3, tie=False), "dense"),
    "mixtral": Arch(lambda: mixtral(), **_MOE),
    "mixtral-tied": Arch(lambda: mixtral(tie_word_embeddings=True), **_MOE),
    "qwen2_moe": Arch(lambda: qwen2_moe(), **_MOE),  # norm_topk_prob=false: router_pre_softmax
    # 4 layers, step 2, layer 3 dense by list: experts in layer 1 only
    "qwen2_moe-sparse": Arch(
        lambda: qwen2_moe(
            num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=True
        ),
        **_MOE,
        toml=('mlp_kind = "moe"', "mlp_kind_freq = [0, 1, 0, 0]"),
    ),
    "qwen3_moe": Arch(lambda: qwen3_moe(), **_MOE),
    "qwen3_moe-sparse": Arch(
        lambda: qwen3_moe(num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=False), **_MOE
    ),
    "deepseek_v3": Arch(lambda: deepseek(), **_MLA),
    "deepseek_v3-yarn": Arch(lambda: deepseek(rope_scaling=dict(YARN)), **_MLA),
    "deepseek_v3-no-q-lora": Arch(lambda: deepseek(q_lora_rank=None), **_MLA),
    "deepseek_v3-rotate-half": Arch(lambda: deepseek(rope_interleave=False, rope_scaling=dict(YARN)), **_MLA),
    "deepseek_v3-tied": Arch(
        lambda: deepseek(tie_word_embeddings=True, first_k_dense_replace=0, n_group=1, topk_group=1), **_MLA
    ),
    "mamba2": Arch(lambda: mamba2(), **_HYBRID, saved_keys=("mixer.in_proj", "mixer.conv1d")),
    "mamba2-tied": Arch(lambda: mamba2(tie_word_embeddings=True, num_hidden_layers=2), **_HYBRID),
    "nemotron_h": Arch(lambda: nemotron_h(), **_HYBRID, toml=('layer_pattern = "M-*-MM-"',)),
    "nemotron_h-moe": Arch(
        lambda: nemotron_h(**NEMOTRON_MOE),
        **_HYBRID,
        saved_keys=(".mixer.experts.3.", "e_score_correction_bias"),
        toml=('layer_pattern = "ME*-ME"',),
    ),
    "qwen3_next": Arch(
        lambda: qwen3_next(),
        **_HYBRID,
        saved_keys=("linear_attn.in_proj_qkvz", ".experts.3.", "shared_expert_gate"),
        toml=('layer_pattern = "GE*EGE*-"',),
    ),
    # attention first, an MLP block after another (mlm's layer with no mixer); transformers 5.24
    # never ties Nemotron-H's embeddings (its tie_word_embeddings leaves lm_head its own)
    "nemotron_h-mlp-only": Arch(
        lambda: nemotron_h(layers_block_type=["attention", "mamba", "mlp", "mlp"]),
        **_HYBRID,
        toml=('layer_pattern = "*M--"',),
    ),
}


def tokens(batch: int, seq: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def read_folder(path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face folder's weight files, as stored."""
    state = {}
    for _, tensors in hf_io.iter_weight_files(path):
        state.update(tensors)
    return state


def saved(model, path) -> dict[str, torch.Tensor]:
    """The tensors `save_pretrained` writes (per-expert keys), as stored."""
    model.save_pretrained(path)
    return read_folder(path)
