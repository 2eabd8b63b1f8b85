"""The pipeline bubble measured on real gloo ranks against the formula, 1F1B and interleaved.

    .venv/bin/python bench/pipeline_bubble.py [--f 0.04] [--steps 3]

Each pipeline rank runs mlm's schedule executor (`mlm.parallel.pipeline.Pipeline`: the same
p2p and bookkeeping as training) over stages that only sleep: a forward of a rank's whole model
takes f seconds, a backward 2f, split evenly over its vpp chunks. Sleeping stages need no CPU, so
4 ranks on 2 cores measure the schedule, not core contention. Per rank: idle fraction = 1 − (time
inside its actions) / (step time between barriers), median over --steps steps after a warm-up
step; the table prints the worst rank beside the formula (pp − 1) / (vpp·m + pp − 1) and their
ratio. What the formula leaves out (p2p latency, Python per action) shows up as a ratio above 1.
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # mlm, and tests.helpers

from mlm.parallel.schedules import bubble_fraction  # noqa: E402
from tests.helpers.distributed import run_ranks  # noqa: E402
from tests.helpers.fixed_cost import measure_bubble  # noqa: E402

CASES = [(2, 1, 4), (2, 1, 8), (4, 1, 8), (4, 1, 16), (2, 2, 4), (4, 2, 8), (2, 4, 8)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--f", type=float, default=0.04, help="seconds of one rank's forward (backward: 2f)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per case (median)")
    args = ap.parse_args()
    print(
        f"sleeping stages, forward {args.f * 1e3:.0f} ms / backward {2 * args.f * 1e3:.0f} ms per rank, "
        f"median of {args.steps} steps after 1 warm-up; torch {torch.__version__}, {platform.processor() or '?'}"
    )
    print(f"{'schedule':<12} {'pp':>3} {'vpp':>4} {'m':>4} {'formula':>9} {'measured':>9} {'ratio':>7}")
    for pp, vpp, m in CASES:
        idle = run_ranks(pp, measure_bubble, vpp, m, args.f, args.steps)
        expected = bubble_fraction(pp, m, vpp)
        worst = max(idle)
        name = "1F1B" if vpp == 1 else "interleaved"
        print(f"{name:<12} {pp:>3} {vpp:>4} {m:>4} {expected:>9.1%} {worst:>9.1%} {worst / expected:>6.2f}x")


if __name__ == "__main__":
    main()
