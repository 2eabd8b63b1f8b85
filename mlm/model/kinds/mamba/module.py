"""The "mamba" mixer: Mamba-2 (Megatron's MambaMixer, HF's Mamba2Mixer and Nemotron-H's).

    z, x, B, C, dt = in_z(u), in_x(u), in_B(u), in_C(u), in_dt(u)     (column-parallel)
    x, B, C = silu(causal depthwise conv of each, K taps, with bias)
    dt = clamp(softplus(dt + dt_bias), limits);  A = −exp(A_log)
    y = SSD(x, dt, A, B, C) + D · x                 (`kernels.ssd`: torch or Triton, model.kernels)
    out(gated RMSNorm(y · silu(z)) per group)                          (row-parallel)

Megatron and HF hold z | x | B | C | dt as one `in_proj` and x | B | C as one `conv1d`; here each
piece is its own tensor, so that splitting each over tp by heads and groups is plain column
parallelism (Megatron's tp layout: every rank the r-th slice of each piece). Each tp rank holds
H/t heads and G/t groups, whose norm groups are its own: nothing is exchanged inside the mixer.

Packed documents (`documents_BT`) restart the convolution's window and the scan's state at each
document. Under a serving cache the state between steps is the last K − 1 convolution inputs and
the scan's state, one slot per sequence (`mlm.inference.state_cache`).

Shape legend: B batch, T tokens, D hidden, H heads, P head dim, G groups, N state width,
W channels, K taps, S segments of a serving step.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from kernels.ssd import at_least_fp32, ssd_step
from mlm.config import ModelConfig
from mlm.model.layers import TP_INPUT
from mlm.model.ops import Ops


def document_starts(documents_BT: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: True where a packed document begins after another (position 0 is False)."""
    starts = torch.zeros_like(documents_BT, dtype=torch.bool)
    starts[:, 1:] = documents_BT[:, 1:] != documents_BT[:, :-1]
    return starts


