"""The CUDA variants of mlm's paths next to the kernels, each against its CPU or torch reference:
fp8 (`torch._scaled_mm`), mixed precision, the attention backends, the Triton kernels in a whole
model, compiled layers, serving (paged attention, CUDA graphs) and the straggler detector's clock.

    pytest -m gpu tests/unit/test_cuda.py                           # on a GPU machine
    MLM_CUDA_TESTS_ON_CPU=1 pytest tests/unit/test_cuda.py          # dry run on the CPU

Without CUDA the module skips, unless MLM_CUDA_TESTS_ON_CPU=1: then the same tests run on the CPU
(DEVICE is cpu), so that they cannot rot between GPU leases; the parts that exist only on CUDA
(SDPA's memory-efficient / cuDNN kernels, flash-attn, Transformer Engine, the compiled Triton
kernels, bf16 compile, CUDA graph capture, CUDA events) skip there, or run their CPU part and
assert the CUDA part only on CUDA. mlm's fp8 GEMM through `torch._scaled_mm` (its CUDA path)
also runs on the CPU, where torch implements it too. Each test states its tolerance and why;
"measured" numbers were measured on the CPU: none of this file has run on a GPU yet.
"""

from __future__ import annotations

import contextlib
import copy
import os
import time
import warnings
from unittest import mock

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import kernels.fp8 as fp8_kernels
from kernels.fp8 import MIN_CAPABILITY, amax, dequantize, fp8_linear, quantize, scale_from_amax
from mlm.build import build_rank_model
from mlm.config import Fp8Config, ModelConfig, ParallelConfig, TrainConfig, load_config
from mlm.inference.decode_graphs import DecodeGraphs
from mlm.inference.engine import Engine, EngineConfig, build_runner
from mlm.inference.kv_cache import PagedKVCache, blocks_needed
from mlm.inference.model_runner import ModelRunner, Segment
from mlm.inference.sampling import SamplingParams
from mlm.model import build_model
from mlm.model.attention import importable
from mlm.model.attention_core import AttentionCore
from mlm.model.ops import Ops
from mlm.parallel.fp8 import apply_fp8
from mlm.parallel.mesh import Mesh
from mlm.train.stragglers import WorkClock
from mlm.train.trainer import Trainer
from tests.helpers.common import tiny_sets

pytestmark = pytest.mark.gpu

if torch.cuda.is_available():
    DEVICE = torch.device("cuda")
elif os.environ.get("MLM_CUDA_TESTS_ON_CPU") == "1":
    DEVICE = torch.device("cpu")
else:
    pytest.skip(
        "no CUDA device here; set MLM_CUDA_TESTS_ON_CPU=1 to dry-run these tests on the CPU",
        allow_module_level=True,
    )
CUDA = DEVICE.type == "cuda"


def cuda_only(what: str) -> None:
    """Skip on the CPU: `what` exists only on CUDA."""
    if not CUDA:
        pytest.skip(f"CUDA only: {what}")


def fp8_or_skip() -> None:
    """Skip on a CUDA device without fp8 tensor cores (`mlm.parallel.fp8.check_fp8_device` refuses it)."""
    if CUDA and torch.cuda.get_device_capability(DEVICE) < MIN_CAPABILITY:
        pytest.skip(f"fp8 needs compute capability ≥ {MIN_CAPABILITY}; {torch.cuda.get_device_name()}")


def rel_error(got: torch.Tensor, want: torch.Tensor, floor: float = 0.0) -> float:
    """max |got − want| / max(max |want|, floor), in fp64."""
    want = want.detach().double()
    scale = max(want.abs().max().item(), floor)
    return (got.detach().double() - want).abs().max().item() / scale


def assert_rel(got: torch.Tensor, want: torch.Tensor, tol: float, name: str, floor: float = 0.0) -> float:
    """`rel_error(got, want, floor)` ≤ tol; returns it (printed by the caller with -s)."""
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} ≠ {tuple(want.shape)}"
    err = rel_error(got, want, floor)
    assert err <= tol, f"{name}: max error {err:.2e} of the largest |value| > {tol:.0e} on {DEVICE}"
    return err


# ---------------------------------------------------------------- training runs

