"""The import graph of `mlm/`: no cycle, and no module imports another module's private name.

Read from the source (the AST), so lazy imports inside functions count too: a cycle that only a
deferred import hides is still a cycle. A package's `__init__` is its own node; importing
`pkg.mod` does not count as importing `pkg`.
"""

import ast
from pathlib import Path

from tests.helpers.common import ROOT

PACKAGE = ROOT / "mlm"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(path: Path, known: set[str]) -> list[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) for each mlm import in `path`."""
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {
        id(n)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and ast.unparse(block.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
        for stmt in block.body
        for n in ast.walk(stmt)
    }
    found = []
    for node in ast.walk(tree):
        if id(node) in typing_only:  # annotations only: never imported at run time
            continue
        if isinstance(node, ast.Import):
            found += [(a.name, None, node.lineno) for a in node.names if a.name.startswith("mlm")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mlm"):
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                if sub in known:  # `from mlm.pkg import mod`: an import of the module
                    found.append((sub, None, node.lineno))
                else:
                    found.append((node.module, a.name, node.lineno))
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {m: {target for target, _, _ in imports(p, set(mods)) if target in mods} for m, p in mods.items()}


def cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `edges` as a path [a, b, …, a], or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle_in_mlm():
    assert cycle(graph()) is None, " → ".join(cycle(graph()))


def test_cycle_finder_finds_a_cycle():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None


def test_no_private_name_imported_across_modules():
    mods = modules()
    offenders = [
        f"{p.relative_to(ROOT)}:{line}: from {target} import {name}"
        for m, p in mods.items()
        for target, name, line in imports(p, set(mods))
        if name is not None and name.startswith("_") and not name.startswith("__") and target != m
    ]
    assert not offenders, "private names imported from another module:\n" + "\n".join(offenders)
