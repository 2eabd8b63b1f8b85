"""Each kernel of `kernels/` against torch eager and torch.compile of its torch reference: forward +
backward tokens/s and memory, at Llama-ish sizes (Llama-3-8B: hidden 4096, ffn 14336, 32 heads of
128, vocabulary 128,256; batch 1 × seq 4096 tokens by default).

    .venv/bin/python bench/kernels.py --device cuda                       # bf16 on a GPU
    .venv/bin/python bench/kernels.py --device cpu --seq 1024 --hidden 1024 --ffn 2816 \\
        --heads 8 --vocab 32000 --dtype fp32                             # a CPU-sized shape

Columns per kernel: `eager` (the torch reference, `kernels.*_reference`), `compile`
(torch.compile of the same reference) and `mlm` (what `model.kernels=triton` runs: the Triton
kernel; for linear + cross-entropy the chunked torch implementation `linear_cross_entropy`,
which runs on any device) and `liger` (Liger-Kernel's Triton kernel of the same form, where it is
installed and has one: rmsnorm, layernorm, swiglu, fused linear + cross-entropy). Triton kernels
run only with `--device cuda`: on CPU they would run under the Triton interpreter, which is a
correctness tool, not a speed measurement, so the row says why it is skipped. Each row gives its
speed against eager and against compile, and for the bandwidth-bound kernels the bytes a fused
forward + backward must move at the least (`min_bytes`) per second, with `--bandwidth` as a share
of the GPU's memory bandwidth.

Time: the median of `--steps` forward + backward calls after `--warmup` (the compile's first
call is among the warm-up and reported apart). tokens/s = batch × seq / median.
Memory, two figures:
- `saved`: bytes the forward keeps for the backward (each distinct tensor once, inputs included),
  counted with `torch.autograd.graph.saved_tensors_hooks` in an extra untimed call: the
  activation memory a layer holds across the step; the same on every device;
- `peak`: on CUDA `torch.cuda.max_memory_allocated` above the allocation before the call; on CPU
  the peak resident set above the one before the call (VmHWM, reset through
  /proc/self/clear_refs). torch's CPU allocator caches nothing; for that one call the script gives
  the heap's free pages back (`malloc_trim`) and sets glibc's mmap threshold to 64 KiB (`mallopt`:
  each new block of 64 KiB or more is then its own mapping, returned on free), so the resident set follows the live tensors, transients and the
  inputs' gradients included. The timed calls run with the threshold at 32 MiB, where glibc's
  own adaptive threshold ends up (reusing freed blocks without page faults).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from linear_cross_entropy import _rss  # noqa: E402  (bench/linear_cross_entropy.py: the resident-set reader)

from kernels.layernorm import layer_norm_reference  # noqa: E402
from kernels.rmsnorm import rms_norm_reference  # noqa: E402
from kernels.rope import rope_reference  # noqa: E402
from kernels.swiglu import gelu_reference, swiglu_reference  # noqa: E402
from mlm.parallel.cross_entropy import linear_cross_entropy, linear_cross_entropy_reference  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
KERNELS = ("rmsnorm", "layernorm", "swiglu", "gelu", "rope", "linear_cross_entropy")


def _triton(name: str):
    """The Triton function of a kernel (imported only when used: `--device cuda`)."""
    if name == "rmsnorm":
        from kernels.rmsnorm import rms_norm

        return rms_norm
    if name == "layernorm":
        from kernels.layernorm import layer_norm

        return layer_norm
    if name in ("swiglu", "gelu"):
        from kernels import swiglu

        return getattr(swiglu, name)
    from kernels.rope import rope

    return rope


def make_case(name: str, args, device: torch.device, dtype: torch.dtype):
    """(inputs that take a gradient, other arguments, torch reference, mlm's implementation)."""
    g = torch.Generator().manual_seed(0)
    N, D, F, H = args.batch * args.seq, args.hidden, args.ffn, args.heads

    def t(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g)).to(device, dtype).requires_grad_()

    if name == "rmsnorm":
        return [t(N, D), t(D)], [1e-5], rms_norm_reference, None
    if name == "layernorm":
        return [t(N, D), t(D), t(D)], [1e-5], layer_norm_reference, None
    if name == "swiglu":
        return [t(N, F), t(N, F)], [], swiglu_reference, None
    if name == "gelu":
        return [t(N, F)], [], gelu_reference, None
    if name == "rope":
        K = D // H
        angles = torch.arange(args.seq)[:, None] * 10000.0 ** (-torch.arange(0, K, 2) / K)
        angles = torch.cat([angles, angles], dim=-1).to(device)
        return [t(args.batch, args.seq, H, K)], [angles.cos(), angles.sin()], rope_reference, None
    V = args.vocab
    labels = torch.randint(0, V, (1, N), generator=g).to(device)
    return (
        [t(1, N, D), t(V, D, scale=0.02)],
        [labels, V],
        linear_cross_entropy_reference,
        linear_cross_entropy,
    )