BASE = {  # tests/distributed/test_compile.py's: the same compiled graphs, so inductor's cache serves both
    "model.hidden_dropout": 0.0,  # dropout draws from the device's RNG: CPU and CUDA masks differ
    "optimizer.adam_eps": 1e-4,  # keeps Adam's update smooth (tests/distributed/test_parallel_training.py)
    "train.global_batch_size": 4,
    "train.micro_batch_size": 2,
    "train.train_iters": 3,
}
_RUNS: dict[tuple, tuple[list[float], Trainer]] = {}


def train(tmp_path_factory, data: str, device: torch.device, **extra) -> tuple[list[float], Trainer]:
    """The losses of a 3-step run of the tiny Llama (tests/helpers/common.py's `tiny_sets`) on `device`
    with `extra` settings, and its trainer; each run once per session."""
    key = (device.type, *sorted(extra.items()))
    if key not in _RUNS:
        sets = {**BASE, "train.device": device.type, **extra}
        trainer = Trainer(load_config(None, tiny_sets(tmp_path_factory.mktemp("run"), data, **sets)))
        _RUNS[key] = trainer.train(), trainer
    return _RUNS[key]


def loss_error(losses: list[float], ref: list[float]) -> float:
    """max over steps of |loss − ref| / ref."""
    assert len(losses) == len(ref)
    return max(abs(a - b) / b for a, b in zip(losses, ref, strict=True))


# ---------------------------------------------------------------- fp8


def other_fp8_gemm():
    """Within it, `kernels.fp8.fp8_linear` takes the path DEVICE does not take by default: on CUDA
    the emulation; on the CPU `torch._scaled_mm`, called as on CUDA (torch implements it on the
    CPU too, without CUDA's layout and multiple-of-16 checks), so that the dry run checks the
    scale convention of mlm's CUDA call."""
    return mock.patch.object(fp8_kernels, "uses_scaled_mm", lambda device: not CUDA)


@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
def test_fp8_gemm_matches_its_emulation(fmt):
    """`kernels.fp8.fp8_linear` by both paths, `torch._scaled_mm` (CUDA sm ≥ 8.9's; forced on the
    CPU) and the emulation, against quantise → dequantise → fp64 matmul of the same quantised
    operands and scales: the forward GEMM (e4m3 × e4m3) and the two backward ones as
    `_Fp8LinearFn` calls them (the gradient, e5m2 under "hybrid", × e4m3), rounded to bf16 and to
    fp32. All accumulate the same exact products, so they differ by the summation order and one
    rounding: ≤ 1e-2 (bf16, 2^-8 with room) and 1e-3 (fp32: Hopper's fp8 tensor cores keep ~14
    bits while accumulating, DeepSeek-V3 §3.3.2) of the largest |value|; measured on the CPU:
    3.4e-3 and 3e-7. A wrong scale convention (scale for 1/scale) or operand layout is off by
    far more."""
    fp8_or_skip()
    if CUDA:
        assert fp8_kernels.uses_scaled_mm(DEVICE)
    gen = torch.Generator().manual_seed(0)
    M, K, N = 64, 96, 48  # multiples of 16, as torch._scaled_mm needs on CUDA
    x = (torch.randn(M, K, generator=gen) * 3).to(DEVICE)
    w = (torch.randn(N, K, generator=gen) * 0.05).to(DEVICE)
    g = (torch.randn(M, N, generator=gen) * 1e-4).to(DEVICE)
    gfmt = "e5m2" if fmt == "hybrid" else "e4m3"
    sx, sw = scale_from_amax(amax(x), "e4m3"), scale_from_amax(amax(w), "e4m3")
    sg = scale_from_amax(amax(g), gfmt)
    xq, wq, gq = quantize(x, sx, "e4m3"), quantize(w, sw, "e4m3"), quantize(g, sg, gfmt)
    gemms = {
        "y = x·Wᵀ": (xq, sx, wq, sw),
        "dx = g·W": (gq, sg, wq.t(), sw),
        "dW = gᵀ·x": (gq.t(), sg, xq.t(), sx),
    }
    errors = []
    for name, (a, sa, b, sb) in gemms.items():
        exact = dequantize(a, sa).double() @ dequantize(b, sb).double().t()
        for dtype, tol in ((torch.bfloat16, 1e-2), (torch.float32, 1e-3)):
            for path, ctx in (("default", contextlib.nullcontext()), ("other", other_fp8_gemm())):
                with ctx:
                    got = fp8_linear(a, sa, b, sb, dtype)
                assert got.dtype == dtype and got.device.type == DEVICE.type
                errors.append(assert_rel(got, exact, tol, f"{name} in {dtype}, {path} path"))
    print(f"fp8 GEMMs ({fmt}) on {DEVICE} vs fp64: max error {max(errors):.1e}")


