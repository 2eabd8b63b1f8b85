"""What the documentation tests read: the pages in reading order, their fenced blocks and prose.

A fenced block's info string says what it is. Shell blocks are `sh run` (the follow-along test
runs them as written, in page order), `sh check` (each `mlm` command is checked against the CLI:
the subcommand exists and takes every option named) or `sh setup` (the README's set-up commands,
run by tests/docs/test_readme_commands.py on a simulated fresh machine). Everything else is shown,
not run: `text`, `toml`, `json`, `python`, `jinja`.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from tests.helpers.common import ROOT

SHELL_KINDS = ("run", "check", "setup")
SHOWN = ("text", "toml", "json", "python", "jinja", "yaml")
FENCE = re.compile(r"^```(.*)$")


@dataclass(frozen=True)
class Block:
    """One fenced block: its page, first line number (1-based, the fence), info string and text."""

    page: Path
    line: int
    info: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def kind(self) -> str | None:
        """`run`, `check` or `setup` for a shell block, None otherwise."""
        words = self.info.split()
        return words[1] if len(words) == 2 and words[0] == "sh" and words[1] in SHELL_KINDS else None


def reading_order() -> list[Path]:
    """README, docs/index.md, then the pages in the order docs/index.md links them, then any page
    it does not link (tests/docs/test_doc_text.py requires there be none)."""
    index = ROOT / "docs" / "index.md"
    linked = [index]
    for name in re.findall(r"\]\(([\w-]+\.md)\)", index.read_text(encoding="utf-8")):
        if (ROOT / "docs" / name).exists() and (ROOT / "docs" / name) not in linked:
            linked.append(ROOT / "docs" / name)
    rest = [p for p in sorted((ROOT / "docs").glob("*.md")) if p not in linked]
    return [ROOT / "README.md", *linked, *rest]


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of a Markdown page (``` fences; a fence inside a block is its end)."""
    out, start, info, body = [], None, "", []
    for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        m = FENCE.match(line)
        if start is None and m:
            start, info, body = n, m.group(1).strip(), []
        elif start is not None and line.strip() == "```":
            out.append(Block(page, start, info, "\n".join(body)))
            start = None
        elif start is not None:
            body.append(line)
    assert start is None, f"{page.relative_to(ROOT)}:{start}: a code block is never closed"
    return out


def commands(block: Block) -> list[str]:
    """The command lines of a shell block: continuation lines joined, comments and blanks dropped."""
    text = re.sub(r"\\\n\s*", " ", block.text)
    lines = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            lines.append(line)
    return lines


def mlm_argv(line: str) -> list[str] | None:
    """The `mlm` arguments of a command line (`mlm …`, `.venv/bin/mlm …`, `torchrun … -m cli.main …`,
    `python -m cli.main …`), up to a shell operator or comment; None when it runs no mlm command."""
    try:
        words = shlex.split(line, comments=True)
    except ValueError as e:
        raise AssertionError(f"cannot split {line!r}: {e}") from None
    for i, w in enumerate(words):
        if w in ("|", "&&", ";", ">", "2>", "||", "&"):
            words = words[:i]
            break
        if w.endswith(("|", ";")) or w.startswith(">"):
            words = words[:i]
            break
    for i, w in enumerate(words):
        if w == "mlm" or w.endswith("/bin/mlm"):
            return words[i + 1 :]
        if w == "cli.main" and i > 0 and words[i - 1] == "-m":
            return words[i + 1 :]
    return None


def prose_units(text: str) -> list[str]:
    """The prose of a Markdown page: paragraphs and list items, outside code blocks; headings,
    tables and HTML comments left out (a table cell is not a sentence)."""
    out, para, code = [], [], False

    def flush():
        if para:
            out.append(" ".join(para))
            para.clear()

    for line in text.splitlines():
        s = line.strip()
        if s.startswith("```"):
            flush()
            code = not code
            continue
        if code:
            continue
        if not s or s.startswith(("#", "<!--", "|")):
            flush()
            continue
        if re.match(r"^([-*+]|\d+[.)])\s", s):
            flush()
            s = re.sub(r"^([-*+]|\d+[.)])\s+", "", s)
        para.append(s)
    flush()
    return out


def sentences(unit: str) -> list[list[str]]:
    """The sentences of a prose unit as word lists: inline code counts as one word, a link as its
    text; a sentence ends at `.`, `!` or `?` before a space and a capital, digit or quote."""
    unit = re.sub(r"`[^`]*`", "CODE", unit)
    unit = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", unit)
    parts = re.split(r"(?<=[.!?])\s+(?=[A-Z0-9`(\"'*])", unit)
    return [p.split() for p in parts if p.split()]


def words_per_sentence(page: Path) -> tuple[float, int]:
    """A page's average sentence length in words, and its number of sentences."""
    lengths = [len(s) for u in prose_units(page.read_text(encoding="utf-8")) for s in sentences(u)]
    return (sum(lengths) / len(lengths) if lengths else 0.0), len(lengths)
