"""The module kinds a transformer layer is built from, each declaring its tensor-parallel plan.

A layer is norm → attention → residual, norm → MLP → residual; which attention, MLP and norm
each layer gets comes from `ModelConfig.layer_specs()` (names) and the registries below
(classes). A new kind is a module class registered under a name:

    @register_mlp("squared_relu")
    class SquaredReLU(nn.Module):
        tp_plan = {TP_INPUT: "enter", "up": "column", "down": "row"}
        def __init__(self, cfg: ModelConfig, layer: int): ...
        def forward(self, x_BTD): ...

and `--set model.mlp_kind=squared_relu` selects it (for the layers `mlp_kind_freq` and
`first_k_dense` choose). Nothing in `mlm.parallel` needs to know it: `parallelize` reads `tp_plan`.

`tp_plan` maps attribute names of the module to styles (see `mlm.parallel.parallelize`):
"column" / "row" (an `nn.Linear` split by output / input features), "vocab" (an `nn.Embedding`
split by rows), "replicated" (parameters replicated over tp; under sequence parallelism their
gradients are summed over tp, which every undeclared parameter gets too), "full_sequence"
(replicated, fed the whole sequence, its output added to the vocabulary-parallel embedding's
partial results: by tp rank 0 only under sequence parallelism), "head_shared" (replicated, applied to
each tp rank's own heads: gradients always summed over tp), "sp_group" (an attribute set to the
tp process group under sequence parallelism, for a module that reduces statistics over the
sequence shards), "enter" (an `nn.Identity` placeholder,
or the module's own input for the key `TP_INPUT`, that enters the tp region), "scatter_sequence"
(a placeholder after the vocabulary-parallel embedding: under sequence parallelism one
reduce-scatter sums its partial results and splits the sequence), "tp_rng" (an attribute
holding the context-manager factory for randomness inside the tp region), and "vocab_loss" /
"vocab_linear_loss" (an attribute holding the loss, from logits or from hidden states and the
output weight, made vocabulary-parallel).

Shape legend: B batch, T sequence, D hidden, H attention heads, G key/value groups, K head dim,
F ffn hidden.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.nn.functional as F
from torch import nn

from kernels import lean
from kernels.lean import autocast_dtype
from mlm.config import LayerSpec, ModelConfig
from mlm.errors import MlmError
from mlm.model.attention import _importable, attention, document_attention
from mlm.model.rope import apply_rope

TP_INPUT = "(input)"
"""`tp_plan` key for the module's first positional input."""

ATTENTION_KINDS: dict[str, type[nn.Module]] = {}
MLP_KINDS: dict[str, type[nn.Module]] = {}
NORM_KINDS: dict[str, type[nn.Module]] = {}


def _register(registry: dict, what: str):
    def register(name: str):
        def add(cls):
            if registry.get(name, cls) is not cls:
                raise MlmError(f"{what} kind {name!r} is registered twice ({registry[name]} and {cls})")
            registry[name] = cls
            return cls

        return add

    return register


register_attention = _register(ATTENTION_KINDS, "attention")
register_mlp = _register(MLP_KINDS, "MLP")
register_norm = _register(NORM_KINDS, "norm")


def _lookup(registry: dict, kind: str, field: str):
    if kind not in registry:
        raise MlmError(
            f"model.{field}={kind!r} is not a registered kind; registered: {', '.join(sorted(registry))} "
            "(a new kind registers itself with mlm.model.layers.register_*)"
        )
    return registry[kind]


# ---------------------------------------------------------------- norms


def to_residual(x: torch.Tensor, fp32_residual: bool) -> torch.Tensor:
    """x in the residual stream's dtype: fp32 with model.fp32_residual_connection, else autocast's
    where autocast is on for x's device (bf16/fp16: the layers' adds stay in it), else x's own."""
    if fp32_residual:
        return x.float()
    return x.to(autocast_dtype(x) or x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, kernels: str = "torch") -> torch.Tensor:
    """RMSNorm saving only its input (and, Triton, rstd); output in the compute dtype (`kernels.lean`)."""
    if kernels == "triton":
        from kernels.rmsnorm import rms_norm as fused

        return fused(x, weight, eps)
    return lean.rms_norm(x, weight, eps)


def swiglu(a: torch.Tensor, b: torch.Tensor, kernels: str = "torch") -> torch.Tensor:
    """silu(a) · b saving only a and b (the backward recomputes silu)."""
    if kernels == "triton":
        from kernels.swiglu import swiglu as fused

        return fused(a, b)
    return lean.swiglu(a, b)


