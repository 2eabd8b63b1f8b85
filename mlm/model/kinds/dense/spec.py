"""The "dense" MLP's spec: SwiGLU (down(silu(gate x) · up x), Llama) or GeLU (down(gelu(up x)),
GPT-2), F wide, column-parallel gate/up and row-parallel down. Torch-free."""

from __future__ import annotations

from mlm.config import ensure
from mlm.model.kinds import register
from mlm.model.kinds.spec import GELU, SWIGLU, Flops, MLPSpec, Param, PartWork


def mlp_params(m, prefix: str, f: int, tp: int) -> list[Param]:
    """A dense MLP of width `f` split over tp (column gate/up, row down: its bias replicated)."""
    h, out = m.hidden_size, []
    names = (["gate"] if m.activation == "swiglu" else []) + ["up"]
    for name in names:
        out.append(Param(f"{prefix}.{name}.weight", f // tp * h, linear=True, rows=f // tp))
        if m.add_bias:
            out.append(Param(f"{prefix}.{name}.bias", f // tp))
    out.append(Param(f"{prefix}.down.weight", h * (f // tp), linear=True, rows=h))
    if m.add_bias:
        out.append(Param(f"{prefix}.down.bias", h))
    return out


def activation_passes(m, sw) -> tuple:
    """The MLP activation's passes (`mlm.model.kinds.spec.SWIGLU` / `GELU`), a GeLU's bias add
    as two more torch ops when unfused."""
    gated = m.activation == "swiglu"
    act = SWIGLU[sw.fused_activation] if gated else GELU[sw.fused_activation]
    if not gated and m.add_bias and not sw.fused_activation:
        act = (act[0] + 2, act[1], act[2] + 1, act[3])
    return act


def matrices(m) -> int:
    """Weight matrices of one MLP: 3 gated (gate, up, down), 2 plain."""
    return 3 if m.activation == "swiglu" else 2


@register
class DenseSpec(MLPSpec):
    name = "dense"
    symbol = "-"
    module = "mlm.model.kinds.dense.module:MLP"
    summary = "dense MLP: SwiGLU, GeLU or squared ReLU (model.activation)"

    def check_parallel(self, m, tp, ep, sequence_parallel):
        given = "" if m.ffn_hidden_size else " (unset: 4 × hidden_size)"
        ensure(
            m.ffn_size % tp == 0,
            f"model.ffn_hidden_size={m.ffn_size}{given} is not divisible by parallel.tp={tp}; "
            f"choose a tp that divides it, or an ffn_hidden_size that is a multiple of {tp}",
        )

    def params(self, m, prefix, tp, ep):
        return mlp_params(m, prefix, m.ffn_size, tp)

    def flops(self, m):
        """6·m·D·F for a width-F MLP (m = 3 matrices gated, 2 plain)."""
        return Flops(tp=6 * matrices(m) * m.hidden_size * m.ffn_size)

    def saved(self, m, mb):
        """The normed input shared by gate and up (e·h·A); SwiGLU's gate, up (silu is recomputed)
        and product, 3·e·f/t·A, or GeLU's up and gelu, 2·e·f/t·A."""
        e, A = mb.e, mb.A
        return {
            "linear inputs": e * m.hidden_size * A,
            "mlp": (3 if m.activation == "swiglu" else 2) * e * m.ffn_size / mb.tp * A,
        }

    def work(self, m, mb, sw, times):
        f = m.ffn_size / mb.tp
        part = PartWork(
            gemms=matrices(m), fp8=[(m.hidden_size + f, f * (matrices(m) - 1) + m.hidden_size, mb.e)]
        )
        part.work.add(activation_passes(m, sw), f, mb.e, mb.A, times.norm_act)
        return part
