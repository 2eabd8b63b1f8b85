"""The gated delta rule (kernels/delta_rule.py): the torch chunked reference against transformers'
Qwen3-Next functions (chunked and per-token) and against the per-token reference, packed documents
against each document run alone, and the Triton forward and backward against the chunked reference
through autograd (the output, the final state and the gradients of q, k, v, g, beta and the
initial state).

Tolerances are relative to the expected tensor's largest magnitude: fp32 within 1e-5 (measured
≤ 1e-6 everywhere); bf16 inputs within 1e-2, one bf16 step of the largest value being 2⁻⁷ ≈ 7.8e-3
(measured ≤ 2e-4 here, where both paths compute in fp32 from the same bf16 inputs and round once;
on a GPU the Triton dots of 16-bit inputs run in tf32, not measured yet).

Without an NVIDIA GPU the kernels run under the Triton interpreter: tests/conftest.py sets
TRITON_INTERPRET=1 before anything imports triton. Importing `kernels.delta_rule` does not import
triton (the model's torch path needs none).
Sizes are small (B=2, T=37–70, H=2–3, d_k=16, d_v=24–32): the interpreter runs each program as Python.

    TRITON_INTERPRET=1 pytest -q tests/unit/test_kernel_delta_rule.py
"""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.common import ROOT

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytest.importorskip("triton", reason="triton is not installed (pip install -e .[dev] installs it)")
dr = importlib.import_module("kernels.delta_rule")
hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
NAMES = ("o", "final state", "dq", "dk", "dv", "dg", "dbeta", "dinitial_state")


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual − expected| / max |expected|."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    scale = max(expected.float().abs().max().item(), 1e-30)
    return (actual.float() - expected.float()).abs().max().item() / scale


def assert_close(actual: torch.Tensor, expected: torch.Tensor, name: str, tolerance: float) -> None:
    assert actual.dtype == expected.dtype, (name, actual.dtype, expected.dtype)
    err = rel_err(actual, expected)
    assert err <= tolerance, f"{name}: relative error {err:.2e} > {tolerance:.0e}"


def make_inputs(B=2, T=37, H=2, dk=16, dv=24, dtype=torch.float32, seed=0):
    """q, k, v, g (log decays ≤ 0, mostly near 0 as in a trained model), beta ∈ (0, 1), initial state."""
    gen = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(shape, generator=gen)

    q, k, v = r(B, T, H, dk), r(B, T, H, dk), r(B, T, H, dv)
    g = F.logsigmoid(r(B, T, H) + 2.0)
    beta = torch.sigmoid(r(B, T, H))
    s0 = 0.5 * r(B, H, dk, dv)
    return [x.to(DEVICE, dtype) for x in (q, k, v, g, beta)] + [s0.to(DEVICE)]


def make_starts(T=37):
    """Row 0: documents at 0, 5, 16 (a chunk boundary of 16, one token long), 17 and 30; row 1 at 0, 20."""
    starts = torch.zeros(2, T, dtype=torch.bool)
    starts[0, [0, 5, 16, 17, 30]] = True
    starts[1, [0, 20]] = True
    return starts.to(DEVICE)


