"""One layer of the model (`Block`): norm → mixer → residual, then norm → MLP → residual, either
half absent where the layer's `LayerSpec` (from `ModelConfig.layer_specs()`) names no kind. The
kinds' modules come from their specs (`mlm.model.kinds`), each declaring its tensor-parallel
plan, so nothing in `mlm.parallel` needs to know a kind: `parallelize` reads `tp_plan`.

`tp_plan` maps attribute names of the module to styles (see `mlm.parallel.parallelize`):
"column" / "row" (an `nn.Linear` split by output / input features), "vocab" (an `nn.Embedding`
split by rows), "channels" (a parameter split along dim 0: per-channel or per-head parameters of
a module that computes on its own channels, such as a depthwise convolution's), "replicated" (parameters replicated over tp; under sequence parallelism their
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

Shape legend: B batch, T sequence, D hidden.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.lean import autocast_dtype
from mlm.config import LayerSpec, ModelConfig
from mlm.model import kinds
from mlm.model.ops import Ops

TP_INPUT = "(input)"
"""`tp_plan` key for the module's first positional input."""


def to_residual(x: torch.Tensor, fp32_residual: bool) -> torch.Tensor:
    """x in the residual stream's dtype: fp32 with model.fp32_residual_connection, else autocast's
    where autocast is on for x's device (bf16/fp16: the layers' adds stay in it), else x's own."""
    if fp32_residual:
        return x.float()
    return x.to(autocast_dtype(x) or x.dtype)


def make_norm(cfg: ModelConfig, kind: str | None = None, ops: Ops | None = None) -> nn.Module:
    """A norm of `kind` (default model.normalization) over the hidden state."""
    return kinds.norm(kind or cfg.normalization).module_class()(cfg, None, ops)


class Block(nn.Module):
    """One layer (pre-norm): x + mixer(norm(x)), then x + mlp(norm(x)), with hidden dropout on both
    branches; its modules are the kinds its `LayerSpec` names. The mixer sits in `attn` (with
    `attn_norm`) and the MLP in `mlp` (with `mlp_norm`), whatever their kinds: the names
    checkpoints have always used."""

    tp_plan = {"attn_norm": "replicated", "mlp_norm": "replicated"}

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, layer: int = 0, ops: Ops | None = None):
        super().__init__()
        self.spec = spec
        has_mixer, has_mlp = spec.mixer is not None, spec.mlp is not None
        self.attn_norm = make_norm(cfg, spec.norm, ops) if has_mixer else None
        self.attn = kinds.mixer(spec.mixer).module_class()(cfg, layer, ops) if has_mixer else None
        self.mlp_norm = make_norm(cfg, spec.norm, ops) if has_mlp else None
        self.mlp = kinds.mlp(spec.mlp).module_class()(cfg, layer, ops) if has_mlp else None
        self.dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(self, x_BTD, rope=None, cache=None, documents_BT=None):
        if self.attn is not None:
            x_BTD = x_BTD + self.dropout(self.attn(self.attn_norm(x_BTD), rope, cache, documents_BT))
        if self.mlp is not None:
            x_BTD = x_BTD + self.dropout(self.mlp(self.mlp_norm(x_BTD)))
        return x_BTD
