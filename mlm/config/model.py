"""The [model] section: `ModelConfig`, its layers' kinds (`LayerSpec`) and its nested tables."""

from __future__ import annotations

import functools
import math
import typing
from dataclasses import dataclass, field

from mlm.config.checks import choice, ensure
from mlm.config.parts import GatedDeltaNetConfig, MambaConfig, MLAConfig, MoEConfig, RopeConfig
from mlm.errors import MlmError

MAX_LAYERS = 4096
"""The most layers (MTP depths included) a model may have: validating a config walks its layers."""


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
    rope: RopeConfig = field(default_factory=RopeConfig)
    """RoPE's base frequency and scaling (Llama-3.1's or YaRN), used when position_embedding is rope."""
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
        choice(s, "position_embedding", self.position_embedding, ("learned", "rope", "none"))
        choice(s, "activation", self.activation, ("swiglu", "gelu_tanh", "gelu", "squared_relu"))
        choice(s, "attention_backend", self.attention_backend, ("auto", "sdpa", "flash", "te"))
        choice(s, "kernels", self.kernels, ("torch", "triton", "auto"))
        choice(s, "recompute", self.recompute, ("none", "selective", "full"))
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
