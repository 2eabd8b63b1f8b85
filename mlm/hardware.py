"""GPU datasheets, the one hardware table: `mlm plan --hardware NAME`, plan files' `[cluster]
hardware` and training's `logging.hardware` (the MFU peak) all name these profiles.

Peaks are the vendors' dense (not 2:4-sparse) tensor-core numbers; bandwidths are per GPU and per
direction (NVLink's "900 GB/s" is both directions together: 450 GB/s each way). Sources:

    a100-40g, a100-80g  NVIDIA A100 datasheet (SXM): 312 TFLOP/s bf16, 40 GB HBM2 1.555 TB/s /
                        80 GB HBM2e 2.039 TB/s, NVLink 3 600 GB/s; HDR InfiniBand 200 Gb/s per GPU
    h100-80g            NVIDIA H100 datasheet (SXM5): 989 TFLOP/s bf16, 1979 fp8, 80 GB HBM3
                        3.35 TB/s, NVLink 4 900 GB/s; NDR InfiniBand 400 Gb/s per GPU (DGX H100)
    h200                NVIDIA H200 datasheet (SXM): 989 / 1979, 141 GB HBM3e 4.8 TB/s, NVLink 900 GB/s
    b200                NVIDIA DGX B200 datasheet: 2.25 PFLOP/s bf16 dense, 4.5 fp8, 180 GB HBM3e
                        7.7 TB/s, NVLink 5 1.8 TB/s; 400 Gb/s ConnectX-7 per GPU

Latencies (5 µs in a node, 10 µs across) are typical NCCL small-message times, not datasheet values.
The host link is PCIe 4.0 x16 (A100: 32 GB/s each way) or 5.0 x16 (H100, H200, B200: 64 GB/s).
memory_efficiency 0.85 is the share of the datasheet bandwidth that streaming kernels (copies,
elementwise ops) reach, an assumption in the range STREAM-like GPU benchmarks report (80-90 %).

Achievable fraction of peak (`efficiency`): a GEMM of m × n × k reaches a fraction of peak that
grows with its smallest dimension d and saturates: `gemm_max · d / (d + gemm_half)`. The default
gemm_max 0.75 and gemm_half 128 are set from published cuBLAS bf16 sweeps on A100/H100 (NVIDIA's
"Matrix Multiplication Background" guide: large square GEMMs reach 70–80 % of peak, and a GEMM
whose smallest side is a few hundred runs at about half its large-size rate). They are
assumptions, not measurements of your cluster: `mlm plan --calibrate metrics.jsonl` refits
gemm_max and the bandwidths from a real run (custom profiles: `mlm.plan.hardware`).

Torch-free and light: `mlm.config` imports it to validate `logging.hardware`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from mlm.errors import MlmError


@dataclass(frozen=True)
class Hardware:
    """One GPU kind and its links."""

    name: str
    """Profile name."""
    peak_bf16: float
    """Dense bf16/fp16 tensor-core FLOP/s."""
    peak_fp8: float
    """Dense fp8 FLOP/s (0: none)."""
    hbm_bytes: float
    """Memory per GPU (bytes, decimal GB as in the datasheet)."""
    hbm_bandwidth: float
    """Memory bandwidth (bytes/s)."""
    intra_bandwidth: float
    """NVLink bandwidth per GPU, one direction (bytes/s)."""
    intra_latency: float
    """Per-collective latency inside a node (s)."""
    inter_bandwidth: float
    """Network bandwidth per GPU, one direction (bytes/s)."""
    inter_latency: float
    """Per-collective latency across nodes (s)."""
    gemm_max: float = 0.75
    """Fraction of peak that large GEMMs reach."""
    gemm_half: float = 128.0
    """GEMM side at which half of gemm_max is reached."""
    peak_fp32: float = 0.0
    """fp32 FLOP/s (used when training in fp32; 0: a quarter of the bf16 peak)."""
    memory_efficiency: float = 0.85
    """Fraction of hbm_bandwidth that elementwise kernels (norms, activations, casts) reach."""
    host_bandwidth: float = 32e9
    """Host-to-GPU bandwidth, one direction (bytes/s): PCIe 4.0 x16 32 GB/s, 5.0 x16 64 GB/s."""

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name != "name" and (not isinstance(v, int | float) or v < 0):
                raise MlmError(f"hardware {self.name}: {f.name}={v!r} must be a number >= 0")
        for name in ("peak_bf16", "hbm_bytes", "intra_bandwidth", "inter_bandwidth"):
            if getattr(self, name) <= 0:
                raise MlmError(f"hardware {self.name}: {name} must be positive")
        for name in ("gemm_max", "memory_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise MlmError(f"hardware {self.name}: {name}={getattr(self, name)} must be in (0, 1]")

    def peak(self, precision: str) -> float:
        """Peak FLOP/s for a training precision (fp32 trains on the fp32 rate)."""
        if precision == "fp32":
            return self.peak_fp32 or self.peak_bf16 / 4
        if precision == "fp8":
            return self.peak_fp8 or self.peak_bf16
        return self.peak_bf16

    def efficiency(self, smallest_side: float) -> float:
        """Achievable fraction of peak for a GEMM whose smallest dimension is `smallest_side`."""
        return self.gemm_max * smallest_side / (smallest_side + self.gemm_half)


_GB = 1e9
PROFILES: dict[str, Hardware] = {
    "a100-40g": Hardware(
        "a100-40g", 312e12, 0.0, 40 * _GB, 1555e9, 300e9, 5e-6, 25e9, 10e-6, peak_fp32=156e12
    ),
    "a100-80g": Hardware(
        "a100-80g", 312e12, 0.0, 80 * _GB, 2039e9, 300e9, 5e-6, 25e9, 10e-6, peak_fp32=156e12
    ),
    "h100-80g": Hardware(
        "h100-80g",
        989e12,
        1979e12,
        80 * _GB,
        3350e9,
        450e9,
        5e-6,
        50e9,
        10e-6,
        peak_fp32=494e12,
        host_bandwidth=64e9,
    ),
    "h200": Hardware(
        "h200",
        989e12,
        1979e12,
        141 * _GB,
        4800e9,
        450e9,
        5e-6,
        50e9,
        10e-6,
        peak_fp32=494e12,
        host_bandwidth=64e9,
    ),
    "b200": Hardware(
        "b200",
        2250e12,
        4500e12,
        180 * _GB,
        7700e9,
        900e9,
        5e-6,
        50e9,
        10e-6,
        peak_fp32=1125e12,
        host_bandwidth=64e9,
    ),
}


ALIASES = {"a100": "a100-80g", "h100": "h100-80g"}
"""The short names `logging.hardware` took before it shared these profile names (each has the same
bf16 peak as its profile, so old configs keep their MFU)."""


def profile_name(name: str) -> str:
    """A profile name from a name or an old alias: 'h100' → 'h100-80g'; other names unchanged."""
    return ALIASES.get(name, name)


GPU_NAMES = (
    ("H200", "h200"),
    ("H100", "h100-80g"),
    ("B200", "b200"),
    ("A100-SXM4-40GB", "a100-40g"),
    ("A100", "a100-80g"),
)
"""Parts of the names CUDA reports (`torch.cuda.get_device_name`) and their profiles, first match wins."""


def profile_of_gpu(device_name: str) -> str | None:
    """The profile of a GPU by the name CUDA reports ('NVIDIA H200' → 'h200'), or None."""
    return next((profile for part, profile in GPU_NAMES if part in device_name), None)