class OneLinear(nn.Module):
    """A transformer-layer-like linear under `layers.` (what `apply_fp8` converts)."""

    def __init__(self, K: int, N: int):
        super().__init__()
        self.layers = nn.ModuleDict({"0": nn.ModuleDict({"fc": nn.Linear(K, N)})})

    def forward(self, x):
        return self.layers["0"]["fc"](x)


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_fp8_linear_tracks_a_bf16_linear(recipe):
    """One linear in fp8 ("hybrid": e4m3 forward, e5m2 gradients) under bf16 autocast on DEVICE,
    forward and backward, for two steps of fresh inputs (the second under "delayed" uses the
    scales of the first step's amax history, which saturate what exceeds it):
    - against the same linear in bf16 autocast on the same inputs, within the formats' rounding:
      an e4m3 value is within 2^-4 of its input, an e5m2 one within 2^-3, so y (e4m3 · e4m3)
      within 0.1, dx and dW (e5m2 · e4m3) within 0.2 of the reference's largest |value|
      (measured on the CPU: 4.6e-2, 6.8e-2, 8.3e-2), the bias gradient (from the unquantised
      gradient) within 1e-2;
    - against the same fp8 linear with the other GEMM path (`other_fp8_gemm`: the emulation on
      CUDA, torch's `_scaled_mm` on the CPU), within 1e-2: the same quantised operands."""
    fp8_or_skip()
    torch.manual_seed(0)
    ref = OneLinear(64, 128).to(DEVICE)
    cfg = TrainConfig(precision="bf16", fp8=Fp8Config(format="hybrid", recipe=recipe, amax_history_len=4))
    models = {"fp8": copy.deepcopy(ref), "fp8, other GEMM": copy.deepcopy(ref), "bf16": ref}
    states = [apply_fp8(models[k], cfg, Mesh.single(), DEVICE) for k in ("fp8", "fp8, other GEMM")]
    errors = []
    for step in range(2):
        x = torch.randn(2, 32, 64, device=DEVICE)
        g = torch.randn(2, 32, 128, device=DEVICE) * 1e-3
        outs = {}
        for key, m in models.items():
            xi = x.clone().requires_grad_()
            with other_fp8_gemm() if key == "fp8, other GEMM" else contextlib.nullcontext():
                with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
                    y = m(xi)
                assert y.dtype == torch.bfloat16
                y.backward(g.to(y.dtype))
            fc = m.layers["0"]["fc"]
            outs[key] = (y, xi.grad, fc.weight.grad, fc.bias.grad)
            fc.weight.grad = fc.bias.grad = None
        for state in states:
            state.finish_step()
        names = ("y", "dx", "dW", "db")
        for name, got, want, other, tol in zip(
            names, outs["fp8"], outs["bf16"], outs["fp8, other GEMM"], (0.1, 0.2, 0.2, 1e-2), strict=True
        ):
            errors.append(assert_rel(got, want, tol, f"step {step} {name} vs bf16"))
            assert_rel(got, other, 1e-2, f"step {step} {name} vs the other GEMM path")
    for state in states:
        assert state.started == (recipe == "delayed")
        if recipe == "delayed":
            assert (state.amax_history[..., -2:] > 0).all()
    print(f"fp8 linear ({recipe}) vs bf16, [y, dx, dW, db] × 2 steps: {[f'{e:.1e}' for e in errors]}")


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_fp8_training_tracks_bf16(tmp_path_factory, tiny_data, recipe):
    """3 steps of the tiny Llama on DEVICE with train.fp8.format=hybrid inside bf16 against the same
    run in bf16 without fp8: losses within 5e-3 relative (measured on the CPU's emulation, which
    computes what the fp8 GEMM does: 2.8e-4 delayed, 4.1e-4 tensorwise; fp8's few-percent
    rounding of each linear's operands barely moves the loss of a near-random model)."""
    fp8_or_skip()
    bf16, _ = train(tmp_path_factory, tiny_data, DEVICE, **{"train.precision": "bf16"})
    fp8 = {"train.precision": "bf16", "train.fp8.format": "hybrid", "train.fp8.recipe": recipe}
    losses, trainer = train(tmp_path_factory, tiny_data, DEVICE, **fp8, **{"train.fp8.amax_history_len": 4})
    assert trainer.fp8 is not None and trainer.fp8.names
    err = loss_error(losses, bf16)
    print(f"fp8 {recipe} vs bf16 on {DEVICE}: max |Δloss|/loss {err:.2e}")
    assert err <= 5e-3, (losses, bf16)
    assert losses != bf16  # fp8 really ran


