"""The "gqa" mixer's spec: H query heads, G key/value groups of K dims (MHA when G = H, MQA when
G = 1), RoPE (on each head's first K · model.rotary_percent dims), optional q/k norms (Qwen3),
q/k/v biases (Qwen2) and output gate (Qwen3-Next, model.attention_output_gate). Torch-free."""

from __future__ import annotations

from mlm.config import ensure
from mlm.model.kinds import register
from mlm.model.kinds.attention_spec import AttentionSpec
from mlm.model.kinds.spec import NORM, ROPE, Flops, Param, PartWork, TokenCache


@register
class GQASpec(AttentionSpec):
    name = "gqa"
    symbol = "*"
    module = "mlm.model.kinds.gqa.module:Attention"
    summary = "attention: multi-head, grouped-query or multi-query, RoPE"
    partial_rope = True
    output_gate = True

    def check(self, m):
        ensure(
            m.num_attention_heads % m.query_groups == 0,
            f"model.num_attention_heads={m.num_attention_heads} is not divisible by "
            f"model.num_query_groups={m.query_groups}",
        )
        ensure(
            m.kv_channels is not None or m.hidden_size % m.num_attention_heads == 0,
            f"model.hidden_size={m.hidden_size} is not divisible by "
            f"model.num_attention_heads={m.num_attention_heads}; set model.kv_channels (the head dim)",
        )
        R = int(m.head_dim * m.rotary_percent)
        ensure(
            m.position_embedding != "rope" or (R > 0 and R % 2 == 0),
            f"model head dim {m.head_dim} × model.rotary_percent={m.rotary_percent} = {R} rotated dims: "
            "RoPE rotates pairs of dims, so it needs an even number of at least 2 (set model.kv_channels "
            f"or model.rotary_percent; with this head dim, e.g. {2 * max(1, R // 2) / m.head_dim:g})",
        )

    def check_parallel(self, m, tp, ep, sequence_parallel):
        super().check_parallel(m, tp, ep, sequence_parallel)
        G = m.query_groups
        ensure(
            G % tp == 0,
            f"model.num_query_groups={G} is not divisible by parallel.tp={tp}: each tp rank holds "
            f"whole key/value groups; choose a tp that divides {G}, or more query groups",
        )

    def rope_dim(self, m):
        """The first K · model.rotary_percent dims of each head (all K by default)."""
        return int(m.head_dim * m.rotary_percent) if m.position_embedding == "rope" else None

    def widths(self, m, t):
        K = m.head_dim
        return m.num_attention_heads * K / t, 2 * m.query_groups * K / t, m.num_attention_heads * K / t

    def head_dims(self, m):
        return m.head_dim, m.head_dim

    def params(self, m, prefix, tp):
        """q, k, v (and the output gate) column-parallel (their biases with them), out
        row-parallel (its bias replicated), the q/k norms' [K] weights replicated (shared by the
        heads)."""
        h, K = m.hidden_size, m.head_dim
        q, kv = m.num_attention_heads * K // tp, m.query_groups * K // tp
        qkv_bias = m.add_bias or m.qkv_bias
        gate = [("gate", q, h, q, qkv_bias)] if m.attention_output_gate else []
        out: list[Param] = []
        for name, rows, cols, bias, has_bias in (
            ("q", q, h, q, qkv_bias),
            ("k", kv, h, kv, qkv_bias),
            ("v", kv, h, kv, qkv_bias),
            *gate,
            ("out", h, q, h, m.add_bias),
        ):
            out.append(Param(f"{prefix}.{name}.weight", rows * cols, linear=True, rows=rows))
            if has_bias:
                out.append(Param(f"{prefix}.{name}.bias", bias))
        if m.qk_norm:
            out += [Param(f"{prefix}.q_norm.weight", K), Param(f"{prefix}.k_norm.weight", K)]
        return out

    def flops(self, m, seq_length):
        """6·(2·D·K·(H + G) + 2·T·H·K): q and out D·H·K each, k and v D·G·K each (the output
        gate another D·H·K); the core T·H·K for the scores and as much for the values."""
        D, H, G, K = m.hidden_size, m.num_attention_heads, m.query_groups, m.head_dim
        gate = D * H * K if m.attention_output_gate else 0
        return Flops(tp=6 * (2 * D * K * (H + G) + gate), core=6 * 2 * seq_length * H * K)

    def saved(self, m, mb):
        """The normed input shared by q, k and v (e·h·A), q, k, v after RoPE e·h/t·(1 + 2G/H)·A,
        the output e·h/t·A (the out-projection's input), the core's logsumexp and cp tensors; the
        output gate's sigmoid and the gated output (the out-projection's input then) e·(H·K/t)·A
        each."""
        e, h, t, A = mb.e, m.hidden_size, mb.tp, mb.A
        H, G = m.num_attention_heads, m.query_groups
        parts = {
            "linear inputs": e * h * A,
            "q, k, v": e * h / t * (1 + 2 * G / H) * A,
            "attention output": e * h / t * A,
        }
        if m.attention_output_gate:
            parts["output gate"] = 2 * e * H * m.head_dim / t * A
        parts.update(self.attention_saved(m, mb))
        return parts

    def work(self, m, mb, sw, times):
        """q/k norms, the output's layout copy, RoPE on q and k (on its rotated fraction, then a
        copy joining the rest), the core, the output gate (sigmoid and product: 5 passes forward,
        9 backward); q, k, v (and the gate) as one GEMM and out; fp8 casts of their inputs (h,
        out) and output gradients (q + kv, the gate's q, h)."""
        q, kv, out = self.widths(m, mb.tp)
        e, A, h = mb.e, mb.A, m.hidden_size
        gate = q if m.attention_output_gate else 0
        part = PartWork(gemms=2, fp8=[(h + out, q + kv + gate + h, e)])
        w = part.work
        if m.qk_norm:
            w.add(NORM[sw.fused_norm], q + kv / 2, e, A, times.norm_act)
        w.add((2, 2, 1, 1), out, e, A, times.full)
        if m.position_embedding == "rope":
            w.add(ROPE[sw.fused_rope], (q + kv / 2) * m.rotary_percent, e, A, times.full)
            if m.rotary_percent < 1:  # the rotated dims put back beside the others
                w.add((2, 2, 1, 1), q + kv / 2, e, A, times.full)
        self.core_work(m, mb, sw, times, w)
        if m.attention_output_gate:
            w.add((5, 9, 2, 3), out, e, A, times.norm_act)
        return part

    def cache(self, m, tp):
        G, K = m.query_groups // tp, m.head_dim
        split = f"; {G} of the {m.query_groups} key/value heads on each of {tp} tp ranks" if tp > 1 else ""
        return TokenCache(G, K, description=f"keys and values: 2 × {G} heads × {K} dims", split=split)
