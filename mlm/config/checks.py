"""What every config section validates with: `ensure` a rule, `choice` among named values."""

from __future__ import annotations

from mlm.errors import MlmError


def ensure(cond: bool, msg: str) -> None:
    """MlmError(msg) unless `cond` (the configs' and the kinds' specs' validation)."""
    if not cond:
        raise MlmError(msg)


def choice(section: str, name: str, value, choices) -> None:
    ensure(value in choices, f"{section}.{name}={value!r}: must be one of {', '.join(map(str, choices))}")
