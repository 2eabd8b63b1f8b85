"""The "mla" mixer's spec (DeepSeek-V2/V3's multi-latent attention, `module.py`): parameters,
FLOPs, saved bytes, work and the serving cache of the latent. Torch-free.

Letters: Q q_lora_rank (0 without a query latent), C kv_lora_rank, R qk_rope_head_dim, N
qk_nope_head_dim, E v_head_dim.
"""

from __future__ import annotations

from mlm.config import ensure
from mlm.model.kinds import register
from mlm.model.kinds.attention_spec import AttentionSpec
from mlm.model.kinds.spec import NORM, ROPE, Flops, Param, PartWork, TokenCache


@register
class MLASpec(AttentionSpec):
    name = "mla"
    symbol = "+"
    module = "mlm.model.kinds.mla.module:MultiLatentAttention"
    summary = "multi-latent attention (DeepSeek), options in model.mla"

    def check(self, m):
        ensure(
            m.query_groups == m.num_attention_heads,
            f"model.num_query_groups={m.num_query_groups} with attention_kind=mla: MLA gives every one of "
            f"the {m.num_attention_heads} heads its own key and value (from the shared latent); unset it",
        )
        ensure(
            m.position_embedding == "rope",
            f"model.position_embedding={m.position_embedding!r} with attention_kind=mla: MLA's decoupled "
            "key part is rotary; set model.position_embedding=rope",
        )
        ignored = [f"{k}={getattr(m, k)}" for k in ("kv_channels", "qk_norm", "qkv_bias") if getattr(m, k)]
        ensure(
            not ignored,
            f"model.{', model.'.join(ignored)} with attention_kind=mla: MLA's head dims are model.mla's "
            "(qk_nope_head_dim, qk_rope_head_dim, v_head_dim) and it has no q/k norms or q/k/v biases; "
            "unset them",
        )

    def rope_dim(self, m):
        return m.mla.qk_rope_head_dim

    def widths(self, m, t):
        H, ml = m.num_attention_heads, m.mla
        return H * ml.qk_head_dim / t, H * (ml.qk_head_dim + ml.v_head_dim) / t, H * ml.v_head_dim / t

    def head_dims(self, m):
        return m.mla.qk_head_dim, m.mla.v_head_dim

    def params(self, m, prefix, tp):
        """The down-projections and their RMSNorms replicated over tp (each rank feeds its heads
        from them), the up-projections (or q without a query latent) column-parallel by heads, out
        row-parallel (its bias replicated)."""
        h, ml, H = m.hidden_size, m.mla, m.num_attention_heads // tp
        out: list[Param] = []

        def linear(name: str, rows: int, cols: int, bias: bool = m.add_bias, bias_rows: int | None = None):
            out.append(Param(f"{prefix}.{name}.weight", rows * cols, linear=True, rows=rows))
            if bias:
                out.append(Param(f"{prefix}.{name}.bias", bias_rows or rows))

        if ml.q_lora_rank is None:
            linear("q", H * ml.qk_head_dim, h)
        else:
            linear("q_down", ml.q_lora_rank, h)
            out.append(Param(f"{prefix}.q_norm.weight", ml.q_lora_rank))
            linear("q_up", H * ml.qk_head_dim, ml.q_lora_rank, bias=False)
        linear("kv_down", ml.kv_lora_rank + ml.qk_rope_head_dim, h)
        out.append(Param(f"{prefix}.kv_norm.weight", ml.kv_lora_rank))
        linear("kv_up", H * (ml.qk_nope_head_dim + ml.v_head_dim), ml.kv_lora_rank, bias=False)
        linear("out", h, H * ml.v_head_dim, bias_rows=h)
        return out

    def flops(self, m, seq_length):
        """Megatron's multi-latent term, norms aside: the query latent 6·D·Q down and 6·Q·H·(N + R)
        up (without it, q 6·D·H·(N + R)); the key/value latent and the shared rope key 6·D·(C + R)
        down, 6·C·H·(N + E) up; out 6·H·E·D; the core 6·T·H·((N + R) + E). The down-projections
        are replicated over tp."""
        D, H, T, ml = m.hidden_size, m.num_attention_heads, seq_length, m.mla
        QK, E = ml.qk_head_dim, ml.v_head_dim
        if ml.q_lora_rank is None:
            q_tp, q_down = D * H * QK, 0
        else:
            q_tp, q_down = ml.q_lora_rank * H * QK, D * ml.q_lora_rank
        kv_down = D * (ml.kv_lora_rank + ml.qk_rope_head_dim)
        kv_up = ml.kv_lora_rank * H * (ml.qk_nope_head_dim + E)
        return Flops(
            tp=6 * (q_tp + kv_up + H * E * D), core=6 * T * H * (QK + E), replicated=6 * (q_down + kv_down)
        )

    def saved(self, m, mb):
        """Measured on the module with saved_tensors_hooks (fp32 and bf16 autocast, tp 1 and 2,
        with and without sequence parallelism, exact; Megatron's layout): the down-projections and
        their norms run on this rank's n = e/u tokens; their outputs, the normed latents and the
        rope key, concatenated, enter the tp region (gathered under sequence parallelism), from
        which the up-projections read all e tokens, the heads split.

        linear inputs    q_down and kv_down read the n tokens (the norm's output shared): n·h·A;
                         without a query latent q reads the hidden state entered into the tp
                         region: its own gathered e·h·A under sequence parallelism
        query latent     q_norm's input (q_down's output): n·Q·A (none without q_lora_rank)
        kv latent        kv_norm's input, a view of kv_down's whole output, so the rope key's
                         too: n·(C + R)·A
        entered latents  [q latent ; kv latent ; rope key] over e tokens, e·(Q + C + R)·A: q_up's
                         and kv_up's inputs are views of it
        q, k, v          q and k after RoPE (nope ; rope dims) and kv_up's output, of which v is a
                         view: e·H/t·(2·(N + R) + N + E)·A
        output           e·H/t·E·A (the out-projection's input)"""
        ml = m.mla
        e, A, n = mb.e, mb.A, mb.e / mb.u
        h, heads = m.hidden_size, m.num_attention_heads / mb.tp
        Q, C, R, N, E = (
            ml.q_lora_rank or 0,
            ml.kv_lora_rank,
            ml.qk_rope_head_dim,
            ml.qk_nope_head_dim,
            ml.v_head_dim,
        )
        inputs = n * h * A if Q else n * h * A + (e * h * A if mb.u > 1 else 0)
        out = {"linear inputs": inputs}
        if Q:
            out["query latent"] = n * Q * A
        out["key/value latent"] = n * (C + R) * A
        out["entered latents"] = e * (Q + C + R) * A
        out["q, k, v"] = e * heads * (2 * (N + R) + N + E) * A
        out["attention output"] = e * heads * E * A
        out.update(self.attention_saved(m, mb))
        return out

    def work(self, m, mb, sw, times):
        """The latents' norms on the rank's e/u tokens, the output's copy, RoPE on the heads' and
        the shared key's rope dims, the core; GEMMs and fp8 casts counted as attention's."""
        q, kv, out = self.widths(m, mb.tp)
        e, A, h, ml = mb.e, mb.A, m.hidden_size, m.mla
        part = PartWork(gemms=2, fp8=[(h + out, q + kv + h, e)])
        w = part.work
        w.add(NORM[sw.fused_norm], ml.kv_lora_rank + (ml.q_lora_rank or 0), e / mb.u, A, times.norm_act)
        w.add((2, 2, 1, 1), out, e, A, times.full)
        w.add(
            ROPE[sw.fused_rope], (m.num_attention_heads / mb.tp + 1) * ml.qk_rope_head_dim, e, A, times.full
        )
        self.core_work(m, mb, sw, times, w)
        return part

    def tp_entries(self, m):
        """The concatenated query latent, key/value latent and rope key, Q + C + R, or without a
        query latent the hidden state for q and then C + R."""
        ml = m.mla
        latents = ml.kv_lora_rank + ml.qk_rope_head_dim
        if ml.q_lora_rank is None:
            return [m.hidden_size, latents]
        return [ml.q_lora_rank + latents]

    def cache(self, m, tp):
        """The normed latent and the roped key, one head every tp rank holds whole."""
        ml = m.mla
        split = f"; the whole latent on each of {tp} tp ranks" if tp > 1 else ""
        return TokenCache(
            1,
            ml.kv_lora_rank + ml.qk_rope_head_dim,
            values_in_keys=True,
            description=f"MLA: (latent {ml.kv_lora_rank} + rope key {ml.qk_rope_head_dim})",
            split=split,
        )
