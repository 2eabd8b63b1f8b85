"""Context-parallel attention (ring and all-gather) against one process's causal attention.

The log-sum-exp merge is checked alone against a softmax over the concatenated keys. Then, on 2
and 4 real gloo ranks, each rank takes its zigzag slice of one random sequence (same seed
everywhere) and runs `ring_attention` and `allgather_attention`; the output and the gradients of
q, k and v (for a fixed random output gradient) must equal `F.scaled_dot_product_attention` on
the whole sequence at that slice, for MHA and GQA. fp32; TOL is on max |error|, inputs randn.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mlm.parallel.context import allgather_attention, zigzag_indices
from mlm.parallel.ring_attention import merge, ring_attention
from tests.helpers.distributed import run_ranks

TOL = 1e-5  # fp32 max |cp − reference|; measured ≤ 1.5e-6 (2 CPU cores, torch 2.13)

B, T, K = 2, 32, 16
# (H, G, value dims): values narrower (MLA's) or wider than queries and keys go zero-padded
SHAPES = {"mha": (4, 4, K), "gqa": (4, 2, K), "narrow-v": (4, 4, K // 2), "wide-v": (4, 4, K + 4)}


def _attend(q_qK, k_sK, v_sK):
    """Softmax attention of one block (no mask): out [..., q, K], lse [..., q]."""
    s = q_qK @ k_sK.transpose(-1, -2)
    return torch.softmax(s, -1) @ v_sK, torch.logsumexp(s, -1)


def test_merge_equals_softmax_over_the_concatenated_keys():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 5, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, 3, 11, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, 3, 11, 8, generator=g, dtype=torch.float64)
    for scale in (1.0, 100.0):  # 100: lse up to ~1000, e^lse beyond fp64 unless merged stably
        full_out, full_lse = _attend(q * scale, k, v)
        a = _attend(q * scale, k[..., :4, :], v[..., :4, :])
        b = _attend(q * scale, k[..., 4:, :], v[..., 4:, :])
        for out, lse in (merge(*a, *b), merge(*b, *a)):
            torch.testing.assert_close(out, full_out, rtol=0, atol=1e-12)
            torch.testing.assert_close(lse, full_lse, rtol=0, atol=1e-12)
    # an empty block (lse −inf, out zeros) drops out; ring attention never makes one, but merge allows it
    empty = torch.zeros_like(full_out), torch.full_like(full_lse, float("-inf"))
    for out, lse in (merge(full_out, full_lse, *empty), merge(*empty, full_out, full_lse)):
        assert torch.equal(out, full_out) and torch.equal(lse, full_lse)


def test_ring_attention_at_cp1_is_causal_attention():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, 8, 4, K, generator=g) for _ in range(3))
    ref = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), is_causal=True)
    assert torch.equal(ring_attention(q, k, v, None, 1, 0), ref.transpose(1, 2))


def _reference(H: int, G: int, E: int):
    """Inputs, output gradient, output and input gradients on the whole sequence (one process)."""
    g = torch.Generator().manual_seed(H * 10 + G)
    q, k = torch.randn(B, T, H, K, generator=g), torch.randn(B, T, G, K, generator=g)
    v = torch.randn(B, T, G, E, generator=g)
    dout = torch.randn(B, T, H, E, generator=g)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = F.scaled_dot_product_attention(
        *(x.transpose(1, 2) for x in leaves), is_causal=True, enable_gqa=H != G
    )
    out = out.transpose(1, 2)
    out.backward(dout)
    return (q, k, v), dout, out.detach(), [x.grad for x in leaves]


def _compare(rank: int, world: int, groups: list[list[int]]) -> dict[str, float]:
    """On each cp group in `groups` (all ranks build them all): both cp attentions against the
    reference at this rank's slice; max |error| by "impl/shape/cp/what"."""
    built = [dist.new_group(ranks) if len(ranks) < world else dist.group.WORLD for ranks in groups]
    group, ranks = next((gr, r) for gr, r in zip(built, groups, strict=True) if rank in r)
    cp, cp_rank = len(ranks), ranks.index(rank)
    idx = zigzag_indices(T, cp, cp_rank)
    errors = {}
    for shape, (H, G, E) in SHAPES.items():
        inputs, dout, ref_out, ref_grads = _reference(H, G, E)
        for name, attention in (("ring", ring_attention), ("allgather", allgather_attention)):
            local = [x[:, idx].clone().requires_grad_(True) for x in inputs]
            out = attention(*local, group, cp, cp_rank)
            out.backward(dout[:, idx])
            pairs = [("out", out, ref_out)] + [
                (f"d{n}", x.grad, r) for n, x, r in zip("qkv", local, ref_grads, strict=True)
            ]
            for what, got, ref in pairs:
                errors[f"{name}/{shape}/cp{cp}/{what}"] = float((got.detach() - ref[:, idx]).abs().max())
    return errors


def _check(results: list[dict[str, float]]) -> None:
    worst = {k: max(r[k] for r in results if k in r) for k in set().union(*results)}
    bad = {k: v for k, v in worst.items() if not v <= TOL}
    assert not bad, f"max |error| above {TOL}: {bad}"


def test_cp_attention_on_2_ranks():
    _check(run_ranks(2, _compare, [[0, 1]]))


def test_cp_attention_on_4_ranks():
    _check(run_ranks(4, _compare, [[0, 1, 2, 3]]))
    # cp = 2 in groups of non-adjacent ranks (as under tp = 2): cp rank ≠ global rank
    _check(run_ranks(4, _compare, [[0, 2], [1, 3]]))
