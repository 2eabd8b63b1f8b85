"""How many tokens the chunked (fused) linear + cross-entropy takes at once: torch-free, so that
the planner (`mlm.plan.memory`) counts the same chunk the loss (`mlm.parallel.cross_entropy`) runs."""

from __future__ import annotations

# Bytes of one fp32 [chunk, v] buffer. A chunk holds about three of them at once (logits, their
# fp32 softmax, the gradient in the compute dtype), so ≤ 0.75 GB in flight: at v = 128,256 a chunk
# is 512 tokens (a [512, D] × [D, 128256] GEMM, large enough to run at full speed on a GPU), at
# v = 16,032 (tp 8) 4,160 tokens.
CHUNK_BYTES = 256 * 2**20


def chunk_tokens(v: int, budget: int = CHUNK_BYTES) -> int:
    """Tokens per chunk for `v` logit columns: an fp32 [chunk, v] buffer within `budget` bytes,
    rounded down to a multiple of 64 (at least 64)."""
    return max(64, budget // (4 * v) // 64 * 64)
