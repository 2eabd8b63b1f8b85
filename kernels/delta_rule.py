"""The gated delta rule (Gated DeltaNet, Qwen3-Next's linear attention): a recurrent state per
(batch, head) written by a decayed delta rule and read by the queries, with packed documents.

Per batch b and head h, with the state S [d_k, d_v] in fp32, and per token t:

    S ← exp(g_t) · S,   m = Sᵀ k_t,   S ← S + k_t ⊗ β_t (v_t − m),   o_t = Sᵀ q_t,

q and k first L2-normalised over d_k (x · rsqrt(Σx² + 1e-6), as FLA and transformers, when
use_qk_l2norm) and q scaled by d_k^-½ (always). g ≤ 0 is the log decay, β ∈ (0, 1) the write
strength. `starts` [B, T] marks the first token of each packed document: there the state is reset
to zero before the token (its g has no effect); starts[:, 0] is ignored, the state entering
position 0 being `initial_state` (zero without one), so a document cut at the left edge of the
sequence continues from the state carried over.

The chunked form (the UT/WY transform) covers chunks of C tokens at once. Within a chunk, with
γ_i = Σ_{j≤i} g_j and σ_i the number of starts at or before i (both within the chunk),

    Γ_ij = exp(γ_i − γ_j) if j ≤ i and σ_i = σ_j else 0        (decay from token j to token i)
    α_i = exp(γ_i) if σ_i = 0 else 0                           (from the chunk's entering state)
    τ_i = exp(γ_last − γ_i) if σ_i = σ_last else 0            (to the chunk's leaving state)
    λ = exp(γ_last) if σ_last = 0 else 0                        (the entering state's decay)
    A = strictly-lower((βK) Kᵀ ∘ Γ),  T = I + A,  U = T⁻¹ (βV),  W = T⁻¹ (βα ∘ K)
    V' = U − W S,   O = (α ∘ Q) S + ((Q Kᵀ) ∘ Γ) V',   S ← λ S + (τ ∘ K)ᵀ V'

(rows scaled by the per-token factors). Decays are masked where a start lies between the two
tokens before exp is taken, so no (−inf) − (−inf) is ever formed and no gradient is NaN; g at a
start is zeroed first, so its gradient is exactly zero. A sequence that is not a multiple of C
is padded (k = v = q = 0, g = 0, β = 0: padded tokens write nothing).

The backward of one chunk, with dS the gradient of the leaving state (walked from the last chunk
to the first):
    dV' = ((QKᵀ)∘Γ)ᵀ dO + (τ∘K) dS,   dS ← (α∘Q)ᵀ dO + λ dS − Wᵀ dV',
    dU = dV',  dW = −dV' Sᵀ,  d(βV) = T⁻ᵀ dU,  d(βα∘K) = T⁻ᵀ dW,
    dA = −strictly-lower(d(βV) Uᵀ + d(βα∘K) Wᵀ),
and the log-decays' gradients dlog Γ_ij = dA_ij A_ij + dP_ij P_ij (P = (QKᵀ)∘Γ), dlog α, dlog τ,
dlog λ gathered into dγ and summed from the end of the chunk (dg_s = Σ_{i≥s} dγ_i).

Shapes: q, k [B, T, H, d_k], v [B, T, H, d_v], g, beta [B, T, H], starts [B, T] bool,
initial_state and the final state [B, H, d_k, d_v] fp32. H is the value heads: callers repeat the
key heads to H before calling (Qwen3-Next's grouped value attention). Outputs o [B, T, H, d_v] in
q's dtype and the final state in fp32.

    delta_rule_recurrent_reference   the per-token loop in fp32 (ground truth; decode steps)
    delta_rule_chunked_reference     the chunked form in fp32 torch, differentiable by autograd
                                     (the torch training path, `backend="torch"`)
    gated_delta_rule                 the public function, backend "torch" or "triton"

What is Triton (`backend="triton"`): the whole chunked forward and backward. One program per
(batch·head, block of d_v columns) walks the chunks in order (forward) or in reverse (backward);
per chunk it computes Γ, α, τ, λ, A, T⁻¹ (forward substitution, row by row, in registers), U, W,
V', the output, the state update and all gradients with tl.dot on the chunk tiles. The forward
saves the state entering each chunk [B·H, chunks, d_k, d_v] (fp32) for the backward, which
recomputes the rest. Columns of d_v are independent in the forward; the backward's gradients of
q, k, g and β are sums over d_v blocks, written per block and summed in torch. What is torch:
the layout ([B, T, H, ·] → [B, H, T, ·] fp32), the L2 normalisation of q and k and the d_k^-½
scale of q, zeroing g at starts (all differentiated by torch's autograd around the Triton Function), and
the final cast of o. tl.dot runs in full fp32 ("ieee") for fp32 inputs and in tf32 for 16-bit
inputs (whose rounding is coarser than tf32's).
triton is imported, and the kernels jitted, on the first Triton call (TRITON_INTERPRET is read
then), never by importing this module (as `kernels.ssd`).

Tested on CPU under the Triton interpreter against the torch references and transformers'
Qwen3-Next functions (tests/unit/test_kernel_delta_rule.py); not yet run on a GPU. Both kernels compile
for sm_90 (triton.compile on CPU, not launched): the forward needs ≤ 147 KB of shared memory at
C=64, d_k=128, BLOCK_V=64, the backward (tf32) 320 KB there (287 KB at BLOCK_V=32, 225 KB at 16, 123 KB
at C=32 and BLOCK_V=64), so for C·BK ≥ 64·128 the backward starts at BLOCK_V=16, and a launch that
triton refuses for want of resources is retried with half the block (`_launch_halving`).
Performance is untuned: each d_v block recomputes the chunk's A, T⁻¹ and W, the substitution is
C serial steps, and in full fp32 ("ieee") ptxas took minutes to compile the backward.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

BLOCK_V = 64  # most d_v columns per Triton program (each program holds a [d_k, BLOCK_V] state)
BACKENDS = ("torch", "triton")


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / √(Σ x² + eps) over the last dim (transformers' and FLA's l2norm)."""
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)


