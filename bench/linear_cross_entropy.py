"""Peak memory and time of the loss, forward + backward: plain (logits, then cross-entropy) against
the chunked linear + cross-entropy (`mlm.parallel.cross_entropy`), at vocabulary 128,256.

    .venv/bin/python bench/linear_cross_entropy.py                      # CPU: ~30 s on 2 cores
    .venv/bin/python bench/linear_cross_entropy.py --runs plain:512,fused:32768 --json

Peak memory on CPU: the peak resident set (VmHWM, reset through /proc/self/clear_refs) above
the resident set just before the call; torch's CPU allocator caches nothing and glibc returns
large blocks on free, so it follows the live tensors. On CUDA: `max_memory_allocated` above the
allocation before the call. Each run is measured after a 64-token warm-up of the same path. The
plain path at 8 × 4096 tokens does not fit a 24 GB machine: `--tokens` extrapolates each path
linearly from its last two runs (both are linear in the tokens, the fused one nearly flat).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

# the repository first: this folder's bench/kernels.py would otherwise shadow the kernels package
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlm.parallel.cross_entropy import linear_cross_entropy, linear_cross_entropy_reference  # noqa: E402

PATHS = {"plain": linear_cross_entropy_reference, "fused": linear_cross_entropy}


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure(kind: str, n: int, V: int, D: int, device: torch.device, dtype: torch.dtype):
    """(peak bytes above the start, seconds) of one forward + backward of `kind` over n tokens."""
    fn = PATHS[kind]
    g = torch.Generator().manual_seed(0)
    w = (0.02 * torch.randn(V, D, generator=g)).to(device, dtype).requires_grad_()
    h = torch.randn(1, n, D, generator=g).to(device, dtype).requires_grad_()
    y = torch.randint(0, V, (1, n), generator=g).to(device)
    fn(h[:, :64], w, y[:, :64], V).backward()  # warm-up: thread pools, lazily made buffers
    h.grad = w.grad = None
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
    t = time.perf_counter()
    fn(h, w, y, V).backward()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t
    peak = torch.cuda.max_memory_allocated() if cuda else _rss("VmHWM")
    return peak - base, seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default="plain:512,plain:1024,fused:2048,fused:4096", help="kind:tokens,...")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=8 * 4096, help="extrapolate the peaks to this many tokens")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true", help="print {'kind tokens': peak bytes} only")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    runs = [(k, int(n)) for k, n in (r.split(":") for r in args.runs.split(","))]
    peaks, times = {}, {}
    for kind, n in runs:
        peaks[f"{kind} {n}"], times[f"{kind} {n}"] = measure(kind, n, args.vocab, args.hidden, device, dtype)
    if args.json:
        print(json.dumps(peaks))
        return
    print(f"vocab {args.vocab}, hidden {args.hidden}, {args.dtype} on {device}")
    for key, peak in peaks.items():
        print(f"{key:>14} tokens: peak {peak / 2**20:9.1f} MiB, {times[key]:6.2f} s")
    at = {}
    for kind in PATHS:
        ns = [n for k, n in runs if k == kind][-2:]
        if len(ns) == 2:
            (a, pa), (b, pb) = ((n, peaks[f"{kind} {n}"]) for n in ns)
            slope = max(0.0, (pb - pa) / (b - a))
            at[kind] = pb + slope * (args.tokens - b)
            print(f"{kind} at {args.tokens} tokens (linear from {a} and {b}): {at[kind] / 1e9:.2f} GB")
    if len(at) == 2:
        print(f"ratio fused / plain: {at['fused'] / at['plain']:.4f}  (target <= 0.25)")


if __name__ == "__main__":
    main()
