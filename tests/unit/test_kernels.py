"""The Triton kernels (top-level `kernels/`) and the torch path's lean autograd Functions
(`kernels.lean`) against their torch references, forward and every gradient: fp32 within 1e-5 and
bf16 within 2e-2 of the reference's largest magnitude, on sizes that are not powers of two; the
lean Functions bitwise equal to torch's own norms and SwiGLU in fp32 (the golden losses rest on
it) and saving only what their backward needs; and a tiny GPT with model.kernels=triton against
model.kernels=torch, over every site the choice covers (norms, Qwen3's q/k norms, MLA's latent
norms, dense and routed experts' activations, Mamba-2's scan, Gated DeltaNet's delta rule).

Without CUDA the kernels run under the Triton interpreter: this module sets TRITON_INTERPRET=1 while
it imports triton and the kernels (triton reads it as its own functions and the kernels are
defined) and while its tests run (triton reads it again at launch), and restores it in between.
Triton stays in interpreter mode in this process, but no real Triton kernel can run without a GPU,
so that changes nothing for other tests. With CUDA the same tests run the compiled kernels on the GPU.

The interpreter rounds fp32 → bf16 towards zero (a GPU rounds to nearest), so bf16 outputs here
differ from the references by up to one bf16 step (2⁻⁷ relative; measured ≤ 0.0076).

    TRITON_INTERPRET=1 pytest -q tests/unit/test_kernels.py
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch
import torch.nn.functional as F

from kernels import lean
from mlm.config import GatedDeltaNetConfig, MambaConfig, MLAConfig, ModelConfig, MoEConfig
from mlm.errors import MlmError
from mlm.model import build_model
from mlm.model.kinds.moe.experts import GroupedExperts
from mlm.model.ops import resolve_kernels
from mlm.model.rope import apply_rope, apply_rope_interleaved

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRETED = DEVICE.type == "cpu"
if INTERPRETED and "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip(
        "triton was imported before this module without TRITON_INTERPRET=1; "
        "run TRITON_INTERPRET=1 pytest tests/unit/test_kernels.py",
        allow_module_level=True,
    )
_saved = os.environ.get("TRITON_INTERPRET")
if INTERPRETED:
    os.environ["TRITON_INTERPRET"] = "1"
try:
    pytest.importorskip("triton", reason="triton is not installed (pip install -e .[dev] installs it)")
    k_rmsnorm, k_layernorm, k_swiglu, k_rope = (
        importlib.import_module(f"kernels.{name}") for name in ("rmsnorm", "layernorm", "swiglu", "rope")
    )
finally:
    if _saved is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _saved

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True, scope="module")
def interpreter():
    """TRITON_INTERPRET=1 while this module's tests run (triton reads it again at launch)."""
    if not INTERPRETED:
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        yield


def assert_close(actual: torch.Tensor, expected: torch.Tensor, name: str, floor: float = 0.0) -> None:
    """max |actual − expected| ≤ tolerance(dtype) × max(max |expected|, floor)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, (name, actual, expected)
    scale = max(expected.float().abs().max().item(), floor)
    err = (actual.float() - expected.float()).abs().max().item() / scale
    assert err <= TOLERANCE[expected.dtype], f"{name}: relative error {err:.2e} ({expected.dtype})"


def check(fn, reference, inputs: list[torch.Tensor], *args, constants: int = 0) -> None:
    """fn(*inputs, *args) against reference(*inputs, *args): output and the gradient of each input
    but the last `constants` (RoPE's tables)."""

    def leaves():  # fresh copies of the inputs (None stays None)
        n = len(inputs) - constants
        return [t if t is None else t.detach().clone().requires_grad_(i < n) for i, t in enumerate(inputs)]

    mine, theirs = leaves(), leaves()
    out, ref = fn(*mine, *args), reference(*theirs, *args)
    assert_close(out, ref, "output")
    grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE, ref.dtype)
    out.backward(grad)
    ref.backward(grad)
    for i, (a, b) in enumerate(zip(mine, theirs, strict=True)):
        if b is not None and b.grad is not None:
            assert_close(a.grad, b.grad, f"gradient of input {i}")