class CausalConv(nn.Module):
    """A causal depthwise convolution of K taps with a bias (unless `bias=False`: Gated DeltaNet's
    has none), per channel (weight [W, 1, K]: torch's depthwise Conv1d layout, as HF and Megatron
    store it)."""

    tp_plan = {"weight": "channels", "bias": "channels"}

    def __init__(self, width: int, taps: int, bias: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(width, 1, taps))
        self.bias = nn.Parameter(torch.empty(width)) if bias else None

    def init_values(self, local: str, shape: tuple[int, ...], seed: int, name: str) -> torch.Tensor | None:
        """The weight U(±1/√K), torch's Conv1d default (`mlm.model.init`); the bias: zeros."""
        if local != "weight":
            return None
        gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
        bound = 1 / math.sqrt(shape[2])
        return torch.empty(shape).uniform_(-bound, bound, generator=gen)

    def forward(self, u_BTW: torch.Tensor, documents_BT: torch.Tensor | None = None) -> torch.Tensor:
        """y_t = Σ_j weight[:, K−1−j] · u_{t−j} + bias, over the taps within u_t's document."""
        K, T = self.weight.shape[2], u_BTW.shape[1]
        if documents_BT is None:
            y = F.conv1d(u_BTW.transpose(1, 2), self.weight, self.bias, padding=K - 1, groups=u_BTW.shape[2])
            return y[..., :T].transpose(1, 2)
        y = u_BTW * self.weight[:, 0, K - 1]
        if self.bias is not None:
            y = y + self.bias
        for j in range(1, min(K, T)):
            same = (documents_BT[:, j:] == documents_BT[:, :-j])[..., None]
            y = y + F.pad((u_BTW[:, :-j] * same) * self.weight[:, 0, K - 1 - j], (0, 0, j, 0))
        return y

    def step(self, u_BTW: torch.Tensor, window_BWJ: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The convolution of u continuing the previous inputs `window` [B, W, K − 1]: (y, the next
        window)."""
        T = u_BTW.shape[1]
        full_BWX = torch.cat([window_BWJ.to(u_BTW.dtype), u_BTW.transpose(1, 2)], dim=2)
        y = F.conv1d(full_BWX, self.weight, self.bias, groups=full_BWX.shape[1])
        return y.transpose(1, 2), full_BWX[:, :, T:]


class GatedRMSNorm(nn.Module):
    """RMSNorm of y · silu(z) over each group of `group_size` channels, in fp32, times the weight
    (Mamba-2's norm_before_gate=False); each tp rank's groups are its own."""

    tp_plan = {"weight": "channels"}

    def __init__(self, width: int, group_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(width))
        self.group_size, self.eps = group_size, eps

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        g = at_least_fp32(y) * F.silu(at_least_fp32(z))
        grouped = g.unflatten(-1, (-1, self.group_size))
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * grouped.flatten(-2)


class Mamba(nn.Module):
    residual_projections = ("out",)
    tp_plan = {
        TP_INPUT: "enter",
        "in_z": "column",
        "in_x": "column",
        "in_B": "column",
        "in_C": "column",
        "in_dt": "column",
        "A_log": "channels",
        "D": "channels",
        "dt_bias": "channels",
        "out": "row",
    }

    def __init__(self, cfg: ModelConfig, layer: int = 0, ops: Ops | None = None):
        super().__init__()
        self.ops = ops or Ops()
        self.layer, self.cfg = layer, cfg.mamba
        m, D = cfg.mamba, cfg.hidden_size
        H, inner, GN = m.heads(D), m.inner(D), m.num_groups * m.state_dim
        self.head_dim, self.state_dim = m.head_dim, m.state_dim
        self.in_z = nn.Linear(D, inner, bias=False)
        self.in_x = nn.Linear(D, inner, bias=False)
        self.in_B = nn.Linear(D, GN, bias=False)
        self.in_C = nn.Linear(D, GN, bias=False)
        self.in_dt = nn.Linear(D, H, bias=False)
        self.conv_x = CausalConv(inner, m.conv_kernel)
        self.conv_B = CausalConv(GN, m.conv_kernel)
        self.conv_C = CausalConv(GN, m.conv_kernel)
        self.A_log = nn.Parameter(torch.empty(H))
        self.D = nn.Parameter(torch.empty(H))
        self.dt_bias = nn.Parameter(torch.empty(H))
        self.norm = GatedRMSNorm(inner, inner // m.num_groups, cfg.norm_eps)
        self.out = nn.Linear(inner, D, bias=False)

    def init_values(self, local: str, shape: tuple[int, ...], seed: int, name: str) -> torch.Tensor | None:
        """The whole tensor `local` of `shape` for (`seed`, `name`), for the parameters drawn other
        than Megatron's normal rule (`mlm.model.init`): A_log = log U(A_init_min, A_init_max), D = 1,
        dt_bias = softplus⁻¹ of a log-uniform step in [dt_min, dt_max] (floored); None for
        the others."""
        m = self.cfg
        gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
        if local == "A_log":
            return torch.empty(shape).uniform_(m.A_init_min, m.A_init_max, generator=gen).log()
        if local == "D":
            return torch.ones(shape)
        if local == "dt_bias":
            lo, hi = math.log(m.dt_min), math.log(m.dt_max)
            dt = torch.exp(torch.rand(shape, generator=gen) * (hi - lo) + lo).clamp(min=m.dt_init_floor)
            return dt + torch.log(-torch.expm1(-dt))
        return None

    def _inputs(self, x_BTD: torch.Tensor):
        """z, the convolutions' inputs x, B, C, and dt after softplus and limits (fp32)."""
        dt = F.softplus(at_least_fp32(self.in_dt(x_BTD)) + at_least_fp32(self.dt_bias))
        dt = dt.clamp(min=self.cfg.dt_limit_min, max=self.cfg.dt_limit_max)
        return self.in_z(x_BTD), self.in_x(x_BTD), self.in_B(x_BTD), self.in_C(x_BTD), dt

    def _heads(self, x, B_, C_):
        """x [.., H·P] → [.., H, P]; B, C [.., G·N] → [.., G, N]."""
        P, N = self.head_dim, self.state_dim
        return x.unflatten(-1, (-1, P)), B_.unflatten(-1, (-1, N)), C_.unflatten(-1, (-1, N))

    def forward(self, x_BTD: torch.Tensor, rope=None, cache=None, documents_BT=None) -> torch.Tensor:
        z, x, B_, C_, dt = self._inputs(x_BTD)
        A = -torch.exp(at_least_fp32(self.A_log))
        if cache is not None:
            y = self._from_states(cache.state(self.layer), x, B_, C_, dt, A)
        else:
            x = F.silu(self.conv_x(x, documents_BT))
            B_, C_ = F.silu(self.conv_B(B_, documents_BT)), F.silu(self.conv_C(C_, documents_BT))
            starts = None if documents_BT is None else document_starts(documents_BT)
            xh, Bh, Ch = self._heads(x, B_, C_)
            y, _ = self.ops.ssd(xh, dt, A, Bh, Ch, self.cfg.chunk_size, starts=starts)
            y = (y + at_least_fp32(self.D)[:, None] * at_least_fp32(xh)).flatten(-2)
        return self.out(self.norm(y, z).to(x_BTD.dtype))

    def _from_states(self, view, x, B_, C_, dt, A):
        """The step's segments (packed in row 0), each from its slot's state (zeros at a sequence's
        start): y [1, T, H·P] fp32; stores each slot's next window and state."""
        state_SHPN = view.load("ssm")
        decode, inputs = convolve_from_windows((self.conv_x, self.conv_B, self.conv_C), (x, B_, C_), view)
        if decode:  # every segment one token: one batched step
            xh, Bh, Ch = self._heads(*(t[:, 0] for t in inputs[0]))
            y, state = ssd_step(xh, dt[0], A, Bh, Ch, state_SHPN)
            view.store("ssm", state)
            return (y + at_least_fp32(self.D)[:, None] * at_least_fp32(xh)).flatten(-2)[None]
        ys, states = [], []
        for i, ((offset, n), conv_out) in enumerate(zip(view.segments, inputs, strict=True)):
            xh, Bh, Ch = self._heads(*conv_out)
            y, state = self.ops.ssd(
                xh,
                dt[:, offset : offset + n],
                A,
                Bh,
                Ch,
                self.cfg.chunk_size,
                initial_state=state_SHPN[i : i + 1],
            )
            ys.append((y + at_least_fp32(self.D)[:, None] * at_least_fp32(xh)).flatten(-2))
            states.append(state)
        view.store("ssm", torch.cat(states))
        return torch.cat(ys, dim=1)


def convolve_from_windows(convs, inputs_1TW, view) -> tuple[bool, list[list[torch.Tensor]]]:
    """A serving step's causal convolutions, SiLU applied, each segment's continuing its slot's
    window (the view's "conv" state: the convolutions' windows side by side); stores the next
    windows. Returns (decode, outputs): for a decode step (every segment one token) one batched
    item [[S, 1, W] per input]; else one item per segment [[1, n, W] per input]."""
    widths = [c.weight.shape[0] for c in convs]
    window_SWJ = view.load("conv")
    decode = all(n == 1 for _, n in view.segments)
    if decode:
        groups = [list(zip((t[0, :, None] for t in inputs_1TW), window_SWJ.split(widths, 1), strict=True))]
    else:
        groups = [
            list(
                zip(
                    (t[:, o : o + n] for t in inputs_1TW), window_SWJ[i : i + 1].split(widths, 1), strict=True
                )
            )
            for i, (o, n) in enumerate(view.segments)
        ]
    outputs, windows = [], []
    for parts in groups:
        stepped = [c.step(t, w) for c, (t, w) in zip(convs, parts, strict=True)]
        outputs.append([F.silu(y) for y, _ in stepped])
        windows.append(torch.cat([w for _, w in stepped], dim=1))
    view.store("conv", torch.cat(windows))
    return decode, outputs