def _saved_bytes(fn, inputs, extra) -> int:
    """Bytes of the distinct tensors the forward saves for the backward."""
    seen: dict[tuple, int] = {}

    def pack(x):
        seen[(x.untyped_storage().data_ptr(), x.storage_offset(), tuple(x.shape))] = (
            x.numel() * x.element_size()
        )
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = fn(*inputs, *extra)
    del out
    return sum(seen.values())


def _glibc_threshold(nbytes: int) -> None:
    """glibc malloc: blocks of `nbytes` or more get their own mapping (returned on free); smaller
    ones come from the heap, which keeps up to twice that free before returning it."""
    import ctypes

    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    libc = ctypes.CDLL("libc.so.6")
    assert libc.mallopt(M_MMAP_THRESHOLD, nbytes) == 1 and libc.mallopt(M_TRIM_THRESHOLD, 2 * nbytes) == 1
    libc.malloc_trim(0)  # give back the heap's free pages: a block reused from it then counts again


def run(fn, inputs, extra, device: torch.device, steps: int, warmup: int) -> dict:
    """Time and memory of forward + backward of `fn`."""
    cuda = device.type == "cuda"

    def step():
        out = fn(*inputs, *extra)
        out.backward(torch.ones_like(out))
        for x in inputs:
            x.grad = None

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    sync()
    t0 = time.perf_counter()
    step()
    sync()
    first = time.perf_counter() - t0
    for _ in range(max(0, warmup - 1)):
        step()
    times = []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    else:
        _glibc_threshold(64 * 2**10)
        base = _rss("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
    step()
    sync()
    peak = (torch.cuda.max_memory_allocated(device) if cuda else _rss("VmHWM")) - base
    if not cuda:
        _glibc_threshold(32 * 2**20)
    return {
        "median": statistics.median(times),
        "first": first,
        "peak": peak,
        "saved": _saved_bytes(fn, inputs, extra),
    }


def _liger(name: str, D: int):
    """Liger-Kernel's function for a kernel, taking the same arguments as the reference, or why
    there is none (not installed; no kernel of that shape)."""
    try:
        from liger_kernel.transformers import functional as lf
    except ImportError as e:
        return f"liger-kernel not installed ({e.name})"
    if name == "rmsnorm":
        return lambda x, w, eps: lf.liger_rms_norm(x, w, eps)
    if name == "layernorm":
        return lf.liger_layer_norm
    if name == "swiglu":
        return lf.liger_swiglu
    if name == "linear_cross_entropy":
        return lambda h, w, labels, vocab: lf.liger_fused_linear_cross_entropy(
            h.reshape(-1, D), w, labels.reshape(-1)
        )
    return (
        "no Liger kernel of this form (gelu: Liger has gelu·mul only; rope: Liger rotates q and k together)"
    )


def min_bytes(name: str, N: int, D: int, F: int, B: int, S: int, H: int, element: int) -> int | None:
    """Bytes a fused forward + backward must move at the least (each input, output and gradient
    once; weights and tables ignored), for the bandwidth-bound kernels; None for the GEMM-bound
    linear + cross-entropy. rmsnorm / layernorm: x, y, dy, x, dx = 5·N·D; swiglu: a, b, y, dy, a, b,
    da, db = 8·N·F; gelu: x, y, dy, x, dx = 5·N·F; rope: x, y, dy, dx = 4·B·S·D."""
    per = {
        "rmsnorm": 5 * N * D,
        "layernorm": 5 * N * D,
        "swiglu": 8 * N * F,
        "gelu": 5 * N * F,
        "rope": 4 * B * S * D,
    }
    return per[name] * element if name in per else None


def measure(
    device: str = "cuda" if torch.cuda.is_available() else "cpu",
    dtype: str | None = None,
    batch: int = 1,
    seq: int = 4096,
    hidden: int = 4096,
    ffn: int = 14336,
    heads: int = 32,
    vocab: int = 128256,
    kernels: tuple[str, ...] = KERNELS,
    steps: int = 10,
    warmup: int = 2,
    bandwidth: float | None = None,
    log=print,
) -> list[dict]:
    """Every (kernel, implementation) row of the table (see the module doc), printed through `log`;
    `bandwidth` (bytes/s, the GPU's datasheet figure) adds each row's share of it."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda, but torch sees no CUDA device; run with --device cpu")
    if dev.type == "cpu":
        _glibc_threshold(32 * 2**20)
    dtype = dtype or ("bf16" if dev.type == "cuda" else "fp32")
    torch_dtype = DTYPES[dtype]
    args = argparse.Namespace(batch=batch, seq=seq, hidden=hidden, ffn=ffn, heads=heads, vocab=vocab)
    N = batch * seq
    where = (
        torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    )
    log(
        f"{N} tokens (batch {batch} x seq {seq}), hidden {hidden}, ffn {ffn}, {heads} heads, vocab {vocab}, "
        f"{dtype}; {where}; torch {torch.__version__}; forward + backward, median of {steps}"
    )
    if dev.type != "cuda":
        log(
            "mlm and liger columns: Triton kernels skipped on CPU (they would run under the Triton interpreter, "
            "a correctness tool, not a speed measurement); linear_cross_entropy's is chunked torch and runs"
        )
    mem = "peak MiB (max_memory_allocated)" if dev.type == "cuda" else "peak MiB (resident set)"
    bw = f"{'GB/s':>9}{'of peak':>9}" if bandwidth else f"{'GB/s':>9}"
    log(
        f"{'kernel':<22}{'impl':<9}{'tokens/s':>14}{'vs eager':>10}{'vs compile':>11}{bw}{'first call s':>14}{'saved MiB':>11}  {mem}"
    )
    rows = []
    for name in kernels:
        inputs, extra, reference, mlm = make_case(name, args, dev, torch_dtype)
        impls = {"eager": reference, "compile": torch.compile(reference, dynamic=False)}
        skipped = {}
        if mlm is None and dev.type == "cuda":
            mlm = _triton(name)
        if mlm is not None:
            impls["mlm"] = mlm
        else:
            skipped["mlm"] = "Triton kernel, CPU"
        liger = _liger(name, hidden) if dev.type == "cuda" else "Triton kernel, CPU"
        if callable(liger):
            impls["liger"] = liger
        else:
            skipped["liger"] = liger
        moved = min_bytes(name, N, hidden, ffn, batch, seq, heads, torch_dtype.itemsize)
        tps_of = {}
        for impl, fn in impls.items():
            torch._dynamo.reset()
            r = run(fn, inputs, extra, dev, steps, warmup)
            tps = tps_of[impl] = N / r["median"]
            row = {"kernel": name, "impl": impl, "tokens_per_s": tps, "vs_eager": tps / tps_of["eager"]}
            row |= {"vs_compile": tps / tps_of["compile"] if "compile" in tps_of else None}
            row |= {"bytes_per_s": moved / r["median"] if moved else None, "first_s": r["first"]}
            row |= {"saved_bytes": r["saved"], "peak_bytes": r["peak"]}
            row["of_bandwidth"] = row["bytes_per_s"] / bandwidth if bandwidth and moved else None
            rows.append(row)
            gbs = f"{row['bytes_per_s'] / 1e9:>9.0f}" if moved else f"{'-':>9}"
            if bandwidth:
                gbs += f"{row['of_bandwidth']:>8.0%} " if moved else f"{'-':>9}"
            vs_compile = f"{row['vs_compile']:>10.2f}x" if row["vs_compile"] else f"{'':>11}"
            log(
                f"{name:<22}{impl:<9}{tps:>14,.0f}{row['vs_eager']:>9.2f}x{vs_compile}{gbs}{r['first']:>14.2f}"
                f"{r['saved'] / 2**20:>11.1f}  {r['peak'] / 2**20:.1f}"
            )
        for impl, why in skipped.items():
            rows.append({"kernel": name, "impl": impl, "skipped": why})
            log(f"{name:<22}{impl:<9}skipped: {why}")
        del inputs, extra
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu"
    )
    ap.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="default: bf16 on cuda, fp32 on cpu")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=14336)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--kernels", nargs="+", choices=KERNELS, default=list(KERNELS))
    ap.add_argument("--steps", type=int, default=10, help="timed calls per column")
    ap.add_argument("--warmup", type=int, default=2, help="untimed calls per column (the first compiles)")
    ap.add_argument(
        "--bandwidth", type=float, default=None, help="memory bandwidth in bytes/s: adds each row's share"
    )
    a = ap.parse_args()
    measure(**{k: (tuple(v) if k == "kernels" else v) for k, v in vars(a).items()})


if __name__ == "__main__":
    main()
