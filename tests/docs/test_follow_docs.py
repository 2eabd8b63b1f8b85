"""A newcomer's path, run for real: the README, then each docs page in reading order, every `sh run`
block as written, in one shell session, in a fresh folder.

The folder holds what a clone has after the README's quick start: `pipelines/` (linked), `.venv`
(the venv running this test, linked) and `runs/tiny/` from `bash pipelines/tiny/run.sh`, the demo
`just demo` runs, shortened to `ITERS` steps. The blocks then run in one bash session whose PATH
lacks the venv, as a new terminal's does: a page that uses `mlm` before telling the reader to
activate the venv fails here (the first trap of issue 41). No page may overwrite what an earlier
one made: the demo's checkpoints keep their step (the fourth trap). About 2-3 minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from tests.helpers.docs_text import ROOT, reading_order
from tests.helpers.docs_text import blocks as page_blocks

ITERS = 20
"""Training steps of the shortened demo (the demo's 300 take about 5 minutes)."""


def _venv(work: Path) -> Path:
    """`.venv` in `work`: the venv running the tests, or, without one, a folder whose
    `bin/activate` puts this Python's scripts on the PATH (what `just setup` would have made)."""
    bindir = Path(sys.executable).parent
    if (bindir / "activate").exists():
        (work / ".venv").symlink_to(bindir.parent)
    else:
        (work / ".venv" / "bin").mkdir(parents=True)
        (work / ".venv" / "bin" / "activate").write_text(f"export PATH={shlex.quote(str(bindir))}:$PATH\n")
    return bindir


def _saved(checkpoints: Path) -> tuple[str, list[str]]:
    """The `latest` pointer of a checkpoint folder and its iteration folders."""
    return (checkpoints / "latest").read_text().strip(), sorted(p.name for p in checkpoints.glob("iter_*"))


def test_follow_the_readme_and_docs_in_order(tmp_path):
    work = tmp_path
    (work / "pipelines").symlink_to(ROOT / "pipelines")
    bindir = _venv(work)
    bare = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    bare["PATH"] = "/usr/local/bin:/usr/bin:/bin"
    demo = subprocess.run(
        ["bash", "pipelines/tiny/run.sh"],
        cwd=work,
        env={**bare, "PATH": f"{bindir}:{bare['PATH']}", "ITERS": str(ITERS)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    checkpoints = work / "runs" / "tiny" / "checkpoints"
    before = _saved(checkpoints)
    assert before[0] == f"iter_{ITERS:07d}", before

    script, where = ["set -euo pipefail"], []
    for page in reading_order():
        for b in page_blocks(page):
            if b.kind == "run":
                where.append(b.where)
                script += [f'echo "::block {b.where} $SECONDS" >&2', b.text]
    assert len(where) >= 10, f"only {len(where)} `sh run` blocks: {where}"
    run = subprocess.run(
        ["bash", "-c", "\n".join(script)], cwd=work, env=bare, capture_output=True, text=True, timeout=900
    )
    marks = [line for line in run.stderr.splitlines() if line.startswith("::block ")]
    last = marks[-1].split()[1] if marks else "(before the first block)"
    assert run.returncode == 0, (
        f"the block at {last} failed (exit {run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-5000:]}"
    )
    assert [m.split()[1] for m in marks] == where
    for m in marks:  # where the time goes (pytest -s shows it)
        print(m)
    assert _saved(checkpoints) == before, "a docs page wrote into the demo's runs/tiny/checkpoints"
    print(json.dumps({"blocks": len(where)}))
