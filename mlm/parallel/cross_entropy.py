"""The losses over the vocabulary, one home: the plain cross-entropy (`cross_entropy`), the
vocabulary-parallel one over tp ranks' logit shards (`vocab_parallel_cross_entropy`, Megatron's),
and linear + cross-entropy fused over chunks of tokens (`linear_cross_entropy`), never holding
the [tokens, vocabulary] logits. `parallelize` swaps the model's loss for its vocabulary-parallel
form (tp_plan styles "vocab_loss", "vocab_linear_loss").

Vocabulary-parallel: the full vocabulary is never gathered; a max, then the target logit and the
sum of exponentials are all-reduced over tp; padding columns count as −inf.

Chunked:

    loss = CE(h · Wᵀ, labels)            # the mean over the tokens, or a weighted sum (MTP's)

The plain path (`linear_cross_entropy_reference`) materialises the logits, their fp32 copy, the
log-softmax and, in backward, a gradient of the same size: at a vocabulary of 128,256 that is
4 × 513 KB per token (16.8 GB each for 8 × 4096 tokens). `linear_cross_entropy` instead walks
the tokens in chunks (Liger-Kernel's FusedLinearCrossEntropy, Megatron's fused linear CE): per
chunk it computes the logits in fp32, the chunk's loss and at once dloss/dlogits, turns that into
the gradient of the chunk's hidden states and adds its share of the weight's gradient, then drops
the chunk. Backward only scales the stored gradients by the incoming one. Memory: O(chunk × V)
plus the gradients themselves (measured ratio to the plain path: tests/distributed/test_linear_cross_entropy.py,
docs/model.md).

Under tensor parallelism each rank holds V/tp rows of the weight; per chunk the max, the target
logit and the sum of exponentials are all-reduced over tp (`vocab_parallel_softmax`, the same
pieces as the vocab-parallel cross-entropy), rows at or past `vocab_size` (padding)
count as −inf, and each rank's gradient of the hidden states is its vocabulary shard's share:
the caller's entry into the tp region (`copy_to_tp`, or `gather_from_sp` under sequence
parallelism) sums them in backward, as it does for the column-parallel output layer.

Pure torch: runs on CPU and GPU. Under autocast the matmuls run in the autocast dtype (as the
plain path's `F.linear` would), the softmax in fp32, the weight's gradient accumulates in fp32.

Shape legend: N tokens, C tokens of one chunk, D hidden, V (padded) vocabulary, v this rank's rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mlm.errors import MlmError
from mlm.parallel.loss_chunks import chunk_tokens
from mlm.parallel.mesh import Mesh

# ---------------------------------------------------------------- the vocabulary-parallel loss


def vocab_parallel_softmax(
    logits_Nv: torch.Tensor, labels_N: torch.Tensor, vocab_size: int, group, rank: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cross-entropy over the vocabulary shards of the tp ranks in `group` (None: one process)
    from this rank's logit columns [..., v] (`logits_Nv` is left unchanged): a max, then the target
    logit and the sum of exponentials all-reduced; columns at or past `vocab_size` count as −inf.
    Returns (loss [...] fp32, softmax [..., v] fp32 (a new tensor), whether each label lies on
    this rank, its column here (0 where not)): what `softmax_minus_onehot_` turns into dloss/dlogits."""
    v = logits_Nv.shape[-1]
    start = rank * v
    x_Nv = logits_Nv.float()
    if start + v > vocab_size:  # Megatron's padding columns: never a prediction
        pad_v = torch.arange(start, start + v, device=x_Nv.device) >= vocab_size
        x_Nv = x_Nv.masked_fill(pad_v, float("-inf"))
    max_N = x_Nv.amax(dim=-1)
    if group is not None:
        dist.all_reduce(max_N, op=dist.ReduceOp.MAX, group=group)
    x_Nv = x_Nv - max_N.unsqueeze(-1)  # a new fp32 tensor, ours to change in place

    inside_N = (labels_N >= start) & (labels_N < start + v)
    local_N = (labels_N - start).masked_fill(~inside_N, 0)
    target_N = x_Nv.gather(-1, local_N.unsqueeze(-1)).squeeze(-1).masked_fill(~inside_N, 0.0)
    exp_Nv = x_Nv.exp_()
    stats_2N = torch.stack([target_N, exp_Nv.sum(dim=-1)])  # one all-reduce for both sums
    if group is not None:
        dist.all_reduce(stats_2N, group=group)
    target_N, sum_exp_N = stats_2N
    loss_N = sum_exp_N.log() - target_N
    return loss_N, exp_Nv.div_(sum_exp_N.unsqueeze(-1)), inside_N, local_N


