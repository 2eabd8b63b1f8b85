"""Ring attention for context parallelism: keys and values passed around the cp ranks.

Each cp rank holds its queries, keys and values in the zigzag layout of `mlm.parallel.context`
(chunks r and 2·cp − 1 − r of 2·cp, t = T / cp tokens). Over cp steps every rank sees every
other rank's keys and values once: at step i it holds those of rank (r − i) mod cp, computes the
block of attention the causal mask leaves, and merges that block's output into its running one
by log-sum-exp (`merge`). The transfer for step i + 1 is started before step i's compute and
waited after it, so the two overlap. With c = t / 2 tokens per chunk, the zigzag step table:

    i = 0      own keys: causal over the two local chunks (their positions ascend, so the plain
               lower-triangular mask is the global one)
    src < r    all t queries against the FIRST chunk of src (earlier than both local chunks),
               no mask; src's second chunk lies after both of them
    src > r    only the SECOND local query chunk, against both src chunks, no mask; the first
               local chunk lies before both of them

Every step costs the same t·c or t·t/2 scores on every rank, and no block is empty, so every
lse is finite. The backward passes the keys and values around the ring again, recomputes each
block's probabilities from the saved queries and final lse (flash attention's backward with
D = rowsum(dO ∘ O)), keeps dq, and sends the dk/dv accumulators one rank on after each step:
after cp steps plus one last send each rank holds the gradient of its own keys and values.

Attention is computed by hand in fp32 (scores → logsumexp → exp → @ V); the model's dtype is
kept for the transfers. GQA: the H query heads are viewed as G groups of R = H / G (head
h = g·R + ρ uses key group g, as `enable_gqa` does), and broadcast against the G key heads, so
keys are never repeated and dk/dv come out summed over each group.

Shape legend: B batch, t this rank's tokens, c = t / 2 one chunk, s keys of a block, H heads,
G key/value groups, R = H / G heads per group, K head dim.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F


def merge(out_a, lse_a, out_b, lse_b):
    """Softmax attention over keys A ∪ B from its parts over A and over B: outputs [..., q, K]
    and their log-sum-exps [..., q] → (out, lse). An empty part has lse −inf and a finite out
    (zeros, say) and drops out."""
    lse = torch.logaddexp(lse_a, lse_b)
    out = torch.exp(lse_a - lse)[..., None] * out_a + torch.exp(lse_b - lse)[..., None] * out_b
    return out, lse


def _scores(q_BGRqK, k_BGsK, scale: float, causal: bool, same_Bqs=None):
    """Scaled scores, −inf where the causal mask or (packed documents) `same_Bqs` forbids."""
    s = torch.einsum("bgrqk,bgsk->bgrqs", q_BGRqK, k_BGsK) * scale
    if causal:
        q, k = s.shape[-2:]
        s = s.masked_fill(~torch.ones(q, k, dtype=torch.bool, device=s.device).tril(), float("-inf"))
    if same_Bqs is not None:
        s = s.masked_fill(~same_Bqs[:, None, None], float("-inf"))
    return s


def _block_forward(q_BGRqK, k_BGsK, v_BGsK, scale: float, causal: bool, same_Bqs=None):
    """One block's normalised output [B, G, R, q, K] and lse [B, G, R, q]; a query that may see
    none of the block's keys (another document) gets output 0 and lse −inf, which `merge` drops."""
    s = _scores(q_BGRqK, k_BGsK, scale, causal, same_Bqs)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return torch.einsum("bgrqs,bgsk->bgrqk", p, v_BGsK), lse


def _block_backward(
    q_BGRqK, k_BGsK, v_BGsK, do_BGRqK, lse_BGRq, D_BGRq, scale: float, causal: bool, same_Bqs=None
):
    """The block's share of (dq, dk, dv), given the final lse and D = rowsum(dO ∘ O)."""
    p = torch.exp(_scores(q_BGRqK, k_BGsK, scale, causal, same_Bqs) - lse_BGRq[..., None])
    dp = torch.einsum("bgrqk,bgsk->bgrqs", do_BGRqK, v_BGsK)
    ds = p * (dp - D_BGRq[..., None]) * scale
    dq = torch.einsum("bgrqs,bgsk->bgrqk", ds, k_BGsK)
    dk = torch.einsum("bgrqs,bgrqk->bgsk", ds, q_BGRqK)
    dv = torch.einsum("bgrqs,bgrqk->bgsk", p, do_BGRqK)
    return dq, dk, dv