def randn(*shape: int, dtype=torch.float32, scale: float = 1.0, shift: float = 0.0, seed: int = 0):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale + shift
    return x.to(DEVICE, dtype)


DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 100), (3, 5, 72)])
def test_rms_norm(dtype, shape):
    N = shape[-1]
    x, w = randn(*shape, dtype=dtype), randn(N, dtype=dtype, scale=0.1, shift=1.0, seed=1)
    check(k_rmsnorm.rms_norm, k_rmsnorm.rms_norm_reference, [x, w], 1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(37, 100), (3, 5, 72)])
def test_layer_norm(dtype, bias, shape):
    N = shape[-1]
    x = randn(*shape, dtype=dtype, shift=0.5)  # a nonzero mean, so that centring matters
    w = randn(N, dtype=dtype, scale=0.1, shift=1.0, seed=1)
    b = randn(N, dtype=dtype, scale=0.1, seed=2) if bias else None
    check(k_layernorm.layer_norm, k_layernorm.layer_norm_reference, [x, w, b], 1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 100), (3, 5, 72)])
def test_lean_norms_and_swiglu_against_the_references(dtype, shape):
    N = shape[-1]
    x = randn(*shape, dtype=dtype, shift=0.5)
    w = randn(N, dtype=dtype, scale=0.1, shift=1.0, seed=1)
    b = randn(N, dtype=dtype, scale=0.1, seed=2)
    check(lean.rms_norm, k_rmsnorm.rms_norm_reference, [x, w], 1e-5)
    check(lean.layer_norm, k_layernorm.layer_norm_reference, [x, w, b], 1e-5)
    check(lean.layer_norm, k_layernorm.layer_norm_reference, [x, w, None], 1e-5)
    check(lean.swiglu, k_swiglu.swiglu_reference, [randn(*shape, dtype=dtype, scale=3.0, seed=3), x])


def test_lean_functions_are_bitwise_torchs_in_fp32():
    """Outputs and gradients equal torch's to the bit, also where x's gradient is summed with a
    residual branch's (RMSNorm hands autograd its two terms apart, as torch's composite does)."""
    x0, g0 = randn(4, 33, 72, shift=0.5), randn(4, 33, 72, scale=3.0, seed=3)
    w0, b0, W = randn(72, scale=0.1, shift=1.0, seed=1), randn(72, scale=0.1, seed=2), randn(72, 72, seed=4)
    cases = {
        "rmsnorm": (lambda x, w, b: lean.rms_norm(x, w, 1e-5), lambda x, w, b: F.rms_norm(x, (72,), w, 1e-5)),
        "layernorm": (
            lambda x, w, b: lean.layer_norm(x, w, b, 1e-5),
            lambda x, w, b: F.layer_norm(x, (72,), w, b, 1e-5),
        ),
        "swiglu": (lambda x, w, b: lean.swiglu(g0 * w, x), lambda x, w, b: F.silu(g0 * w) * x),
    }
    for name, (mine, theirs) in cases.items():
        results = []
        for fn in (mine, theirs):
            x, w, b = (t.clone().requires_grad_() for t in (x0, w0, b0))
            y = x + F.linear(fn(x, w, b), W)  # a residual branch beside the op
            y.square().sum().backward()
            results.append([y.detach(), x.grad, w.grad, b.grad])
        for i, (p, q) in enumerate(zip(*results, strict=True)):
            assert (p is None and q is None) or torch.equal(p, q), (name, i)


def _saved(fn, *inputs) -> list[tuple[tuple[int, ...], torch.dtype]]:
    out = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: out.append((tuple(t.shape), t.dtype)) or t, lambda t: t
    ):
        fn(*inputs)
    return out