# ---------------------------------------------------------------- mixed precision

PRECISIONS = {
    "fp32": ({}, 1e-4),
    "bf16-autocast": ({"train.precision": "bf16"}, 5e-3),
    "bf16-params": ({"train.precision": "bf16", "train.param_dtype": "bf16"}, 5e-3),
}


@pytest.mark.parametrize("precision", PRECISIONS)
def test_precision_on_device_matches_fp32_on_cpu(tmp_path_factory, tiny_data, precision):
    """3 steps of the tiny Llama on DEVICE in fp32, bf16 autocast (fp32 parameters) and bf16
    parameters (fp32 main weights) against fp32 on the CPU (the same data and initial weights:
    the init draws on the CPU whatever the device). fp32: losses within 1e-4 relative (GPU and
    CPU kernels sum in other orders, ~1e-6; TF32 must be off, torch's default, which mlm keeps).
    bf16: within 5e-3 (measured on the CPU: 9e-5 autocast, 5e-5 bf16 parameters; a GPU's bf16
    kernels round at other points, of the same order; tests/distributed/test_mixed_precision.py allows 2e-2
    over 50 steps)."""
    extra, tol = PRECISIONS[precision]
    if CUDA:
        assert not torch.backends.cuda.matmul.allow_tf32, "TF32 matmuls are on: fp32 would not be fp32"
    ref, _ = train(tmp_path_factory, tiny_data, torch.device("cpu"))
    losses, trainer = train(tmp_path_factory, tiny_data, DEVICE, **extra)
    params = list(trainer.model.parameters())
    assert {p.device.type for p in params} == {DEVICE.type}
    want = torch.bfloat16 if precision == "bf16-params" else torch.float32
    assert {p.dtype for p in params} == {want}
    if precision == "bf16-params":
        mains = trainer.optimizer.mains
        assert mains and {m.dtype for m in mains.values()} == {torch.float32}
    err = loss_error(losses, ref)
    print(f"{precision} on {DEVICE} vs fp32 on cpu: max |Δloss|/loss {err:.2e}")
    assert err <= tol, (losses, ref)


# ---------------------------------------------------------------- attention backends

