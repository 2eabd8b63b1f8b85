"""The "gdn" mixer's spec: Gated DeltaNet, Qwen3-Next's linear attention (model.gdn; torch-free).

Per layer: G key heads of K channels (q and k, key width k = G·K), H value heads of V channels
(v, z and the output, value width d = H·V; r = H / G value heads per key head), K_c convolution
taps over the c = 2k + d channels of q, k and v, chunks of Q tokens. Tensor parallelism splits
heads (each rank G/t key heads and the H/t value heads that read them): the input projections
column-parallel, the output projection row-parallel, the convolutions and the per-head A_log and
dt_bias by channel, the gated norm's [V] weight replicated (applied to each rank's heads).
Serving keeps per sequence the last K_c − 1 convolution inputs and the [H, K, V] state.
"""

from __future__ import annotations

from mlm.config import ensure
from mlm.model.kinds import register
from mlm.model.kinds.spec import NORM, Flops, MixerSpec, Param, PartWork, StateCache


def _sizes(m, t: int = 1) -> tuple[int, int, int, int, int, int, int]:
    """(key heads, key head dim, value heads, value head dim, key width, value width, taps) on one
    of `t` tp ranks."""
    c = m.gdn
    G, H = c.num_key_heads // t, c.num_value_heads // t
    return G, c.key_head_dim, H, c.value_head_dim, G * c.key_head_dim, H * c.value_head_dim, c.conv_kernel


@register
class GatedDeltaNetSpec(MixerSpec):
    name = "gdn"
    symbol = "G"
    module = "mlm.model.kinds.gdn.module:GatedDeltaNet"
    summary = "Gated DeltaNet: causal convolution and chunked gated delta rule (Qwen3-Next; model.gdn)"

    def check_parallel(self, m, tp, ep, sequence_parallel):
        c = m.gdn
        ensure(
            c.num_key_heads % tp == 0 and c.num_value_heads % tp == 0,
            f"model.gdn: num_key_heads={c.num_key_heads} and num_value_heads={c.num_value_heads} must both "
            f"divide over parallel.tp={tp} (each tp rank holds whole key heads and the value heads that "
            "read them, as Megatron's GatedDeltaNet); choose a tp dividing both",
        )

    def params(self, m, prefix, tp):
        """in_q, in_k, in_v, in_z, in_b, in_a column-parallel; the convolutions (no bias), A_log and
        dt_bias by channel; the norm's [V] weight replicated; out row-parallel."""
        _, _, H, V, k, d, Kc = _sizes(m, tp)
        D = m.hidden_size
        out = [
            Param(f"{prefix}.in_{name}.weight", rows * D, linear=True, rows=rows)
            for name, rows in (("q", k), ("k", k), ("v", d), ("z", d), ("b", H), ("a", H))
        ]
        out += [
            Param(f"{prefix}.conv_{name}.weight", w * Kc, rows=w)
            for name, w in (("q", k), ("k", k), ("v", d))
        ]
        out += [Param(f"{prefix}.{name}", H) for name in ("A_log", "dt_bias")]
        out += [
            Param(f"{prefix}.norm.weight", V),
            Param(f"{prefix}.out.weight", D * d, linear=True, rows=D),
        ]
        return out

    def flops(self, m, seq_length):
        """The projections 6·D·(2k + 3d + 2H); the convolution 6·K_c·c; the chunked rule per token
        and value head 6·(Q·(3K + 2V) + 3·K·V): within the chunk (βK)Kᵀ, W = T⁻¹(βK), QKᵀ (Q·K
        each), U = T⁻¹(βV) and (QKᵀ)V' (Q·V each), and with the chunk's state W·S, Q·S and the
        state update Kᵀ·V' (K·V each) — an estimate that leaves out forming T⁻¹ (Q²/3 per token),
        the L2 norms and the gated norm (all split over tp by heads)."""
        _, K, H, V, k, d, Kc = _sizes(m)
        D, Q = m.hidden_size, min(m.gdn.chunk_size, seq_length)
        projections = 6 * D * (2 * k + 3 * d + 2 * H)
        rule = 6 * H * (Q * (3 * K + 2 * V) + 3 * K * V)
        return Flops(tp=projections + 6 * Kc * (2 * k + d) + rule)

    def saved(self, m, mb):
        """What the torch path keeps for backward per micro-batch (an estimate, not yet measured):
        the normed input the six projections share; z and the convolutions' inputs and outputs; g
        and β (fp32); the delta rule's fp32 copies of q, k (repeated to the value heads, normalised)
        and v, its per-chunk Q-wide rows (Γ, A, T⁻¹, QKᵀ: 4·Q per token and head) and U, W; the
        gated norm's inputs (fp32); the output projection's input."""
        _, K, H, V, k, d, _ = _sizes(m, mb.tp)
        e, A, h = mb.e, mb.A, m.hidden_size
        c = 2 * k + d
        Q = min(m.gdn.chunk_size, mb.s)
        return {
            "linear inputs": e * h * A,
            "projections": e * (d + 2 * c) * A + 2 * e * H * 4,
            "delta rule": e * H * (2 * K + V + 4 * Q + V + K) * 4,
            "norm": 2 * e * d * 4 + e * d * A,
        }

    def work(self, m, mb, sw, times):
        """The convolutions with SiLU, the gates (sigmoid, softplus, exp), the L2 norms of q and k
        and the rule's elementwise work, the gated norm; seven GEMMs (six in, one out) and their
        fp8 casts."""
        _, K, H, V, k, d, Kc = _sizes(m, mb.tp)
        e, A, h = mb.e, mb.A, m.hidden_size
        c = 2 * k + d
        part = PartWork(gemms=7, fp8=[(h + d, 2 * k + 2 * d + 2 * H + h, e)])
        part.work.add((2 + Kc, 4 + Kc, 3, 6), c, e, A, times.full)  # convolution + SiLU
        part.work.add((4, 8, 4, 8), 2 * H, e, 4, times.full)  # β and g
        part.work.add((4, 8, 4, 8), 2 * H * K + d, e, 4, times.full)  # L2 norms, the rule's in/out
        part.work.add(NORM[sw.fused_norm], d, e, 4, times.norm_act)  # gated norm
        return part

    def cache(self, m, tp):
        _, K, H, V, k, d, Kc = _sizes(m, tp)
        c = 2 * k + d
        return StateCache(
            {"conv": (c, Kc - 1), "ssm": (H, K, V)},
            description=f"gdn: convolution window {c} × {Kc - 1} and state {H} × {K} × {V}",
        )
