"""The attention core as a module: softmax(q kᵀ · scale) v, causal, over [B, T, heads, K], by the
model's `Ops` (its attention backend). The attention kinds (gqa, mla) call it; context
parallelism and selective recompute hook into it through what it declares (`mlm.model.contract`)."""

from __future__ import annotations

import contextlib

from torch import nn

from mlm.model.attention import document_attention
from mlm.model.ops import Ops


class AttentionCore(nn.Module):
    """softmax(q kᵀ · scale) v (scale 1/√K unless given), causal, over [B, T, heads, K] (no
    parameters): the part selective recompute recomputes. `rng_region` is where attention dropout
    draws its randomness: tensor parallelism sets it to `TensorParallelRNG.fork`, so tp ranks
    (holding other heads) drop differently."""

    selective_recompute = True
    cp_attention = "context"
    tp_plan = {"rng_region": "tp_rng"}

    def __init__(self, cfg, scale: float | None = None, ops: Ops | None = None):
        super().__init__()
        self.ops = ops or Ops()
        self.dropout = cfg.attention_dropout
        self.scale = scale  # softmax scale; None: 1/√K
        self.rng_region = contextlib.nullcontext
        self.context = None  # context parallelism: attention over the cp ranks' tokens (mlm.parallel.context)

    def forward(self, q_BTHK, k_BTGK, v_BTGK, documents_BT=None):
        if self.context is not None:
            return self.context(q_BTHK, k_BTGK, v_BTGK, documents_BT=documents_BT, scale=self.scale)
        if documents_BT is not None:  # packed documents: causal within each one
            return document_attention(q_BTHK, k_BTGK, v_BTGK, documents_BT, self.scale)
        dropping = self.training and self.dropout > 0
        with self.rng_region(q_BTHK.device) if dropping else contextlib.nullcontext():
            return self.ops.attention(q_BTHK, k_BTGK, v_BTGK, self.dropout, self.training, self.scale)
