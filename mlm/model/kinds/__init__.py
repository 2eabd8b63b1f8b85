"""The layer kinds, one folder each (`<kind>/spec.py` torch-free, `<kind>/module.py` torch), and
their registry (torch-free: the config, the planner and `mlm config show` read it).

A kind registers its spec with `@register`; every folder here is found and its `spec.py` imported
on the first lookup, so a new built-in kind is a new folder and nothing else. A kind defined
elsewhere (a test, a user's package) registers when its file is imported:

    @register
    class SquaredReLUSpec(MLPSpec):
        name, symbol, module = "squared_relu_mlp", "Q", SquaredReLU
        ...

Lookups: `mixer(name)`, `mlp(name)`, `norm(name)`, `by_symbol(symbol)`, `registered(role)`.
"""

from __future__ import annotations

import importlib
import pkgutil

from mlm.errors import MlmError
from mlm.model.kinds.spec import KindSpec, MixerSpec, MLPSpec, NormSpec

ROLES = {"mixer": "model.attention_kind", "mlp": "model.mlp_kind", "norm": "model.normalization"}
"""Each role and the config field that names a kind of it."""

_REGISTRY: dict[str, dict[str, KindSpec]] = {role: {} for role in ROLES}
_SYMBOLS: dict[str, KindSpec] = {}
_found = False


def register(cls: type[KindSpec]) -> type[KindSpec]:
    """Class decorator: register a spec (one instance per kind); a name or symbol taken by another
    kind is an error."""
    spec = cls()
    kinds = _REGISTRY[cls.role]
    old = kinds.get(cls.name)
    if old is not None and type(old).__qualname__ != cls.__qualname__:
        raise MlmError(f"{cls.role} kind {cls.name!r} is registered twice ({type(old)} and {cls})")
    if cls.symbol is not None:
        other = _SYMBOLS.get(cls.symbol)
        if other is not None and other.name != cls.name:
            raise MlmError(
                f"pattern symbol {cls.symbol!r} of kind {cls.name!r} is kind {other.name!r}'s already"
            )
        _SYMBOLS[cls.symbol] = spec
    kinds[cls.name] = spec
    return cls


def _find() -> None:
    """Import every built-in kind's spec (once)."""
    global _found
    if _found:
        return
    _found = True
    for info in pkgutil.iter_modules(__path__):
        if info.ispkg:
            importlib.import_module(f"{__name__}.{info.name}.spec")


def registered(role: str) -> dict[str, KindSpec]:
    """The kinds of `role` ("mixer", "mlp", "norm") by name."""
    _find()
    return _REGISTRY[role]


def lookup(role: str, name: str) -> KindSpec:
    """The spec of kind `name` in `role`; MlmError listing the registered ones."""
    spec = _REGISTRY[role].get(name) if _found else None
    if spec is not None:  # the planner asks this many thousand times per search
        return spec
    kinds = registered(role)
    if name not in kinds:
        raise MlmError(
            f"{ROLES[role]}={name!r} is not a registered {role} kind; registered: {', '.join(sorted(kinds))} "
            "(a new kind registers its spec with mlm.model.kinds.register, see docs/model-kinds.md)"
        )
    return kinds[name]


def mixer(name: str) -> MixerSpec:
    return lookup("mixer", name)


def mlp(name: str) -> MLPSpec:
    return lookup("mlp", name)


def norm(name: str) -> NormSpec:
    return lookup("norm", name)


def by_symbol(symbol: str) -> KindSpec | None:
    """The kind a pattern symbol stands for, or None."""
    _find()
    return _SYMBOLS.get(symbol)


def symbols() -> dict[str, KindSpec]:
    """Every pattern symbol and its kind."""
    _find()
    return dict(_SYMBOLS)
