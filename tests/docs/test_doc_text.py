"""README and docs/ stay readable and true: short pages, short sentences, every shell block marked
(`sh run`, `sh check` or `sh setup`; see tests/helpers/docs_text.py), every `mlm` command in them
one the CLI takes, every `just` recipe one the Justfile has, every link one that resolves.

The sentence measure (tests/helpers/docs_text.py: paragraphs and list items outside code blocks,
headings and tables left out; a sentence ends at `.`, `!` or `?` before a capital) prints its
table with `pytest -s tests/docs/test_doc_text.py -k sentence`.
"""

from __future__ import annotations

import re

import typer

from tests.helpers.docs_text import ROOT, SHOWN, blocks, commands, mlm_argv, reading_order, words_per_sentence

README_LINES = 120
CELL = 120
PAGE_LINES = 400
WORDS = 25
"""The issue's bounds: README under 120 lines, no table cell over 120 characters, no docs page
over 400 lines, fewer than 25 words per sentence on average on each page."""

PAGES = reading_order()
BLOCKS = [b for page in PAGES for b in blocks(page)]


def test_readme_fits_one_screen():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) < README_LINES, f"README.md has {len(lines)} lines; the bound is {README_LINES}"
    cells = [c.strip() for line in lines if line.startswith("|") for c in line.strip("|").split("|")]
    long = [c for c in cells if len(c) > CELL]
    assert not long, f"README.md table cells over {CELL} characters: {long}"


def test_docs_index_lists_every_page():
    index = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    missing = [
        p.name
        for p in sorted((ROOT / "docs").glob("*.md"))
        if p.name != "index.md" and f"]({p.name})" not in index
    ]
    assert not missing, f"docs/index.md must link every page, in reading order; it lacks {missing}"


def test_docs_pages_are_short():
    long = {
        p.name: n for p in PAGES[1:] if (n := len(p.read_text(encoding="utf-8").splitlines())) > PAGE_LINES
    }
    assert not long, f"docs pages over {PAGE_LINES} lines (split them by topic): {long}"


def test_sentences_are_short():
    rows = {p.relative_to(ROOT).as_posix(): words_per_sentence(p) for p in PAGES}
    for name, (words, n) in rows.items():
        print(f"{name:32} {words:5.1f} words per sentence over {n} sentences")
    long = {name: round(w, 1) for name, (w, _) in rows.items() if w >= WORDS}
    assert not long, f"pages averaging {WORDS} words per sentence or more: {long}"


def test_every_block_says_what_it_is():
    bad = [
        f"{b.where}: ```{b.info}"
        for b in BLOCKS
        if b.kind is None and b.info.split()[:1] not in [[s] for s in SHOWN]
    ]
    assert not bad, (
        "each fenced block needs an info string: `sh run`, `sh check` or `sh setup` for commands, "
        f"or one of {SHOWN} for what is shown: {bad}"
    )


def test_setup_blocks_are_the_readme_commands():
    readme = [c for b in BLOCKS if b.kind == "setup" and b.page.name == "README.md" for c in commands(b)]
    assert len(readme) == 2, readme
    for b in BLOCKS:
        if b.kind == "setup":
            extra = [c for c in commands(b) if c not in readme]
            assert not extra, f"{b.where}: set-up commands other than the README's: {extra}"


def _command(argv: list[str], where: str) -> None:
    """Check one `mlm` command line against the CLI: each subcommand exists, each option is taken."""
    from cli.main import app

    cmd, path = typer.main.get_command(app), ["mlm"]
    while hasattr(cmd, "commands") and argv and not argv[0].startswith("-"):
        assert argv[0] in cmd.commands, f"{where}: `{' '.join(path)} {argv[0]}` is not a command"
        cmd, path, argv = cmd.commands[argv[0]], [*path, argv[0]], argv[1:]
    assert not hasattr(cmd, "commands") or "--help" in argv, f"{where}: `{' '.join(path)}` needs a subcommand"
    options = {o for p in cmd.params if p.param_type_name == "option" for o in (*p.opts, *p.secondary_opts)}
    for word in argv:
        if word == "--":
            break
        name = word.split("=", 1)[0]
        if re.fullmatch(r"--[\w-]+|-[A-Za-z]", name) and name != "--help":
            assert name in options, (
                f"{where}: `{' '.join(path)}` takes no option {name} (it takes {sorted(options)})"
            )


def test_commands_in_shell_blocks_are_ones_the_cli_takes():
    checked = 0
    for b in BLOCKS:
        if b.kind in ("run", "check"):
            for line in commands(b):
                if (argv := mlm_argv(line)) is not None:
                    _command(argv, f"{b.where}: {line}")
                    checked += 1
    assert checked > 20, f"only {checked} mlm commands found in the docs' shell blocks"


def test_just_recipes_in_docs_exist():
    justfile = (ROOT / "Justfile").read_text(encoding="utf-8")
    recipes = set(re.findall(r"^([\w-]+)(?:\s[^:=]*)?:(?!=)", justfile, re.M))
    for b in BLOCKS:
        if b.kind is not None:
            for line in commands(b):
                for recipe in re.findall(r"(?:^|[\s/])just ([\w-]+)", line):
                    assert recipe in recipes, (
                        f"{b.where}: `just {recipe}` is not a recipe ({sorted(recipes)})"
                    )


def _anchors(page) -> set[str]:
    """GitHub's anchors for a page's headings."""
    out = set()
    for line in page.read_text(encoding="utf-8").splitlines():
        if m := re.match(r"^#{1,6}\s+(.*)$", line):
            text = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            out.add(text)
    return out


def _links():
    """(where, target) of every relative link in README, docs/ and the pipelines' READMEs, and of
    every docs/ page named in mlm/ and cli/ (help texts and errors point readers there)."""
    pages = [*PAGES, *sorted((ROOT / "pipelines").glob("*/README.md")), ROOT / "tests" / "README.md"]
    for page in pages:
        text = page.read_text(encoding="utf-8")
        text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
        for m in re.finditer(r"\]\(([^)\s]+)\)", text):
            target = m.group(1)
            if not re.match(r"[a-z]+:", target):
                line = text[: m.start()].count("\n") + 1
                yield f"{page.relative_to(ROOT)}:{line}", (page.parent / target.split("#")[0]), target
    for path in sorted([*(ROOT / "mlm").rglob("*.py"), *(ROOT / "cli").rglob("*.py")]):
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for target in re.findall(r"docs/[\w-]+\.md(?:#[\w-]+)?", line):
                yield f"{path.relative_to(ROOT)}:{n}", ROOT / target.split("#")[0], target


def test_links_resolve():
    bad, n = [], 0
    for where, path, target in _links():
        n += 1
        if target.startswith("#"):
            path = ROOT / where.split(":")[0]
        if not path.exists():
            bad.append(f"{where}: link to {target}, which does not exist")
        elif "#" in target and path.suffix == ".md" and target.split("#", 1)[1] not in _anchors(path):
            bad.append(f"{where}: {target}: no heading in {path.name} has this anchor")
    assert n > 50, f"only {n} links found"
    assert not bad, "\n".join(bad)
