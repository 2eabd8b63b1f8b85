"""The "mamba" mixer's spec: Mamba-2 (model.mamba; torch-free).

Per layer: H heads of P channels (d = H·P), G groups of B and C of width N, K convolution taps
over the c = d + 2·G·N channels of x, B and C, chunks of Q tokens. Tensor parallelism splits
heads and groups (each rank H/t heads, G/t groups, its own norm groups): the input projections
column-parallel, the output projection row-parallel, the convolution and the per-head A, D and
dt bias by channel. Serving keeps per sequence the last K − 1 convolution inputs and the [H, P,
N] state.
"""

from __future__ import annotations

from mlm.config import ensure
from mlm.model.kinds import register
from mlm.model.kinds.spec import NORM, Flops, MixerSpec, Param, PartWork, StateCache


def _sizes(m, t: int = 1) -> tuple[int, int, int, int, int, int]:
    """(heads, head dim, groups, state width, inner width, taps) on one of `t` tp ranks."""
    c = m.mamba
    H = c.heads(m.hidden_size)
    return H // t, c.head_dim, c.num_groups // t, c.state_dim, H * c.head_dim // t, c.conv_kernel


@register
class MambaSpec(MixerSpec):
    name = "mamba"
    symbol = "M"
    module = "mlm.model.kinds.mamba.module:Mamba"
    summary = "Mamba-2: causal convolution and chunked state-space scan (model.mamba)"

    def check(self, m):
        c = m.mamba
        ensure(
            c.num_heads is not None or (2 * m.hidden_size) % c.head_dim == 0,
            f"model.mamba.head_dim={c.head_dim} does not divide 2 × hidden_size={2 * m.hidden_size}; "
            "set model.mamba.num_heads",
        )
        H = c.heads(m.hidden_size)
        ensure(
            H % c.num_groups == 0,
            f"model.mamba: {H} heads are not divisible by num_groups={c.num_groups} (each group serves "
            "whole heads); choose num_groups dividing the heads",
        )

    def check_parallel(self, m, tp, ep, sequence_parallel):
        c = m.mamba
        H = c.heads(m.hidden_size)
        ensure(
            H % tp == 0 and c.num_groups % tp == 0,
            f"model.mamba: {H} heads and num_groups={c.num_groups} must both divide over parallel.tp={tp} "
            "(each tp rank holds whole heads and groups, as Megatron's MambaMixer); choose a tp dividing both",
        )

    def params(self, m, prefix, tp):
        """in_z, in_x, in_B, in_C, in_dt column-parallel; the convolutions, A_log, D, dt_bias and
        the norm by channel; out row-parallel."""
        H, _, G, N, d, K = _sizes(m, tp)
        D = m.hidden_size
        out = [
            Param(f"{prefix}.in_{name}.weight", rows * D, linear=True, rows=rows)
            for name, rows in (("z", d), ("x", d), ("B", G * N), ("C", G * N), ("dt", H))
        ]
        for name, width in (("x", d), ("B", G * N), ("C", G * N)):
            out += [
                Param(f"{prefix}.conv_{name}.weight", width * K, rows=width),
                Param(f"{prefix}.conv_{name}.bias", width),
            ]
        out += [Param(f"{prefix}.{name}", H) for name in ("A_log", "D", "dt_bias")]
        out += [
            Param(f"{prefix}.norm.weight", d),
            Param(f"{prefix}.out.weight", D * d, linear=True, rows=D),
        ]
        return out

    def flops(self, m, seq_length):
        """The projections 6·D·(3d + 2GN + H); the convolution 6·K·c; the chunked scan per token
        and head 6·(Q·(N + P) + 2·P·N): the chunk's scores C·Bᵀ over its Q tokens, applying them
        to x, the chunk's state and the output from the entering state (all split over tp by heads)."""
        H, P, G, N, d, K = _sizes(m)
        D, Q = m.hidden_size, min(m.mamba.chunk_size, seq_length)
        projections = 6 * D * (3 * d + 2 * G * N + H)
        scan = 6 * H * (Q * (N + P) + 2 * P * N)
        return Flops(tp=projections + 6 * K * (d + 2 * G * N) + scan)

    def saved(self, m, mb):
        """What the torch path keeps for backward per micro-batch (c = d + 2·G·N channels of the
        convolutions; the scan saves only its inputs and recomputes itself in the backward):
        - the normed input the five projections share, e·h·A;
        - dt in fp32: dt + dt_bias (softplus's input), softplus's output, the clamped step, 3·e·H·4;
        - the convolutions' inputs e·c·A and outputs with their K − 1 padding columns, SiLU's
          outputs e·c·A (x, B and C: also the scan's inputs);
        - the gated norm in fp32: y + D·x, z, silu(z), their product, the normed groups (5·e·d·4),
          the groups' rsqrt e·G·4; the output projection's input e·d·A."""
        H, P, G, N, d, K = _sizes(m, mb.tp)
        e, A, h = mb.e, mb.A, m.hidden_size
        c = d + 2 * G * N
        return {
            "linear inputs": e * h * A,
            "time step": 3 * e * H * 4 + 2 * H * 4,
            "convolutions": 3 * e * c * A + mb.b * c * (K - 1) * A,
            "gated norm": 5 * e * d * 4 + e * G * 4 + e * d * A,
        }

    def work(self, m, mb, sw, times):
        """The convolutions with SiLU, softplus of dt, the scan's elementwise work, the gated norm;
        six GEMMs (five in, one out) and their fp8 casts."""
        H, P, G, N, d, K = _sizes(m, mb.tp)
        e, A, h = mb.e, mb.A, m.hidden_size
        c = d + 2 * G * N
        part = PartWork(gemms=6, fp8=[(h + d, 2 * d + 2 * G * N + H + h, e)])
        part.work.add((2 + K, 4 + K, 3, 6), c, e, A, times.full)  # convolution + SiLU
        part.work.add((4, 8, 4, 8), d + H, e, 4, times.full)  # dt, x·dt, D·x, the scan's in/out
        part.work.add(NORM[sw.fused_norm], d, e, 4, times.norm_act)  # gated norm
        return part

    def cache(self, m, tp):
        H, P, G, N, d, K = _sizes(m, tp)
        c = d + 2 * G * N
        return StateCache(
            {"conv": (c, K - 1), "ssm": (H, P, N)},
            description=f"mamba: convolution window {c} × {K - 1} and state {H} × {P} × {N}",
        )
