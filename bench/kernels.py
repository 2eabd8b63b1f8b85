"""Each kernel of `kernels/` against torch eager and torch.compile of its torch reference: forward +
backward tokens/s and memory, at Llama-ish sizes (Llama-3-8B: hidden 4096, ffn 14336, 32 heads of
128, vocabulary 128,256; batch 1 × seq 4096 tokens by default).

    .venv/bin/python bench/kernels.py --device cuda                       # bf16 on a GPU
    .venv/bin/python bench/kernels.py --device cpu --seq 1024 --hidden 1024 --ffn 2816 \\
        --heads 8 --vocab 32000 --dtype fp32                             # a CPU-sized shape

Columns per kernel: `eager` (the torch reference, `kernels.*_reference`), `compile`
(torch.compile of the same reference) and `mlm` (what `model.kernels=triton` runs: the Triton
kernel; for linear + cross-entropy the chunked torch implementation `linear_cross_entropy`,
which runs on any device). Triton kernels run only with `--device cuda`: on CPU they would run
under the Triton interpreter, which is a correctness tool, not a speed measurement, so the
column says why it is empty.

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
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("error: --device cuda, but torch sees no CUDA device; run with --device cpu")
    if device.type == "cpu":
        _glibc_threshold(32 * 2**20)
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    N = args.batch * args.seq
    where = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"cpu, {torch.get_num_threads()} threads"
    )
    print(
        f"{N} tokens (batch {args.batch} x seq {args.seq}), hidden {args.hidden}, ffn {args.ffn}, "
        f"{args.heads} heads, vocab {args.vocab}, {args.dtype or str(dtype).removeprefix('torch.')}; "
        f"{where}; torch {torch.__version__}; forward + backward, median of {args.steps}"
    )
    if device.type != "cuda":
        print(
            "mlm column: Triton kernels skipped on CPU (they would run under the Triton interpreter, "
            "a correctness tool, not a speed measurement); linear_cross_entropy's is chunked torch and runs"
        )
    mem = "peak MiB (max_memory_allocated)" if device.type == "cuda" else "peak MiB (resident set)"
    print(
        f"{'kernel':<22}{'impl':<9}{'tokens/s':>14}{'vs eager':>10}{'first call s':>14}{'saved MiB':>11}  {mem}"
    )
    for name in args.kernels:
        inputs, extra, reference, mlm = make_case(name, args, device, dtype)
        impls = {"eager": reference, "compile": torch.compile(reference, dynamic=False)}
        if mlm is None and device.type == "cuda":
            mlm = _triton(name)
        if mlm is not None:
            impls["mlm"] = mlm
        eager = None
        for impl, fn in impls.items():
            torch._dynamo.reset()
            r = run(fn, inputs, extra, device, args.steps, args.warmup)
            tps = N / r["median"]
            eager = eager or tps
            print(
                f"{name:<22}{impl:<9}{tps:>14,.0f}{tps / eager:>9.2f}x{r['first']:>14.2f}"
                f"{r['saved'] / 2**20:>11.1f}  {r['peak'] / 2**20:.1f}",
                flush=True,
            )
        if "mlm" not in impls:
            print(f"{name:<22}{'mlm':<9}{'skipped: Triton kernel, CPU':>14}")
        del inputs, extra


if __name__ == "__main__":
    main()