def gelu(a: torch.Tensor, approximate: str, kernels: str = "torch") -> torch.Tensor:
    """GeLU ('none': erf, 'tanh': GPT-2's), saving only its input (F.gelu's autograd does too)."""
    if kernels == "triton":
        from kernels.swiglu import gelu as fused

        return fused(a, approximate=approximate)
    return F.gelu(a, approximate=approximate)


@register_norm("rmsnorm")
class RMSNorm(nn.RMSNorm):
    """Llama's norm over the hidden state (or over `size` features: Qwen3's per-head q/k norms,
    MLA's latents)."""

    def __init__(self, cfg: ModelConfig, size: int | None = None):
        super().__init__(size or cfg.hidden_size, eps=cfg.norm_eps)
        self.kernels = "torch"  # or "triton": set by GPT.set_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.kernels)


@register_norm("layernorm")
class LayerNorm(nn.LayerNorm):
    """GPT-2's norm (with a bias)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg.hidden_size, eps=cfg.norm_eps)
        self.kernels = "torch"  # or "triton": set by GPT.set_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels == "triton":
            from kernels.layernorm import layer_norm

            return layer_norm(x, self.weight, self.bias, self.eps)
        return lean.layer_norm(x, self.weight, self.bias, self.eps)


def make_norm(cfg: ModelConfig, kind: str | None = None) -> nn.Module:
    return _lookup(NORM_KINDS, kind or cfg.normalization, "normalization")(cfg)


def resolve_kernels(requested: str, device: torch.device) -> str:
    """The kernels that will run for `model.kernels=requested` on `device`: torch, or triton (the
    top-level `kernels` package); auto is triton on CUDA when triton imports, else torch. Triton
    off CUDA runs only under its interpreter (TRITON_INTERPRET=1, set before triton is imported)."""
    if requested == "auto":
        return "triton" if device.type == "cuda" and _importable("triton") else "torch"
    if requested == "triton":
        if not _importable("triton"):
            raise MlmError(
                "model.kernels='triton' needs the triton package: pip install triton "
                "(or pip install -e .[dev]), or use model.kernels=torch or auto"
            )
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise MlmError(
                f"model.kernels='triton' on {device.type} runs only under the Triton interpreter: set "
                "TRITON_INTERPRET=1 before starting (slow; meant for tests), or use model.kernels=torch or auto"
            )
    return requested


# ---------------------------------------------------------------- attention


class AttentionCore(nn.Module):
    """softmax(q kᵀ · scale) v (scale 1/√K unless given), causal, over [B, T, heads, K] (no
    parameters): the part selective recompute recomputes. `rng_region` is where attention dropout draws its randomness: tensor
    parallelism sets it to `TensorParallelRNG.fork`, so tp ranks (holding other heads) drop
    differently."""

    selective_recompute = True
    tp_plan = {"rng_region": "tp_rng"}

    def __init__(self, cfg: ModelConfig, scale: float | None = None):
        super().__init__()
        self.dropout = cfg.attention_dropout
        self.scale = scale  # softmax scale; None: 1/√K
        self.backend = "sdpa"
        self.rng_region = contextlib.nullcontext
        self.context = None  # context parallelism: attention over the cp ranks' tokens (mlm.parallel.context)

    def forward(self, q_BTHK, k_BTGK, v_BTGK, documents_BT=None):
        if self.context is not None:
            return self.context(q_BTHK, k_BTGK, v_BTGK, documents_BT=documents_BT, scale=self.scale)
        if documents_BT is not None:  # packed documents: causal within each one
            return document_attention(q_BTHK, k_BTGK, v_BTGK, documents_BT, self.scale)
        dropping = self.training and self.dropout > 0
        with self.rng_region(q_BTHK.device) if dropping else contextlib.nullcontext():
            return attention(q_BTHK, k_BTGK, v_BTGK, self.backend, self.dropout, self.training, self.scale)


@register_attention("gqa")
class Attention(nn.Module):
    """Multi-head attention with grouped key/value heads (MHA when G = H, MQA when G = 1) and
    RoPE. Under a KV cache (`cache`, from serving) the keys and values of the new tokens go to
    the cache and attention runs over what it holds (`cache.attend`); otherwise causal over T."""

    tp_plan = {
        TP_INPUT: "enter",
        "q": "column",
        "k": "column",
        "v": "column",
        "out": "row",
        "q_norm": "head_shared",
        "k_norm": "head_shared",
    }

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.layer, self.head_dim = layer, cfg.head_dim
        K, H, G = cfg.head_dim, cfg.num_attention_heads, cfg.query_groups
        qkv_bias = cfg.add_bias or cfg.qkv_bias
        self.q = nn.Linear(cfg.hidden_size, H * K, bias=qkv_bias)
        self.k = nn.Linear(cfg.hidden_size, G * K, bias=qkv_bias)
        self.v = nn.Linear(cfg.hidden_size, G * K, bias=qkv_bias)
        self.out = nn.Linear(H * K, cfg.hidden_size, bias=cfg.add_bias)
        # Qwen3: RMSNorm over each head's query and key (weights [K], shared by the heads)
        self.q_norm = RMSNorm(cfg, K) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg, K) if cfg.qk_norm else None
        self.core = AttentionCore(cfg)
        self.kernels = "torch"  # RoPE's; or "triton": set by GPT.set_kernels

    def forward(self, x_BTD: torch.Tensor, rope=None, cache=None, documents_BT=None) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        K = self.head_dim
        q_BTHK = self.q(x_BTD).view(B, T, -1, K)
        k_BTGK = self.k(x_BTD).view(B, T, -1, K)
        v_BTGK = self.v(x_BTD).view(B, T, -1, K)
        if self.q_norm is not None:
            q_BTHK, k_BTGK = self.q_norm(q_BTHK), self.k_norm(k_BTGK)
        if rope is not None:
            q_BTHK = apply_rope(q_BTHK, *rope, kernels=self.kernels)
            k_BTGK = apply_rope(k_BTGK, *rope, kernels=self.kernels)
        if cache is None:
            o_BTHK = self.core(q_BTHK, k_BTGK, v_BTGK, documents_BT)
        else:
            o_BTHK = cache.attend(self.layer, q_BTHK, k_BTGK, v_BTGK)
        return self.out(o_BTHK.reshape(B, T, -1))


# ---------------------------------------------------------------- MLPs


@register_mlp("dense")
class MLP(nn.Module):
    """The dense MLP: SwiGLU (Llama: down(silu(gate x) · up x)) or GeLU (GPT-2: down(gelu(up x)))."""

    tp_plan = {TP_INPUT: "enter", "gate": "column", "up": "column", "down": "row"}

    def __init__(self, cfg: ModelConfig, layer: int = 0, ffn_size: int | None = None):
        super().__init__()
        self.gated = cfg.activation == "swiglu"
        D, F_ = cfg.hidden_size, ffn_size or cfg.ffn_size
        self.gate = nn.Linear(D, F_, bias=cfg.add_bias) if self.gated else None
        self.up = nn.Linear(D, F_, bias=cfg.add_bias)
        self.down = nn.Linear(F_, D, bias=cfg.add_bias)
        self.approximate = "tanh" if cfg.activation == "gelu_tanh" else "none"
        self.kernels = "torch"  # or "triton": set by GPT.set_kernels

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        if self.gated:
            h_BTF = swiglu(self.gate(x_BTD), self.up(x_BTD), self.kernels)
        else:
            h_BTF = gelu(self.up(x_BTD), self.approximate, self.kernels)
        return self.down(h_BTF)


# ---------------------------------------------------------------- the layer


class Block(nn.Module):
    """One transformer layer (pre-norm): x + attn(norm(x)), then x + mlp(norm(x)), with hidden
    dropout on both branches; its modules are the kinds its `LayerSpec` names."""

    tp_plan = {"attn_norm": "replicated", "mlp_norm": "replicated"}

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, layer: int = 0):
        super().__init__()
        self.spec = spec
        self.attn_norm = make_norm(cfg, spec.norm)
        self.attn = _lookup(ATTENTION_KINDS, spec.attention, "attention_kind")(cfg, layer)
        self.mlp_norm = make_norm(cfg, spec.norm)
        self.mlp = _lookup(MLP_KINDS, spec.mlp, "mlp_kind")(cfg, layer)
        self.dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(self, x_BTD, rope=None, cache=None, documents_BT=None):
        x_BTD = x_BTD + self.dropout(self.attn(self.attn_norm(x_BTD), rope, cache, documents_BT))
        return x_BTD + self.dropout(self.mlp(self.mlp_norm(x_BTD)))
