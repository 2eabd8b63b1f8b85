"""Building configs from dicts, TOML files and `--set section.key=value` overrides, and writing
them back as TOML with each field's docstring (`mlm config show`)."""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import sys
import tomllib
import types
import typing
from pathlib import Path

from mlm.config import legacy
from mlm.config.run import Config
from mlm.errors import MlmError


def _field_types(cls) -> dict[str, object]:
    return typing.get_type_hints(cls)


def _convert(where: str, value, tp):
    """Check `value` against the annotation `tp`, converting ints to floats where asked."""
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _convert(where, value, a)
            except MlmError as e:
                errors.append(str(e))
        raise MlmError(errors[0])
    if origin is list:
        (item,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise MlmError(f"{where}={value!r}: expected a list, e.g. {_list_example(where, value, item)}")
        return [_convert(where, v, item) for v in value]
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is str and value is None:  # --set key=none: a str field cannot be unset, so it means "none"
        return "none"
    if tp in (int, float, str, bool) and (type(value) is not tp):
        raise MlmError(f"{where}={value!r}: expected {tp.__name__}, got {type(value).__name__}")
    return value


def _list_example(where: str, value, item) -> str:
    """How to write a list for `where`, with `value` as its item when it is one:
    --set data.data_path="['x']" (in a TOML file: data_path = ['x'])."""
    if item is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if type(value) is not item:
        value = {str: "a", int: 1, float: 0.5, bool: True}.get(item, "a")
    text = f"[{value!r}]" if item is not bool else f"[{str(value).lower()}]"
    return f'--set {where}="{text}" (in a TOML file: {where.rsplit(".", 1)[-1]} = {text})'


def _build(cls, data: dict, where: str):
    if hasattr(cls, "legacy"):
        data = cls.legacy(data)
    hints = _field_types(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f" (did you mean {where}{close[0]}?)" if close else f"; valid keys: {', '.join(names)}"
            raise MlmError(f"unknown config key {where}{key}{hint}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise MlmError(f"{where}{key}: expected a table")
            kwargs[key] = _build(tp, value, f"{where}{key}.")
        else:
            kwargs[key] = _convert(f"{where}{key}", value, tp)
    return cls(**kwargs)


def flat_keys(d: dict, prefix: str = "") -> dict[str, object]:
    """A config dict's values by dotted key (`{"train": {"fp8": {"recipe": x}}}` → `{"train.fp8.recipe": x}`)."""
    out: dict[str, object] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flat_keys(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def parse_override(item: str) -> tuple[list[str], object]:
    """ "train.lr=3e-4" → (["train", "lr"], 3e-4); values are TOML (bare words become strings)."""
    if "=" not in item:
        raise MlmError(f"--set {item!r}: expected section.key=value, e.g. --set train.micro_batch_size=8")
    key, raw = item.split("=", 1)
    raw = raw.strip()
    if raw.lower() in ("none", "null"):
        value = None
    else:
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
    return key.strip().split("."), value


def _merge(base: dict, path: list[str], value) -> None:
    node = base
    for p in path[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise MlmError(f"--set {'.'.join(path)}: {p} is not a section")
    node[path[-1]] = value


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """TOML file (optional) → preset → overrides → validated Config."""
    from mlm.fileio import read_toml
    from mlm.presets import preset_tables

    data: dict = {}
    if path is not None:
        data = read_toml(path, missing="config file not found; check the path given to --config")
        data = _upgraded(data, str(path))
    for item in overrides:
        keys, value = parse_override(item)
        legacy.stale_override(keys, item.split("=", 1)[1].strip())
        _merge(data, keys, value)
    preset = data.get("preset") or ""
    if preset:
        data = _overlay(preset_tables(preset), data)
    return _build(Config, data, "")


def _overlay(base: dict, top: dict) -> dict:
    """`base` with `top`'s keys on it, table by table (a preset under the user's config)."""
    out = dict(base)
    for key, value in top.items():
        both = isinstance(value, dict) and isinstance(base.get(key), dict)
        out[key] = _overlay(base[key], value) if both else value
    return out


def config_from_dict(data: dict, where: str = "") -> Config:
    """A Config from `Config.to_dict()` output (e.g. a checkpoint manifest at `where`), written
    today or before the config's nested tables (`mlm.config.legacy`)."""
    return _build(Config, _upgraded(data, where or "a saved config"), "")


def _upgraded(data: dict, where: str) -> dict:
    """`data` with the old keys of `mlm.config.legacy.RENAMES` at their new places, said once on stderr."""
    data, found = legacy.upgrade(data, where)
    if found:
        print(legacy.note(where, found), file=sys.stderr)
    return data


@functools.cache
def field_docs(cls) -> dict[str, str]:
    """Attribute docstrings of a dataclass: {field: one line}."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for a, b in zip(body, body[1:], strict=False):
        if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
            docs[a.target.id] = " ".join(str(b.value.value).split())  # one line, however written
    return docs


def toml_value(v) -> str:
    """A bool, number, string or list of them as a TOML value."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return repr(v)


def to_toml(cfg: Config, comments: bool = True) -> str:
    """The resolved config as TOML, each value followed by its meaning."""
    lines = []

    def emit(obj, prefix: str) -> None:
        docs = field_docs(type(obj))
        nested = []
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if dataclasses.is_dataclass(v):
                nested.append((f.name, v))
                continue
            text = f"{f.name} = {toml_value(v)}" if v is not None else f"# {f.name} = (unset)"
            if comments and f.name in docs:
                text = f"{text:<44} # {docs[f.name]}"
            lines.append(text)
        for name, v in nested:
            lines.append("")
            lines.append(f"[{prefix}{name}]")
            emit(v, f"{prefix}{name}.")

    emit(cfg, "")
    return "\n".join(lines) + "\n"
