"""The suite's own shape (issue 41): test files live in subject folders, no test module is imported
by another (what they share is in `tests.helpers`), and pyproject.toml names no test module."""

from __future__ import annotations

import ast
import tomllib

from tests.helpers.common import ROOT

TESTS = ROOT / "tests"


def test_no_test_module_is_imported_by_another():
    found = []
    for path in sorted([*TESTS.rglob("*.py"), *(ROOT / "bench").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                if name.split(".")[-1].startswith("test_"):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: imports {name}")
    assert not found, "move what tests share into tests/helpers/:\n" + "\n".join(found)


def test_test_files_live_in_subject_folders():
    loose = sorted(p.name for p in TESTS.glob("test_*.py"))
    assert not loose, f"tests/ holds test files outside a subject folder (see tests/README.md): {loose}"
    folders = {p.parent.relative_to(TESTS).parts[0] for p in TESTS.rglob("test_*.py")}
    readme = (TESTS / "README.md").read_text(encoding="utf-8")
    missing = sorted(f for f in folders if f"`{f}/`" not in readme)
    assert not missing, f"tests/README.md does not describe the folders {missing}"


def test_pyproject_names_no_test_module():
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]
    isort = tool["ruff"]["lint"]["isort"]
    assert "known-local-folder" not in isort, isort
    assert not [m for m in isort.get("known-first-party", []) if m.startswith("test_")], isort
