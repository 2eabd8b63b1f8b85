"""What the attention kinds (gqa, mla) share in their specs: the core's saved logsumexp, its
memory-bound work, and context parallelism's exchange, saved tensors and workspace (torch-free).

A subclass gives its widths per token on one of t tp ranks (`widths`: queries, keys and values
as the core sees them, the output) and its per-head dims (`head_dims`).
"""

from __future__ import annotations

from mlm.config import ensure
from mlm.model.kinds.spec import SOFTMAX, Micro, MixerSpec, Work


class AttentionSpec(MixerSpec):
    context_parallel = True
    attention = True

    def widths(self, m, t: int) -> tuple[float, float, float]:
        """(queries, keys and values, output) values per token on one of `t` tp ranks."""
        raise NotImplementedError

    def head_dims(self, m) -> tuple[int, int]:
        """(query/key dims, value dims) of one head as the core sees it."""
        raise NotImplementedError

    def core_side(self, m) -> float:
        return self.head_dims(m)[0]

    def check_parallel(self, m, tp, ep, sequence_parallel):
        """Each tp rank holds whole attention heads."""
        H = m.num_attention_heads
        ensure(
            H % tp == 0,
            f"model.num_attention_heads={H} is not divisible by parallel.tp={tp}: each tp rank "
            f"holds whole attention heads; choose a tp that divides {H}",
        )

    def attention_saved(self, m, mb: Micro) -> dict[str, float]:
        """The core's logsumexp b·(H/t)·s·4 (SDPA and flash keep no s × s matrix; selective
        recompute re-runs the core and drops it; the ring keeps it in the autocast dtype) and what
        context parallelism adds (`cp_saved`)."""
        out = {}
        if mb.recompute != "selective":
            out["attention logsumexp"] = (
                mb.b * m.num_attention_heads / mb.tp * mb.s * (mb.A if mb.ring else 4)
            )
        out.update(self.cp_saved(m, mb))
        return out

    def core_work(self, m, mb: Micro, sw, times, w: Work) -> None:
        """The core's memory-bound work: with flash attention it reads q, k, v and writes the
        output (1 + 2 over each); else the (H/t)·S scores per token through the softmax (and
        attention dropout), and the two batched GEMMs each way."""
        q, kv, out = self.widths(m, mb.tp)
        if sw.flash_attention:
            w.add((1, 2, 1, 3), q + kv + out, mb.e, mb.A, times.core)
            return
        scores = m.num_attention_heads / mb.tp * mb.S
        w.add(SOFTMAX[sw.fused_softmax], scores, mb.e, mb.A, times.core)
        if m.attention_dropout > 0:
            w.add((2.5, 2.5, 1, 1), scores, mb.e, mb.A, times.core)
        w.kernels += 2 * times.core + 4

    def cp_kv_elements(self, m, mb: Micro, tokens: int) -> float:
        return mb.b * tokens * self.widths(m, mb.tp)[1]

    def cp_saved(self, m, mb: Micro) -> dict[str, float]:
        """all_gather: the other ranks' keys and values and the global-position mask s·S·A; p2p:
        the merged output e·(H/t)·E·A; nothing at cp = 1 or when the core is recomputed."""
        if mb.cp == 1 or mb.recompute != "none":
            return {}
        if mb.cp_comm_type == "all_gather":
            return {
                "gathered k, v (other cp ranks)": self.cp_kv_elements(m, mb, mb.S - mb.s) * mb.A,
                "cp attention mask": mb.s * mb.S * mb.A,
            }
        heads = m.num_attention_heads / mb.tp
        return {"ring output": mb.b * mb.s * heads * self.head_dims(m)[1] * mb.A}

    def cp_workspace(self, m, mb: Micro) -> float:
        """p2p: four fp32 s × s blocks per head in the backward, the boolean causal mask, the fp32
        copies of q, dO and dq; all_gather under recompute: the mask and the gathered keys and
        values the recomputed core builds again."""
        if mb.cp == 1:
            return 0.0
        if mb.cp_comm_type == "all_gather":
            if mb.recompute == "none":
                return 0.0
            return (mb.s * mb.S + self.cp_kv_elements(m, mb, mb.S - mb.s)) * mb.A
        heads = m.num_attention_heads / mb.tp
        qk, v = self.head_dims(m)
        s, b = mb.s, mb.b
        return 4 * b * heads * s * s * 4 + s * s + b * s * heads * (2 * qk + v) * 4

    def cp_buffers(self, m, mb: Micro) -> float:
        """p2p: the key/value message in flight and its receive buffer, and two fp32 dK/dV
        accumulators; all_gather: the gathered keys' and values' gradients."""
        if mb.cp == 1:
            return 0.0
        if mb.cp_comm_type == "all_gather":
            return self.cp_kv_elements(m, mb, mb.S) * mb.A
        return 2 * self.cp_kv_elements(m, mb, mb.s) * (mb.A + 4)
