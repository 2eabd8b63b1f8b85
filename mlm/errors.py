"""The one error type for bad user input.

An `MlmError` message says what is wrong, where (file, line, field) and how to fix it; the CLI
prints it alone (no traceback) and exits with code 2. Internal invariants use `assert`.
"""


class MlmError(Exception):
    """Bad input from the user: the message is complete and meant to be read as is."""