def run_with_grads(fn, inputs, seed=7):
    """fn(q, k, v, g, beta, s0) → (o, S); returns [o, S, the gradients of the six inputs] of
    Σ o·do + Σ S·dS for fixed random do, dS."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    o, S = fn(*leaves)
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=gen).to(o.device, o.dtype)
    dS = torch.randn(S.shape, generator=gen).to(S.device)
    ((o.float() * do.float()).sum() + (S * dS).sum()).backward()
    return [o.detach(), S.detach()] + [x.grad for x in leaves]


@pytest.mark.parametrize("use_qk_l2norm", [True, False])
def test_chunked_reference_matches_transformers(use_qk_l2norm):
    """T=37 over chunks of 16 (padded), with an initial state, against transformers' chunked and
    per-token functions; the per-token reference too."""
    q, k, v, g, beta, s0 = make_inputs()
    kwargs = dict(initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm)
    hf_chunk = hf.torch_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=16, **kwargs)
    hf_rec = hf.torch_recurrent_gated_delta_rule(q, k, v, g, beta, **kwargs)
    ours = dr.delta_rule_chunked_reference(q, k, v, g, beta, s0, None, use_qk_l2norm, chunk_size=16)
    ours_rec = dr.delta_rule_recurrent_reference(q, k, v, g, beta, s0, None, use_qk_l2norm)
    for expected in (hf_chunk, hf_rec):
        for mine in (ours, ours_rec):
            for name, a, b in zip(("o", "final state"), mine, expected, strict=True):
                assert_close(a, b, name, 1e-5)
    # without an initial state, through the public function and its default chunk of 64 (T < 64)
    o, S = dr.gated_delta_rule(q, k, v, g, beta, output_final_state=True, use_qk_l2norm=use_qk_l2norm)
    ho, hS = hf.torch_chunk_gated_delta_rule(
        q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm
    )
    assert_close(o, ho, "o", 1e-5)
    assert_close(S, hS, "final state", 1e-5)


def _documents_alone(q, k, v, g, beta, s0, starts):
    """transformers' chunked function run on each document alone, the outputs concatenated; the
    first document of each row from s0, the others from zero; the last document's final state."""
    outs, finals = [], []
    for b in range(q.shape[0]):
        edges = [*starts[b].nonzero().flatten().tolist(), q.shape[1]]
        edges = [0, *edges] if edges[0] != 0 else edges
        row, state = [], s0[b : b + 1]
        for lo, hi in zip(edges[:-1], edges[1:], strict=True):
            o, state = hf.torch_chunk_gated_delta_rule(
                *(x[b : b + 1, lo:hi] for x in (q, k, v, g, beta)),
                chunk_size=16,
                initial_state=state if lo == 0 else None,
                output_final_state=True,
                use_qk_l2norm_in_kernel=True,
            )
            row.append(o)
        outs.append(torch.cat(row, dim=1))
        finals.append(state)
    return torch.cat(outs), torch.cat(finals)


def test_starts_equal_each_document_run_alone():
    q, k, v, g, beta, s0 = make_inputs()
    starts = make_starts()
    expected = _documents_alone(q, k, v, g, beta, s0, starts)
    chunked = dr.delta_rule_chunked_reference(q, k, v, g, beta, s0, starts, chunk_size=16)
    recurrent = dr.delta_rule_recurrent_reference(q, k, v, g, beta, s0, starts)
    for mine in (chunked, recurrent):
        for name, a, b in zip(("o", "final state"), mine, expected, strict=True):
            assert_close(a, b, name, 1e-5)
    # a document that starts at position 0 continues from the initial state (starts[:, 0] is ignored)
    cleared = starts.clone()
    cleared[:, 0] = False
    again = dr.delta_rule_chunked_reference(q, k, v, g, beta, s0, cleared, chunk_size=16)
    assert torch.equal(again[0], chunked[0]) and torch.equal(again[1], chunked[1])


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_recurrent_reference_equals_chunked_reference(chunk_size):
    """Outputs and every gradient (autograd through both), with documents and an initial state;
    g at a document's first token has no effect, so its gradient is zero."""
    inputs = make_inputs()
    starts = make_starts()
    chunked = run_with_grads(
        lambda q, k, v, g, b, s: dr.delta_rule_chunked_reference(
            q, k, v, g, b, s, starts, chunk_size=chunk_size
        ),
        inputs,
    )
    recurrent = run_with_grads(
        lambda q, k, v, g, b, s: dr.delta_rule_recurrent_reference(q, k, v, g, b, s, starts), inputs
    )
    for name, a, b in zip(NAMES, chunked, recurrent, strict=True):
        assert_close(a, b, name, 1e-5)
    dg = chunked[5]
    inner = starts.clone()
    inner[:, 0] = False
    assert inner.sum() == 5 and torch.all(dg[inner] == 0)


