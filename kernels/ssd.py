"""Mamba-2's state-space scan (SSD, Dao & Gu 2024), chunked, with packed documents.

Per head h of P channels and state width N, with a_t = dt_t · A_h ≤ 0 (the log decay):

    state_t = exp(a_t) · state_{t−1} + dt_t · x_t ⊗ B_t        state [P, N]
    y_t     = state_t · C_t

B and C come in G groups; head h reads group h // (H / G) (consecutive heads share a group).
A document start (`starts`) empties the state before its token (the decay there is exp(−∞)).

The chunked form (`ssd_reference`) cuts the sequence into chunks of Q tokens and computes:
1. within each chunk, y from the chunk's own tokens: (L ∘ C Bᵀ)(dt · x), with
   L[i, j] = exp(a_{j+1} + … + a_i) for j ≤ i, else 0;
2. each chunk's state from its own tokens;
3. the state entering each chunk, from the chunk states and the chunks' total decays;
4. y from the entering state: exp(a_1 + … + a_i) · state · C_i.
Every decay is a sum over a range of positions, never a difference of running sums, so a
document start's −∞ gives exp(−∞) = 0 and never (−∞) − (−∞).

`ssd_step` is the recurrence for one token (serving's decode).

`ssd(..., backend="triton")` runs the same scan as Triton kernels (`_SSDFunction`), forward and
backward, gradients for x, dt, A, B, C and initial_state through y and the final state:
- Triton, one program per (batch, head) walking its chunks in order (forward) or in reverse
  (backward), the [P, N] state (or its gradient) in registers, P, N and Q padded to powers of
  two ≥ 16 under masks: loading each chunk (x, dt, B, C straight from [B, T, …] tensors, the
  group of head h at h // (H / G), tokens past T masked to no input and no decay); dt · x and
  a = dt · A; the running sums of a within the chunk; the decays and document masks;
  C Bᵀ ([Q, N]×[N, Q]) ∘ L times dt · x ([Q, Q]×[Q, P]); the entering state's part; the chunk
  state and the recurrence over chunks. The forward stores each chunk's entering state (fp32
  [B, H, C, P, N]) for the backward, which recomputes the rest and carries d(state) backwards,
  including d a (reverse running sums of the decay terms) into d dt and a per-(batch, head) dA.
- torch glue: `.contiguous()`, the running count of document starts per row (an int32 cumsum
  of `starts`), allocating outputs, summing dA over the batch and dB, dC over a group's heads,
  casting the gradients to the inputs' dtypes.
The kernels never see −∞: a start's token gets a = 0 in the running sums, and every term whose
range crosses a start (document ids differ) is masked to 0 with tl.where. Decays inside a chunk
are exp(cs_i − cs_j), differences of running sums within one chunk (as mamba_ssm does), not the
reference's direct range sums: the same up to fp32 rounding of the sums. Products are tl.dot in
fp32 with input_precision="ieee" (no TF32); inputs fp32 or bf16, computed in fp32; y and the
final state fp32, gradients in their inputs' dtypes. triton is imported, and the kernels jitted,
on the first Triton call (TRITON_INTERPRET is read then), never by importing this module.
Tested on CPU under the Triton interpreter (tests/unit/test_kernel_ssd.py) only: never run on a GPU.

Shape legend: B batch, T tokens, H heads, P head dim, G groups, N state width, Q chunk, C chunks.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    """t in fp32, or as it is when wider (fp64: the tests' exact arithmetic)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def segment_sum(a: torch.Tensor) -> torch.Tensor:
    """[..., Q] → [..., Q, Q]: out[i, j] = a[j+1] + … + a[i] for j ≤ i (0 on the diagonal), −∞
    above it; built from masked running sums, so −∞ entries of `a` never meet each other."""
    Q = a.shape[-1]
    a = a[..., None, :].expand(*a.shape[:-1], Q, Q)  # [..., i, j] = a[j]
    strictly = torch.tril(torch.ones(Q, Q, dtype=torch.bool, device=a.device), diagonal=-1)
    # column j, rows i: a[i] for i > j (the terms j+1..i after a running sum over i)
    terms = a.transpose(-1, -2).masked_fill(~strictly, 0.0)
    sums = torch.cumsum(terms, dim=-2)
    lower = torch.tril(torch.ones(Q, Q, dtype=torch.bool, device=a.device))
    return sums.masked_fill(~lower, float("-inf"))


def ssd_reference(
    x_BTHP: torch.Tensor,
    dt_BTH: torch.Tensor,
    A_H: torch.Tensor,
    B_BTGN: torch.Tensor,
    C_BTGN: torch.Tensor,
    chunk: int,
    initial_state_BHPN: torch.Tensor | None = None,
    starts_BT: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked scan in fp32 (see the module doc): (y [B, T, H, P] fp32, the final state
    [B, H, P, N] fp32). `dt` is the step after softplus and limits; `A` ≤ 0 per head;
    `starts_BT` True where a packed document begins (the state before it is zero: a start at
    position 0 drops `initial_state`). Differentiable by autograd: this is the torch path."""
    Bsz, T, H, P = x_BTHP.shape
    G, N = B_BTGN.shape[2], B_BTGN.shape[3]
    pad = (-T) % chunk
    x = at_least_fp32(x_BTHP) * at_least_fp32(dt_BTH)[..., None]  # dt · x
    a = at_least_fp32(dt_BTH) * at_least_fp32(A_H)  # [B, T, H]
    if starts_BT is not None:
        a = a.masked_fill(starts_BT[..., None], float("-inf"))
    Bm = at_least_fp32(B_BTGN).repeat_interleave(H // G, dim=2)  # [B, T, H, N]
    Cm = at_least_fp32(C_BTGN).repeat_interleave(H // G, dim=2)
    if pad:  # padding tokens: no input, no decay (the final state passes through them)
        x, Bm, Cm = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (x, Bm, Cm))
        a = F.pad(a, (0, 0, 0, pad))
    n = (T + pad) // chunk
    x = x.view(Bsz, n, chunk, H, P)
    Bm, Cm = Bm.view(Bsz, n, chunk, H, N), Cm.view(Bsz, n, chunk, H, N)
    a_BHCQ = a.view(Bsz, n, chunk, H).permute(0, 3, 1, 2)

    seg_BHCQQ = segment_sum(a_BHCQ)  # [b, h, c, i, j]: a_{j+1} + … + a_i
    # 1. within chunks
    scores = torch.einsum("bcihn,bcjhn->bchij", Cm, Bm) * torch.exp(seg_BHCQQ).permute(0, 2, 1, 3, 4)
    y_diag = torch.einsum("bchij,bcjhp->bcihp", scores, x)
    # 2. each chunk's state: decay from token j to the chunk's end, a_{j+1} + … + a_{Q−1}
    to_end_BHCQ = seg_BHCQQ[..., -1, :]
    states = torch.einsum("bcjhn,bhcj,bcjhp->bchpn", Bm, torch.exp(to_end_BHCQ), x)
    # 3. the state entering each chunk (and the final one)
    first = (
        at_least_fp32(initial_state_BHPN)[:, None]
        if initial_state_BHPN is not None
        else torch.zeros_like(states[:, :1])
    )
    if starts_BT is not None and initial_state_BHPN is not None:
        first = first * (~starts_BT[:, :1]).to(first.dtype)[:, :, None, None, None]
    states = torch.cat([first, states], dim=1)  # [B, C + 1, H, P, N]
    totals_BHC = seg_BHCQQ[..., -1, 0] + a_BHCQ[..., 0]  # a_0 + … + a_{Q−1}
    between = torch.exp(segment_sum(F.pad(totals_BHC, (1, 0))))  # [b, h, C + 1, C + 1]
    entering = torch.einsum("bhzc,bchpn->bzhpn", between, states)
    states, final = entering[:, :-1], entering[:, -1]
    # 4. from the entering state
    from_start_BHCQ = torch.cumsum(a_BHCQ, dim=-1)  # a_0 + … + a_i
    y_off = torch.einsum("bcihn,bchpn,bhci->bcihp", Cm, states, torch.exp(from_start_BHCQ))
    y = (y_diag + y_off).reshape(Bsz, n * chunk, H, P)[:, :T]
    return y, final


def ssd_step(
    x_BHP: torch.Tensor,
    dt_BH: torch.Tensor,
    A_H: torch.Tensor,
    B_BGN: torch.Tensor,
    C_BGN: torch.Tensor,
    state_BHPN: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the recurrence in fp32: (y [B, H, P], the new state [B, H, P, N])."""
    H, G = x_BHP.shape[1], B_BGN.shape[1]
    dt = at_least_fp32(dt_BH)
    Bm = at_least_fp32(B_BGN).repeat_interleave(H // G, dim=1)  # [B, H, N]
    Cm = at_least_fp32(C_BGN).repeat_interleave(H // G, dim=1)
    decay = torch.exp(dt * at_least_fp32(A_H))[..., None, None]
    state = (
        at_least_fp32(state_BHPN) * decay
        + (dt[..., None] * at_least_fp32(x_BHP))[..., None] * Bm[:, :, None, :]
    )
    y = torch.einsum("bhpn,bhn->bhp", state, Cm)
    return y, state


# ---------------------------------------------------------------------------------------------
# The Triton path. triton is imported on the first call of `ssd(..., backend="triton")`, not with
# this module: the torch path (and `ssd_step`) needs no triton, and importing this module never
# imports triton behind the back of a caller that must set TRITON_INTERPRET=1 first. The kernels
# are plain functions below, `triton.jit`-ed by `_kernels()` once `tl` is bound.

tl = None  # triton.language, bound by `_kernels()`


def _ssd_forward_kernel(
    X,  # [B, T, H, P]
    DT,  # [B, T, H]
    A,  # [H]
    BM,  # [B, T, G, N]
    CM,  # [B, T, G, N]
    STARTS,  # [B, T] int8 (unused without HAS_STARTS)
    DOCS,  # [B, T] int32: starts at or before t (unused without HAS_STARTS)
    INIT,  # [B, H, P, N] (unused without HAS_INIT)
    Y,  # [B, T, H, P] fp32
    STATES,  # [B, H, C, P, N] fp32: the state entering each chunk
    FINAL,  # [B, H, P, N] fp32
    T,
    H,
    G,
    P,
    N,
    chunk,
    n_chunks,
    HAS_INIT: tl.constexpr,
    HAS_STARTS: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    b = pid // H
    h = pid % H
    g = h // (H // G)
    q = tl.arange(0, BLOCK_Q)
    p = tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    p_ok, n_ok = p < P, n < N
    pn = p[:, None] * N + n[None, :]
    pn_ok = p_ok[:, None] & n_ok[None, :]
    causal = q[:, None] >= q[None, :]  # [i, j]: j ≤ i
    A_h = tl.load(A + h).to(tl.float32)
    state_base = pid.to(tl.int64) * P * N
    if HAS_INIT:
        S = tl.load(INIT + state_base + pn, mask=pn_ok, other=0.0).to(tl.float32)
    else:
        S = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    for c in range(0, n_chunks):
        t = c * chunk + q
        t_ok = (q < chunk) & (t < T)
        row = b.to(tl.int64) * T + t  # [Q]: b·T + t
        dt = tl.load(DT + row * H + h, mask=t_ok, other=0.0).to(tl.float32)
        xp = (row * H + h)[:, None] * P + p[None, :]
        qp_ok = t_ok[:, None] & p_ok[None, :]
        xs = tl.load(X + xp, mask=qp_ok, other=0.0).to(tl.float32) * dt[:, None]  # dt · x
        bn = (row * G + g)[:, None] * N + n[None, :]
        qn_ok = t_ok[:, None] & n_ok[None, :]
        Bc = tl.load(BM + bn, mask=qn_ok, other=0.0).to(tl.float32)
        Cc = tl.load(CM + bn, mask=qn_ok, other=0.0).to(tl.float32)
        a = dt * A_h  # 0 on padding
        if HAS_STARTS:
            # a start's decay (−∞ in the reference) never enters a kept term below: 0 here keeps
            # the running sums free of it, and the masks drop every term that crosses a start
            is_start = tl.load(STARTS + row, mask=t_ok, other=0) != 0
            a = tl.where(is_start, 0.0, a)
            last_row = b.to(tl.int64) * T + tl.minimum(t, T - 1)
            docs = tl.load(DOCS + last_row)  # padding repeats the last token's document
            d0 = tl.load(DOCS + b.to(tl.int64) * T + tl.maximum(c * chunk - 1, 0))
            d0 = tl.where(c > 0, d0, 0)  # the document of the state entering the chunk
            d_end = tl.load(DOCS + b.to(tl.int64) * T + tl.minimum(c * chunk + chunk - 1, T - 1))
        else:
            docs = tl.zeros((BLOCK_Q,), dtype=tl.int32)
            d0 = 0
            d_end = 0
        cs = tl.sum(tl.where(causal, a[None, :], 0.0), axis=1)  # a_0 + … + a_i
        cs_end = tl.sum(a, axis=0)
        L_ok = causal & (docs[:, None] == docs[None, :])
        L = tl.where(L_ok, tl.exp(tl.where(L_ok, cs[:, None] - cs[None, :], 0.0)), 0.0)
        g_in = tl.where(docs == d0, tl.exp(cs), 0.0)  # entering state → token i
        w_out = tl.where(docs == d_end, tl.exp(cs_end - cs), 0.0)  # token j → chunk's end
        D = tl.where(d_end == d0, tl.exp(cs_end), 0.0)  # entering state → chunk's end
        scores = tl.dot(Cc, tl.trans(Bc), input_precision="ieee") * L
        y = tl.dot(scores, xs, input_precision="ieee")
        y += g_in[:, None] * tl.dot(Cc, tl.trans(S), input_precision="ieee")
        tl.store(Y + xp, y, mask=qp_ok)
        chunk_base = (pid.to(tl.int64) * n_chunks + c) * P * N
        tl.store(STATES + chunk_base + pn, S, mask=pn_ok)
        S = S * D + tl.dot(tl.trans(xs * w_out[:, None]), Bc, input_precision="ieee")
    tl.store(FINAL + state_base + pn, S, mask=pn_ok)


def _ssd_backward_kernel(
    X,
    DT,
    A,
    BM,
    CM,
    STARTS,
    DOCS,
    STATES,  # [B, H, C, P, N] fp32 from the forward
    DY,  # [B, T, H, P] fp32
    DFINAL,  # [B, H, P, N] fp32
    DX,  # [B, T, H, P] fp32
    DDT,  # [B, T, H] fp32
    DB,  # [B, T, H, N] fp32, per head (summed over a group's heads in torch)
    DC,  # [B, T, H, N] fp32, per head
    DINIT,  # [B, H, P, N] fp32 (unused without HAS_INIT)
    DA,  # [B, H] fp32: this program's part of dA
    T,
    H,
    G,
    P,
    N,
    chunk,
    n_chunks,
    HAS_INIT: tl.constexpr,
    HAS_STARTS: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    b = pid // H
    h = pid % H
    g = h // (H // G)
    q = tl.arange(0, BLOCK_Q)
    p = tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    p_ok, n_ok = p < P, n < N
    pn = p[:, None] * N + n[None, :]
    pn_ok = p_ok[:, None] & n_ok[None, :]
    causal = q[:, None] >= q[None, :]
    A_h = tl.load(A + h).to(tl.float32)
    state_base = pid.to(tl.int64) * P * N
    dS = tl.load(DFINAL + state_base + pn, mask=pn_ok, other=0.0)  # d(state leaving the chunk)
    dA = tl.zeros((BLOCK_Q,), dtype=tl.float32)
    for k in range(0, n_chunks):
        c = n_chunks - 1 - k
        t = c * chunk + q
        t_ok = (q < chunk) & (t < T)
        row = b.to(tl.int64) * T + t
        dt = tl.load(DT + row * H + h, mask=t_ok, other=0.0).to(tl.float32)
        xp = (row * H + h)[:, None] * P + p[None, :]
        qp_ok = t_ok[:, None] & p_ok[None, :]
        x = tl.load(X + xp, mask=qp_ok, other=0.0).to(tl.float32)
        xs = x * dt[:, None]
        bn = (row * G + g)[:, None] * N + n[None, :]
        qn_ok = t_ok[:, None] & n_ok[None, :]
        Bc = tl.load(BM + bn, mask=qn_ok, other=0.0).to(tl.float32)
        Cc = tl.load(CM + bn, mask=qn_ok, other=0.0).to(tl.float32)
        a = dt * A_h
        if HAS_STARTS:
            is_start = tl.load(STARTS + row, mask=t_ok, other=0) != 0
            a = tl.where(is_start, 0.0, a)
            last_row = b.to(tl.int64) * T + tl.minimum(t, T - 1)
            docs = tl.load(DOCS + last_row)
            d0 = tl.load(DOCS + b.to(tl.int64) * T + tl.maximum(c * chunk - 1, 0))
            d0 = tl.where(c > 0, d0, 0)
            d_end = tl.load(DOCS + b.to(tl.int64) * T + tl.minimum(c * chunk + chunk - 1, T - 1))
        else:
            is_start = q < 0
            docs = tl.zeros((BLOCK_Q,), dtype=tl.int32)
            d0 = 0
            d_end = 0
        cs = tl.sum(tl.where(causal, a[None, :], 0.0), axis=1)
        cs_end = tl.sum(a, axis=0)
        L_ok = causal & (docs[:, None] == docs[None, :])
        L = tl.where(L_ok, tl.exp(tl.where(L_ok, cs[:, None] - cs[None, :], 0.0)), 0.0)
        g_in = tl.where(docs == d0, tl.exp(cs), 0.0)
        w_out = tl.where(docs == d_end, tl.exp(cs_end - cs), 0.0)
        D = tl.where(d_end == d0, tl.exp(cs_end), 0.0)

        chunk_base = (pid.to(tl.int64) * n_chunks + c) * P * N
        S_in = tl.load(STATES + chunk_base + pn, mask=pn_ok, other=0.0)
        dy = tl.load(DY + xp, mask=qp_ok, other=0.0)
        scores = tl.dot(Cc, tl.trans(Bc), input_precision="ieee") * L  # (C_i · B_j) L[i, j]
        dM = tl.dot(dy, tl.trans(xs), input_precision="ieee")  # dy_i · xs_j
        dCB = dM * L
        # d(running sums of a): L[i, j] = exp(cs_i − cs_j), g_in = exp(cs_i), w_out = exp(cs_end − cs_j)
        TL = dM * scores
        dcs = tl.sum(TL, axis=1) - tl.sum(TL, axis=0)
        CS = tl.dot(Cc, tl.trans(S_in), input_precision="ieee")  # [Q, P]: S_in · C_i
        dcs += tl.sum(dy * CS, axis=1) * g_in
        dSB = tl.dot(Bc, tl.trans(dS), input_precision="ieee")  # [Q, P]: dS · B_j
        tw = tl.sum(xs * dSB, axis=1) * w_out
        dcs -= tw
        d_end_term = tl.sum(tw, axis=0) + tl.sum(tl.sum(dS * S_in, axis=1), axis=0) * D
        # d a_k = Σ_{i ≥ k} d cs_i (every running sum through k), plus the chunk end's terms
        da = tl.sum(tl.where(causal, dcs[:, None], 0.0), axis=0) + d_end_term
        da = tl.where(is_start | ~t_ok, 0.0, da)

        dxs = tl.dot(tl.trans(scores), dy, input_precision="ieee") + w_out[:, None] * dSB
        dB = tl.dot(tl.trans(dCB), Cc, input_precision="ieee")
        dB += w_out[:, None] * tl.dot(xs, dS, input_precision="ieee")
        dC = tl.dot(dCB, Bc, input_precision="ieee")
        dC += g_in[:, None] * tl.dot(dy, S_in, input_precision="ieee")
        dS = dS * D + tl.dot(tl.trans(dy * g_in[:, None]), Cc, input_precision="ieee")

        tl.store(DX + xp, dxs * dt[:, None], mask=qp_ok)
        tl.store(DDT + row * H + h, tl.sum(dxs * x, axis=1) + da * A_h, mask=t_ok)
        hn = (row * H + h)[:, None] * N + n[None, :]
        tl.store(DB + hn, dB, mask=qn_ok)
        tl.store(DC + hn, dC, mask=qn_ok)
        dA += da * dt
    if HAS_INIT:
        tl.store(DINIT + state_base + pn, dS, mask=pn_ok)
    tl.store(DA + pid, tl.sum(dA, axis=0))


@functools.cache
def _kernels():
    """(triton, forward kernel, backward kernel), jitted on first use (TRITON_INTERPRET is read
    here: set it before the first Triton call to run on the interpreter)."""
    global tl
    import triton
    import triton.language

    tl = triton.language
    return triton, triton.jit(_ssd_forward_kernel), triton.jit(_ssd_backward_kernel)


def _block(size: int) -> int:
    """A power of two ≥ max(size, 16) (tl.dot's smallest tile)."""
    return max(16, 1 << (size - 1).bit_length())


class _SSDFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dt, A, B, C, chunk, initial_state, starts):
        triton, forward, _ = _kernels()
        Bsz, T, H, P = x.shape
        G, N = B.shape[2], B.shape[3]
        assert H % G == 0, (H, G)
        n_chunks = triton.cdiv(T, chunk)
        x, dt, A, B, C = (t.contiguous() for t in (x, dt, A, B, C))
        if starts is not None:
            starts_i8 = starts.to(torch.int8).contiguous()
            docs = torch.cumsum(starts.to(torch.int32), dim=1, dtype=torch.int32)
        else:
            starts_i8 = docs = torch.zeros(1, dtype=torch.int32, device=x.device)
        init = initial_state.contiguous() if initial_state is not None else x.new_zeros(1)
        y = torch.empty(Bsz, T, H, P, dtype=torch.float32, device=x.device)
        states = torch.empty(Bsz, H, n_chunks, P, N, dtype=torch.float32, device=x.device)
        final = torch.empty(Bsz, H, P, N, dtype=torch.float32, device=x.device)
        meta = dict(
            HAS_INIT=initial_state is not None,
            HAS_STARTS=starts is not None,
            BLOCK_Q=_block(chunk),
            BLOCK_P=_block(P),
            BLOCK_N=_block(N),
        )
        forward[(Bsz * H,)](
            x, dt, A, B, C, starts_i8, docs, init, y, states, final, T, H, G, P, N, chunk, n_chunks, **meta
        )
        ctx.save_for_backward(x, dt, A, B, C, starts_i8, docs, states)
        ctx.meta, ctx.chunk, ctx.n_chunks = meta, chunk, n_chunks
        ctx.init_dtype = initial_state.dtype if initial_state is not None else None
        return y, final

    @staticmethod
    def backward(ctx, dy, dfinal):
        _, _, backward = _kernels()
        x, dt, A, B, C, starts_i8, docs, states = ctx.saved_tensors
        Bsz, T, H, P = x.shape
        G, N = B.shape[2], B.shape[3]
        f32 = dict(dtype=torch.float32, device=x.device)
        dy = dy.float().contiguous() if dy is not None else torch.zeros(Bsz, T, H, P, **f32)
        dfinal = dfinal.float().contiguous() if dfinal is not None else torch.zeros(Bsz, H, P, N, **f32)
        dx = torch.empty(Bsz, T, H, P, **f32)
        ddt = torch.empty(Bsz, T, H, **f32)
        dB = torch.empty(Bsz, T, H, N, **f32)
        dC = torch.empty(Bsz, T, H, N, **f32)
        dinit = torch.empty(Bsz, H, P, N, **f32) if ctx.meta["HAS_INIT"] else dfinal.new_zeros(1)
        dA = torch.empty(Bsz, H, **f32)
        backward[(Bsz * H,)](
            x, dt, A, B, C, starts_i8, docs, states, dy, dfinal, dx, ddt, dB, dC, dinit, dA,
            T, H, G, P, N, ctx.chunk, ctx.n_chunks, **ctx.meta,
        )  # fmt: skip
        dB = dB.view(Bsz, T, G, H // G, N).sum(3)  # heads of one group share its B and C
        dC = dC.view(Bsz, T, G, H // G, N).sum(3)
        return (
            dx.to(x.dtype),
            ddt.to(dt.dtype),
            dA.sum(0).to(A.dtype),
            dB.to(B.dtype),
            dC.to(C.dtype),
            None,
            dinit.to(ctx.init_dtype) if ctx.meta["HAS_INIT"] else None,
            None,
        )


class _SSDRecompute(torch.autograd.Function):
    """`ssd_reference` saving its inputs only: the backward runs it again under autograd (the
    torch path's memory is then the scan's inputs, not its [chunk × chunk] intermediates)."""

    @staticmethod
    def forward(ctx, x, dt, A, B, C, chunk, initial_state, starts):
        ctx.chunk, ctx.starts, ctx.has_initial = chunk, starts, initial_state is not None
        ctx.save_for_backward(x, dt, A, B, C, *([initial_state] if ctx.has_initial else []))
        return ssd_reference(x, dt, A, B, C, chunk, initial_state, starts)

    @staticmethod
    def backward(ctx, dy, dfinal):
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        with torch.enable_grad():
            x, dt, A, B, C, *initial = inputs
            y, final = ssd_reference(x, dt, A, B, C, ctx.chunk, initial[0] if initial else None, ctx.starts)
            wanted = [t for t in inputs if t.requires_grad]
            grads = iter(torch.autograd.grad((y, final), wanted, (dy, dfinal), allow_unused=True))
        out = [next(grads) if t.requires_grad else None for t in inputs]
        return (*out[:5], None, out[5] if ctx.has_initial else None, None)


def ssd(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk: int,
    initial_state: torch.Tensor | None = None,
    starts: torch.Tensor | None = None,
    backend: str = "torch",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked scan (shapes and meaning as `ssd_reference`): (y [B, T, H, P] fp32, the final
    state [B, H, P, N] fp32), differentiable in x, dt, A, B, C and initial_state through both
    outputs. backend "torch": `ssd_reference`, which recomputes itself in the backward when a
    gradient is wanted (saving its inputs only); "triton": the Triton kernels."""
    if backend == "torch":
        inputs = (x, dt, A, B, C, initial_state)
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs):
            return _SSDRecompute.apply(x, dt, A, B, C, chunk, initial_state, starts)
        return ssd_reference(x, dt, A, B, C, chunk, initial_state, starts)
    if backend != "triton":
        raise ValueError(f"backend={backend!r}: must be one of torch, triton")
    if starts is not None:
        starts = starts.bool()
    return _SSDFunction.apply(x, dt, A, B, C, chunk, initial_state, starts)