BACKENDS = {
    "math": SDPBackend.MATH,
    "flash": SDPBackend.FLASH_ATTENTION,  # on the CPU: torch's fused CPU kernel of that name
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
}
# combinations that must run (elsewhere torch may have no kernel: the test skips with its reasons)
MUST_RUN = {
    "cuda": {("math", d, g) for d in ("fp32", "bf16") for g in (2, 4)}
    | {("flash", "bf16", 4), ("efficient", "bf16", 4), ("efficient", "fp32", 4)},
    "cpu": {(b, d, g) for b in ("math", "flash") for d in ("fp32", "bf16") for g in (2, 4)},
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ATTENTION_TOL = {"fp32": 1e-4, "bf16": 2e-2}


def reference_attention(q_BTHK, k_BTGK, v_BTGK, scale: float) -> torch.Tensor:
    """softmax(q kᵀ · scale + causal mask) v, each key head serving H / G query heads, plainly."""
    H, G = q_BTHK.shape[2], k_BTGK.shape[2]
    q, k, v = (t.transpose(1, 2) for t in (q_BTHK, k_BTGK, v_BTGK))
    k, v = k.repeat_interleave(H // G, dim=1), v.repeat_interleave(H // G, dim=1)
    T = q.shape[2]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


def attention_case(dtype: torch.dtype, groups: int, device=DEVICE):
    """q [2, 40, 4, 64], k and v [2, 40, groups, 64] in `dtype` and an output gradient, seeded."""
    gen = torch.Generator().manual_seed(0)
    B, T, H, K = 2, 40, 4, 64
    q, k, v = (torch.randn(B, T, n, K, generator=gen) for n in (H, groups, groups))
    g = torch.randn(B, T, H, K, generator=gen)
    return [t.to(device, dtype) for t in (q, k, v, g)]


def check_attention(core: AttentionCore, dtype_name: str, groups: int) -> list[float]:
    """`core` forward and backward against `reference_attention` in fp64 on the same (rounded)
    inputs: output, dq, dk, dv within ATTENTION_TOL of the reference's largest |value|."""
    q, k, v, g = attention_case(DTYPES[dtype_name], groups)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = core(*leaves)
    out.backward(g)
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(*ref_leaves, scale=q.shape[-1] ** -0.5)
    ref.backward(g.double())
    tol = ATTENTION_TOL[dtype_name]
    assert out.dtype == q.dtype
    names = ("out", "dq", "dk", "dv")
    pairs = zip(names, (out, *(t.grad for t in leaves)), (ref, *(t.grad for t in ref_leaves)), strict=True)
    return [assert_rel(a, b, tol, name) for name, a, b in pairs]


@pytest.mark.parametrize("groups", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_sdpa_backend_matches_plain_attention(backend, dtype, groups):
    """mlm's attention core (model.attention_backend=sdpa, causal, 4 query heads over `groups`
    key heads of 64 dims, 40 tokens) with SDPA held to one kernel (`sdpa_kernel`), forward and
    backward, against plain softmax(q kᵀ/√d) v in fp64 on the same inputs. Tolerance of the
    reference's largest |value|: fp32 1e-4 (kernels sum in their own order), bf16 2e-2 (the
    kernels round their probabilities and outputs to bf16, 2^-8 each). Flash and cuDNN take no
    fp32; a combination torch offers no kernel for skips with torch's reasons, except those that
    must run on this device (MUST_RUN)."""
    if backend in ("efficient", "cudnn"):
        cuda_only(f"SDPA's {backend} kernel")
    if CUDA and backend in ("flash", "cudnn") and dtype == "fp32":
        pytest.skip(f"SDPA's {backend} kernel takes fp16/bf16 only")
    core = AttentionCore(ModelConfig(), ops=Ops("torch", "sdpa"))
    with warnings.catch_warnings(record=True) as why, sdpa_kernel(BACKENDS[backend]):
        warnings.simplefilter("always")
        try:
            errors = check_attention(core, dtype, groups)
        except RuntimeError as e:
            if "No available kernel" not in str(e) or (backend, dtype, groups) in MUST_RUN[DEVICE.type]:
                raise
            reasons = "; ".join(str(w.message) for w in why)
            pytest.skip(f"torch {torch.__version__} has no {backend} kernel here: {reasons}"[:400])
    print(
        f"sdpa {backend} {dtype} groups={groups} on {DEVICE}: [out, dq, dk, dv] {[f'{e:.1e}' for e in errors]}"
    )


@pytest.mark.parametrize("groups", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("backend", ["flash", "te"])
def test_flash_attn_and_te_backends_match_plain_attention(backend, groups):
    """model.attention_backend=flash (flash-attn) and te (Transformer Engine) through mlm's
    attention core in bf16, forward and backward, against plain attention in fp64: 2e-2 of the
    largest |value|, as SDPA's fused kernels. Only where the package imports (on CUDA)."""
    cuda_only(f"the {backend} backend")
    module = "flash_attn" if backend == "flash" else "transformer_engine"
    if not importable(module):
        pytest.skip(f"{module} is not installed (pip install -e .[gpu])")
    core = AttentionCore(ModelConfig(), ops=Ops("torch", backend))
    check_attention(core, "bf16", groups)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_default_attention_matches_plain_attention(dtype):
    """The attention core as the model runs it (model.attention_backend=sdpa, SDPA choosing its
    kernel) on DEVICE with GQA, forward and backward, against plain attention in fp64 within
    ATTENTION_TOL (fp32 1e-4, bf16 2e-2)."""
    core = AttentionCore(ModelConfig(), ops=Ops("torch", "sdpa"))
    check_attention(core, dtype, 2)


# ---------------------------------------------------------------- Triton kernels in a model


@pytest.mark.parametrize("params", ["fp32", "bf16"], ids=["autocast", "bf16-params"])
def test_triton_kernels_in_a_bf16_model(params):
    """A tiny Llama (RMSNorm, SwiGLU, RoPE, GQA, q/k norms) in bf16 with model.kernels=triton
    against model.kernels=torch on DEVICE, under bf16 autocast (fp32 parameters) and with bf16
    parameters: logits and every parameter's gradient within 5e-2 of the torch path's largest
    |value| (gradients floored at 1e-3 of the largest gradient: the key bias-like ones are ~0).
    The two paths round to bf16 at other points (tests/unit/test_kernels.py: 2e-2 per kernel); two
    layers and the loss compound it."""
    cuda_only(
        "compiled Triton kernels (tests/unit/test_kernels.py runs them on the CPU under the interpreter)"
    )
    cfg = ModelConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
        vocab_size=97, normalization="rmsnorm", activation="swiglu", position_embedding="rope", qk_norm=True,
    )  # fmt: skip
    tokens = torch.randint(0, 97, (2, 33), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    results = {}
    for kernels in ("torch", "triton"):
        model = build_model(cfg, DEVICE, seed=3).to(DTYPES[params])
        assert model.set_kernels(kernels, DEVICE) == kernels
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            logits = model(tokens)
        assert logits.dtype == torch.bfloat16
        logits.float().square().mean().backward()
        results[kernels] = logits, {n: p.grad for n, p in model.named_parameters()}
    (logits, grads), (ref_logits, ref_grads) = results["triton"], results["torch"]
    assert_rel(logits, ref_logits, 5e-2, "logits")
    floor = 1e-3 * max(g.abs().max().item() for g in ref_grads.values())
    for name, g in ref_grads.items():
        assert_rel(grads[name], g, 5e-2, name, floor)


# ---------------------------------------------------------------- compile


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_compiled_layers_train_as_eager(tmp_path_factory, tiny_data, precision):
    """train.compile=true (each layer under torch.compile, inductor) against eager on DEVICE, 3
    steps of the tiny Llama. fp32: losses within 1e-4 relative (inductor fuses and reorders
    reductions: 1e-7 measured on the CPU, tests/distributed/test_compile.py asserts 1e-5 there; Triton's
    reductions on a GPU sum in yet another order). bf16 parameters: within 5e-3 (inductor keeps
    fused intermediates in fp32 where eager rounds each op to bf16: measured 1.7e-5 on the CPU).
    On the CPU only fp32 runs: its graphs are tests/distributed/test_compile.py's, so inductor's cache has
    them; the bf16 cold compile took 27 s on 2 cores."""
    extra = {} if precision == "fp32" else {"train.precision": "bf16", "train.param_dtype": "bf16"}
    if precision == "bf16":
        cuda_only("compiled bf16 layers (on the CPU its cold inductor compile takes ~30 s)")
    eager, _ = train(tmp_path_factory, tiny_data, DEVICE, **extra)
    losses, trainer = train(tmp_path_factory, tiny_data, DEVICE, **extra, **{"train.compile": "true"})
    assert all(layer._compiled_call_impl is not None for layer in trainer.model.layers.values())
    err = loss_error(losses, eager)
    print(f"compiled vs eager ({precision}) on {DEVICE}: max |Δloss|/loss {err:.2e}")
    assert err <= (1e-4 if precision == "fp32" else 5e-3), (losses, eager)


# ---------------------------------------------------------------- serving

SERVE_CFG = ModelConfig(
    num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
    vocab_size=97, max_position_embeddings=64, normalization="rmsnorm", activation="swiglu",
)  # fmt: skip
V = SERVE_CFG.vocab_size
SERVE_TOL = {"fp32": 1e-4, "bf16": 5e-2}
"""Logits of the paged, packed serving forward against the training forward, of the largest
|logit|: fp32 1e-4 (tests/serve/test_inference.py asserts 1e-5 on the CPU; GPU kernels sum in other
orders); bf16 5e-2 (the two forwards run attention as different kernels over differently
packed rows, each rounding to bf16 at every op: measured on the CPU, see the printed errors)."""


def serving_model(dtype_name: str):
    """The tiny Llama as `mlm serve` loads it (`build_rank_model` in the serving dtype), eval."""
    model = build_rank_model(
        SERVE_CFG, ParallelConfig(), Mesh.single(), DEVICE, dtype=DTYPES[dtype_name], seed=5
    )
    return model.eval()


@torch.no_grad()
def training_logits(model, ids: list[int]) -> torch.Tensor:
    """The cache-less training forward's logits [T, V] (fp32) at every position of `ids`."""
    return model(torch.tensor([ids], device=DEVICE))[0, :, :V].float()


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_serving_runner_gives_the_training_forward(dtype):
    """The serving runner on DEVICE (paged KV cache of block size 4): a 30-token prompt prefilled
    in two parts, the second packed with a 9-token prompt, then 6 decode steps of both, each
    fed the runner's greedy token: every sampled row's logits equal the training forward's at
    that position within SERVE_TOL."""
    model = serving_model(dtype)
    runner = build_runner(model, EngineConfig(max_seqs=4, block_size=4, num_blocks=40, packed_weights=False))
    cache = runner.cache
    assert cache.k_LNSGK.dtype == DTYPES[dtype] and cache.k_LNSGK.device.type == DEVICE.type
    a, b = prompt(30, 1), prompt(9, 2)
    blocks_a, blocks_b = cache.allocator.allocate(blocks_needed(36, 4)), cache.allocator.allocate(4)
    assert runner.forward([Segment(a[:17], 0, blocks_a, sample=False)]).shape == (0, V)
    got = runner.forward([Segment(a[17:], 17, blocks_a), Segment(b, 0, blocks_b)]).clone()
    tol, errors = SERVE_TOL[dtype], []
    for step in range(7):
        want = [training_logits(model, a)[-1], training_logits(model, b)[-1]]
        for row, (seq, w) in enumerate(zip(("a", "b"), want, strict=True)):
            errors.append(assert_rel(got[row].float(), w, tol, f"{dtype} step {step} sequence {seq}"))
        if step == 6:
            break
        ta, tb = got[:, :V].argmax(-1).tolist()
        a, b = a + [ta], b + [tb]
        got = runner.forward(
            [Segment([ta], len(a) - 1, blocks_a), Segment([tb], len(b) - 1, blocks_b)]
        ).clone()
    print(f"serving vs training forward ({dtype}) on {DEVICE}: max error {max(errors):.1e}")


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda-graphs"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_engine_greedy_decoding_follows_the_training_forward(dtype, graphs):
    """The Engine on DEVICE (continuous batching of 3 prompts of 5, 19 and 1 tokens, 16 tokens a
    step: the 19-token prompt is prefilled in two chunks; EngineConfig(cuda_graphs=True): decode
    steps replayed as CUDA graphs, CUDA only), 8 greedy tokens each with their log-probs: each
    token's log-prob equals the training forward's log-softmax at its position, and the token
    is the training forward's argmax, both up to SERVE_TOL × the largest |logit| (a bf16 near
    tie may pick the runner-up)."""
    if graphs:
        cuda_only("CUDA graph capture (build_runner refuses cuda_graphs off CUDA)")
    model = serving_model(dtype)
    config = EngineConfig(max_seqs=3, max_tokens_per_step=16, block_size=4, cuda_graphs=graphs)
    engine = Engine(model, None, config)
    prompts = [prompt(n, seed) for seed, n in enumerate((5, 19, 1))]
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=1)
    results = engine.generate(prompts, params)
    errors = []
    for p, r in zip(prompts, results, strict=True):
        assert r.finish_reason == "length" and len(r.token_ids) == 8
        logits = training_logits(model, p + r.token_ids)[len(p) - 1 : -1]
        tol = SERVE_TOL[dtype] * logits.abs().max().item()
        logprobs = logits.double().log_softmax(-1)
        for i, (token, lp) in enumerate(zip(r.token_ids, r.logprobs, strict=True)):
            assert lp.token_id == token
            errors.append(abs(lp.logprob - logprobs[i, token].item()))
            assert errors[-1] <= tol, f"token {i}: log-prob {lp.logprob} vs {logprobs[i, token].item()}"
            assert logits[i, token] >= logits[i].max() - tol, f"token {i}: {token} is not the argmax"
    assert engine.cache.allocator.num_used == 0
    if graphs:
        captured = engine.runner.graphs
        assert captured.failed is None, captured.failed
        assert captured.buckets and all(b.graph is not None for b in captured.buckets.values())
    print(
        f"engine ({dtype}, graphs={graphs}) vs training forward on {DEVICE}: max Δlogprob {max(errors):.1e}"
    )


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_decode_graphs_give_the_eager_runners_logits(dtype):
    """Decode steps through `DecodeGraphs` (on CUDA: captured and replayed, from
    `build_runner(EngineConfig(cuda_graphs=True))`; on the CPU: the same padded static path
    without capture) against the eager runner on the same model and inputs: 3 sequences (a
    bucket of 4) over 8 steps that cross block boundaries (tables of 4 to 6 blocks, padded to 4
    and 8): logits within SERVE_TOL of the largest |logit| (a padded batch may take other GEMM
    and attention kernels: measured on the CPU, see the printed error)."""
    model = serving_model(dtype)
    eager = build_runner(model, EngineConfig(max_seqs=4, block_size=4, num_blocks=40, packed_weights=False))
    if CUDA:
        static = build_runner(model, EngineConfig(max_seqs=4, block_size=4, num_blocks=40, cuda_graphs=True))
        graphs = static.graphs
        assert graphs.capture
    else:
        cache = PagedKVCache(SERVE_CFG, 40, 4, DTYPES[dtype], DEVICE, scratch=True)
        graphs = DecodeGraphs(model, cache, max_seqs=4, capture=False)
        static = ModelRunner(model, cache, graphs=graphs)
    tol, errors = SERVE_TOL[dtype], []
    seqs = [prompt(n, seed) for seed, n in enumerate((3, 9, 13))]
    tables = [list(range(10 * i, 10 * i + 10)) for i in range(3)]  # 40 tokens each
    prefill = [Segment(s, 0, t) for s, t in zip(seqs, tables, strict=True)]
    assert not graphs.takes(prefill)
    static.forward(prefill)
    nxt = eager.forward(prefill).argmax(-1).tolist()
    for step in range(8):
        segments = [Segment([t], len(s), b) for s, t, b in zip(seqs, nxt, tables, strict=True)]
        assert graphs.takes(segments)
        got, want = static.forward(segments).clone(), eager.forward(segments).clone()
        errors.append(assert_rel(got.float(), want.float(), tol, f"{dtype} step {step}"))
        seqs = [s + [t] for s, t in zip(seqs, nxt, strict=True)]
        nxt = want.argmax(-1).tolist()
    assert graphs.failed is None, graphs.failed
    assert set(graphs.buckets) == {(4, 4), (4, 8)}  # 3 sequences padded to 4; tables of 4 to 6 blocks
    if CUDA:
        assert all(b.graph is not None for b in graphs.buckets.values())
    print(f"decode graphs vs eager ({dtype}) on {DEVICE}: max error {max(errors):.1e}")


# ---------------------------------------------------------------- straggler clock


def test_work_clock_measures_device_work():
    """`WorkClock` on DEVICE (CUDA events on the current stream on a GPU, perf_counter on the
    CPU) over two spans of matmuls with 0.2 s of host sleep between them: its reading is the
    spans' work, within [0.5, 1.1] × the wall time of the spans measured with a synchronize
    around each (generous: launch latency and event resolution), and excludes the sleep. On
    CUDA the reading also exceeds twice the host time spent launching the work: it times the
    device, not the launches."""
    n, reps = (4096, 20) if CUDA else (256, 20)
    a = torch.randn(n, n, device=DEVICE)

    def work():
        x = a
        for _ in range(reps):
            x = (x @ a) * n**-0.5  # stays of size ~1
        return x

    def sync():
        if CUDA:
            torch.cuda.synchronize()

    work()  # warm up (cuBLAS handles, allocator)
    sync()
    clock = WorkClock(DEVICE)
    walls, launches = [], []
    for _ in range(2):
        sync()
        t0 = time.perf_counter()
        with clock.span():
            work()
        launches.append(time.perf_counter() - t0)
        sync()
        walls.append(time.perf_counter() - t0)
        time.sleep(0.2)  # not own work: outside the spans
    measured, wall = clock.take(), sum(walls)
    print(f"WorkClock on {DEVICE}: {measured:.4f} s; wall {wall:.4f} s; launches {sum(launches):.4f} s")
    assert 0.5 * wall <= measured <= 1.1 * wall + 1e-3, (measured, walls)
    assert clock.take() == 0.0  # take() starts a new sum
    if CUDA:
        assert measured > 2 * sum(launches), (measured, launches)
    with clock.span(on=False):
        work()
    sync()
    assert clock.take() == 0.0