@pytest.mark.parametrize("path", ["torch", "triton"])
def test_norms_output_the_compute_dtype_and_save_their_input(path):
    """Under bf16 autocast a norm of a bf16 input with fp32 weights returns bf16 (the next linear
    reads it without a copy) and saves the bf16 input (+ fp32 per-row statistics), no fp32 copy."""
    rms, ln = (
        (lean.rms_norm, lean.layer_norm) if path == "torch" else (k_rmsnorm.rms_norm, k_layernorm.layer_norm)
    )
    x = randn(3, 5, 72, dtype=torch.bfloat16).requires_grad_()
    w, b = randn(72, shift=1.0).requires_grad_(), randn(72, seed=2).requires_grad_()
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        assert rms(x, w, 1e-5).dtype == ln(x, w, b, 1e-5).dtype == torch.bfloat16
        assert rms(x.float(), w, 1e-5).dtype == torch.bfloat16  # an fp32 residual stream too
        saved_rms, saved_ln = _saved(rms, x, w, 1e-5), _saved(ln, x, w, b, 1e-5)
    assert rms(x.float(), w, 1e-5).dtype == torch.float32  # no autocast: the promoted dtype
    big = [(s, d) for s, d in saved_rms + saved_ln if s[-1] == 72 and len(s) > 1]
    assert all(d == torch.bfloat16 for _, d in big) and len(big) == 2, big  # x, once per norm
    assert all(d == torch.float32 for s, d in saved_rms + saved_ln if s[-1] != 72), (saved_rms, saved_ln)


def test_lean_swiglu_saves_its_two_inputs():
    a, b = (randn(5, 37, dtype=torch.bfloat16, seed=i).requires_grad_() for i in (0, 1))
    assert _saved(lean.swiglu, a, b) == [((5, 37), torch.bfloat16)] * 2


