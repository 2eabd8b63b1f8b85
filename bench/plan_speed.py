"""How long `mlm plan` takes, against its targets, and whether the exhaustive search picks the same plan.

    python bench/plan_speed.py               # the three jobs, each timed twice (the best counts)
    python bench/plan_speed.py --repeat 3
    python bench/plan_speed.py --no-exhaustive

For each job: `mlm plan` in a fresh process, timed in process from the command's call to its
last line (what a user waits for once Python has started: the job, the search, the report), and
the whole command's wall time (Python's start-up and imports included); then the exhaustive search
(`search(job, exhaustive=True)`: every layout sized and timed, no shared terms), its time and
whether its plans are the pruned search's (the chosen plan, the top 10 and every plan that fits).
No GPU needed. Results: bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository's `kernels` package, not bench/kernels.py

from mlm.plan.hardware import load_hardware  # noqa: E402
from mlm.plan.job import make_job  # noqa: E402
from mlm.plan.search import search  # noqa: E402
from mlm.plan.software import load_software  # noqa: E402

CASES = [
    # (name, preset, GPUs, global batch, target seconds in process)
    ("llama3-70b on 512 H100s", "llama3-70b", 512, 1024, 1.0),
    ("llama3-405b on 16,384 H100s", "llama3-405b", 16384, 2048, 2.0),
    ("deepseek-v3 on 1,024 H100s", "deepseek-v3", 1024, 1024, 3.0),
]
"""Each at its preset's sequence (8192; deepseek-v3 4096), 8 GPUs a node, bf16: 8M, 16M (Llama 3's
batch on 16K GPUs) and 4M tokens a step."""

IN_PROCESS = """
import contextlib, io, sys, time
from cli.main import app
args = sys.argv[1:]
with contextlib.redirect_stdout(io.StringIO()) as out:
    start = time.perf_counter()
    try:
        app(args)
    except SystemExit as e:
        assert not e.code, e.code
    seconds = time.perf_counter() - start
print(seconds, "torch" in sys.modules, out.getvalue().splitlines()[0])
"""


def plan_args(preset: str, gpus: int, batch: int) -> list[str]:
    return ["plan", "--preset", preset, "--gpus", str(gpus), "--global-batch", str(batch)]


def in_process(args: list[str]) -> tuple[float, bool, str]:
    """(seconds of the command in process, whether it imported torch, its headline)."""
    r = subprocess.run([sys.executable, "-c", IN_PROCESS, *args], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    seconds, torch, headline = r.stdout.strip().splitlines()[-1].split(" ", 2)
    return float(seconds), torch == "True", headline


def command(args: list[str]) -> float:
    """Wall seconds of `mlm plan ...` as a command."""
    start = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "cli.main", *args], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return time.perf_counter() - start


def exhaustive(preset: str, gpus: int, batch: int) -> tuple[float, bool, str]:
    """(seconds of the exhaustive search, whether its plans are the pruned search's, its chosen plan)."""
    job = make_job(None, [f"preset={preset}"], gpus, 8, load_hardware("h100-80g"), None, batch)
    job = dataclasses.replace(job, software=load_software("auto", job.cfg))  # as `mlm plan` does
    pruned = search(job)
    start = time.perf_counter()
    every = search(job, exhaustive=True)
    seconds = time.perf_counter() - start
    same = [(str(c.layout), c.timing, c.memory) for c in pruned.ranked] == [
        (str(c.layout), c.timing, c.memory) for c in every.ranked
    ]
    return seconds, same and pruned.rejected == every.rejected, str(every.ranked[0].layout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=2, help="times each command runs (the best counts)")
    ap.add_argument("--no-exhaustive", action="store_true", help="skip the exhaustive search")
    args = ap.parse_args()
    print(f"mlm plan, best of {args.repeat} (seconds); targets in process")
    for name, preset, gpus, batch, target in CASES:
        cmd = plan_args(preset, gpus, batch)
        runs = [in_process(cmd) for _ in range(args.repeat)]
        best, torch, headline = min(runs)
        wall = min(command(cmd) for _ in range(args.repeat))
        ok = "met" if best <= target else "MISSED"
        print(f"{name}: `mlm {' '.join(cmd)}`")
        print(f"  {headline.split(', ', 2)[2]}")
        print(
            f"  in process {best:5.2f}  (target <= {target:.1f}: {ok}; runs {', '.join(f'{r[0]:.2f}' for r in runs)})"
        )
        print(f"  command    {wall:5.2f}  (wall, with start-up; torch imported: {'yes' if torch else 'no'})")
        if not args.no_exhaustive:
            seconds, same, chosen = exhaustive(preset, gpus, batch)
            print(
                f"  exhaustive {seconds:5.2f}  (search alone; same plans: {'yes' if same else 'NO'}; chosen {chosen})"
            )


if __name__ == "__main__":
    main()
