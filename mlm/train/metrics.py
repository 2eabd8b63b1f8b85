"""Training metrics: a fixed-width console line, `metrics.jsonl` and TensorBoard.

MFU is model FLOPs (Megatron's count, `mlm.model.flops_per_token`) per second over the peak of
`logging.hardware`: for a GPU the dense bf16 tensor-core peak of its profile in `mlm.hardware` (the
table plan files name), and for `cpu` the fp32 matmul throughput measured on this machine at
start-up (a CPU has no published "peak" to compare to).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from mlm.console import console, human
from mlm.hardware import PROFILES, profile_name


def measured_cpu_flops(n: int = 1536, reps: int = 4) -> float:
    """Best fp32 matmul throughput of `reps` timed n×n×n products (the best, so that a busy
    moment during the measurement does not make MFU look higher than it is)."""
    g = torch.Generator().manual_seed(0)  # never the global RNG: a resumed run must not see a shifted stream
    a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
    a @ b
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def peak_flops(hardware: str) -> float:
    """Peak FLOP/s of one device: a profile's dense bf16 peak (an old alias such as 'h100' names
    its profile), or for `cpu` the measured matmul rate."""
    if hardware == "cpu":
        return measured_cpu_flops()
    return PROFILES[profile_name(hardware)].peak_bf16


def memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


class MetricsLogger:
    """Writes each record to the console, JSONL and TensorBoard (rank 0 only)."""

    def __init__(self, run_dir: str | Path, tensorboard: bool, enabled: bool = True):
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self.jsonl = None
        self.tb = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(self.run_dir / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115 - closed in close()
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.run_dir / "tensorboard"))

    def log(self, step: int, record: dict, prefix: str = "train") -> None:
        if not self.enabled:
            return
        self.jsonl.write(json.dumps({"step": step, "split": prefix, **record}) + "\n")
        if self.tb is not None:
            for k, v in record.items():
                if isinstance(v, int | float):
                    self.tb.add_scalar(f"{prefix}/{k}", v, step)
            self.tb.flush()

    def train_line(self, step: int, total: int, r: dict) -> None:
        if not self.enabled:
            return
        eta = r["eta_s"]
        line = (
            f"step {step:>{len(str(total))}}/{total}  loss {r['loss']:8.4f}  lr {r['lr']:.3e}  "
            f"grad {r['grad_norm']:7.3f}  {human(r['tokens_per_s']):>7} tok/s  MFU {100 * r['mfu']:5.1f}%  "
            f"mem {r['memory_gib']:6.2f} GiB  ETA {int(eta // 60):>3}m{int(eta % 60):02d}s"
        )
        if r.get("skipped"):
            line += f"  skipped {r['skipped']}"
        mtp = [f"{r[k]:.4f}" for k in sorted(r) if k.startswith("mtp_loss.")]
        if mtp:  # multi-token prediction, per depth (not in the loss above)
            line += f"  mtp {' '.join(mtp)}"
        line += expert_load_summary(r)
        console.print(line, highlight=False)

    def close(self) -> None:
        if self.jsonl:
            self.jsonl.close()
        if self.tb:
            self.tb.close()


def expert_load_summary(r: dict) -> str:
    """The console's compact view of MoE load: the worst layer's busiest expert over the mean
    (1.00 is balanced) and the share of token copies dropped; empty without MoE layers."""
    loads = {k.rsplit(".", 1)[1]: v for k, v in r.items() if k.startswith("moe.load_max_mean.")}
    if not loads:
        return ""
    worst = max(loads, key=loads.get)
    dropped = max((v for k, v in r.items() if k.startswith("moe.dropped.")), default=0.0)
    text = f"  moe load max/mean {loads[worst]:.2f} (layer {worst})"
    return text + (f" dropped {100 * dropped:.1f}%" if dropped else "")
