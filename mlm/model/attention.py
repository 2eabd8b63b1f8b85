"""The attention core behind one switch: torch SDPA everywhere; flash-attn and Transformer
Engine on CUDA when importable. `auto` picks flash-attn, then TE, then SDPA (which itself
uses flash/cuDNN kernels on recent GPUs). The attention kinds call it through `AttentionCore`
(`mlm.model.attention_core`), chosen by the model's `Ops`."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from mlm.errors import MlmError


@functools.cache
def importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def resolve_backend(requested: str, device: torch.device) -> str:
    """The backend that will run: `requested`, or the best available for `auto`."""
    cuda = device.type == "cuda"
    if requested == "auto":
        if cuda and importable("flash_attn"):
            return "flash"
        if cuda and importable("transformer_engine"):
            return "te"
        return "sdpa"
    if requested in ("flash", "te"):
        module = "flash_attn" if requested == "flash" else "transformer_engine"
        if not cuda or not importable(module):
            raise MlmError(
                f"model.attention_backend={requested!r} needs CUDA and the {module} package "
                f"(pip install -e .[gpu]); use 'auto' or 'sdpa' here"
            )
    return requested


def attention(
    q_BTHD, k_BTGD, v_BTGE, backend: str, dropout: float, training: bool, scale: float | None = None
):
    """Causal attention; q has H heads, k/v have G ≤ H heads (GQA); values may be narrower than
    queries and keys (MLA: E < D); `scale` defaults to 1/√D. Returns [B, T, H, E]."""
    p = dropout if training else 0.0
    D, E = q_BTHD.shape[-1], v_BTGE.shape[-1]
    if backend in ("flash", "te") and E != D:  # their kernels want one head dim
        q, k, v = same_head_dim(q_BTHD, k_BTGD, v_BTGE)
        return attention(q, k, v, backend, dropout, training, scale or D**-0.5)[..., :E]
    if backend == "flash":
        from flash_attn import flash_attn_func

        return flash_attn_func(q_BTHD, k_BTGD, v_BTGE, dropout_p=p, causal=True, softmax_scale=scale)
    if backend == "te":
        core = _te_attention(q_BTHD.shape[2], k_BTGD.shape[2], D, p, scale)
        return core(q_BTHD, k_BTGD, v_BTGE)
    q, k, v = (t.transpose(1, 2) for t in (q_BTHD, k_BTGD, v_BTGE))
    out = F.scaled_dot_product_attention(
        q, k, v, dropout_p=p, is_causal=True, scale=scale, enable_gqa=bool(k.shape[1] != q.shape[1])
    )
    return out.transpose(1, 2)


def same_head_dim(q, k, v):
    """q, k, v zero-padded to one head dim (the widest): q · k and the first v-width output columns
    are unchanged (pass the softmax scale of the unpadded dim)."""
    W = max(q.shape[-1], v.shape[-1])
    return tuple(F.pad(t, (0, W - t.shape[-1])) for t in (q, k, v))


def document_mask(q_documents_BT, k_documents_BT, q_positions_T, k_positions_T):
    """[B, 1, Tq, Tk] boolean: query i may see key j when j is not after i and both belong to the
    same document (Megatron's reset_attention_mask)."""
    causal = k_positions_T[None, :] <= q_positions_T[:, None]
    same = k_documents_BT[:, None, :] == q_documents_BT[:, :, None]
    return (causal & same)[:, None]


def document_attention(q_BTHD, k_BTGD, v_BTGD, documents_BT, scale: float | None = None):
    """Causal attention within each packed document (`documents_BT`: the document index of every
    token), with torch SDPA whatever the backend (flash-attn's and TE's varlen paths are not
    wired); no dropout."""
    T = q_BTHD.shape[1]
    pos = torch.arange(T, device=q_BTHD.device)
    mask = document_mask(documents_BT, documents_BT, pos, pos)
    q, k, v = (t.transpose(1, 2) for t in (q_BTHD, k_BTGD, v_BTGD))
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=bool(k.shape[1] != q.shape[1])
    )
    return out.transpose(1, 2)


@functools.cache
def _te_attention(heads: int, groups: int, head_dim: int, dropout: float, scale: float | None):
    import transformer_engine.pytorch as te

    core = te.DotProductAttention(
        heads,
        head_dim,
        num_gqa_groups=groups,
        attention_dropout=dropout,
        qkv_format="bshd",
        attn_mask_type="causal",
        softmax_scale=scale,
    )
    return lambda q, k, v: core(q, k, v).view(q.shape)