def softmax_minus_onehot_(
    softmax_Nv: torch.Tensor, inside_N: torch.Tensor, local_N: torch.Tensor
) -> torch.Tensor:
    """dloss/dlogits on this rank's columns, softmax − onehot, written over `softmax_Nv`."""
    return softmax_Nv.scatter_add_(-1, local_N.unsqueeze(-1), -inside_N.unsqueeze(-1).to(softmax_Nv.dtype))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_BTv, labels_BT, vocab_size: int, group, size: int, rank: int):
        loss_BT, softmax_BTv, inside_BT, local_BT = vocab_parallel_softmax(
            logits_BTv, labels_BT, vocab_size, group, rank
        )
        ctx.save_for_backward(softmax_BTv, inside_BT, local_BT)
        ctx.dtype = logits_BTv.dtype
        return loss_BT

    @staticmethod
    def backward(ctx, grad_BT):
        # softmax − onehot on this rank's columns, written over the saved softmax (a second
        # backward through the same graph is refused by autograd's version check).
        grad_BTv = softmax_minus_onehot_(*ctx.saved_tensors)
        grad_BTv.mul_(grad_BT.unsqueeze(-1))
        return grad_BTv.to(ctx.dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits_BTv: torch.Tensor, labels_BT: torch.Tensor, mesh: Mesh, vocab_size: int
) -> torch.Tensor:
    """Per-token cross-entropy [B, T] in fp32 from this rank's logit columns [B, T, V/tp].

    The full vocabulary is never gathered: a max, then the target logit and the sum of
    exponentials are all-reduced over tp. Columns at or past `vocab_size` (padding) count as
    −inf, so the result equals `F.cross_entropy(full_logits[..., :vocab_size], labels)` of one
    process. Labels must lie in [0, vocab_size); mask unwanted tokens on the returned loss."""
    V = logits_BTv.shape[-1] * mesh.tp
    if not 0 < vocab_size <= V:
        raise MlmError(
            f"vocab_size={vocab_size} must be within [1, {V}] (the padded vocabulary of the logits, "
            f"{logits_BTv.shape[-1]} columns × tp={mesh.tp}); pass model.vocab_size"
        )
    group = mesh.tp_group if mesh.tp > 1 else None
    assert mesh.tp == 1 or group is not None, f"tp={mesh.tp} needs the mesh's tp process group"
    return _VocabParallelCrossEntropy.apply(logits_BTv, labels_BT, vocab_size, group, mesh.tp, mesh.tp_rank)


def vocab_parallel_loss(
    logits_BTv, labels_BT, vocab_size: int, weights_BT=None, *, mesh: Mesh
) -> torch.Tensor:
    """`vocab_parallel_cross_entropy`'s mean, or with `weights_BT` its weighted sum: what
    `parallelize` puts in place of `cross_entropy` under tensor parallelism (style "vocab_loss")."""
    loss_BT = vocab_parallel_cross_entropy(logits_BTv, labels_BT, mesh, vocab_size)
    return loss_BT.mean() if weights_BT is None else (loss_BT * weights_BT).sum()


# ---------------------------------------------------------------- chunked linear + cross-entropy


def cross_entropy(
    logits_BTV: torch.Tensor, labels_BT: torch.Tensor, vocab_size: int, weights_BT: torch.Tensor | None = None
) -> torch.Tensor:
    """Next-token cross-entropy in fp32 over the unpadded vocabulary (one process): the mean over
    the tokens, or with `weights_BT` the weighted sum."""
    logits_BTV = logits_BTV[..., :vocab_size].float()
    if weights_BT is None:
        return F.cross_entropy(logits_BTV.flatten(0, 1), labels_BT.flatten())
    loss = F.cross_entropy(logits_BTV.flatten(0, 1), labels_BT.flatten(), reduction="none")
    return (loss * weights_BT.flatten()).sum()


def linear_cross_entropy_reference(
    h_BTD: torch.Tensor,
    weight_VD: torch.Tensor,
    labels_BT: torch.Tensor,
    vocab_size: int,
    weights_BT: torch.Tensor | None = None,
) -> torch.Tensor:
    """The plain path (one process): logits = h · Wᵀ, then `cross_entropy`."""
    return cross_entropy(F.linear(h_BTD, weight_VD), labels_BT, vocab_size, weights_BT)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


