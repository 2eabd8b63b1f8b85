"""What a layer kind is, as the rest of mlm asks it: the torch-free spec beside each kind's module.

A layer is norm → mixer → residual, then norm → MLP → residual (either half may be absent: a
Megatron hybrid pattern can give a layer a mixer alone, `M`, or an MLP alone, `-`). Each part is
a kind, in one of three roles:

    mixer   mixes tokens: attention (gqa, mla), recurrent mixers with a per-sequence state
    mlp     works per token: the dense MLP, the mixture of experts
    norm    the norm before each half (and the model's final norm)

Each kind lives in its own folder, `mlm/model/kinds/<kind>/`: `module.py` (the `nn.Module`, torch)
and `spec.py`, a subclass of `MixerSpec`, `MLPSpec` or `NormSpec` registered with `register`.
The planner, the FLOP count, the serving cache and the config's checks ask the spec; outside the
kinds (and the format converters) no code compares a kind name (`tests/unit/test_kinds.py` checks).

The planner's formulas see one micro-batch on one rank as a `Micro`; a kind answers in the shared
vocabulary here: `Param` (a parameter as one rank holds it), `Flops` (training FLOPs per token, by
where they run), `Work` (bytes and kernels of the memory-bound ops, with the pass tables the
kinds and `mlm.plan.work` share) and `CacheSpec` (what serving keeps per token or per sequence).

Shape letters in the formulas: b micro-batch, s tokens of each sequence on the rank (seq_length /
cp), e = b·s, S the whole sequence, t tp, u sequence shards (t under sequence parallelism, else
1), h hidden, A bytes of an activation element, R of the residual stream's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from mlm.config import ModelConfig


# ---------------------------------------------------------------- the vocabulary


@dataclass(frozen=True)
class Param:
    """One parameter as one rank holds it (the planner's count, `mlm.plan.memory`)."""

    name: str
    numel: int
    linear: bool = False
    """A linear layer's weight (cast to bf16/fp16 under autocast)."""
    expert_parallel: bool = False
    """Routed experts' weights sharded over ep (> 1): their own gradient buffer, reduced over edp."""
    trainable: bool = True
    """False for the router's selection-only expert bias: a weight, with no gradient or Adam state."""
    active: int | None = None
    """Elements one token's forward uses (routed experts: the k of E it is sent to); None: all."""
    rows: int | None = None
    """The tensor's dim 0 as this rank holds it (what FSDP splits, `mlm.plan.memory.fsdp_rows`);
    None: one-dimensional (numel rows)."""

    @property
    def active_numel(self) -> int:
        return self.numel if self.active is None else self.active


@dataclass(frozen=True)
class Flops:
    """Training FLOPs per token of one part of a layer (6 = 3 passes × 2 per multiply-add), by
    where they run: the planner times each apart."""

    tp: float = 0.0
    """Split over tensor parallelism (by heads, channels or ffn columns)."""
    core: float = 0.0
    """Attention's scores and values over the sequence (split over tp by heads)."""
    replicated: float = 0.0
    """Replicated over tensor parallelism, every tp rank computing them whole for its own tokens
    (MLA's down-projections)."""
    routed: float = 0.0
    """The routed experts a token goes to (each expert whole on one rank)."""
    router: float = 0.0
    """The router (and a shared experts' gate): replicated over tp."""

    @property
    def total(self) -> float:
        return self.tp + self.core + self.replicated + self.routed + self.router

    def __add__(self, other: Flops) -> Flops:
        return Flops(*(a + b for a, b in zip(self.astuple(), other.astuple(), strict=True)))

    def astuple(self) -> tuple[float, ...]:
        return (self.tp, self.core, self.replicated, self.routed, self.router)


@dataclass(frozen=True)
class Micro:
    """One micro-batch on one rank, as the planner's formulas see it (see the module doc)."""

    b: int
    s: int
    S: int
    tp: int = 1
    u: int = 1
    cp: int = 1
    cp_comm_type: str = "p2p"
    ep: int = 1
    A: int = 4
    R: int = 4
    recompute: str = "none"

    @property
    def e(self) -> int:
        return self.b * self.s

    @property
    def ring(self) -> bool:
        """Context parallelism's p2p ring (`mlm.parallel.ring_attention`)."""
        return self.cp > 1 and self.cp_comm_type == "p2p"


NORM = {True: (2, 3, 1, 2), False: (12, 24, 6, 10)}
"""A norm: (forward passes, backward passes, forward kernels, backward kernels), fused or torch ops."""
ROPE = {True: (2, 2, 2, 2), False: (8, 8, 10, 10)}
SOFTMAX = {True: (2, 3, 1, 1), False: (6, 6, 4, 4)}
GELU = {True: (2, 3, 1, 1), False: (4, 8, 2, 4)}
SWIGLU = {True: (3, 5, 1, 1), False: (5, 10, 2, 4)}


@dataclass
class Work:
    """Memory-bound bytes and kernels of one micro-batch's forward and backward (`mlm.plan.work`)."""

    bytes: float = 0.0
    kernels: float = 0.0

    def add(self, passes: tuple, width: float, tokens: float, A: int, forward_times: int = 1) -> None:
        """One op: (forward passes, backward passes, forward kernels, backward kernels) over
        `width` elements per token of `tokens`, its forward run `forward_times` times."""
        f, b, kf, kb = passes
        self.bytes += (f * forward_times + b) * width * tokens * A
        self.kernels += kf * forward_times + kb

    def __iadd__(self, other: Work) -> Work:
        self.bytes += other.bytes
        self.kernels += other.kernels
        return self


@dataclass(frozen=True)
class Passes:
    """How often a layer's ops run forward under its recompute (`mlm.plan.work.layer_work`)."""

    full: int
    """Every op (2 under full recompute and torchtitan's per-op policy)."""
    norm_act: int
    """Norms and activations (2 also under Megatron's elementwise selective recompute)."""
    core: int
    """The attention core (2 under full and core-selective recompute)."""


@dataclass
class PartWork:
    """What one part of a layer adds to its memory-bound work: `work`; its GEMMs (`gemms`, each
    1 + 2 kernels, more under recompute); and the fp8 casts of those GEMMs (`fp8`: per GEMM group
    (forward width, backward width, rows): the inputs cast forward, the output gradients backward)."""

    work: Work = field(default_factory=Work)
    gemms: int = 0
    fp8: list[tuple[float, float, float]] = field(default_factory=list)


@dataclass(frozen=True)
class TokenCache:
    """Serving cache kept per token and layer, in paged blocks (`mlm.inference.kv_cache`): `heads`
    key heads of `key_dim` values, and as many value heads, unless `values_in_keys` (MLA: the
    values are the first columns of the one key head)."""

    heads: int
    key_dim: int
    values_in_keys: bool = False
    description: str = field(default="", compare=False)
    """What a token holds, for `mlm serve`'s log (e.g. "keys and values: 2 × 4 heads × 128 dims")."""
    split: str = field(default="", compare=False)
    """How tensor parallelism splits it, for the same log (e.g. "; 4 of the 8 key/value heads on each
    of 2 tp ranks")."""

    @property
    def per_token(self) -> int:
        """Values stored per token and layer."""
        return self.heads * self.key_dim * (1 if self.values_in_keys else 2)


@dataclass(frozen=True)
class StateCache:
    """Serving state kept per sequence and layer, of a fixed size whatever the sequence's length
    (a recurrent mixer's): tensors by name and shape on one tp rank, e.g. {"conv": (W, K - 1),
    "ssm": (H, P, N)}. `mlm.inference` gives each running sequence one slot of each."""

    shapes: dict[str, tuple[int, ...]]
    description: str = field(default="", compare=False)

    @property
    def per_sequence(self) -> int:
        """Values stored per sequence and layer."""
        total = 0
        for shape in self.shapes.values():
            n = 1
            for d in shape:
                n *= d
            total += n
        return total


CacheSpec = TokenCache | StateCache


# ---------------------------------------------------------------- the specs


class KindSpec:
    """What every kind answers. A subclass sets `name`, `role` (by its base), `module` and,
    for pattern kinds, `symbol`; registered with `mlm.model.kinds.register`."""

    name: ClassVar[str]
    """The kind's name in configs (model.attention_kind, model.mlp_kind, model.normalization)."""
    role: ClassVar[str]
    symbol: ClassVar[str | None] = None
    """Its symbol in a layer pattern (Megatron's hybrid pattern: `*` attention, `-` MLP, `E` MoE)."""
    module: ClassVar[object]
    """The module class, or "package.module:Class" imported when a model is built (torch)."""
    summary: ClassVar[str] = ""
    """One line for `mlm config show`."""

    def check(self, m: ModelConfig) -> None:
        """MlmError when `m` cannot build this kind (called for every kind the layers use)."""

    def check_parallel(self, m: ModelConfig, tp: int, ep: int, sequence_parallel: bool) -> None:
        """MlmError when this kind cannot split over `tp` (and `ep`) ranks."""

    def module_class(self):
        """The module class (imports it when given as a string)."""
        module = type(self).module
        if isinstance(module, str):
            import importlib

            path, _, attr = module.partition(":")
            module = getattr(importlib.import_module(path), attr)
        return module


class MixerSpec(KindSpec):
    """A mixer: the first half of a layer, mixing tokens. Its module is called as
    `module(x_BTD, rope, cache, documents_BT)` (`mlm.model.layers.Block`)."""

    role = "mixer"
    context_parallel: ClassVar[bool] = False
    """Whether it runs under context parallelism (cp > 1); mixers that do not are refused there."""
    attention: ClassVar[bool] = False
    """An attention (queries over keys and values; the attention options below apply to it)."""
    partial_rope: ClassVar[bool] = False
    """It rotates the first model.rotary_percent of each head's dims (an attention without it
    rotates dims of its own choosing and refuses rotary_percent < 1)."""
    output_gate: ClassVar[bool] = False
    """It gates its output with model.attention_output_gate (an attention without it refuses the option)."""

    def rope_dim(self, m: ModelConfig) -> int | None:
        """Dims per head its RoPE rotates (the model's tables are built for them); None: no RoPE."""
        return None

    def params(self, m: ModelConfig, prefix: str, tp: int) -> list[Param]:
        raise NotImplementedError

    def flops(self, m: ModelConfig, seq_length: int) -> Flops:
        raise NotImplementedError

    def saved(self, m: ModelConfig, mb: Micro) -> dict[str, float]:
        """Bytes it saves for backward per micro-batch, by part (its input projections' inputs
        under "linear inputs"), without recompute or under selective recompute (which re-runs the
        attention core); full recompute is the layer's business."""
        raise NotImplementedError

    def work(self, m: ModelConfig, mb: Micro, sw, times: Passes) -> PartWork:
        """Its memory-bound ops, GEMMs and fp8 casts per micro-batch (`sw`: the planner's software
        profile, `mlm.plan.software.Software`)."""
        raise NotImplementedError

    def tp_entries(self, m: ModelConfig) -> list[int]:
        """Values per token of each tensor with which it enters the tp region (all-gathered under
        sequence parallelism, all-reduced in the backward without); its output leaves it h wide."""
        return [m.hidden_size]

    def core_side(self, m: ModelConfig) -> float:
        """The smallest GEMM side of its core without flash attention (the head dim)."""
        return m.hidden_size

    def cp_kv_elements(self, m: ModelConfig, mb: Micro, tokens: int) -> float:
        """Elements of this rank's keys and values for `tokens` tokens per sequence (what context
        parallelism exchanges)."""
        return 0.0

    def cp_saved(self, m: ModelConfig, mb: Micro) -> dict[str, float]:
        """What it saves under cp beyond its cp = 1 core (its logsumexp aside), per micro-batch."""
        return {}

    def cp_workspace(self, m: ModelConfig, mb: Micro) -> float:
        """Its transient workspace under cp (one layer at a time)."""
        return 0.0

    def cp_buffers(self, m: ModelConfig, mb: Micro) -> float:
        """Its cp exchange buffers (one layer at a time)."""
        return 0.0

    def cache(self, m: ModelConfig, tp: int) -> CacheSpec | None:
        """What serving keeps for it on one of `tp` ranks; None: nothing."""
        return None


class MLPSpec(KindSpec):
    """An MLP: the second half of a layer, per token. Its module is called as `module(x_BTD)`."""

    role = "mlp"
    expert_parallel: ClassVar[bool] = False
    """Whether expert parallelism (ep > 1) spreads it over ranks (the MoE layers)."""

    def params(self, m: ModelConfig, prefix: str, tp: int, ep: int) -> list[Param]:
        raise NotImplementedError

    def flops(self, m: ModelConfig) -> Flops:
        raise NotImplementedError

    def saved(self, m: ModelConfig, mb: Micro) -> dict[str, float]:
        """Bytes it saves for backward per micro-batch, by part (see `MixerSpec.saved`)."""
        raise NotImplementedError

    def work(self, m: ModelConfig, mb: Micro, sw, times: Passes) -> PartWork:
        raise NotImplementedError

    def gemm_side(self, m: ModelConfig, mb: Micro) -> float | None:
        """The smallest side of its routed experts' GEMMs (for their efficiency); None: none."""
        return None

    def ep_exchange(self, m: ModelConfig, mb: Micro) -> list[tuple[str, float]]:
        """Its expert-parallel collectives per micro-batch, one direction of the forward:
        ("all_to_all", bytes a rank sends away) or ("all_gather" / "reduce_scatter", bytes of the
        gathered or scattered whole); [] at ep = 1."""
        return []

    def ep_buffers(self, m: ModelConfig, mb: Micro) -> float:
        """Its expert-parallel exchange buffers (one layer at a time)."""
        return 0.0


class NormSpec(KindSpec):
    """A norm over the hidden state (or `size` features). Its module is built as
    `module(cfg, size, ops)` (size None: the hidden size) and called as `module(x)`."""

    role = "norm"

    def params(self, m: ModelConfig, prefix: str, size: int | None = None) -> list[Param]:
        raise NotImplementedError

    def saved(self, m: ModelConfig, tokens: float, R: int) -> float:
        """Bytes it saves over `tokens` tokens of the residual stream (R bytes an element)."""
        raise NotImplementedError
