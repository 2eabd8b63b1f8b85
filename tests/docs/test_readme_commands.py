"""The README's two Quick-start commands work on a stock Linux whose Python is PEP 668 managed.

On Debian's own `python3` (also Ubuntu ≥ 23.04, Homebrew) `python3 -m pip install ...` stops at
once with `error: externally-managed-environment`, so the commands must make `.venv` first and
install `just` into it. This reads both commands from README.md (so README and test cannot drift),
checks that `.ci/run` runs the README's test command verbatim, then runs the commands up to their
`just` recipe under a simulated system-managed Python.

The simulation. pip refuses an install when it is not in a virtual environment
(`sys.prefix == sys.base_prefix`) and `sysconfig.get_path("stdlib")/EXTERNALLY-MANAGED` exists
(PEP 668); a venv never counts, and a venv's stdlib is its base interpreter's, so the marker
cannot go there without changing the real install. Instead the test makes a small "system"
Python of its own: a copy of the base interpreter's executable in `sys/bin/` (a copy, since Python
follows a symlinked executable back to its real prefix; ~20 KB when libpython is shared), and a
`sys/lib/pythonX.Y/` that links every entry of the real stdlib except `site-packages` and
`EXTERNALLY-MANAGED`. Python finds its prefix by searching up from its executable for the stdlib
landmark (`lib/pythonX.Y/os.py`), so this one's prefix is `sys/`: it is not a venv, its stdlib dir
is the test's own, and nothing of the real install is written. pip goes into its site-packages
(from ensurepip's wheel, as a distribution's `python3-pip` would), then the `EXTERNALLY-MANAGED`
file, and `sys/bin` comes first on PATH so that `python3` is this Python. The test asserts the
simulation is what it claims (prefix, no venv, its own stdlib dir) and that the old
`python3 -m pip install -q rust-just` fails there with externally-managed-environment, so that it
tests something.

Both commands then run in a temporary folder holding a copy of the Justfile, demo first, then test
on the `.venv` the first one made, each stopping at `.venv/bin/just --dry-run RECIPE`, which parses
the Justfile and prints the recipe without running it. `.venv` must be a venv of the managed
Python, and making it again must keep what was installed in it (a file standing for torch and mlm).
It needs PyPI (for `rust-just`): 11 s on 2 cores with a warm pip cache (31 s when they are busy).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.helpers import docs_text
from tests.helpers.common import ROOT

MARKER = "EXTERNALLY-MANAGED"
# pip options that switch its PEP 668 check off; a user's shell has none of them.
UNSET = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PIP_PREFIX", "PIP_TARGET", "PIP_ROOT")


def readme_commands() -> dict[str, str]:
    """The Quick-start commands (the README's `sh setup` blocks), keyed by their `just` recipe:
    {"demo": ..., "test": ...}."""
    blocks = [b.text.strip() for b in docs_text.blocks(ROOT / "README.md") if b.kind == "setup"]
    commands = {b.split()[-1]: b for b in blocks if "just" in b}
    assert sorted(commands) == ["demo", "test"], f"Quick start code blocks: {blocks}"
    for command in commands.values():
        assert "\n" not in command, f"one line per command: {command!r}"
        assert command.startswith("python3 "), command
    return commands


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert readme_commands()["test"] in ci, ".ci/run must run the README's test command verbatim"
    assert "set -euo pipefail" in ci


def system_python(root: Path) -> Path:
    """A non-venv Python with prefix `root`, sharing the real stdlib by links; returns its bin dir."""
    base = Path(os.path.realpath(getattr(sys, "_base_executable", sys.executable)))
    stdlib = Path(sysconfig.get_path("stdlib"))
    lib = root / stdlib.relative_to(sys.base_prefix)  # root/lib/python3.X
    lib.mkdir(parents=True)
    for entry in stdlib.iterdir():
        if entry.name not in ("site-packages", "__pycache__", MARKER):
            (lib / entry.name).symlink_to(entry)
    for shared in Path(sys.base_prefix, "lib").glob("libpython*"):  # for an $ORIGIN/../lib rpath
        if not (root / "lib" / shared.name).exists():
            (root / "lib" / shared.name).symlink_to(shared)
    bindir = root / "bin"
    bindir.mkdir()
    shutil.copy2(base, bindir / base.name)
    (bindir / "python3").symlink_to(base.name)
    return bindir


def paths(python: str, cwd: Path, env: dict[str, str]) -> dict[str, str]:
    """sys.prefix, sys.base_prefix and the sysconfig paths of `python` as it runs in `env`."""
    probe = "import json, sys, sysconfig; print(json.dumps(dict(sysconfig.get_paths(), prefix=sys.prefix, base_prefix=sys.base_prefix)))"
    r = run(f"{python} -c {shlex.quote(probe)}", cwd, env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def install_pip(cwd: Path, env: dict[str, str]) -> None:
    """pip into the system Python's site-packages, as a distribution's `python3-pip` puts it.

    Unpacking the wheel that ensurepip bundles takes under a second; `python3 -m ensurepip`
    (the fallback, for a Python whose ensurepip keeps its wheels elsewhere, as Debian's does)
    also compiles it, 18 s on 2 busy cores.
    """
    wheels = sorted(Path(sysconfig.get_path("stdlib"), "ensurepip", "_bundled").glob("pip-*.whl"))
    if wheels:
        with zipfile.ZipFile(wheels[-1]) as whl:
            whl.extractall(paths("python3", cwd, env)["purelib"])
    else:
        r = run("python3 -m ensurepip --default-pip", cwd, env)
        assert r.returncode == 0, r.stdout + r.stderr


def run(command: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True)


@pytest.mark.slow
def test_readme_commands_under_a_pep668_python(tmp_path):
    commands = readme_commands()
    root = tmp_path / "sys"
    env = {k: v for k, v in os.environ.items() if k not in UNSET}
    env["PATH"] = f"{system_python(root)}{os.pathsep}{env['PATH']}"
    env["PIP_BREAK_SYSTEM_PACKAGES"] = "0"  # over any pip.conf that would set it

    install_pip(tmp_path, env)
    system = paths("python3", tmp_path, env)
    assert system["prefix"] == system["base_prefix"] == str(root), f"not a system Python of its own: {system}"
    assert Path(system["stdlib"]).parent.parent == root, system["stdlib"]
    (Path(system["stdlib"]) / MARKER).write_text(
        "[externally-managed]\nError=This Python is managed by the system (a test's PEP 668 simulation).\n"
    )
    old = run("python3 -m pip install -q rust-just", tmp_path, env)
    assert old.returncode != 0 and "externally-managed-environment" in old.stderr, old.stdout + old.stderr

    work = tmp_path / "clone"
    work.mkdir()
    shutil.copy2(ROOT / "Justfile", work / "Justfile")
    expect = {"demo": "pipelines/tiny/run.sh", "test": "-m pytest"}
    for recipe in ("demo", "test"):  # the second runs on the .venv the first made
        *setup, last = commands[recipe].split(" && ")
        assert setup, f"README {recipe} command should make .venv and install just before running it"
        r = run(" && ".join(setup), work, env)
        assert r.returncode == 0, f"{' && '.join(setup)}\n{r.stdout}{r.stderr}"
        just, *args = shlex.split(last)
        assert args == [recipe], last
        r = run(shlex.join([just, "--dry-run", *args]), work, env)
        assert r.returncode == 0 and expect[recipe] in r.stdout + r.stderr, r.stdout + r.stderr
        venv = paths(".venv/bin/python", work, env)
        assert venv["base_prefix"] == str(root) != venv["prefix"], (
            f"not a venv of the managed python3: {venv}"
        )
        sentinel = Path(venv["purelib"], "mlm_readme_sentinel.py")  # stands for torch and mlm
        if recipe == "demo":
            sentinel.write_text("")
        else:
            assert sentinel.exists(), "making .venv again dropped what was installed in it"