def _check(q, k, v, g, beta, initial_state, starts) -> None:
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(
            f"q and k must be [B, T, H, d_k] of one shape, got {tuple(q.shape)}, {tuple(k.shape)}"
        )
    B, T, H, dk = q.shape
    if v.dim() != 4 or v.shape[:3] != (B, T, H):
        raise ValueError(f"v must be [B, T, H, d_v] = [{B}, {T}, {H}, d_v], got {tuple(v.shape)}")
    for name, t in (("g", g), ("beta", beta)):
        if t.shape != (B, T, H):
            raise ValueError(f"{name} must be [B, T, H] = [{B}, {T}, {H}], got {tuple(t.shape)}")
    if initial_state is not None and initial_state.shape != (B, H, dk, v.shape[-1]):
        raise ValueError(
            f"initial_state must be [B, H, d_k, d_v] = [{B}, {H}, {dk}, {v.shape[-1]}], "
            f"got {tuple(initial_state.shape)}"
        )
    if starts is not None and starts.shape != (B, T):
        raise ValueError(f"starts must be [B, T] = [{B}, {T}], got {tuple(starts.shape)}")


def _prepare(q, k, v, g, beta, starts, use_qk_l2norm):
    """fp32 [B, H, T, ·] copies: q, k normalised (if asked) and q scaled by d_k^-½, g zeroed at the
    starts; and the starts as bool [B, T] with position 0 cleared (None without starts)."""
    q, k, v = (x.float().transpose(1, 2) for x in (q, k, v))
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q = q * q.shape[-1] ** -0.5
    g, beta = (x.float().transpose(1, 2) for x in (g, beta))
    if starts is not None:
        starts = starts.to(device=g.device, dtype=torch.bool).clone()
        starts[:, 0] = False
        g = g.masked_fill(starts[:, None, :], 0.0)
    return [x.contiguous() for x in (q, k, v, g, beta)], starts


