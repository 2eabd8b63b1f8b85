"""The "gdn" mixer: Gated DeltaNet (Qwen3-Next's linear attention; HF's Qwen3NextGatedDeltaNet,
Megatron's GatedDeltaNet).

    q, k, v, z = in_q(u), in_k(u), in_v(u), in_z(u);  b, a = in_b(u), in_a(u)   (column-parallel)
    q, k, v = silu(causal depthwise conv of each, K taps, no bias)
    β = sigmoid(b);  g = −exp(A_log) · softplus(a + dt_bias)            (fp32, per value head)
    o = gated delta rule(q, k, v, g, β)     (`kernels.delta_rule`: torch or Triton, model.kernels;
                                             q and k L2-normalised, value head h reads key head h // r)
    out(RMSNorm(o) · weight · silu(z) per value head)                              (row-parallel)

with r = H_v / H_k value heads per key head. HF holds q | k | v | z as one `in_proj_qkvz`
interleaved per key head ([q_g | k_g | v_g (r heads) | z_g (r heads)] for each key head g), b | a
as one `in_proj_ba` (likewise) and q | k | v as one `conv1d`; Megatron holds them as one flat
`in_proj`. Here each piece is its own tensor, so that splitting each over tp by heads is plain
column parallelism: each tp rank holds H_k/t key heads and the H_v/t value heads that read them
(value heads are consecutive per key head), and nothing is exchanged inside the mixer. The gated
norm's one [d_v] weight is shared by every value head (replicated, "head_shared").

Packed documents (`documents_BT`) restart the convolutions' windows and the delta rule's state at
each document. Under a serving cache the state between steps is the last K − 1 convolution inputs
(q | k | v channels) and the [H_v, d_k, d_v] state, one slot per sequence
(`mlm.inference.state_cache`).

Shape legend: B batch, T tokens, D hidden, G key heads, H value heads, K key head dim, V value head
dim, W channels, J = taps − 1, S segments of a serving step.
"""

from __future__ import annotations

import zlib

import torch
import torch.nn.functional as F
from torch import nn

from kernels.delta_rule import delta_rule_recurrent_reference
from kernels.ssd import at_least_fp32
from mlm.config import ModelConfig
from mlm.model.kinds.mamba.module import CausalConv, convolve_from_windows, document_starts
from mlm.model.layers import TP_INPUT
from mlm.model.ops import Ops


class HeadGatedRMSNorm(nn.Module):
    """RMSNorm of each head's output o in fp32, times the weight, times silu(z) (Qwen3-Next's
    RMSNormGated: norm before the gate); one [d_v] weight shared by every head."""

    def __init__(self, head_dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(head_dim))
        self.eps = eps

    def forward(self, o_BTHV: torch.Tensor, z_BTHV: torch.Tensor) -> torch.Tensor:
        o = at_least_fp32(o_BTHV)
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * o * F.silu(at_least_fp32(z_BTHV))


