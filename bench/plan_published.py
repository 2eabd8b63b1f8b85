"""The planner's time model against published training throughputs: predicted and measured tokens/s
per GPU for every run in tests/data/published_throughput.toml (and its held-back rows), as the
markdown table of docs/plan-validation.md.

    python bench/plan_published.py              # the table (runs, then the holdout)
    python bench/plan_published.py --holdout    # only the held-back check (Narayanan et al. 2021)

No GPU needed: it evaluates the model (`mlm.plan.published`), it does not train.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository's `kernels` package, not bench/kernels.py

from mlm.plan.published import evaluable, family, load_runs, predict  # noqa: E402

DATA = ROOT / "tests" / "data" / "published_throughput.toml"


def table(runs: list[dict]) -> str:
    skipped: list[dict] = []
    lines = [
        "| run | family | GPUs | layout | software | measured tokens/s/GPU | predicted | predicted / measured |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for run in runs:
        if not evaluable(run):
            skipped.append(run)
            continue
        p = predict(run)
        lines.append(
            f"| {run['id']} | {family(run)} | {run['gpus']} | {p.candidate.layout} | {p.job.software.name} | {p.measured:,.0f} | "
            f"{p.predicted:,.0f} | {p.ratio:.3f} |"
        )
    if skipped:
        lines.append("")
        lines.append("Not evaluated:")
        for run in skipped:
            why = run.get("not_evaluated") or f"not published: {', '.join(run.get('unknown', []))}"
            lines.append(f"- {run['id']}: {why}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--holdout", action="store_true", help="only the held-back rows")
    args = ap.parse_args()
    data = load_runs(DATA)
    if not args.holdout:
        print(table(data["run"]))
        print()
    print(table(data.get("holdout", [])))


if __name__ == "__main__":
    main()