def delta_rule_recurrent_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    starts: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token recurrence in fp32: (o [B, T, H, d_v] in q's dtype, final state fp32)."""
    _check(q, k, v, g, beta, initial_state, starts)
    (q_, k_, v_, g_, beta_), starts = _prepare(q, k, v, g, beta, starts, use_qk_l2norm)
    B, H, T, dk = q_.shape
    dv = v_.shape[-1]
    if initial_state is None:
        S = q_.new_zeros(B, H, dk, dv)
    else:
        S = initial_state.float()
    out = []
    for t in range(T):
        if starts is not None:
            S = S.masked_fill(starts[:, t, None, None, None], 0.0)
        S = S * g_[:, :, t, None, None].exp()
        kt = k_[:, :, t]
        read = torch.einsum("bhkv,bhk->bhv", S, kt)
        S = S + kt[..., None] * (beta_[:, :, t, None] * (v_[:, :, t] - read))[..., None, :]
        out.append(torch.einsum("bhkv,bhk->bhv", S, q_[:, :, t]))
    o = torch.stack(out, dim=1) if out else v_.new_zeros(B, 0, H, dv)
    return o.to(q.dtype), S


def delta_rule_chunked_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    starts: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked form (UT transform within chunks, a loop over chunks) in fp32 torch,
    differentiable by autograd: (o [B, T, H, d_v] in q's dtype, final state fp32)."""
    _check(q, k, v, g, beta, initial_state, starts)
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be positive")
    (q_, k_, v_, g_, beta_), starts = _prepare(q, k, v, g, beta, starts, use_qk_l2norm)
    B, H, T, dk = q_.shape
    dv = v_.shape[-1]
    C = chunk_size
    pad = (-T) % C
    N = (T + pad) // C
    q_, k_, v_ = (F.pad(x, (0, 0, 0, pad)).view(B, H, N, C, -1) for x in (q_, k_, v_))
    g_, beta_ = (F.pad(x, (0, pad)).view(B, H, N, C) for x in (g_, beta_))
    if starts is None:
        seg = g_.new_zeros(1, 1, N, C)
    else:  # σ: the starts at or before each position of its chunk
        seg = F.pad(starts.float(), (0, pad)).view(B, 1, N, C).cumsum(-1)
    gam = g_.cumsum(-1)
    gam_last, seg_last = gam[..., -1:], seg[..., -1:]
    idx = torch.arange(C, device=q_.device)
    causal = (idx[:, None] >= idx[None, :]) & (seg[..., :, None] == seg[..., None, :])
    strict = causal & (idx[:, None] > idx[None, :])
    neg_inf = torch.tensor(float("-inf"), device=q_.device)
    # exp of the masked log-decays: masked entries are −inf before exp (0 after, zero gradient)
    Gam = torch.where(causal, gam[..., :, None] - gam[..., None, :], neg_inf).exp()
    alpha = torch.where(seg == 0, gam, neg_inf).exp()
    tau = torch.where(seg == seg_last, gam_last - gam, neg_inf).exp()
    lam = torch.where(seg_last == 0, gam_last, neg_inf).exp()

    kb = k_ * beta_[..., None]
    A = torch.where(strict, kb @ k_.transpose(-1, -2) * Gam, 0.0)
    Tmat = A + torch.eye(C, device=q_.device)
    U = torch.linalg.solve_triangular(Tmat, v_ * beta_[..., None], upper=False, unitriangular=True)
    W = torch.linalg.solve_triangular(Tmat, kb * alpha[..., None], upper=False, unitriangular=True)
    P = q_ @ k_.transpose(-1, -2) * Gam
    qa, kt = q_ * alpha[..., None], k_ * tau[..., None]

    S = q_.new_zeros(B, H, dk, dv) if initial_state is None else initial_state.float()
    out = []
    for n in range(N):
        vn = U[:, :, n] - W[:, :, n] @ S
        out.append(qa[:, :, n] @ S + P[:, :, n] @ vn)
        S = lam[:, :, n, :, None] * S + kt[:, :, n].transpose(-1, -2) @ vn
    o = torch.stack(out, dim=2).reshape(B, H, N * C, dv)[:, :, :T]
    return o.transpose(1, 2).to(q.dtype), S


# ---------------------------------------------------------------------------------------------
# Triton: one program per (batch·head, block of d_v columns), walking the chunks. triton is
# imported on the first `backend="triton"` call, not with this module: the torch path (the model's
# training path on CPU and `delta_rule_recurrent_reference` for decode) needs no triton, and
# importing this module never imports triton behind the back of a caller that must set
# TRITON_INTERPRET=1 first. The kernels and their helpers are plain functions below, `triton.jit`-ed
# by `_kernels()` once `tl` is bound (the kernels call the helpers by their module-level names,
# which `_kernels()` rebinds to the jitted ones).

tl = None  # triton.language, bound by `_kernels()`
_JIT = (
    "_dot",
    "_decays",
    "_unit_lower_inverse",
    "_ut",
    "_load_chunk",
    "_delta_rule_forward",
    "_delta_rule_backward",
)


@functools.cache
def _kernels():
    """(triton, forward kernel, backward kernel), jitted on first use (TRITON_INTERPRET is read
    here: set it before the first Triton call to run on the interpreter)."""
    global tl
    import triton
    import triton.language

    tl = triton.language
    for name in _JIT:
        globals()[name] = triton.jit(globals()[name])
    return triton, _delta_rule_forward, _delta_rule_backward


def _out_of_resources() -> type[Exception]:
    """triton's OutOfResources (imported with triton, on the first Triton launch)."""
    from triton.runtime.errors import OutOfResources

    return OutOfResources


def _dot(a, b, PREC: tl.constexpr):
    return tl.dot(a, b, input_precision=PREC)


def _decays(g, st, rows):
    """Γ (with its diagonal), Γ strictly below it, α, τ, λ of one chunk from its g and starts."""
    lower = rows[:, None] >= rows[None, :]
    gam = tl.sum(tl.where(lower, g[None, :], 0.0), axis=1)  # γ_i = Σ_{j≤i} g_j
    seg = tl.sum(tl.where(lower, st[None, :], 0.0), axis=1)  # σ_i = starts at or before i
    gam_last = tl.sum(g, axis=0)
    seg_last = tl.sum(st, axis=0)
    same = lower & (seg[:, None] == seg[None, :])
    gam_inc = tl.where(same, tl.exp(tl.where(same, gam[:, None] - gam[None, :], 0.0)), 0.0)
    gam_strict = tl.where(rows[:, None] > rows[None, :], gam_inc, 0.0)
    alpha = tl.where(seg == 0, tl.exp(tl.where(seg == 0, gam, 0.0)), 0.0)
    tau = tl.where(seg == seg_last, tl.exp(tl.where(seg == seg_last, gam_last - gam, 0.0)), 0.0)
    lam = tl.where(seg_last == 0, tl.exp(tl.where(seg_last == 0, gam_last, 0.0)), 0.0)
    return gam_inc, gam_strict, alpha, tau, lam


def _unit_lower_inverse(A, rows, C: tl.constexpr):
    """(I + A)⁻¹ for A strictly lower [C, C], by forward substitution: row i of the inverse is
    e_i − Σ_{j<i} A_ij · (row j)."""
    inv = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    for i in range(1, C):
        a_i = tl.sum(tl.where(rows[:, None] == i, A, 0.0), axis=0)
        r = tl.where(rows == i, 1.0, 0.0) - tl.sum(a_i[:, None] * inv, axis=0)
        inv = tl.where(rows[:, None] == i, r[None, :], inv)
    return inv


def _ut(k, v, beta, alpha, gam_strict, rows, C: tl.constexpr, PREC: tl.constexpr):
    """A, T⁻¹ = (I + A)⁻¹, U = T⁻¹(βV) and W = T⁻¹(βα∘K) of one chunk."""
    A = _dot(k * beta[:, None], tl.trans(k), PREC) * gam_strict
    Tinv = _unit_lower_inverse(A, rows, C)
    U = _dot(Tinv, v * beta[:, None], PREC)
    W = _dot(Tinv, k * (beta * alpha)[:, None], PREC)
    return A, Tinv, U, W


def _load_chunk(
    Q, K, V, G, BETA, STARTS, bh, b, n, T, DK, DV, v0, rows, ck, cv, C: tl.constexpr, HAS_STARTS: tl.constexpr
):
    t = n * C + rows
    t_ok = t < T
    k_mask = t_ok[:, None] & (ck < DK)[None, :]
    v_mask = t_ok[:, None] & (v0 + cv < DV)[None, :]
    k_offs = (bh * T + t)[:, None] * DK + ck[None, :]
    v_offs = (bh * T + t)[:, None] * DV + v0 + cv[None, :]
    q = tl.load(Q + k_offs, mask=k_mask, other=0.0)
    k = tl.load(K + k_offs, mask=k_mask, other=0.0)
    v = tl.load(V + v_offs, mask=v_mask, other=0.0)
    g = tl.load(G + bh * T + t, mask=t_ok, other=0.0)
    beta = tl.load(BETA + bh * T + t, mask=t_ok, other=0.0)
    if HAS_STARTS:
        st = tl.load(STARTS + b * T + t, mask=t_ok, other=0.0)
    else:
        st = tl.zeros((C,), dtype=tl.float32)
    return q, k, v, g, beta, st, t_ok, k_offs, v_offs, k_mask, v_mask


def _delta_rule_forward(
    Q,
    K,
    V,
    G,
    BETA,
    STARTS,
    S0,
    OUT,
    STATES,
    SF,
    T,
    H,
    DK,
    DV,
    N,
    HAS_STARTS: tl.constexpr,
    HAS_S0: tl.constexpr,
    C: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    PREC: tl.constexpr,
):
    bh = tl.program_id(0).to(tl.int64)
    v0 = tl.program_id(1) * BV
    b = bh // H
    rows = tl.arange(0, C)
    ck = tl.arange(0, BK)
    cv = tl.arange(0, BV)
    s_offs = ck[:, None] * DV + v0 + cv[None, :]
    s_mask = (ck < DK)[:, None] & (v0 + cv < DV)[None, :]
    if HAS_S0:
        S = tl.load(S0 + bh * DK * DV + s_offs, mask=s_mask, other=0.0)
    else:
        S = tl.zeros((BK, BV), dtype=tl.float32)
    for n in range(N):
        q, k, v, g, beta, st, t_ok, k_offs, v_offs, k_mask, v_mask = _load_chunk(
            Q, K, V, G, BETA, STARTS, bh, b, n, T, DK, DV, v0, rows, ck, cv, C, HAS_STARTS
        )
        tl.store(STATES + (bh * N + n) * DK * DV + s_offs, S, mask=s_mask)
        gam_inc, gam_strict, alpha, tau, lam = _decays(g, st, rows)
        A, Tinv, U, W = _ut(k, v, beta, alpha, gam_strict, rows, C, PREC)
        vn = U - _dot(W, S, PREC)
        P = _dot(q, tl.trans(k), PREC) * gam_inc
        o = _dot(q * alpha[:, None], S, PREC) + _dot(P, vn, PREC)
        tl.store(OUT + v_offs, o, mask=v_mask)
        S = lam * S + _dot(tl.trans(k * tau[:, None]), vn, PREC)
    tl.store(SF + bh * DK * DV + s_offs, S, mask=s_mask)


def _delta_rule_backward(
    Q,
    K,
    V,
    G,
    BETA,
    STARTS,
    STATES,
    DO,
    DSF,
    DQ,
    DKEY,
    DVAL,
    DG,
    DBETA,
    DS0,
    T,
    H,
    DK,
    DV,
    N,
    BH,
    HAS_STARTS: tl.constexpr,
    HAS_DSF: tl.constexpr,
    C: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    PREC: tl.constexpr,
):
    bh = tl.program_id(0).to(tl.int64)
    vb = tl.program_id(1).to(tl.int64)
    v0 = vb * BV
    b = bh // H
    rows = tl.arange(0, C)
    ck = tl.arange(0, BK)
    cv = tl.arange(0, BV)
    s_offs = ck[:, None] * DV + v0 + cv[None, :]
    s_mask = (ck < DK)[:, None] & (v0 + cv < DV)[None, :]
    strict = rows[:, None] > rows[None, :]
    # this d_v block's partial gradients of q, k, g, beta (summed over blocks on the host)
    part = vb * BH * T
    if HAS_DSF:
        dS = tl.load(DSF + bh * DK * DV + s_offs, mask=s_mask, other=0.0)
    else:
        dS = tl.zeros((BK, BV), dtype=tl.float32)
    for i in range(N):
        n = N - 1 - i
        q, k, v, g, beta, st, t_ok, k_offs, v_offs, k_mask, v_mask = _load_chunk(
            Q, K, V, G, BETA, STARTS, bh, b, n, T, DK, DV, v0, rows, ck, cv, C, HAS_STARTS
        )
        do = tl.load(DO + v_offs, mask=v_mask, other=0.0)
        S = tl.load(STATES + (bh * N + n) * DK * DV + s_offs, mask=s_mask, other=0.0)
        gam_inc, gam_strict, alpha, tau, lam = _decays(g, st, rows)
        A, Tinv, U, W = _ut(k, v, beta, alpha, gam_strict, rows, C, PREC)
        vn = U - _dot(W, S, PREC)
        qk = _dot(q, tl.trans(k), PREC)
        P = qk * gam_inc
        qa = q * alpha[:, None]
        kt = k * tau[:, None]
        # through O = (α∘Q) S + P V' and S' = λ S + (τ∘K)ᵀ V'
        dvn = _dot(tl.trans(P), do, PREC) + _dot(kt, dS, PREC)
        dqa = _dot(do, tl.trans(S), PREC)
        dkt = _dot(vn, tl.trans(dS), PREC)
        dPg = _dot(do, tl.trans(vn), PREC) * gam_inc  # dP ∘ Γ
        dlam = tl.sum(tl.sum(S * dS, axis=1), axis=0)
        # through V' = U − W S, U = T⁻¹(βV), W = T⁻¹(βα∘K)
        dS_prev = _dot(tl.trans(qa), do, PREC) + lam * dS - _dot(tl.trans(W), dvn, PREC)
        dW = -_dot(dvn, tl.trans(S), PREC)
        tinv_t = tl.trans(Tinv)
        dbv = _dot(tinv_t, dvn, PREC)
        dbk = _dot(tinv_t, dW, PREC)
        dA = -(_dot(dbv, tl.trans(U), PREC) + _dot(dbk, tl.trans(W), PREC))
        dA = tl.where(strict, dA, 0.0)
        # through A = strictly-lower(β ∘ KKᵀ ∘ Γ) and P = QKᵀ ∘ Γ
        kk = _dot(k, tl.trans(k), PREC)
        MA = dA * gam_strict
        bMA = MA * beta[:, None]
        ba = beta * alpha
        dq = _dot(dPg, k, PREC) + alpha[:, None] * dqa
        dk = (
            _dot(bMA, k, PREC)
            + _dot(tl.trans(bMA), k, PREC)
            + _dot(tl.trans(dPg), q, PREC)
            + tau[:, None] * dkt
            + ba[:, None] * dbk
        )
        dv = beta[:, None] * dbv
        k_dbk = tl.sum(k * dbk, axis=1)
        dbeta = tl.sum(MA * kk, axis=1) + tl.sum(v * dbv, axis=1) + alpha * k_dbk
        # the log-decays: Γ_ij = e^{γ_i − γ_j}, α_i = e^{γ_i}, τ_i = e^{γ_last − γ_i}, λ = e^{γ_last}
        dlg = dA * A + dPg * qk
        dla = tl.sum(qa * dqa, axis=1) + ba * k_dbk
        dlt = tl.sum(kt * dkt, axis=1)
        dgam = dla + tl.sum(dlg, axis=1) - tl.sum(dlg, axis=0) - dlt
        dgam += tl.where(rows == C - 1, tl.sum(dlt, axis=0) + lam * dlam, 0.0)
        dg = tl.sum(tl.where(rows[:, None] >= rows[None, :], dgam[:, None], 0.0), axis=0)
        t = n * C + rows
        tl.store(DQ + part * DK + k_offs, dq, mask=k_mask)
        tl.store(DKEY + part * DK + k_offs, dk, mask=k_mask)
        tl.store(DVAL + v_offs, dv, mask=v_mask)
        tl.store(DG + part + bh * T + t, dg, mask=t_ok)
        tl.store(DBETA + part + bh * T + t, dbeta, mask=t_ok)
        dS = dS_prev
    tl.store(DS0 + bh * DK * DV + s_offs, dS, mask=s_mask)


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _block_k(dk: int) -> int:
    return max(16, _next_power_of_2(dk))


def _block_v(dv: int, limit: int) -> int:
    """d_v columns per program: a power of two, at least tl.dot's 16, at most `limit`."""
    return max(16, min(_next_power_of_2(dv), limit))


# The d_v block each (kernel, C, BK, d_v, precision) fell back to, so that a block too large for
# the GPU's shared memory is tried once per process (compiled for sm_90: the backward needs
# 320 KB at C=64, d_k=128, BLOCK_V=64, 287 KB at 32, 225 KB at 16, under H100/H200's 227 KB).
_fitted_block_v: dict[tuple, int] = {}


def _launch_halving(key: tuple, block_v: int, launch) -> None:
    """launch(block_v), halving block_v (down to 16) while triton reports too few resources
    (shared memory, registers) for it; remembers under `key` a block that ran after halving."""
    out_of_resources = _out_of_resources()
    block_v = min(block_v, _fitted_block_v.get(key, block_v))
    while True:
        try:
            return launch(block_v)
        except out_of_resources:
            if block_v <= 16:
                raise
            block_v //= 2
            _fitted_block_v[key] = block_v


class GatedDeltaRuleFunction(torch.autograd.Function):
    """The chunked gated delta rule on prepared inputs: q, k [B, H, T, d_k] (normalised, scaled),
    v [B, H, T, d_v], g, beta [B, H, T], all fp32 contiguous; starts fp32 [B, T] (1 at a start,
    position 0 cleared) or None; initial_state fp32 [B, H, d_k, d_v] or None. Returns o fp32
    [B, H, T, d_v] and the final state."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, starts, initial_state, chunk_size: int, precision: str):
        triton, forward, _ = _kernels()
        B, H, T, dk = q.shape
        dv = v.shape[-1]
        C, N, bk = chunk_size, triton.cdiv(T, chunk_size), _block_k(dk)
        o = torch.empty_like(v)
        states = torch.empty((B * H, N, dk, dv), dtype=torch.float32, device=q.device)
        final = torch.empty((B, H, dk, dv), dtype=torch.float32, device=q.device)
        s0 = initial_state.contiguous() if initial_state is not None else final
        st = starts if starts is not None else g

        def launch(bv):
            forward[(B * H, triton.cdiv(dv, bv))](
                q, k, v, g, beta, st, s0, o, states, final, T, H, dk, dv, N,
                HAS_STARTS=starts is not None, HAS_S0=initial_state is not None,
                C=C, BK=bk, BV=bv, PREC=precision,
            )  # fmt: skip

        _launch_halving(("forward", C, bk, dv, precision), _block_v(dv, BLOCK_V), launch)
        ctx.save_for_backward(q, k, v, g, beta, starts, states)
        ctx.has_s0 = initial_state is not None
        ctx.chunk_size, ctx.precision = C, precision
        return o, final

    @staticmethod
    def backward(ctx, do, dfinal):
        triton, _, backward = _kernels()
        q, k, v, g, beta, starts, states = ctx.saved_tensors
        B, H, T, dk = q.shape
        dv = v.shape[-1]
        C, N, bk = ctx.chunk_size, triton.cdiv(T, ctx.chunk_size), _block_k(dk)
        do = torch.zeros_like(v) if do is None else do.float().contiguous()
        dsf = None if dfinal is None else dfinal.float().contiguous()
        f32 = dict(dtype=torch.float32, device=q.device)
        dv_ = torch.empty_like(v)
        ds0 = torch.empty((B, H, dk, dv), **f32)
        st = starts if starts is not None else g
        partials = []

        def launch(bv):
            nv = triton.cdiv(dv, bv)  # one partial gradient of q, k, g, beta per d_v block
            dq, dk_ = (torch.empty((nv, B, H, T, dk), **f32) for _ in range(2))
            dg, dbeta = (torch.empty((nv, B, H, T), **f32) for _ in range(2))
            backward[(B * H, nv)](
                q, k, v, g, beta, st, states, do, dsf if dsf is not None else ds0,
                dq, dk_, dv_, dg, dbeta, ds0, T, H, dk, dv, N, B * H,
                HAS_STARTS=starts is not None, HAS_DSF=dsf is not None,
                C=C, BK=bk, BV=bv, PREC=ctx.precision,
            )  # fmt: skip
            partials[:] = dq, dk_, dg, dbeta

        # the backward holds several more [C, BV] and [BK, BV] tiles: start narrower for large C·BK
        first = _block_v(dv, BLOCK_V if C * bk < 64 * 128 else 16)
        _launch_halving(("backward", C, bk, dv, ctx.precision), first, launch)
        dq, dk_, dg, dbeta = (p.sum(0) for p in partials)
        return dq, dk_, dv_, dg, dbeta, None, ds0 if ctx.has_s0 else None, None, None


def _triton_chunked(q, k, v, g, beta, initial_state, starts, use_qk_l2norm, chunk_size):
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size={chunk_size}: the Triton backend needs a power of two ≥ 16")
    (q_, k_, v_, g_, beta_), starts_ = _prepare(q, k, v, g, beta, starts, use_qk_l2norm)
    s0 = None if initial_state is None else initial_state.float()
    st = None if starts_ is None else starts_.float().contiguous()
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    o, final = GatedDeltaRuleFunction.apply(q_, k_, v_, g_, beta_, st, s0, chunk_size, precision)
    return o.transpose(1, 2).to(q.dtype), final


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    initial_state: torch.Tensor | None = None,
    starts: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
    backend: str = "torch",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule over q, k [B, T, H, d_k], v [B, T, H, d_v], g, beta [B, T, H], chunked:
    (o [B, T, H, d_v] in q's dtype, the final state [B, H, d_k, d_v] fp32 if output_final_state
    else None). backend "torch" (`delta_rule_chunked_reference`, autograd) or "triton" (Triton
    forward and backward); starts [B, T] bool resets the state at each packed document's first
    token (starts[:, 0] ignored: position 0 reads initial_state)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: must be one of {', '.join(BACKENDS)}")
    _check(q, k, v, g, beta, initial_state, starts)
    if backend == "torch":
        o, final = delta_rule_chunked_reference(
            q, k, v, g, beta, initial_state, starts, use_qk_l2norm, chunk_size=chunk_size
        )
    else:
        o, final = _triton_chunked(q, k, v, g, beta, initial_state, starts, use_qk_l2norm, chunk_size)
    return o, final if output_final_state else None
