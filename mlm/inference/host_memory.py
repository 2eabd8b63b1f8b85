"""Keep freed host memory in the process (glibc's malloc), for CPU serving.

glibc serves a large request (from 128 KiB, a threshold it raises as blocks are freed, up to
32 MiB) with a fresh mmap and unmaps it when freed, and it trims the top of its heap back to the
kernel past 128 KiB free. A CPU forward allocates and frees activations of megabytes per layer
(a 1,000-token prompt: 6 MiB per MLP tensor on SmolLM2-135M's shape), so each of them is faulted
in page by page again, at every layer of every step. `keep_freed_memory` fixes both thresholds
(mmap from 32 MiB, glibc's maximum; trim past 1 GiB free), so the heap keeps what a step freed for
the next one. It is what `mlm serve` and `mlm generate` do on the CPU; tcmalloc or jemalloc
(LD_PRELOAD) does the same and more. Measured on a 2-core Xeon (`bench/serve_step.py`): the
prefill step of 16 prompts (1,059 tokens, SmolLM2-135M's shape, fp32) took 898-943 ms before and
827-910 ms after, median of 15, in a process that has done nothing else; with glibc's defaults
single steps swung up to 1.9 s after other work had shaped the heap. The price is memory the
process keeps after a peak (up to the peak's activations)."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 1 << 30


def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds (see the module); False where the C library has no
    mallopt or refuses them (with another malloc preloaded they may be accepted and do nothing)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others have no mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
