"""The one error type for bad user input.

An `MlmError` message says what is wrong, where (file, line, field) and how to fix it; the CLI
prints it alone (no traceback) and exits with code 2. Internal invariants use `assert`.
`check_version` is the one refusal of an artifact version (dataset, plan, checkpoint).
"""

from collections.abc import Sequence


class MlmError(Exception):
    """Bad input from the user: the message is complete and meant to be read as is."""


def check_version(path: object, found: object, readable: Sequence[object], what: str) -> None:
    """Refuse an artifact version this mlm does not read, naming the file, the version found and
    the versions it reads: `check_version(p, meta.get("format_version"), [1], "format_version")`."""
    if found not in readable:
        versions = "version" if len(readable) == 1 else "versions"
        raise MlmError(f"{path}: {what} {found!r}; this mlm reads {versions} {', '.join(map(str, readable))}")