def _block(i: int, src: int, rank: int, c: int):
    """(query slice, key slice, causal) of step i, whose keys come from cp rank src."""
    if i == 0:
        return slice(None), slice(None), True
    if src < rank:
        return slice(None), slice(0, c), False
    return slice(c, None), slice(None), False


class _Ring:
    """Send a tensor to the next rank of the ring and receive one from the previous, in flight;
    keys/values (tag 0) and their gradients (tag 1) may be in flight at once."""

    def __init__(self, group, cp: int, rank: int):
        group = dist.group.WORLD if group is None else group
        self.group = group
        self.next = dist.get_global_rank(group, (rank + 1) % cp)
        self.prev = dist.get_global_rank(group, (rank - 1) % cp)

    def start(self, x: torch.Tensor, tag: int = 0):
        buf = torch.empty_like(x)
        ops = [
            dist.P2POp(dist.isend, x, self.next, self.group, tag),
            dist.P2POp(dist.irecv, buf, self.prev, self.group, tag),
        ]
        return buf, dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(pending) -> torch.Tensor:
        buf, works = pending
        for w in works:
            w.wait()
        return buf


def _heads(x_BtHK: torch.Tensor, G: int) -> torch.Tensor:
    """[B, t, H, K] → [B, G, R, t, K] in fp32."""
    B, t, H, K = x_BtHK.shape
    return x_BtHK.float().reshape(B, t, G, H // G, K).permute(0, 2, 3, 1, 4)


def _unheads(x_BGRtK: torch.Tensor) -> torch.Tensor:
    B, G, R, t, K = x_BGRtK.shape
    return x_BGRtK.permute(0, 3, 1, 2, 4).reshape(B, t, G * R, K)


def _same_document(docs, rank: int, src: int, qs: slice, ks: slice):
    """[B, q, s]: whether each query of the block shares its document with each key; None
    without packed documents (`docs`: every cp rank's document indices, [cp, B, t])."""
    if docs is None:
        return None
    return docs[rank][:, qs, None] == docs[src][:, None, ks]


def _gather_documents(documents_BT, group, cp: int):
    if documents_BT is None:
        return None
    parts = [torch.empty_like(documents_BT) for _ in range(cp)]
    dist.all_gather(parts, documents_BT.contiguous(), group=group)
    return torch.stack(parts)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_BtHK, k_BtGK, v_BtGK, group, cp: int, rank: int, documents_BT=None, scale=None):
        G, c = k_BtGK.shape[2], q_BtHK.shape[1] // 2
        scale = ctx.scale = scale or 1.0 / math.sqrt(q_BtHK.shape[-1])
        ring = _Ring(group, cp, rank)
        docs = _gather_documents(documents_BT, ring.group, cp)
        q = _heads(q_BtHK, G)
        kv_2BGtK = torch.stack([k_BtGK, v_BtGK]).transpose(2, 3).contiguous()  # one message a step
        out = lse = None
        for i in range(cp):
            pending = ring.start(kv_2BGtK) if i + 1 < cp else None
            src = (rank - i) % cp
            qs, ks, causal = _block(i, src, rank, c)
            k, v = kv_2BGtK[:, :, :, ks].float()
            same = _same_document(docs, rank, src, qs, ks)
            o_blk, lse_blk = _block_forward(q[..., qs, :], k, v, scale, causal, same)
            if i == 0:
                out, lse = o_blk, lse_blk
            else:
                out[..., qs, :], lse[..., qs] = merge(out[..., qs, :], lse[..., qs], o_blk, lse_blk)
            if pending:
                kv_2BGtK = ring.wait(pending)
        ctx.save_for_backward(q_BtHK, k_BtGK, v_BtGK, out, lse)
        ctx.ring, ctx.cp, ctx.rank, ctx.docs = ring, cp, rank, docs
        return _unheads(out).to(q_BtHK.dtype)

    @staticmethod
    def backward(ctx, do_BtHK):
        q_BtHK, k_BtGK, v_BtGK, out, lse = ctx.saved_tensors
        ring, cp, rank = ctx.ring, ctx.cp, ctx.rank
        G, c, scale = k_BtGK.shape[2], q_BtHK.shape[1] // 2, ctx.scale
        q, do = _heads(q_BtHK, G), _heads(do_BtHK, G)
        D = (do * out).sum(-1)
        dq = torch.zeros_like(q)
        kv_2BGtK = torch.stack([k_BtGK, v_BtGK]).transpose(2, 3).contiguous()
        dkv_pending = None  # the accumulators of this step's keys, from the previous rank
        for i in range(cp):
            kv_pending = ring.start(kv_2BGtK) if i + 1 < cp else None
            src = (rank - i) % cp
            qs, ks, causal = _block(i, src, rank, c)
            k, v = kv_2BGtK[:, :, :, ks].float()
            same = _same_document(ctx.docs, rank, src, qs, ks)
            dq_blk, dk_blk, dv_blk = _block_backward(
                q[..., qs, :], k, v, do[..., qs, :], lse[..., qs], D[..., qs], scale, causal, same
            )
            dq[..., qs, :] += dq_blk
            dkv = ring.wait(dkv_pending) if dkv_pending else torch.zeros(kv_2BGtK.shape, device=q.device)
            dkv[0, :, :, ks] += dk_blk
            dkv[1, :, :, ks] += dv_blk
            # on to the rank that holds these keys next step (after the last step: their owner)
            dkv_pending = ring.start(dkv, tag=1)
            if kv_pending:
                kv_2BGtK = ring.wait(kv_pending)
        dk, dv = ring.wait(dkv_pending).transpose(2, 3)
        return (
            _unheads(dq).to(q_BtHK.dtype),
            dk.to(k_BtGK.dtype),
            dv.to(v_BtGK.dtype),
            None,
            None,
            None,
            None,
            None,
        )