def _triton_vs_reference(dtype, starts, chunk_size, **sizes):
    inputs = make_inputs(dtype=dtype, **sizes)

    def path(backend):
        return lambda q, k, v, g, b, s: dr.gated_delta_rule(
            q, k, v, g, b, initial_state=s, starts=starts, output_final_state=True,
            chunk_size=chunk_size, backend=backend,
        )  # fmt: skip

    mine, expected = run_with_grads(path("triton"), inputs), run_with_grads(path("torch"), inputs)
    errors = {}
    for name, a, b in zip(NAMES, mine, expected, strict=True):
        errors[name] = rel_err(a, b)
        assert a.dtype == b.dtype, (name, a.dtype, b.dtype)
    bad = {n: f"{e:.2e}" for n, e in errors.items() if e > TOLERANCE[dtype]}
    assert not bad, f"above {TOLERANCE[dtype]:.0e} ({dtype}): {bad}"
    return errors


@pytest.mark.parametrize("with_starts", [False, True], ids=["one-document", "documents"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_matches_chunked_reference(dtype, with_starts, monkeypatch):
    """T=37 over chunks of 16, d_v=24 in two blocks of 16 (BLOCK_V lowered to split it), with an
    initial state and the final state's gradient."""
    monkeypatch.setattr(dr, "BLOCK_V", 16)
    _triton_vs_reference(dtype, make_starts() if with_starts else None, 16)


def test_triton_longer_sequence_whole_value_block():
    """T=70 over chunks of 32 (three, the last padded), H=3, d_v=32 in one block, from a zero state."""
    inputs = make_inputs(T=70, H=3, dv=32)
    mine = run_with_grads(
        lambda q, k, v, g, b, s: dr.gated_delta_rule(
            q, k, v, g, b, output_final_state=True, chunk_size=32, backend="triton"
        ),
        inputs,
    )
    expected = run_with_grads(
        lambda q, k, v, g, b, s: dr.delta_rule_chunked_reference(q, k, v, g, b, chunk_size=32), inputs
    )
    for name, a, b in zip(NAMES[:-1], mine[:-1], expected[:-1], strict=True):
        assert_close(a, b, name, 1e-5)
    assert mine[-1] is None and expected[-1] is None  # the unused initial state gets no gradient


def test_public_function_checks_its_arguments():
    q, k, v, g, beta, s0 = make_inputs(T=5)
    o, final = dr.gated_delta_rule(q, k, v, g, beta)
    assert o.shape == v.shape and o.dtype == q.dtype and final is None
    with pytest.raises(ValueError, match="backend"):
        dr.gated_delta_rule(q, k, v, g, beta, backend="cuda")
    with pytest.raises(ValueError, match="power of two"):
        dr.gated_delta_rule(q, k, v, g, beta, chunk_size=24, backend="triton")
    with pytest.raises(ValueError, match="initial_state"):
        dr.gated_delta_rule(q, k, v, g, beta, initial_state=s0[:, :1])
    with pytest.raises(ValueError, match="starts"):
        dr.gated_delta_rule(q, k, v, g, beta, starts=torch.ones(2, 4, dtype=torch.bool))
    # a decode step: one token from a carried state, per-token reference == chunked
    step = [x[:, :1] for x in (q, k, v, g, beta)]
    a = dr.delta_rule_recurrent_reference(*step, initial_state=s0)
    b = dr.gated_delta_rule(*step, initial_state=s0, output_final_state=True)
    assert_close(a[0], b[0], "o", 1e-5)
    assert_close(a[1], b[1], "final state", 1e-5)


def test_a_block_too_large_for_the_gpu_is_halved_once(monkeypatch):
    """On a GPU whose shared memory a d_v block overflows, triton's launch raises OutOfResources:
    the launcher halves the block (down to 16) and remembers it for the next launch."""
    from triton.runtime.errors import OutOfResources

    monkeypatch.setattr(dr, "_fitted_block_v", {})
    tried = []

    def launch(block_v):
        tried.append(block_v)
        if block_v > 16:
            raise OutOfResources(block_v * 10_000, 232_448, "shared memory")

    dr._launch_halving(("backward", 64, 128, 128, "tf32"), 64, launch)
    dr._launch_halving(("backward", 64, 128, 128, "tf32"), 64, launch)
    assert tried == [64, 32, 16, 16]
    with pytest.raises(OutOfResources):
        dr._launch_halving(("other",), 16, lambda block_v: launch(64))


def test_import_does_not_import_triton():
    code = "import sys, kernels.delta_rule; assert 'triton' not in sys.modules, 'triton imported'"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
