"""Mamba-2's chunked scan (`kernels.ssd`): the Triton kernels against the torch reference
`ssd_reference`, and the reference against code nobody here wrote.

- `ssd_reference` equals transformers' `mamba2_chunk_scan` (already-softplus'd dt, no dt_bias,
  D=None), with and without an initial state: fp32, within 1e-5 of the largest |expected|.
- Packed documents: the Triton path with `starts` equals the token recurrence `ssd_step` with the
  state emptied before each start (1e-5).
- Triton forward (y and the final state) and backward (x, dt, A, B, C, initial_state, from a loss
  on both outputs) equal the reference and autograd through it, fp32 within 1e-5 of the largest
  |expected|, on: T not a multiple of the chunk (37, 70 with chunk 16), a chunk that is not a
  power of two (12) with P and N that are not (6, 10), one group for all heads (G=1), G < H, an
  initial state, several starts per row (a start at position 0 with an initial state, starts on
  chunk boundaries, at the last token, at every token). Measured: ≤ 5e-7.
- bf16 inputs: both paths compute in fp32 from the same bf16 values, so y and the final state
  (fp32) agree within 1e-5 (measured ≤ 2e-7); the gradients come back in bf16, where one rounding
  on either side of a bf16 step differs by up to 2⁻⁷ relative: tolerance 2e-2 of the largest
  |expected| (measured ≤ 6.3e-3, on dt; ≤ 5e-5 on the others). Against the fp32 reference on
  the fp32 inputs before rounding them to bf16 (information, not tested): ≤ 1e-2 (dC).
- `backend="torch"` is `ssd_reference` itself; importing `kernels.ssd` does not import triton.

Without an NVIDIA GPU the kernels run under the Triton interpreter: tests/conftest.py sets
TRITON_INTERPRET=1 before anything imports triton.

    pytest -q tests/unit/test_kernel_ssd.py
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from kernels.ssd import ssd, ssd_reference, ssd_step
from tests.helpers.common import ROOT

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytest.importorskip("triton", reason="triton is not installed (pip install -e .[dev] installs it)")

FP32 = 1e-5
BF16_GRAD = 2e-2


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual − expected| / max |expected| (0 when both are 0)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, (actual, expected)
    diff = (actual.float() - expected.float()).abs().max().item()
    scale = expected.float().abs().max().item()
    return diff / scale if scale else diff


def assert_close(actual: torch.Tensor, expected: torch.Tensor, name: str, tol: float) -> None:
    err = rel_err(actual, expected)
    assert err <= tol, f"{name}: relative error {err:.2e} > {tol:.0e}"


def make_inputs(B=2, T=37, H=4, P=8, G=2, N=16, init=True, dtype=torch.float32, seed=0):
    """x, dt (softplus'd: 0.05–2), A (−1.6…−0.1), B, C, initial_state or None; leaves."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    x = randn(B, T, H, P)
    dt = F.softplus(randn(B, T, H) - 1.0)
    A = -(torch.rand(H, generator=gen) * 1.5 + 0.1)
    Bm, Cm = randn(B, T, G, N), randn(B, T, G, N)
    state = randn(B, H, P, N) if init else None
    tensors = [x, dt, A, Bm, Cm, state]
    return [t.to(DEVICE, dtype).requires_grad_() if t is not None else None for t in tensors]


def starts_at(B: int, T: int, rows: dict[int, list[int]]) -> torch.Tensor:
    starts = torch.zeros(B, T, dtype=torch.bool)
    for row, positions in rows.items():
        starts[row, positions] = True
    return starts.to(DEVICE)


# (name, sizes for make_inputs, chunk, starts as {row: positions})
CASES = [
    ("ragged", dict(T=37, init=False), 16, None),
    ("ragged-init", dict(T=37), 16, None),
    ("one-group", dict(T=40, G=1), 16, None),
    ("chunk12-P6-N10", dict(B=1, T=45, H=3, P=6, G=3, N=10), 12, None),
    ("starts", dict(T=70), 16, {0: [0, 5, 16, 17, 40, 69], 1: [15, 32, 33, 48]}),
    ("starts-no-init", dict(T=37, init=False), 16, {0: [3, 20], 1: [0, 16, 36]}),
    ("starts-chunk12", dict(B=1, T=45, H=3, P=6, G=1, N=10), 12, {0: [0, 11, 12, 24, 44]}),
    ("starts-everywhere", dict(T=20), 16, {0: list(range(20)), 1: list(range(0, 20, 2))}),
]


def run_case(sizes, chunk, rows, dtype=torch.float32):
    """Both paths on the same inputs: (outputs, grads) for triton and for the reference, from a
    loss that weighs y and the final state."""
    x, dt, A, Bm, Cm, init = make_inputs(**sizes, dtype=dtype)
    starts = starts_at(x.shape[0], x.shape[1], rows) if rows is not None else None
    leaves = [t for t in (x, dt, A, Bm, Cm, init) if t is not None]
    results = []
    for backend in ("triton", "torch"):
        y, final = ssd(x, dt, A, Bm, Cm, chunk, init, starts, backend=backend)
        gen = torch.Generator().manual_seed(1)
        wy = torch.randn(y.shape, generator=gen).to(DEVICE)
        wf = torch.randn(final.shape, generator=gen).to(DEVICE)
        loss = (y * wy).sum() + (final * wf).sum()
        results.append(((y, final), torch.autograd.grad(loss, leaves)))
    names = ["x", "dt", "A", "B", "C", "initial_state"][: len(leaves)]
    return results[0], results[1], names


def test_reference_matches_transformers():
    from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan

    for init in (False, True):
        x, dt, A, Bm, Cm, state = (
            t.detach() if t is not None else None for t in make_inputs(T=37, G=2, init=init)
        )
        y, final = ssd_reference(x, dt, A, Bm, Cm, 16, state)
        y_hf, final_hf = mamba2_chunk_scan(
            x, dt, A, Bm, Cm, 16, D=None, initial_states=state, return_final_states=True
        )
        assert_close(y, y_hf.float(), f"y (init={init})", FP32)
        assert_close(final, final_hf.float(), f"final state (init={init})", FP32)


@torch.no_grad()
def test_starts_are_document_resets():
    """Against the token recurrence: the state is emptied before each start token."""
    x, dt, A, Bm, Cm, init = make_inputs(T=37)
    starts = starts_at(2, 37, {0: [0, 9, 16, 30], 1: [16, 17, 36]})
    y, final = ssd(x, dt, A, Bm, Cm, 16, init, starts, backend="triton")
    state = init.float()
    ys = []
    for t in range(x.shape[1]):
        state = state * (~starts[:, t]).float()[:, None, None, None]
        y_t, state = ssd_step(x[:, t], dt[:, t], A, Bm[:, t], Cm[:, t], state)
        ys.append(y_t)
    assert_close(y, torch.stack(ys, dim=1), "y", FP32)
    assert_close(final, state, "final state", FP32)


@pytest.mark.parametrize("name, sizes, chunk, rows", CASES, ids=[c[0] for c in CASES])
def test_forward(name, sizes, chunk, rows):
    x, dt, A, Bm, Cm, init = make_inputs(**sizes)
    starts = starts_at(x.shape[0], x.shape[1], rows) if rows is not None else None
    with torch.no_grad():
        y, final = ssd(x, dt, A, Bm, Cm, chunk, init, starts, backend="triton")
        y_ref, final_ref = ssd_reference(x, dt, A, Bm, Cm, chunk, init, starts)
    assert y.dtype == final.dtype == torch.float32
    assert_close(y, y_ref, f"{name}: y", FP32)
    assert_close(final, final_ref, f"{name}: final state", FP32)


@pytest.mark.parametrize("name, sizes, chunk, rows", CASES, ids=[c[0] for c in CASES])
def test_backward(name, sizes, chunk, rows):
    (_, grads), (_, grads_ref), names = run_case(sizes, chunk, rows)
    for g, g_ref, what in zip(grads, grads_ref, names, strict=True):
        assert_close(g, g_ref, f"{name}: d{what}", FP32)
    if rows is not None and 0 in rows.get(0, []) and sizes.get("init", True):
        assert grads[-1][0].abs().max().item() == 0.0  # a start at 0 drops the initial state


@pytest.mark.parametrize("used", ["y", "final"])
def test_backward_through_one_output(used):
    """The other output's gradient is absent (autograd passes zeros); the final state does not
    read C, so its dC is zero (None through the reference)."""
    x, dt, A, Bm, Cm, init = make_inputs(T=37)
    leaves = [x, dt, A, Bm, Cm, init]
    grads = []
    for backend in ("triton", "torch"):
        y, final = ssd(x, dt, A, Bm, Cm, 16, init, backend=backend)
        out = y if used == "y" else final
        grad = torch.autograd.grad((out * out).sum(), leaves, allow_unused=True)
        grads.append([torch.zeros_like(t) if g is None else g for g, t in zip(grad, leaves, strict=True)])
    for g, g_ref, what in zip(*grads, ["x", "dt", "A", "B", "C", "initial_state"], strict=True):
        assert_close(g, g_ref, f"d{what}", FP32)


def test_bf16():
    rows = {0: [0, 5, 40], 1: [16, 33]}
    (out, grads), (out_ref, grads_ref), names = run_case(dict(T=70), 16, rows, dtype=torch.bfloat16)
    for o, o_ref, what in zip(out, out_ref, ["y", "final state"], strict=True):
        assert o.dtype == torch.float32
        assert_close(o, o_ref, what, FP32)
    for g, g_ref, what in zip(grads, grads_ref, names, strict=True):
        assert g.dtype == torch.bfloat16, what
        assert_close(g, g_ref, f"d{what}", BF16_GRAD)


def test_torch_backend_is_the_reference():
    x, dt, A, Bm, Cm, init = (t.detach() for t in make_inputs(T=37))
    starts = starts_at(2, 37, {0: [0, 7]})
    y, final = ssd(x, dt, A, Bm, Cm, 16, init, starts)
    y_ref, final_ref = ssd_reference(x, dt, A, Bm, Cm, 16, init, starts)
    assert torch.equal(y, y_ref) and torch.equal(final, final_ref)
    with pytest.raises(ValueError, match="backend"):
        ssd(x, dt, A, Bm, Cm, 16, backend="cuda")


def test_import_does_not_import_triton():
    code = "import sys, kernels.ssd; assert 'triton' not in sys.modules, 'triton imported'"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