def ring_attention(
    q_BtHK, k_BtGK, v_BtGK, group, cp: int, rank: int, documents_BT=None, scale: float | None = None
) -> torch.Tensor:
    """Causal attention of this rank's queries over all cp ranks' keys and values (zigzag layout),
    the keys and values passed around the ring of `group` (cp rank → global rank by the group);
    with `documents_BT` (this rank's tokens' document indices, gathered once) within each
    packed document; [B, t, H, K] out, as `mlm.parallel.context.allgather_attention`. Values
    of another width than the keys (MLA) travel zero-padded to one width. `scale`: default 1/√K."""
    H, G = q_BtHK.shape[2], k_BtGK.shape[2]
    if H % G:
        raise ValueError(f"query heads {H} are not a multiple of key/value groups {G}")
    if cp == 1:
        if documents_BT is not None:
            from mlm.model.attention import document_attention

            return document_attention(q_BtHK, k_BtGK, v_BtGK, documents_BT, scale)
        q, k, v = (x.transpose(1, 2) for x in (q_BtHK, k_BtGK, v_BtGK))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=H != G)
        return out.transpose(1, 2)
    assert q_BtHK.shape[1] % 2 == 0, q_BtHK.shape
    K, E = k_BtGK.shape[-1], v_BtGK.shape[-1]
    if E != K:  # k and v go round the ring as one message
        from mlm.model.attention import same_head_dim

        q, k, v = same_head_dim(q_BtHK, k_BtGK, v_BtGK)
        return ring_attention(q, k, v, group, cp, rank, documents_BT, scale or K**-0.5)[..., :E]
    with torch.autocast(q_BtHK.device.type, enabled=False):  # the blocks and their merge in fp32
        return _RingAttention.apply(q_BtHK, k_BtGK, v_BtGK, group, cp, rank, documents_BT, scale)