class GatedDeltaNet(nn.Module):
    residual_projections = ("out",)
    tp_plan = {
        TP_INPUT: "enter",
        "in_q": "column",
        "in_k": "column",
        "in_v": "column",
        "in_z": "column",
        "in_b": "column",
        "in_a": "column",
        "A_log": "channels",
        "dt_bias": "channels",
        "norm": "head_shared",
        "out": "row",
    }

    def __init__(self, cfg: ModelConfig, layer: int = 0, ops: Ops | None = None):
        super().__init__()
        self.ops = ops or Ops()
        self.layer, self.cfg = layer, cfg.gdn
        c, D = cfg.gdn, cfg.hidden_size
        self.key_head_dim, self.value_head_dim = c.key_head_dim, c.value_head_dim
        self.ratio = c.num_value_heads // c.num_key_heads  # value heads per key head
        self.in_q = nn.Linear(D, c.key_dim, bias=False)
        self.in_k = nn.Linear(D, c.key_dim, bias=False)
        self.in_v = nn.Linear(D, c.value_dim, bias=False)
        self.in_z = nn.Linear(D, c.value_dim, bias=False)
        self.in_b = nn.Linear(D, c.num_value_heads, bias=False)
        self.in_a = nn.Linear(D, c.num_value_heads, bias=False)
        self.conv_q = CausalConv(c.key_dim, c.conv_kernel, bias=False)
        self.conv_k = CausalConv(c.key_dim, c.conv_kernel, bias=False)
        self.conv_v = CausalConv(c.value_dim, c.conv_kernel, bias=False)
        self.A_log = nn.Parameter(torch.empty(c.num_value_heads))
        self.dt_bias = nn.Parameter(torch.empty(c.num_value_heads))
        self.norm = HeadGatedRMSNorm(c.value_head_dim, cfg.norm_eps)
        self.out = nn.Linear(c.value_dim, D, bias=False)

    def init_values(self, local: str, shape: tuple[int, ...], seed: int, name: str) -> torch.Tensor | None:
        """The whole tensor `local` of `shape` for (`seed`, `name`), for the parameters drawn other
        than Megatron's normal rule (`mlm.model.init`): A_log = log U(A_init_min, A_init_max),
        dt_bias = 1 (HF's and Megatron's); None for the others (the convolutions draw their own,
        the norm weight is 1)."""
        gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
        if local == "A_log":
            return torch.empty(shape).uniform_(self.cfg.A_init_min, self.cfg.A_init_max, generator=gen).log()
        if local == "dt_bias":
            return torch.ones(shape)
        return None

    def _gates(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """g (the log decay, ≤ 0) and β (the write strength) per value head, fp32 [B, T, H]."""
        beta = torch.sigmoid(at_least_fp32(self.in_b(x_BTD)))
        a = at_least_fp32(self.in_a(x_BTD)) + at_least_fp32(self.dt_bias)
        return -torch.exp(at_least_fp32(self.A_log)) * F.softplus(a), beta

    def _heads(self, q, k, v):
        """q, k [.., G·K] → [.., H, K] (each key head repeated for its r value heads); v [.., H·V]
        → [.., H, V]."""
        K, V, r = self.key_head_dim, self.value_head_dim, self.ratio
        q, k = (t.unflatten(-1, (-1, K)).repeat_interleave(r, dim=-2) for t in (q, k))
        return q, k, v.unflatten(-1, (-1, V))

    def forward(self, x_BTD: torch.Tensor, rope=None, cache=None, documents_BT=None) -> torch.Tensor:
        q, k, v, z = self.in_q(x_BTD), self.in_k(x_BTD), self.in_v(x_BTD), self.in_z(x_BTD)
        g_BTH, beta_BTH = self._gates(x_BTD)
        if cache is not None:
            o_BTHV = self._from_states(cache.state(self.layer), q, k, v, g_BTH, beta_BTH)
        else:
            q, k, v = (
                F.silu(conv(t, documents_BT))
                for conv, t in ((self.conv_q, q), (self.conv_k, k), (self.conv_v, v))
            )
            starts = None if documents_BT is None else document_starts(documents_BT)
            q_BTHK, k_BTHK, v_BTHV = self._heads(q, k, v)
            o_BTHV, _ = self.ops.gated_delta_rule(
                q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, self.cfg.chunk_size, starts=starts
            )
        y = self.norm(o_BTHV, z.unflatten(-1, (-1, self.value_head_dim))).flatten(-2)
        return self.out(y.to(x_BTD.dtype))

    def _from_states(self, view, q, k, v, g, beta):
        """The step's segments (packed in row 0), each from its slot's state (zeros at a sequence's
        start): o [1, T, H, V]; stores each slot's next window and state."""
        state_SHKV = view.load("ssm")
        decode, inputs = convolve_from_windows((self.conv_q, self.conv_k, self.conv_v), (q, k, v), view)
        if decode:  # every segment one token: one batched step
            o, state = delta_rule_recurrent_reference(
                *self._heads(*inputs[0]), g[0, :, None], beta[0, :, None], initial_state=state_SHKV
            )
            view.store("ssm", state)
            return o[:, 0][None]
        outs, states = [], []
        for i, ((offset, n), conv_out) in enumerate(zip(view.segments, inputs, strict=True)):
            part = slice(offset, offset + n)
            o, state = self.ops.gated_delta_rule(
                *self._heads(*conv_out), g[:, part], beta[:, part], self.cfg.chunk_size,
                initial_state=state_SHKV[i : i + 1],
            )  # fmt: skip
            outs.append(o)
            states.append(state)
        view.store("ssm", torch.cat(states))
        return torch.cat(outs, dim=1)
