"""Hardware profiles for the planner: a built-in profile by name (the datasheet table in
`mlm.hardware`, shared with training's MFU) or a custom TOML profile, and the TOML a calibration
writes.

A custom profile is a TOML file with the same keys as `Hardware` (numbers in SI units, bytes
and FLOP/s), optionally starting from a built-in one with `base = "h100-80g"`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from mlm.errors import MlmError
from mlm.fileio import read_toml
from mlm.hardware import PROFILES, Hardware, profile_name


def load_hardware(spec: str) -> Hardware:
    """A built-in profile by name, or a custom TOML profile by path."""
    if profile_name(spec) in PROFILES:
        return PROFILES[profile_name(spec)]
    path = Path(spec)
    if not path.is_file():
        raise MlmError(
            f"--hardware {spec!r}: not a known profile ({', '.join(PROFILES)}) nor a TOML file; "
            "see docs/plan-model.md for the custom profile keys"
        )
    data = read_toml(path)
    base = data.pop("base", None)
    known = {f.name for f in dataclasses.fields(Hardware)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise MlmError(f"{path}: unknown hardware keys {unknown}; known: {sorted(known)}")
    if base is not None:
        if base not in PROFILES:
            raise MlmError(f"{path}: base={base!r} is not a built-in profile ({', '.join(PROFILES)})")
        return dataclasses.replace(PROFILES[base], **{"name": str(path.stem), **data})
    missing = sorted(
        f.name
        for f in dataclasses.fields(Hardware)
        if f.default is dataclasses.MISSING and f.name not in data and f.name != "name"
    )
    if missing:
        raise MlmError(
            f'{path}: missing hardware keys {missing} (or give base = "h100-80g" to start from one)'
        )
    return Hardware(**{"name": str(path.stem), **data})


def hardware_toml(hw: Hardware) -> str:
    """A profile as TOML that `load_hardware` reads back (e.g. after calibration)."""
    lines = []
    for f in dataclasses.fields(hw):
        if f.name != "name":
            lines.append(f"{f.name} = {float(getattr(hw, f.name))!r}")
    return "\n".join(lines) + "\n"