def test_norm_references_are_torchs_norms():
    x, w, b = randn(37, 100), randn(100, seed=1), randn(100, seed=2)
    torch.testing.assert_close(
        k_rmsnorm.rms_norm_reference(x, w, 1e-5), torch.nn.functional.rms_norm(x, (100,), w, 1e-5)
    )
    torch.testing.assert_close(
        k_layernorm.layer_norm_reference(x, w, b, 1e-5), torch.nn.functional.layer_norm(x, (100,), w, b, 1e-5)
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu(dtype):
    a, b = randn(37, 100, dtype=dtype, scale=3.0), randn(37, 100, dtype=dtype, seed=1)
    check(k_swiglu.swiglu, k_swiglu.swiglu_reference, [a, b])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu(dtype, approximate):
    a = randn(3, 37, 24, dtype=dtype, scale=3.0)  # ±10: both tails
    check(k_swiglu.gelu, k_swiglu.gelu_reference, [a], approximate)


def _tables(B: int, T: int, D: int, per_batch: bool):
    """cos, sin [T, D] (or [B, T, D]) built as mlm's are: the angles repeated in both halves."""
    angles = randn(B if per_batch else 1, T, D // 2, scale=3.0, seed=5)
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos(), angles.sin()
    return (cos, sin) if per_batch else (cos[0], sin[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_batch", [False, True], ids=["tables_TD", "tables_BTD"])
@pytest.mark.parametrize("layout,D", [("rotate_half", 20), ("interleaved", 24)])
def test_rope(dtype, per_batch, layout, D):
    B, T, H = 2, 7, 3
    x, (cos, sin) = randn(B, T, H, D, dtype=dtype), _tables(B, T, D, per_batch)
    if layout == "rotate_half":
        fn, reference, model_fn = k_rope.rope, k_rope.rope_reference, apply_rope
    else:
        fn, reference, model_fn = (
            k_rope.rope_interleaved,
            k_rope.rope_interleaved_reference,
            apply_rope_interleaved,
        )
    assert torch.equal(reference(x, cos, sin), model_fn(x, cos, sin))  # the reference is the model's
    check(fn, reference, [x, cos, sin], constants=2)


def test_rope_of_a_strided_input():
    """MLA rotates a slice of each head's query (not contiguous): the kernel copies it first."""
    q = randn(2, 7, 3, 32)
    cos, sin = _tables(2, 7, 24, per_batch=False)
    check(
        lambda q: k_rope.rope_interleaved(q[..., 8:], cos, sin),
        lambda q: k_rope.rope_interleaved_reference(q[..., 8:], cos, sin),
        [q],
    )


# ---------------------------------------------------------------- choosing the kernels


def test_kernels_resolve_to_torch_on_cpu_and_name_the_fix(monkeypatch):
    cpu = torch.device("cpu")
    assert resolve_kernels("auto", cpu) == "torch"
    assert resolve_kernels("torch", cpu) == "torch"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(MlmError, match=r"model.kernels='triton' on cpu .* TRITON_INTERPRET=1"):
        resolve_kernels("triton", cpu)
    with pytest.raises(MlmError, match="model.kernels='cuda': must be one of torch, triton, auto"):
        ModelConfig(kernels="cuda")


GPTS = {
    "llama": dict(normalization="rmsnorm", activation="swiglu", position_embedding="rope"),
    "gpt2": dict(
        normalization="layernorm", activation="gelu_tanh", position_embedding="learned", add_bias=True
    ),
    "mla": dict(
        attention_kind="mla",
        mla=MLAConfig(q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=6, v_head_dim=4),
    ),
    "qwen3-qk-norm": dict(qk_norm=True),
    # Qwen3-Next's attention: zero-centred norms (1 + weight into the kernels), the output gate,
    # RoPE on each head's first 6 of 12 dims
    "qwen3-next-attention": dict(
        qk_norm=True, norm_zero_centered=True, attention_output_gate=True, rotary_percent=0.5
    ),
    "moe-shared": dict(
        mlp_kind="moe",
        moe=MoEConfig(num_experts=4, router_topk=2, ffn_hidden_size=20, shared_expert_ffn_hidden_size=24),
    ),
    "moe-gelu": dict(
        mlp_kind="moe", activation="gelu", moe=MoEConfig(num_experts=4, router_topk=2, ffn_hidden_size=20)
    ),
    # Mamba-2's scan (kernels.ssd): 12 heads of 6, 2 groups, chunks of 4 over 9 tokens
    "mamba-hybrid": dict(
        layer_pattern="M-*-", mamba=MambaConfig(head_dim=6, state_dim=8, num_groups=2, chunk_size=4)
    ),
    # Gated DeltaNet's delta rule (kernels.delta_rule): 2 key heads of 6 for 4 value heads of 10, in
    # one chunk of 16 (the Triton kernels' smallest) over 9 tokens. −A drawn in [0.1, 1], not the
    # default [1, 16]: there a token keeps as little as e⁻²⁰ of the state, and A_log's gradient
    # Σ_t g_t · dg_t (|g_t| up to 20) is ill-conditioned in fp32 — measured, both paths up to 2e-5
    # from an fp64 recurrence and 3.5e-5 apart; here ≤ 1e-6 apart.
    "gdn-hybrid": dict(
        layer_pattern="G-*-",
        gdn=GatedDeltaNetConfig(
            num_key_heads=2,
            num_value_heads=4,
            key_head_dim=6,
            value_head_dim=10,
            chunk_size=16,
            A_init_min=0.1,
            A_init_max=1.0,
        ),
    ),
}


@pytest.mark.parametrize("arch", GPTS)
def test_gpt_with_triton_kernels_matches_torch(arch):
    cfg = ModelConfig(
        num_layers=2, hidden_size=36, num_attention_heads=3, ffn_hidden_size=52, vocab_size=50, **GPTS[arch]
    )
    tokens = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    results = {}
    for kernels in ("torch", "triton"):
        model = build_model(cfg, DEVICE, seed=3)
        assert model.set_kernels(kernels, DEVICE) == kernels
        # every norm (per-head and latent ones too) and every experts' activation follows the choice:
        # they share the model's one Ops
        sites = [
            m
            for m in model.modules()
            if isinstance(m, (torch.nn.RMSNorm, torch.nn.LayerNorm, GroupedExperts))
        ]
        assert sites and all(m.ops is model.ops for m in sites), sites
        assert model.ops.kernels == kernels
        logits = model(tokens)
        logits.float().square().mean().backward()
        results[kernels] = logits.detach(), {n: p.grad for n, p in model.named_parameters()}
    (logits, grads), (ref_logits, ref_grads) = results["triton"], results["torch"]
    assert_close(logits, ref_logits, "logits")
    # the key bias's gradient is zero but for rounding (softmax ignores a shift shared by every
    # key; max 7e-13): each gradient is compared on at least 1e-4 of the largest one's scale
    floor = 1e-4 * max(g.abs().max().item() for g in ref_grads.values())
    for name, g in ref_grads.items():
        assert_close(grads[name], g, name, floor)
