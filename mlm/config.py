"""Run configuration: nested dataclasses, TOML files and `--set section.key=value` overrides.

A run config is a TOML file whose tables are the sections below; `preset = "NAME"` fills the
model (and the seq length) from `mlm.presets`. Each config validates itself in `__post_init__`
and names the field, the value and the rule. Field docstrings are read back by `field_docs`,
so `mlm config show` prints each value with its meaning.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import math
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

from mlm.errors import MlmError
from mlm.hardware import ALIASES, PROFILES, profile_name

MAX_LAYERS = 4096
"""The most layers (MTP depths included) a model may have: validating a config walks its layers."""


def ensure(cond: bool, msg: str) -> None:
    """MlmError(msg) unless `cond` (the configs' and the kinds' specs' validation)."""
    if not cond:
        raise MlmError(msg)


def _choice(section: str, name: str, value, choices) -> None:
    ensure(value in choices, f"{section}.{name}={value!r}: must be one of {', '.join(map(str, choices))}")


class LayerSpec(typing.NamedTuple):
    """The kinds of one layer (`mlm.model.kinds`): its mixer and its MLP (either may be None: a
    layer with one half only) and its norm. A tuple: the planner keys its tables by it."""

    mixer: str | None
    mlp: str | None
    norm: str

    def __str__(self) -> str:
        parts = " + ".join(k for k in (self.mixer, self.mlp) if k is not None)
        return f"{parts} ({self.norm})"


def describe_layers(specs: list[LayerSpec]) -> str:
    """Runs of equal layers: "0-1: gqa + dense (rmsnorm); 2: gqa + moe (rmsnorm)"."""
    runs: list[list] = []
    for i, spec in enumerate(specs):
        if runs and runs[-1][2] == spec:
            runs[-1][1] = i
        else:
            runs.append([i, i, spec])
    return "; ".join(f"{a}{f'-{b}' if b > a else ''}: {spec}" for a, b, spec in runs)


@dataclass
class MoEConfig:
    """Mixture of experts (the layers whose mlp kind is "moe"): Megatron's --moe-* options."""

    num_experts: int = 0
    """Routed experts per MoE layer (Megatron's num_moe_experts, HF's num_local_experts)."""
    ffn_hidden_size: int | None = None
    """Each expert's MLP width (moe_ffn_hidden_size, HF's moe_intermediate_size); unset: model.ffn_hidden_size."""
    router_topk: int = 2
    """Experts each token goes to (k)."""
    router_score_function: str = "softmax"
    """softmax or sigmoid over the router logits (computed in fp32)."""
    router_pre_softmax: bool = False
    """softmax over all experts before top-k, weights not renormalised (Qwen2-MoE); else top-k, then softmax over the k."""
    router_num_groups: int | None = None
    """Group-limited routing: experts form this many groups (DeepSeek's n_group); unset: off."""
    router_group_topk: int | None = None
    """Group-limited routing: the groups each token may use (DeepSeek's topk_group)."""
    router_topk_scaling_factor: float | None = None
    """Multiply the top-k weights by this (DeepSeek's routed_scaling_factor); unset: 1."""
    router_enable_expert_bias: bool = False
    """Aux-loss-free balancing: a per-expert bias used only to select experts, updated once per step."""
    router_bias_update_rate: float = 1e-3
    """Expert bias update: bias += rate · sign(mean load − load), per global batch."""
    aux_loss_coeff: float = 0.0
    """Load-balancing loss (Switch/GShard, per micro-batch) coefficient; 0: off."""
    seq_aux_loss_coeff: float = 0.0
    """Sequence-wise load-balancing loss (DeepSeek-V2/V3) coefficient; 0: off."""
    z_loss_coeff: float = 0.0
    """Router z-loss (mean logsumexp² of the logits) coefficient; 0: off."""
    capacity_factor: float | None = None
    """Token dropping: each expert takes at most ceil(tokens · k / experts · factor) tokens per micro-batch; unset: dropless."""
    pad_to_capacity: bool = False
    """With capacity_factor: every expert computes exactly its capacity (padded), for static shapes."""
    token_drop_policy: str = "probs"
    """Which tokens an over-full expert keeps: probs (the highest weights) or position (the first ones)."""
    shared_expert_ffn_hidden_size: int | None = None
    """Shared experts' total MLP width (moe_shared_expert_intermediate_size); unset: none."""
    shared_expert_gate: bool = False
    """Scale the shared experts' output by sigmoid(x · w) (Qwen2-MoE's shared_expert_gate)."""
    token_dispatcher: str = "alltoall"
    """Expert parallelism's token exchange: alltoall (tokens to their experts' ranks) or allgather (all tokens to all ranks)."""
    experts_impl: str = "auto"
    """Expert matmuls: grouped_mm (torch._grouped_mm), bmm (padded batched matmul), loop (one per expert) or auto."""

    def __post_init__(self):
        s = "model.moe"
        ensure(self.num_experts >= 0, f"{s}.num_experts={self.num_experts}: must be >= 0")
        for name in ("ffn_hidden_size", "shared_expert_ffn_hidden_size"):
            n = getattr(self, name)
            ensure(n is None or n > 0, f"{s}.{name}={n}: must be positive (or unset)")
        ensure(self.router_topk >= 1, f"{s}.router_topk={self.router_topk}: must be at least 1")
        _choice(s, "router_score_function", self.router_score_function, ("softmax", "sigmoid"))
        ensure(
            not (self.router_pre_softmax and self.router_score_function == "sigmoid"),
            f"{s}.router_pre_softmax=true needs router_score_function=softmax (a sigmoid has no 'before top-k')",
        )
        ensure(
            not self.router_enable_expert_bias or self.router_score_function == "sigmoid",
            f"{s}.router_enable_expert_bias=true needs router_score_function=sigmoid (the bias selects "
            "among sigmoid scores, as in DeepSeek-V3 and Megatron)",
        )
        _choice(s, "token_drop_policy", self.token_drop_policy, ("probs", "position"))
        _choice(s, "token_dispatcher", self.token_dispatcher, ("alltoall", "allgather"))
        _choice(s, "experts_impl", self.experts_impl, ("auto", "grouped_mm", "bmm", "loop"))
        ensure(
            self.capacity_factor is None or self.capacity_factor > 0,
            f"{s}.capacity_factor={self.capacity_factor}: must be positive (or unset for dropless)",
        )
        ensure(
            not self.pad_to_capacity or self.capacity_factor is not None,
            f"{s}.pad_to_capacity=true needs {s}.capacity_factor (the capacity to pad to)",
        )
        for name in ("aux_loss_coeff", "seq_aux_loss_coeff", "z_loss_coeff", "router_bias_update_rate"):
            ensure(getattr(self, name) >= 0, f"{s}.{name}={getattr(self, name)}: must be >= 0")
        groups, group_topk = self.router_num_groups, self.router_group_topk
        ensure(
            (groups is None) == (group_topk is None),
            f"{s}.router_num_groups={groups}, router_group_topk={group_topk}: set both (group-limited routing) or neither",
        )
        if not self.num_experts:
            return
        E, k = self.num_experts, self.router_topk
        ensure(
            k <= E,
            f"{s}.router_topk={k} exceeds {s}.num_experts={E}: a token cannot go to more experts than exist",
        )
        if groups is not None:
            ensure(
                groups >= 1 and E % groups == 0,
                f"{s}.router_num_groups={groups} does not divide {s}.num_experts={E}; choose a divisor of {E}",
            )
            ensure(
                1 <= group_topk <= groups,
                f"{s}.router_group_topk={group_topk} exceeds {s}.router_num_groups={groups}: "
                f"a token can use at most all {groups} groups",
            )
            ensure(
                k % group_topk == 0 and k // group_topk <= E // groups,
                f"{s}.router_topk={k} over router_group_topk={group_topk} groups: k must be a multiple of "
                f"group_topk with at most {E // groups} (experts per group) from each group",
            )


@dataclass
class MLAConfig:
    """Multi-Latent Attention (attention_kind = "mla"; DeepSeek-V2/V3, Megatron's MLATransformerConfig):
    keys and values come up from one compressed latent per token, queries optionally from another,
    and each head's query/key has a part without position (nope) and a RoPE part shared by all heads."""

    q_lora_rank: int | None = None
    """Query down-projection width (HF's q_lora_rank); unset: queries projected straight from the hidden state."""
    kv_lora_rank: int = 512
    """Key/value latent width (HF's kv_lora_rank): what serving caches per token, with the rope key."""
    qk_nope_head_dim: int = 128
    """Per-head query/key dims without position (Megatron's qk_head_dim)."""
    qk_rope_head_dim: int = 64
    """Per-head query/key dims with RoPE, the key part shared by all heads (Megatron's qk_pos_emb_head_dim)."""
    v_head_dim: int = 128
    """Per-head value dims."""
    rope_interleave: bool = True
    """RoPE on adjacent pairs of the rope dims (DeepSeek's layout, HF's rope_interleave); false: rotate-half."""

    def __post_init__(self):
        s = "model.mla"
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            ensure(getattr(self, name) > 0, f"{s}.{name}={getattr(self, name)}: must be positive")
        ensure(
            self.q_lora_rank is None or self.q_lora_rank > 0,
            f"{s}.q_lora_rank={self.q_lora_rank}: must be positive (or unset: no query down-projection)",
        )
        ensure(
            self.qk_rope_head_dim % 2 == 0,
            f"{s}.qk_rope_head_dim={self.qk_rope_head_dim}: RoPE rotates pairs of dims; make it even",
        )

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass
class MambaConfig:
    """Mamba-2 layers (mixer kind "mamba", pattern symbol M; Megatron's MambaMixer, HF's Mamba2 and
    Nemotron-H): an input projection to z, x, B, C and dt, a causal depthwise convolution over x, B
    and C, the chunked state-space scan (SSD), a gated RMSNorm per group, an output projection."""

    num_heads: int | None = None
    """SSM heads (Megatron's mamba_num_heads); unset: 2 × hidden_size / head_dim (expand 2)."""
    head_dim: int = 64
    """Channels per head P (mamba_head_dim); the inner width is num_heads × head_dim."""
    state_dim: int = 128
    """State width N per head (mamba_state_dim, HF's state_size)."""
    num_groups: int = 8
    """Groups of B and C (mamba_num_groups, HF's n_groups); consecutive heads share a group."""
    conv_kernel: int = 4
    """Taps of the causal depthwise convolution (HF's conv_kernel)."""
    chunk_size: int = 128
    """Tokens per chunk of the scan (HF's chunk_size); changes rounding, not the result."""
    dt_min: float = 0.001
    """Init: the time step is drawn log-uniform in [dt_min, dt_max] (dt_bias = its inverse softplus)."""
    dt_max: float = 0.1
    """Init: the largest drawn time step."""
    dt_init_floor: float = 0.0001
    """Init: drawn time steps below this are raised to it."""
    dt_limit_min: float = 0.0
    """The time step after softplus is clamped to at least this (HF's time_step_limit[0])."""
    dt_limit_max: float | None = None
    """The time step is clamped to at most this (HF's time_step_limit[1]); unset: no upper limit."""
    A_init_min: float = 1.0
    """Init: −A per head drawn uniform in [A_init_min, A_init_max] (A_log = its log)."""
    A_init_max: float = 16.0
    """Init: the largest drawn −A."""

    def __post_init__(self):
        s = "model.mamba"
        for name in ("head_dim", "state_dim", "num_groups", "conv_kernel", "chunk_size"):
            ensure(getattr(self, name) > 0, f"{s}.{name}={getattr(self, name)}: must be positive")
        ensure(
            self.num_heads is None or self.num_heads > 0,
            f"{s}.num_heads={self.num_heads}: must be positive (or unset for 2 × hidden_size / head_dim)",
        )
        ensure(
            0 < self.dt_min <= self.dt_max,
            f"{s}.dt_min={self.dt_min}, dt_max={self.dt_max}: need 0 < dt_min <= dt_max",
        )
        ensure(
            self.dt_limit_max is None or self.dt_limit_min < self.dt_limit_max,
            f"{s}.dt_limit_min={self.dt_limit_min} >= dt_limit_max={self.dt_limit_max}: the clamp would be empty",
        )
        ensure(
            0 < self.A_init_min <= self.A_init_max,
            f"{s}.A_init_min={self.A_init_min}, A_init_max={self.A_init_max}: need 0 < min <= max",
        )

    def heads(self, hidden_size: int) -> int:
        return self.num_heads or 2 * hidden_size // self.head_dim

    def inner(self, hidden_size: int) -> int:
        """The inner width d_inner = heads × head_dim."""
        return self.heads(hidden_size) * self.head_dim

    def conv_width(self, hidden_size: int) -> int:
        """Channels the convolution runs over: x, B and C."""
        return self.inner(hidden_size) + 2 * self.num_groups * self.state_dim


@dataclass
class GatedDeltaNetConfig:
    """Gated DeltaNet layers (mixer kind "gdn", pattern symbol G; Qwen3-Next's linear attention,
    Megatron's GatedDeltaNet, HF's Qwen3NextGatedDeltaNet): projections to q, k (key heads), v, z
    (value heads), b and a (one each per value head), a causal depthwise convolution over q, k and
    v, the chunked gated delta rule, a gated RMSNorm per value head, an output projection.
    Defaults: Qwen3-Next-80B-A3B's heads and dims, the 4 taps and 64-token chunks of HF and FLA, −A
    drawn as Megatron's GatedDeltaNet draws it."""

    num_key_heads: int = 16
    """Heads of q and k (HF's linear_num_key_heads); each serves num_value_heads / num_key_heads value heads."""
    num_value_heads: int = 32
    """Heads of v, z, the state and the output (HF's linear_num_value_heads)."""
    key_head_dim: int = 128
    """Channels d_k per query and key head (HF's linear_key_head_dim); the state is d_k × d_v per value head."""
    value_head_dim: int = 128
    """Channels d_v per value head (HF's linear_value_head_dim)."""
    conv_kernel: int = 4
    """Taps of the causal depthwise convolution over q, k and v (HF's linear_conv_kernel_dim)."""
    chunk_size: int = 64
    """Tokens per chunk of the delta rule (FLA's and HF's 64); changes rounding, not the result."""
    A_init_min: float = 1.0
    """Init: −A per value head drawn uniform in [A_init_min, A_init_max] (A_log = its log); Megatron's (1, 16), HF draws from (0.01, 16)."""
    A_init_max: float = 16.0
    """Init: the largest drawn −A."""

    def __post_init__(self):
        s = "model.gdn"
        for name in ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim", "conv_kernel"):
            ensure(getattr(self, name) > 0, f"{s}.{name}={getattr(self, name)}: must be positive")
        ensure(self.chunk_size > 0, f"{s}.chunk_size={self.chunk_size}: must be positive")
        ensure(
            self.num_value_heads % self.num_key_heads == 0,
            f"{s}.num_value_heads={self.num_value_heads} is not a multiple of num_key_heads="
            f"{self.num_key_heads}: each key head serves a whole number of value heads (Qwen3-Next's 16 and 32)",
        )
        ensure(
            0 < self.A_init_min <= self.A_init_max,
            f"{s}.A_init_min={self.A_init_min}, A_init_max={self.A_init_max}: need 0 < min <= max",
        )

    @property
    def key_dim(self) -> int:
        """Width of q (and of k): num_key_heads × key_head_dim."""
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        """Width of v, z and the output: num_value_heads × value_head_dim."""
        return self.num_value_heads * self.value_head_dim


@dataclass
class ModelConfig:
    """The transformer: GPT-2 or Llama style, from the same fields."""

    num_layers: int = 2
    """Transformer layers."""
    hidden_size: int = 64
    """Model width (d_model)."""
    num_attention_heads: int = 4
    """Attention heads."""
    num_query_groups: int | None = None
    """Key/value heads for GQA/MQA; unset means one per attention head (MHA)."""
    kv_channels: int | None = None
    """Head dim (Megatron's kv_channels, HF's head_dim); unset means hidden_size / num_attention_heads."""
    ffn_hidden_size: int | None = None
    """MLP width; unset means 4 × hidden_size."""
    vocab_size: int = 256
    """Tokenizer vocabulary size (the embedding is padded up, see make_vocab_size_divisible_by)."""
    make_vocab_size_divisible_by: int = 128
    """Pad the embedding rows to a multiple of this (Megatron's padding, times tp)."""
    max_position_embeddings: int = 256
    """Longest sequence the model supports (learned positions, RoPE tables)."""
    normalization: str = "rmsnorm"
    """Norm kind: layernorm (GPT-2) or rmsnorm (Llama)."""
    norm_eps: float = 1e-5
    """Epsilon of the normalisation layers."""
    position_embedding: str = "rope"
    """learned (GPT-2), rope (Llama) or none (no positions: Nemotron-H's attention; Mamba layers need none)."""
    rope_base: float = 10000.0
    """RoPE base frequency (theta)."""
    rope_scaling_factor: float | None = None
    """RoPE frequency scaling factor (Llama-3.1's 8.0, DeepSeek-V3's YaRN 40.0); unset means none."""
    rope_low_freq_factor: float = 1.0
    """Llama-3.1 scaling: low-frequency factor."""
    rope_high_freq_factor: float = 4.0
    """Llama-3.1 scaling: high-frequency factor."""
    rope_original_max_position_embeddings: int = 8192
    """RoPE scaling: the context length the model was pretrained with."""
    rope_scaling_type: str = "llama3"
    """What rope_scaling_factor does: llama3 (Llama-3.1's frequency bands) or yarn (YaRN, as DeepSeek-V3 configures it)."""
    rope_yarn_beta_fast: float = 32.0
    """YaRN: rotations below which dims are extrapolated (beta_fast)."""
    rope_yarn_beta_slow: float = 1.0
    """YaRN: rotations above which dims are interpolated (beta_slow)."""
    rope_yarn_mscale: float = 1.0
    """YaRN: cos and sin × (0.1·mscale·ln(factor) + 1) / (the same with mscale_all_dim) when both are nonzero; else × (0.1·ln(factor) + 1)."""
    rope_yarn_mscale_all_dim: float = 0.0
    """YaRN: mscale_all_dim; nonzero also scales MLA's softmax by (0.1·it·ln(factor) + 1)² (DeepSeek); 0: off."""
    activation: str = "swiglu"
    """swiglu (Llama), gelu_tanh (GPT-2), gelu or squared_relu (relu(x)², Nemotron-H; not gated)."""
    add_bias: bool = False
    """Biases in linear layers (GPT-2: true)."""
    tie_embeddings: bool = False
    """Share the input embedding with the output layer."""
    hidden_dropout: float = 0.0
    """Dropout after attention and MLP, and on embeddings."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities."""
    init_std: float = 0.02
    """Std of the normal init; output projections use init_std / sqrt(2 × num_layers)."""
    attention_backend: str = "auto"
    """auto, sdpa, flash (flash-attn) or te (Transformer Engine); auto picks the fastest available."""
    kernels: str = "auto"
    """Norms, MLP activations, RoPE and Mamba-2's scan: torch, triton (the `kernels` package) or auto (triton on CUDA when importable, else torch)."""
    fp32_residual_connection: bool = False
    """Keep the residual stream (the layers' inputs and adds) in fp32 under bf16/fp16 autocast; by default it is in the autocast dtype (Megatron's name and default)."""
    recompute: str = "none"
    """Activation recompute: none, selective (attention core) or full (each layer)."""
    fused_cross_entropy: bool = False
    """Compute the loss with the chunked linear + cross-entropy (Liger/Megatron style, mlm.parallel.cross_entropy), never holding the [tokens, vocab] logits."""
    train_padded_vocab: bool = False
    """Megatron-LM's loss: the softmax covers the vocabulary's padding rows (make_vocab_size_divisible_by), which are initialised and trained like the others. Off (mlm): they stay zero and outside the softmax."""
    layer_pattern: str = ""
    """Every layer's kinds as Megatron's hybrid layer pattern: * gqa, + mla, - dense, E moe (and the symbols registered kinds add); a mixer and the MLP after it are one layer; /X per MTP depth. Empty: from the four fields below."""
    attention_kind: str = "gqa"
    """Mixer of every layer without layer_pattern: gqa (multi-head, grouped-query or multi-query attention) or mla (multi-latent, see model.mla)."""
    mlp_kind: str = "dense"
    """MLP of the layers that mlp_kind_freq and first_k_dense select (without layer_pattern); the others are dense."""
    mlp_kind_freq: int | list[int] = 1
    """Which layers get mlp_kind (Megatron's moe_layer_freq): every Nth layer from 0, or a 0/1 list per layer."""
    first_k_dense: int = 0
    """The first k layers keep the dense MLP whatever mlp_kind_freq says (HF's first_k_dense_replace)."""
    qkv_bias: bool = False
    """Biases on the query, key and value projections only (Qwen2); add_bias puts them everywhere."""
    qk_norm: bool = False
    """RMSNorm over each head's query and key before RoPE (Qwen3's q_norm / k_norm)."""
    norm_zero_centered: bool = False
    """Norms compute x̂ · (1 + weight), weight initialised to 0 (every norm built from normalization: the layers', the final, MTP's, the q/k and MLA latent norms; not Mamba's or Gated DeltaNet's gated norms); Megatron's --apply-layernorm-1p, Qwen3-Next's."""
    attention_output_gate: bool = False
    """gqa: attention's output times sigmoid(gate(x)) per head and dim before the out-projection (a gate linear D → heads × head dim); Qwen3-Next's gated attention, Megatron's attention_output_gate."""
    rotary_percent: float = 1.0
    """The fraction of each head's dims RoPE rotates, the first ones (gqa; the rest pass through); Megatron's --rotary-percent, HF's partial_rotary_factor."""
    mtp_num_layers: int = 0
    """Multi-token prediction depths D (DeepSeek-V3's MTP modules, Megatron's mtp_num_layers); 0: none."""
    mtp_loss_scaling_factor: float = 0.1
    """Weight of the MTP losses: the total adds factor / D × Σ_k loss_k (Megatron's default 0.1)."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """Mixture-of-experts options, used by the layers whose mlp kind is moe."""
    mla: MLAConfig = field(default_factory=MLAConfig)
    """Multi-latent attention options, used when attention_kind is mla."""
    mamba: MambaConfig = field(default_factory=MambaConfig)
    """Mamba-2 options, used by the layers whose mixer kind is mamba (pattern symbol M)."""
    gdn: GatedDeltaNetConfig = field(default_factory=GatedDeltaNetConfig)
    """Gated DeltaNet options, used by the layers whose mixer kind is gdn (pattern symbol G)."""

    def __post_init__(self):
        s = "model"
        for name in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "vocab_size",
            "max_position_embeddings",
        ):
            ensure(getattr(self, name) > 0, f"{s}.{name}={getattr(self, name)}: must be positive")
        ensure(
            self.num_layers + self.mtp_num_layers <= MAX_LAYERS,
            f"model.num_layers={self.num_layers} (+ mtp_num_layers={self.mtp_num_layers}): more than "
            f"{MAX_LAYERS} layers, which mlm does not build (the deepest published models have about 200)",
        )
        ensure(
            self.kv_channels is None or self.kv_channels > 0,
            f"model.kv_channels={self.kv_channels}: must be positive (or unset for hidden / heads)",
        )
        freq = self.mlp_kind_freq
        if isinstance(freq, list):
            ensure(
                len(freq) == self.num_layers and set(freq) <= {0, 1},
                f"model.mlp_kind_freq={freq}: a list needs one 0 or 1 per layer ({self.num_layers} layers)",
            )
        else:
            ensure(freq >= 1, f"model.mlp_kind_freq={freq}: must be at least 1 (1: every layer)")
        ensure(
            0 <= self.first_k_dense <= self.num_layers,
            f"model.first_k_dense={self.first_k_dense}: must be within [0, num_layers={self.num_layers}]",
        )
        for name in ("mtp_num_layers", "mtp_loss_scaling_factor"):
            ensure(getattr(self, name) >= 0, f"model.{name}={getattr(self, name)}: must be >= 0 (0: no MTP)")
        ensure(
            not self.mtp_num_layers or self.position_embedding == "rope",
            f"model.mtp_num_layers={self.mtp_num_layers} with position_embedding={self.position_embedding!r}: "
            "MTP depths are built for rotary positions (DeepSeek-V3's); set model.position_embedding=rope "
            "or model.mtp_num_layers=0",
        )
        _choice(s, "rope_scaling_type", self.rope_scaling_type, ("llama3", "yarn"))
        ensure(
            self.rope_scaling_factor is None or self.rope_scaling_factor >= 1.0,
            f"model.rope_scaling_factor={self.rope_scaling_factor}: must be >= 1 (or unset)",
        )
        _choice(s, "position_embedding", self.position_embedding, ("learned", "rope", "none"))
        _choice(s, "activation", self.activation, ("swiglu", "gelu_tanh", "gelu", "squared_relu"))
        _choice(s, "attention_backend", self.attention_backend, ("auto", "sdpa", "flash", "te"))
        _choice(s, "kernels", self.kernels, ("torch", "triton", "auto"))
        _choice(s, "recompute", self.recompute, ("none", "selective", "full"))
        for name in ("hidden_dropout", "attention_dropout"):
            ensure(0.0 <= getattr(self, name) < 1.0, f"{s}.{name}={getattr(self, name)}: must be in [0, 1)")
        ensure(
            0.0 < self.rotary_percent <= 1.0,
            f"model.rotary_percent={self.rotary_percent}: must be in (0, 1] (the fraction of each head's "
            "dims RoPE rotates; 1: all of them)",
        )
        self._check_kinds()

    def check_depth(self, tensors: int, where: str) -> None:
        """MlmError unless the files at `where` hold at least one tensor per layer: a config that
        came with foreign weights is only a claim, checked before a model is built from it."""
        layers = self.num_layers + self.mtp_num_layers
        if layers > tensors:
            raise MlmError(
                f"{where}: the config says {layers} layers, but the weights hold {tensors} tensors (each "
                "layer has at least one); the config does not belong to these weights"
            )

    def _check_kinds(self) -> None:
        """The layers' kinds exist, the pattern agrees with the fields, and each kind accepts the
        config (its spec's `check`)."""
        from mlm.model import kinds
        from mlm.model.kinds.pattern import parse

        if self.layer_pattern:
            fields = {"attention_kind": "gqa", "mlp_kind": "dense", "mlp_kind_freq": 1, "first_k_dense": 0}
            given = [f"model.{k}={getattr(self, k)!r}" for k, v in fields.items() if getattr(self, k) != v]
            ensure(
                not given,
                f"model.layer_pattern={self.layer_pattern!r} with {', '.join(given)}: the pattern gives every "
                "layer's kinds; unset the fields (they choose kinds only without a pattern)",
            )
            layers, mtp = parse(self.layer_pattern)
            ensure(
                len(layers) == self.num_layers,
                f"model.layer_pattern={self.layer_pattern!r} has {len(layers)} layers (a mixer and the MLP "
                f"after it are one layer) but model.num_layers={self.num_layers}; set model.num_layers="
                f"{len(layers)}",
            )
            ensure(
                mtp == self.mtp_num_layers,
                f"model.layer_pattern={self.layer_pattern!r} has {mtp} MTP depths ('/') but "
                f"model.mtp_num_layers={self.mtp_num_layers}; make them agree",
            )
        kinds.norm(self.normalization)
        used = {
            (role, name)
            for spec in self.layer_specs()
            for role, name in (("mixer", spec.mixer), ("mlp", spec.mlp))
        }
        for role, name in sorted(used, key=lambda rn: (rn[0], rn[1] or "")):
            if name is not None:
                kinds.lookup(role, name).check(self)
        if self.rotary_percent != 1.0:  # a spec that rotates a fraction of its heads says so
            whole = [
                k
                for k in self.mixer_kinds()
                if kinds.mixer(k).rope_dim(self) and not kinds.mixer(k).partial_rope
            ]
            ensure(
                not whole,
                f"model.rotary_percent={self.rotary_percent} with the mixer kind {', '.join(whole)}: it rotates "
                "dims of its own choosing (MLA: model.mla.qk_rope_head_dim), not a fraction of the head; set "
                "model.rotary_percent=1",
            )
        ungated = [
            k for k in self.mixer_kinds() if kinds.mixer(k).attention and not kinds.mixer(k).output_gate
        ]
        ensure(
            not (self.attention_output_gate and ungated),
            f"model.attention_output_gate=true with the mixer kind {', '.join(ungated)}: it has no output gate "
            "(gqa has); set model.attention_output_gate=false",
        )
        ropes = {kinds.mixer(k).rope_dim(self) for k in self.mixer_kinds()} - {None}
        ensure(
            len(ropes) <= 1,
            f"model: the mixers {', '.join(self.mixer_kinds())} rotate {sorted(ropes)} dims per head; the "
            "model's RoPE tables are one size, so layers with RoPE must agree",
        )

    def _layers(self) -> _Layers:
        """The layers' kinds, computed once per distinct set of the fields that choose them (the
        planner asks thousands of times per search)."""
        freq = self.mlp_kind_freq
        return _layers(
            self.layer_pattern,
            self.attention_kind,
            self.mlp_kind,
            tuple(freq) if isinstance(freq, list) else freq,
            self.first_k_dense,
            self.num_layers,
            self.normalization,
        )

    def mixer_kinds(self) -> tuple[str, ...]:
        """The mixer kinds the layers use, in order of first use."""
        return self._layers().mixers

    def mlp_kinds(self) -> tuple[str, ...]:
        """The MLP kinds the layers use, in order of first use."""
        return self._layers().mlps

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def rope_dim(self) -> int | None:
        """The dims RoPE rotates per head (the mixers' common `rope_dim`: the head dim, MLA's
        qk_rope_head_dim); None when no layer uses RoPE."""
        from mlm.model import kinds

        dims = [kinds.mixer(k).rope_dim(self) for k in self.mixer_kinds()]
        return next((d for d in dims if d is not None), None)

    def layer_specs(self) -> list[LayerSpec]:
        """The kinds of every layer: from layer_pattern, else from attention_kind, mlp_kind,
        mlp_kind_freq, first_k_dense; and normalization (names only: `mlm.model.kinds` builds them)."""
        return list(self._layers().specs)

    def pattern(self) -> str:
        """The layers as a layer pattern (`model.layer_pattern` reads it back to the same layers)."""
        from mlm.model.kinds.pattern import format_pattern

        return format_pattern([(s.mixer, s.mlp) for s in self.layer_specs()], self.mtp_num_layers)

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def expert_ffn_size(self) -> int:
        return self.moe.ffn_hidden_size or self.ffn_size

    @staticmethod
    def kv_channels_from(hidden: int, heads: int, head_dim: int | None) -> int | None:
        """`kv_channels` for another format's head dim: None when it is absent or the default
        hidden / heads (so that configs read back compare equal), else the head dim."""
        return head_dim if head_dim is not None and (hidden % heads or head_dim != hidden // heads) else None

    def padded_vocab_size(self, tp: int = 1) -> int:
        multiple = self.make_vocab_size_divisible_by * tp
        return math.ceil(self.vocab_size / multiple) * multiple


@dataclass
class DataConfig:
    """Where samples come from (datasets made by `mlm data build`)."""

    data_path: list[str] = field(default_factory=list)
    """A dataset prefix, or weight-prefix pairs as strings: ["0.3", "a", "0.7", "b"]."""
    split: str = "969,30,1"
    """Shares of documents for train, valid, test."""
    seq_length: int = 256
    """Tokens per sample."""
    tokenizer: str = ""
    """Tokenizer for generated samples; default: the one recorded in the dataset's PREFIX.json."""
    cache_dir: str = ""
    """Sample-index cache; default: cache/ beside the first dataset."""
    reset_position_ids: bool = False
    """Positions restart after each end-of-document token (Megatron's --reset-position-ids)."""
    reset_attention_mask: bool = False
    """Attention stays within each document packed in a sequence (Megatron's --reset-attention-mask)."""
    packing: str = "first_fit"
    """Chat datasets: first_fit (conversations share sequences, each in the first with room) or
    none (one conversation per sequence, padded)."""

    def __post_init__(self):
        ensure(self.seq_length > 0, f"data.seq_length={self.seq_length}: must be positive")
        ensure(
            self.packing in ("first_fit", "none"),
            f"data.packing={self.packing!r}: must be first_fit or none",
        )


@dataclass
class OptimizerConfig:
    """AdamW and the learning-rate and weight-decay schedules (Megatron-LM's OptimizerParamScheduler
    formulas; docs/train.md sets mlm's defaults beside Megatron-LM's)."""

    lr: float = 3e-4
    """Peak learning rate."""
    min_lr: float = 3e-5
    """Learning rate at the end of the decay."""
    weight_decay: float = 0.1
    """AdamW weight decay (constant; see weight_decay_incr_style)."""
    weight_decay_exempt: str = "1d_and_embeddings"
    """Parameters without weight decay: 1d_and_embeddings (norms, biases, embeddings), 1d (norms and
    biases: Megatron-LM's rule) or none."""
    weight_decay_incr_style: str = "constant"
    """constant (weight_decay), or linear / cosine from start_weight_decay to end_weight_decay over
    the run (Megatron-LM's --weight-decay-incr-style)."""
    start_weight_decay: float | None = None
    """Weight decay at the first step, with an increasing style."""
    end_weight_decay: float | None = None
    """Weight decay at the last step, with an increasing style."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.95
    """AdamW beta2."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    clip_grad: float = 1.0
    """Clip gradients to this global L2 norm; 0 disables."""
    warmup_iters: int = 0
    """Linear warm-up iterations."""
    warmup_samples: int | None = None
    """Warm-up over this many samples instead, a fraction of a step included (Megatron-LM's
    --lr-warmup-samples; its scheduler counts samples)."""
    warmup_fraction: float | None = None
    """Warm-up over this fraction of the decay iterations instead (Megatron-LM's --lr-warmup-fraction)."""
    lr_warmup_init: float = 0.0
    """The learning rate the warm-up starts from (Megatron-LM's --lr-warmup-init)."""
    warmup_offset: int = 1
    """Warm-up step s (from 0) runs at lr_warmup_init + (lr - lr_warmup_init) * (s + warmup_offset) /
    warmup: 1 (mlm: the first step trains) or 0 (Megatron-LM, which steps its scheduler after the
    optimizer: the first step runs at lr_warmup_init)."""
    decay_style: str = "cosine"
    """cosine, linear, constant, inverse-square-root or wsd (warmup-stable-decay)."""
    decay_iters: int | None = None
    """Iterations over which the LR decays; unset means the whole run."""
    decay_samples: int | None = None
    """Samples over which the LR decays instead (Megatron-LM's --lr-decay-samples)."""
    wsd_decay_iters: int = 0
    """wsd: iterations of the final decay, which ends at decay_iters."""
    wsd_decay_samples: int | None = None
    """wsd: the final decay in samples instead (Megatron-LM's --lr-wsd-decay-samples)."""
    wsd_decay_style: str = "linear"
    """wsd: the final decay's shape: linear, cosine, exponential or minus_sqrt (Megatron-LM's
    --lr-wsd-decay-style)."""

    def __post_init__(self):
        styles = ("cosine", "linear", "constant", "inverse-square-root", "wsd")
        _choice("optimizer", "decay_style", self.decay_style, styles)
        _choice(
            "optimizer",
            "wsd_decay_style",
            self.wsd_decay_style,
            ("linear", "cosine", "exponential", "minus_sqrt"),
        )
        _choice(
            "optimizer", "weight_decay_exempt", self.weight_decay_exempt, ("1d_and_embeddings", "1d", "none")
        )
        _choice(
            "optimizer",
            "weight_decay_incr_style",
            self.weight_decay_incr_style,
            ("constant", "linear", "cosine"),
        )
        _choice("optimizer", "warmup_offset", self.warmup_offset, (0, 1))
        ensure(self.lr > 0, f"optimizer.lr={self.lr}: must be positive")
        ensure(
            0 <= self.min_lr <= self.lr, f"optimizer.min_lr={self.min_lr}: must be within [0, lr={self.lr}]"
        )
        ensure(
            0 <= self.lr_warmup_init <= self.lr,
            f"optimizer.lr_warmup_init={self.lr_warmup_init}: must be within [0, lr={self.lr}]",
        )
        ensure(self.warmup_iters >= 0, f"optimizer.warmup_iters={self.warmup_iters}: must be >= 0")
        if self.warmup_fraction is not None:
            ensure(
                0 <= self.warmup_fraction < 1 and not self.warmup_iters,
                f"optimizer.warmup_fraction={self.warmup_fraction}: must be within [0, 1), with "
                "optimizer.warmup_iters=0 (give one or the other)",
            )
        ensure(self.wsd_decay_iters >= 0, f"optimizer.wsd_decay_iters={self.wsd_decay_iters}: must be >= 0")
        for name, other, unset in (
            ("warmup_samples", "warmup_iters", 0),
            ("decay_samples", "decay_iters", None),
            ("wsd_decay_samples", "wsd_decay_iters", 0),
        ):
            samples = getattr(self, name)
            if samples is None:
                continue
            ensure(samples > 0, f"optimizer.{name}={samples}: must be positive")
            ensure(
                getattr(self, other) == unset and (name != "warmup_samples" or self.warmup_fraction is None),
                f"optimizer.{name}={samples} with optimizer.{other}={getattr(self, other)}"
                f"{' or warmup_fraction' if name == 'warmup_samples' else ''}: give one length, in samples or "
                "in iterations",
            )
        ends = (self.start_weight_decay, self.end_weight_decay)
        if self.weight_decay_incr_style == "constant":
            ensure(
                ends == (None, None),
                f"optimizer.start_weight_decay / end_weight_decay = {ends}: they are for an increasing "
                "weight decay; set optimizer.weight_decay_incr_style=linear or cosine, or unset them",
            )
        else:
            ensure(
                None not in ends and 0 <= ends[0] <= ends[1],
                f"optimizer.weight_decay_incr_style={self.weight_decay_incr_style} needs "
                f"0 <= start_weight_decay <= end_weight_decay, got {ends}",
            )

    @staticmethod
    def legacy(data: dict) -> dict:
        """Keys of configs written before their replacement, translated (a checkpoint's manifest)."""
        data = dict(data)
        if "no_decay_norms_biases_embeddings" in data:
            old = data.pop("no_decay_norms_biases_embeddings")
            data.setdefault("weight_decay_exempt", "1d_and_embeddings" if old else "none")
        return data


@dataclass
class ParallelConfig:
    """The mesh. dp is inferred from the world size."""

    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size (stages; 1F1B schedule)."""
    vpp: int = 1
    """Virtual pipeline size: model chunks per pipeline rank (interleaved 1F1B when > 1)."""
    first_stage_layers: int | None = None
    """Layers on the first (virtual) pipeline stage, which also holds the embedding; unset: an even share."""
    last_stage_layers: int | None = None
    """Layers on the last (virtual) pipeline stage, which also holds the output layer; unset: an even share."""
    cp: int = 1
    """Context-parallel size: each sequence split over cp ranks (2·cp chunks, load-balanced)."""
    cp_comm_type: str = "p2p"
    """Attention under cp (Megatron's cp_comm_type): p2p (a ring of key/value exchanges) or all_gather."""
    ep: int = 1
    """Expert-parallel size."""
    sequence_parallel: bool = False
    """Shard norms and dropout over the sequence across tp ranks (all-gather/reduce-scatter around tp layers)."""
    distributed_optimizer: bool = False
    """Shard fp32 master weights and Adam state over dp (ZeRO-1, Megatron's --use-distributed-optimizer)."""
    bucket_size_mb: float = 25.0
    """Gradient bucket size for the overlapped data-parallel reduction."""
    grad_reduce_dtype: str = "fp32"
    """Data-parallel gradient reduction in fp32 or bf16."""
    fsdp: bool = False
    """Shard parameters, gradients and Adam state over dp × cp (ZeRO-3, torch's FSDP2 `fully_shard`)."""
    fsdp_shard_size: int | None = None
    """FSDP: shard over groups of this many of the dp × cp ranks and replicate across the groups
    (HSDP: reduce-scatter in a group, all-reduce across); unset: shard over all dp × cp ranks."""
    fsdp_reshard_after_forward: bool = True
    """FSDP: free each layer's gathered parameters after its forward and gather them again for its
    backward (ZeRO-3); false keeps them until the backward (ZeRO-2-like memory, one gather less)."""

    def __post_init__(self):
        for name in ("tp", "pp", "vpp", "cp", "ep"):
            ensure(getattr(self, name) >= 1, f"parallel.{name}={getattr(self, name)}: must be at least 1")
        ensure(
            self.vpp == 1 or self.pp > 1,
            f"parallel.vpp={self.vpp} needs pipeline parallelism: set parallel.pp >= 2 or parallel.vpp=1",
        )
        for name in ("first_stage_layers", "last_stage_layers"):
            n = getattr(self, name)
            ensure(n is None or n >= 1, f"parallel.{name}={n}: must be at least 1 (or unset)")
            ensure(n is None or self.pp > 1, f"parallel.{name}={n}: only meaningful with parallel.pp > 1")
        _choice("parallel", "grad_reduce_dtype", self.grad_reduce_dtype, ("fp32", "bf16"))
        _choice("parallel", "cp_comm_type", self.cp_comm_type, ("p2p", "all_gather"))
        ensure(self.bucket_size_mb > 0, f"parallel.bucket_size_mb={self.bucket_size_mb}: must be positive")
        ensure(
            self.fsdp_shard_size is None or (self.fsdp and self.fsdp_shard_size >= 1),
            f"parallel.fsdp_shard_size={self.fsdp_shard_size}: needs parallel.fsdp=true and a size of at "
            "least 1 (unset: shard over all dp × cp ranks)",
        )
        ensure(
            not (self.fsdp and self.distributed_optimizer),
            "parallel.fsdp and parallel.distributed_optimizer: FSDP already shards the optimizer state "
            "(and the parameters and gradients); set one of them",
        )


def _cuda_visible() -> bool:
    """Whether torch sees a CUDA device (False without torch: the planner runs without it)."""
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@dataclass
class TrainConfig:
    """The loop: batch sizes, length, precision, evaluation."""

    micro_batch_size: int = 4
    """Samples per forward/backward on one rank."""
    global_batch_size: int = 8
    """Samples per optimizer step: micro × accumulation × dp."""
    train_iters: int | None = 100
    """Optimizer steps; give this or train_tokens."""
    train_tokens: int | None = None
    """Tokens to train on (steps = tokens / (global batch × seq length)); replaces train_iters."""
    precision: str = "fp32"
    """fp32, bf16 (autocast) or fp16 (autocast + dynamic loss scaling)."""
    param_dtype: str = "auto"
    """auto (bf16 when training in bf16 on CUDA without an fp32 residual stream, else fp32), fp32, or train.precision's bf16/fp16: low-precision parameters, fp32 main weights."""
    initial_loss_scale: float = 2.0**16
    """fp16: starting loss scale."""
    loss_scale_window: int = 1000
    """fp16: steps without overflow before the scale doubles."""
    eval_interval: int = 0
    """Evaluate on the validation split every this many steps; 0 disables."""
    eval_iters: int = 4
    """Global batches per evaluation (each split over the dp ranks as in training)."""
    seed: int = 1234
    """Seed of initialisation, dropout and data order."""
    hang_timeout: float = 900.0
    """Seconds without progress on a rank before the job is declared hung: stacks to RUN_DIR/hang/, exit 4; 0 disables."""
    device: str = "auto"
    """auto (cuda when available), cpu or cuda."""
    compile: bool = False
    """torch.compile each transformer layer (after parallelism, recompute and kernel choice)."""
    fp8: str = ""
    """FP8 linears in the transformer layers: "" off, e4m3, or hybrid (e4m3 forward, e5m2 gradients); needs bf16."""
    fp8_recipe: str = "delayed"
    """fp8 scaling: delayed (scale from an amax history) or tensorwise (from the tensor's own amax)."""
    fp8_margin: int = 0
    """fp8: scale = fp8 max / amax / 2^margin."""
    fp8_amax_history_len: int = 1024
    """fp8 delayed scaling: amax values (optimizer steps) kept per tensor."""
    fp8_amax_compute_algo: str = "max"
    """fp8 delayed scaling: the amax a scale comes from: max (of the history) or most_recent."""
    straggler_window: int = 20
    """Compare the ranks' compute time every this many steps (one small all-gather); 0 disables."""
    straggler_threshold: float = 1.2
    """Name a rank whose compute per step is at least this multiple of its peers' median (> 1)."""
    fault_action: str = "skip"
    """On a NaN/Inf loss or gradient norm, or a loss spike: skip the update, rollback to the last checkpoint, or stop."""
    loss_spike_zscore: float = 0.0
    """A loss this many standard deviations above the last loss_spike_window applied steps' mean is a fault; 0: off."""
    loss_spike_window: int = 50
    """Applied steps the loss spike test compares with (it starts once this many have run)."""
    skip_iterations: list[int] = field(default_factory=list)
    """Steps (1-based, as logged) whose data is consumed without forward, backward or update (Megatron's --iterations-to-skip)."""

    def __post_init__(self):
        _choice("train", "precision", self.precision, ("fp32", "bf16", "fp16"))
        _choice("train", "fp8", self.fp8, ("", "e4m3", "hybrid"))
        _choice("train", "fp8_recipe", self.fp8_recipe, ("delayed", "tensorwise"))
        _choice("train", "fp8_amax_compute_algo", self.fp8_amax_compute_algo, ("max", "most_recent"))
        ensure(self.fp8_margin >= 0, f"train.fp8_margin={self.fp8_margin}: must be 0 or more")
        ensure(
            self.fp8_amax_history_len >= 1,
            f"train.fp8_amax_history_len={self.fp8_amax_history_len}: must be at least 1",
        )
        ensure(
            not self.fp8 or self.precision == "bf16",
            f"train.fp8={self.fp8!r} with train.precision={self.precision!r}: fp8 runs inside bf16 "
            "(everything outside the fp8 linears, as in Megatron); set train.precision=bf16",
        )
        ensure(
            not (self.fp8 and self.compile),
            f"train.fp8={self.fp8!r} with train.compile=true: the fp8 linears record amaxes into shared "
            "state during forward and backward, which torch.compile's compiled backward cannot replay; "
            "set train.compile=false (or train.fp8='')",
        )
        _choice("train", "device", self.device, ("auto", "cpu", "cuda"))
        _choice("train", "fault_action", self.fault_action, ("skip", "rollback", "stop"))
        ensure(
            0 <= self.loss_spike_zscore < math.inf,
            f"train.loss_spike_zscore={self.loss_spike_zscore}: must be 0 (off) or a positive number, e.g. 6",
        )
        ensure(
            self.loss_spike_window >= 2,
            f"train.loss_spike_window={self.loss_spike_window}: must be at least 2 (a standard deviation needs two losses)",
        )
        bad = [s for s in self.skip_iterations if s < 1]
        ensure(
            not bad,
            f"train.skip_iterations={self.skip_iterations}: steps count from 1 (as logged); remove {bad}",
        )
        ensure(
            0 <= self.hang_timeout <= 1e9,  # + 300 s, the process group's timeout: a timedelta
            f"train.hang_timeout={self.hang_timeout}: must be 0 (off) or a number of seconds up to 1e9, "
            "e.g. 900",
        )
        ensure(
            self.param_dtype in ("auto", "fp32", self.precision),
            f"train.param_dtype={self.param_dtype}: must be fp32 or the compute dtype "
            f"train.precision={self.precision}; set --set train.param_dtype=fp32 or "
            f"--set train.precision={self.param_dtype}",
        )
        ensure(
            self.straggler_window >= 0,
            f"train.straggler_window={self.straggler_window}: must be 0 (off) or a number of steps",
        )
        ensure(
            self.straggler_threshold > 1,
            f"train.straggler_threshold={self.straggler_threshold}: must be above 1 (a multiple of the "
            "median compute time per step, e.g. 1.2)",
        )
        ensure(self.micro_batch_size > 0, f"train.micro_batch_size={self.micro_batch_size}: must be positive")
        ensure(
            self.global_batch_size % self.micro_batch_size == 0,
            f"train.global_batch_size={self.global_batch_size} is not divisible by "
            f"train.micro_batch_size={self.micro_batch_size}",
        )
        ensure(
            (self.train_iters is None) != (self.train_tokens is None),
            "train.train_iters and train.train_tokens: give exactly one (set the other to none with --set)",
        )


@dataclass
class LoggingConfig:
    """Where and how often metrics go."""

    log_interval: int = 10
    """Print and record metrics every this many steps."""
    tensorboard: bool = True
    """Write TensorBoard event files to RUN_DIR/tensorboard."""
    hardware: str = "cpu"
    """MFU peak: cpu (measured) or a plan-file profile: a100-40g, a100-80g, h100-80g, h200, b200."""
    sample_prompt: str = ""
    """Print a greedy sample from this prompt after each evaluation and at the end; empty: none."""
    sample_tokens: int = 48
    """Tokens to generate for the sample."""

    def __post_init__(self):
        _choice("logging", "hardware", self.hardware, ("cpu", *PROFILES, *ALIASES))
        self.hardware = profile_name(self.hardware)


@dataclass
class CheckpointConfig:
    """Saving and resuming."""

    save: str = ""
    """Checkpoint directory (DIR/iter_NNNNNNN, DIR/latest); empty disables saving."""
    save_interval: int = 0
    """Save every this many steps (and at the end); 0 saves only at the end."""
    keep_last: int | None = None
    """Keep only the newest K checkpoints; unset keeps all."""
    async_save: bool = False
    """Write checkpoints from a background thread (tensors are copied to CPU first); training goes on."""
    load: str = ""
    """Resume from this checkpoint directory (its latest) or iter_ directory."""
    resume_changes: list[str] = field(default_factory=list)
    """Settings (or sections) this run changes on purpose from the checkpoint it resumes, e.g.
    ["optimizer.lr"]; other differences are refused (docs/train.md, "Resuming")."""


@dataclass
class Config:
    """A whole run."""

    preset: str = ""
    """Model preset the [model] table starts from (see `mlm config list`)."""
    run_dir: str = "runs/default"
    """Where metrics.jsonl, TensorBoard files and the resolved config go."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def __post_init__(self):
        t = self.train
        if t.param_dtype == "auto":  # Megatron's bf16 parameters with fp32 main weights where they pay
            on_cuda = t.device.startswith("cuda") or (t.device == "auto" and _cuda_visible())
            bf16 = t.precision == "bf16" and on_cuda and not self.model.fp32_residual_connection
            self.train = dataclasses.replace(t, param_dtype="bf16" if bf16 else "fp32")
        ensure(
            self.data.seq_length <= self.model.max_position_embeddings,
            f"data.seq_length={self.data.seq_length} exceeds "
            f"model.max_position_embeddings={self.model.max_position_embeddings}",
        )
        ensure(
            self.data.seq_length > self.model.mtp_num_layers,
            f"model.mtp_num_layers={self.model.mtp_num_layers} with data.seq_length={self.data.seq_length}: "
            "the deepest MTP depth would have no token to predict; use fewer depths or longer sequences",
        )
        ensure(
            not (self.model.fp32_residual_connection and self.train.param_dtype != "fp32"),
            f"model.fp32_residual_connection=true with train.param_dtype={self.train.param_dtype!r}: the "
            "residual stream follows bf16/fp16 parameters (the embedding's output is in their dtype); "
            "set train.param_dtype=fp32 to keep an fp32 residual stream, or model.fp32_residual_connection=false",
        )
        if self.parallel.cp > 1:
            check_context_parallel_kinds(self.model, self.parallel.cp)
        refused = fsdp_refusals(self.model, self.train) if self.parallel.fsdp else []
        ensure(
            not refused,
            f"parallel.fsdp with {', '.join(refused)}: FSDP is not built with these yet; unset them, "
            "or train with parallel.distributed_optimizer instead of parallel.fsdp",
        )
        ensure(
            self.train.fault_action != "rollback" or bool(self.checkpoint.save),
            "train.fault_action=rollback with checkpoint.save empty: a rollback reloads checkpoint.save's latest "
            "checkpoint; set --set checkpoint.save=DIR (and checkpoint.save_interval), or train.fault_action=skip",
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class _Layers:
    specs: tuple[LayerSpec, ...]
    mixers: tuple[str, ...]
    mlps: tuple[str, ...]


@functools.lru_cache(maxsize=256)
def _layers(pattern, attention_kind, mlp_kind, freq, first_k_dense, num_layers, norm) -> _Layers:
    """`ModelConfig.layer_specs` of these fields, with the mixer and MLP kinds in order of first use."""
    if pattern:
        from mlm.model.kinds.pattern import parse

        specs = tuple(LayerSpec(a, b, norm) for a, b in parse(pattern)[0])
    else:
        chosen = [
            i >= first_k_dense and (freq[i] == 1 if isinstance(freq, tuple) else i % freq == 0)
            for i in range(num_layers)
        ]
        specs = tuple(LayerSpec(attention_kind, mlp_kind if c else "dense", norm) for c in chosen)
    mixers = tuple(dict.fromkeys(s.mixer for s in specs if s.mixer is not None))
    return _Layers(specs, mixers, tuple(dict.fromkeys(s.mlp for s in specs if s.mlp is not None)))


def fsdp_refusals(model: ModelConfig, train: TrainConfig) -> list[str]:
    """The settings `parallel.fsdp` is not built with yet, each as `name=value` (empty: none).
    Torch-free: a run config refuses them (`Config`), the planner offers no FSDP layout with them."""
    refused = [
        (bool(train.fp8), f"train.fp8={train.fp8!r}"),
        (train.compile, "train.compile=true"),
        (model.mtp_num_layers > 0, f"model.mtp_num_layers={model.mtp_num_layers}"),
    ]
    return [what for bad, what in refused if bad]


def check_context_parallel_kinds(m: ModelConfig, cp: int) -> None:
    """MlmError when a layer's mixer does not run under context parallelism (its spec says)."""
    from mlm.model import kinds

    refused = [k for k in m.mixer_kinds() if not kinds.mixer(k).context_parallel]
    ensure(
        not refused,
        f"parallel.cp={cp} with the mixer kind(s) {', '.join(refused)}: they are not built for context "
        "parallelism (each rank would need the state of the tokens before its own); set parallel.cp=1",
    )


# ---------------------------------------------------------------- building from dicts / TOML / --set


def _field_types(cls) -> dict[str, object]:
    return typing.get_type_hints(cls)


def _convert(where: str, value, tp):
    """Check `value` against the annotation `tp`, converting ints to floats where asked."""
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _convert(where, value, a)
            except MlmError as e:
                errors.append(str(e))
        raise MlmError(errors[0])
    if origin is list:
        (item,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise MlmError(f"{where}={value!r}: expected a list, e.g. {_list_example(where, value, item)}")
        return [_convert(where, v, item) for v in value]
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is str and value is None:  # --set key=none: a str field cannot be unset, so it means "none"
        return "none"
    if tp in (int, float, str, bool) and (type(value) is not tp):
        raise MlmError(f"{where}={value!r}: expected {tp.__name__}, got {type(value).__name__}")
    return value


def _list_example(where: str, value, item) -> str:
    """How to write a list for `where`, with `value` as its item when it is one:
    --set data.data_path="['x']" (in a TOML file: data_path = ['x'])."""
    if item is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if type(value) is not item:
        value = {str: "a", int: 1, float: 0.5, bool: True}.get(item, "a")
    text = f"[{value!r}]" if item is not bool else f"[{str(value).lower()}]"
    return f'--set {where}="{text}" (in a TOML file: {where.rsplit(".", 1)[-1]} = {text})'


def _build(cls, data: dict, where: str):
    if hasattr(cls, "legacy"):
        data = cls.legacy(data)
    hints = _field_types(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f" (did you mean {where}{close[0]}?)" if close else f"; valid keys: {', '.join(names)}"
            raise MlmError(f"unknown config key {where}{key}{hint}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise MlmError(f"{where}{key}: expected a table")
            kwargs[key] = _build(tp, value, f"{where}{key}.")
        else:
            kwargs[key] = _convert(f"{where}{key}", value, tp)
    return cls(**kwargs)


def parse_override(item: str) -> tuple[list[str], object]:
    """ "train.lr=3e-4" → (["train", "lr"], 3e-4); values are TOML (bare words become strings)."""
    if "=" not in item:
        raise MlmError(f"--set {item!r}: expected section.key=value, e.g. --set train.micro_batch_size=8")
    key, raw = item.split("=", 1)
    raw = raw.strip()
    if raw.lower() in ("none", "null"):
        value = None
    else:
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
    return key.strip().split("."), value


def _merge(base: dict, path: list[str], value) -> None:
    node = base
    for p in path[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise MlmError(f"--set {'.'.join(path)}: {p} is not a section")
    node[path[-1]] = value


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """TOML file (optional) → preset → overrides → validated Config."""
    from mlm.fileio import read_toml
    from mlm.presets import preset_tables

    data: dict = {}
    if path is not None:
        data = read_toml(path, missing="config file not found; check the path given to --config")
    for item in overrides:
        keys, value = parse_override(item)
        _merge(data, keys, value)
    preset = data.get("preset") or ""
    if preset:
        data = _overlay(preset_tables(preset), data)
    return _build(Config, data, "")


def _overlay(base: dict, top: dict) -> dict:
    """`base` with `top`'s keys on it, table by table (a preset under the user's config)."""
    out = dict(base)
    for key, value in top.items():
        both = isinstance(value, dict) and isinstance(base.get(key), dict)
        out[key] = _overlay(base[key], value) if both else value
    return out


def config_from_dict(data: dict) -> Config:
    """A Config from `Config.to_dict()` output (e.g. a checkpoint manifest)."""
    return _build(Config, data, "")


@functools.cache
def field_docs(cls) -> dict[str, str]:
    """Attribute docstrings of a dataclass: {field: one line}."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for a, b in zip(body, body[1:], strict=False):
        if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
            docs[a.target.id] = " ".join(str(b.value.value).split())  # one line, however written
    return docs


def toml_value(v) -> str:
    """A bool, number, string or list of them as a TOML value."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return repr(v)


def to_toml(cfg: Config, comments: bool = True) -> str:
    """The resolved config as TOML, each value followed by its meaning."""
    lines = []

    def emit(obj, prefix: str) -> None:
        docs = field_docs(type(obj))
        nested = []
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if dataclasses.is_dataclass(v):
                nested.append((f.name, v))
                continue
            text = f"{f.name} = {toml_value(v)}" if v is not None else f"# {f.name} = (unset)"
            if comments and f.name in docs:
                text = f"{text:<44} # {docs[f.name]}"
            lines.append(text)
        for name, v in nested:
            lines.append("")
            lines.append(f"[{prefix}{name}]")
            emit(v, f"{prefix}{name}.")

    emit(cfg, "")
    return "\n".join(lines) + "\n"