class _LinearCrossEntropy(torch.autograd.Function):
    """Forward computes the loss and both gradients chunk by chunk; backward scales them."""

    @staticmethod
    def forward(ctx, h_ND, weight_vD, labels_N, scale_N, vocab_size: int, chunk: int, group, rank: int):
        dtype = _compute_dtype(h_ND)
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        N, D = h_ND.shape
        with torch.autocast(h_ND.device.type, enabled=False):  # every cast below is explicit
            w_vD = weight_vD.to(dtype)
            loss = torch.zeros((), dtype=torch.float32, device=h_ND.device)
            grad_h_ND = torch.empty_like(h_ND) if need_grad else None
            grad_w_vD = (
                torch.zeros(w_vD.shape, dtype=torch.float32, device=h_ND.device) if need_grad else None
            )
            for s in range(0, N, chunk):
                e = min(s + chunk, N)
                h_CD = h_ND[s:e].to(dtype)
                scale_C = scale_N[s:e]
                loss_C, grad_Cv, inside_C, local_C = vocab_parallel_softmax(
                    h_CD @ w_vD.T, labels_N[s:e], vocab_size, group, rank
                )
                loss += (loss_C * scale_C).sum()
                if not need_grad:
                    continue
                softmax_minus_onehot_(grad_Cv, inside_C, local_C).mul_(scale_C.unsqueeze(-1))
                grad_Cv = grad_Cv.to(dtype)
                grad_h_ND[s:e] = grad_Cv @ w_vD
                if dtype == torch.float32:
                    grad_w_vD.addmm_(grad_Cv.T, h_CD)
                else:
                    grad_w_vD += (grad_Cv.T @ h_CD).float()
        if need_grad:  # saved as autograd's own: saved-tensor hooks (offload, memory counts) see them
            ctx.save_for_backward(grad_h_ND, grad_w_vD.to(weight_vD.dtype))
        return loss

    @staticmethod
    def backward(ctx, grad):
        grad_h_ND, grad_w_vD = ctx.saved_tensors
        if not torch.equal(grad, torch.ones_like(grad)):
            # scaled in place: they are ours (a second backward through the same graph is then
            # refused by autograd's version check)
            grad_h_ND.mul_(grad.to(grad_h_ND.dtype))
            grad_w_vD.mul_(grad.to(grad_w_vD.dtype))
        return grad_h_ND, grad_w_vD, None, None, None, None, None, None


def linear_cross_entropy(
    h_BTD: torch.Tensor,
    weight_vD: torch.Tensor,
    labels_BT: torch.Tensor,
    vocab_size: int,
    weights_BT: torch.Tensor | None = None,
    *,
    mesh: Mesh | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """CE(h · Wᵀ, labels) in fp32 over the unpadded vocabulary, chunked over the tokens: the mean,
    or with `weights_BT` the weighted sum. `weight_vD`: the output weight, or this tp rank's V/tp
    rows of it under `mesh`'s tp (vocab-parallel: `h_BTD` is then the input that entered the tp
    region, the same on every tp rank). `chunk`: tokens per chunk (default `chunk_tokens(v)`).
    Equals `linear_cross_entropy_reference` of one process, loss and gradients."""
    tp = mesh.tp if mesh is not None else 1
    V = weight_vD.shape[0] * tp
    if not 0 < vocab_size <= V:
        raise MlmError(
            f"vocab_size={vocab_size} must be within [1, {V}] (the padded vocabulary: "
            f"{weight_vD.shape[0]} weight rows × tp={tp}); pass model.vocab_size"
        )
    if h_BTD.shape[-1] != weight_vD.shape[1]:
        raise MlmError(f"hidden states {tuple(h_BTD.shape)} do not match the weight {tuple(weight_vD.shape)}")
    group = mesh.tp_group if tp > 1 else None
    assert tp == 1 or group is not None, f"tp={tp} needs the mesh's tp process group"
    h_ND = h_BTD.reshape(-1, h_BTD.shape[-1])
    labels_N = labels_BT.reshape(-1)
    if weights_BT is None:
        scale_N = torch.full(labels_N.shape, 1.0 / labels_N.numel(), device=h_ND.device)
    else:
        scale_N = weights_BT.reshape(-1).float()
    chunk = chunk or chunk_tokens(weight_vD.shape[0])
    rank = mesh.tp_rank if tp > 1 else 0
    return _LinearCrossEntropy.apply(h_ND, weight_vD, labels_N, scale_N, vocab_size, chunk, group, rank)
