"""The config keys of before the split into nested tables (issue 41), and their spellings now.

`RENAMES` is the one table: a run config (RUN_DIR/config.toml) or a checkpoint manifest written
with the old flat keys loads through `upgrade`, with the same values; a stale key given to
`--set` is refused by `stale_override`, which names the new spelling.
"""

from __future__ import annotations

from mlm.errors import MlmError

_ROPE = (
    "base",
    "scaling_factor",
    "scaling_type",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
    "yarn_beta_fast",
    "yarn_beta_slow",
    "yarn_mscale",
    "yarn_mscale_all_dim",
)
_FP8 = ("recipe", "margin", "amax_history_len", "amax_compute_algo")
_RESILIENCE = (
    "hang_timeout",
    "straggler_window",
    "straggler_threshold",
    "fault_action",
    "loss_spike_zscore",
    "loss_spike_window",
    "skip_iterations",
)

RENAMES: dict[str, str] = {
    **{f"model.rope_{k}": f"model.rope.{k}" for k in _ROPE},
    "train.fp8": "train.fp8.format",  # the old key held the format; now it names the table
    **{f"train.fp8_{k}": f"train.fp8.{k}" for k in _FP8},
    **{f"train.{k}": f"train.resilience.{k}" for k in _RESILIENCE},
}
"""Old dotted key → new dotted key."""


def _get(data: dict, path: list[str]):
    node = data
    for p in path[:-1]:
        node = node.get(p)
        if not isinstance(node, dict):
            return None
    return node


def upgrade(data: dict, where: str = "") -> tuple[dict, list[str]]:
    """(`data`, a run config as a dict, with every old key of `RENAMES` moved to its new place;
    the old keys found). MlmError where a key is given both ways."""
    found = []
    for old, new in RENAMES.items():
        path = old.split(".")
        parent = _get(data, path)
        if parent is None or path[-1] not in parent or isinstance(parent[path[-1]], dict):
            continue  # (train.fp8 as a table is the new spelling)
        if not found:
            data = _copy_tables(data)
            parent = _get(data, path)
        value = parent.pop(path[-1])
        node = data
        *tables, key = new.split(".")
        for t in tables:
            node = node.setdefault(t, {})
        if key in node:
            raise MlmError(
                f"{where or 'config'}: {old} and {new} are both given; {old} is the old spelling of "
                f"{new}: keep only {new}"
            )
        node[key] = value
        found.append(old)
    return data, found


def _copy_tables(data: dict) -> dict:
    return {k: _copy_tables(v) if isinstance(v, dict) else v for k, v in data.items()}


def note(where: str, found: list[str]) -> str:
    """The one line that says which old keys a file was read with."""
    shown = ", ".join(f"{k} → {RENAMES[k]}" for k in found[:2])
    more = f" and {len(found) - 2} more" if len(found) > 2 else ""
    return f"note: {where}: old config keys read as their new spellings ({shown}{more}; mlm.config.legacy)"


def stale_override(keys: list[str], raw: str) -> None:
    """MlmError naming the new spelling when `--set KEYS=RAW` uses an old key."""
    old = ".".join(keys)
    if old in RENAMES:
        new = RENAMES[old]
        raise MlmError(f"--set {old}: this key is now {new}; use --set {new}={raw}")
