"""Key templates: how a foreign format's tensor names map onto mlm's, indexed, split and stacked.

The one name-mapping engine of the interop package: the Hugging Face adapters (`mlm.convert.hf`)
and Megatron's GPTModel names (`mlm.convert.megatron.names`) are tables of it ("HF" below: the
foreign side). A template names a family of keys through the placeholders of `PLACEHOLDERS`; an
HF key may hold a placeholder's value plus an offset (`KeyMap(offsets=...)`: DeepSeek-V3 stores
MTP depth d as `model.layers.{num_layers + d}`), an mlm key holds the value itself. A table maps
each HF template to a `Rule` (its fields are the layout changes on the way), a string or tuple
short for one (one mlm template, or a split into several), or None (the key is dropped):

    "model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight":
        stacked("layers.{layer}.mlp.experts.gate.weight", over="expert", dim=0)
    # per layer, num_experts HF tensors [F, D] ⇄ one mlm tensor [num_experts, F, D]
    "model.layers.{depth}.embed_tokens.weight": copied("embed.weight")
    # DeepSeek-V3's MTP depths store the embedding again: a copy of another template's tensor

Import transposes (or unstacks), then splits, then stacks; export does the reverse. `KeyMap`
applies a table for given placeholder counts; `mlm.convert.hf.engine` checks shapes and streams.
"""

from __future__ import annotations

import itertools
import re
import string
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from mlm.convert.layouts import fuse_grouped, split_grouped
from mlm.errors import MlmError

PLACEHOLDERS = {"layer": "num_layers", "expert": "moe.num_experts", "depth": "mtp_num_layers"}
"""Each placeholder a template may hold → the config field that counts its values."""


@dataclass(frozen=True)
class Rule:
    """What the tensors one Hugging Face template names become in mlm."""

    mlm: tuple[str, ...]
    """The mlm template, or several: the HF tensor is cut along `split_dim` into them, in the sizes
    of the mlm tensors (GPT-2's fused `c_attn` → q, k, v); export concatenates them."""
    transpose: bool = False
    """The HF tensor is stored [in, out] (GPT-2's Conv1D), mlm's `nn.Linear` [out, in]."""
    stack: str | None = None
    """A placeholder of the HF template, not of the mlm one: the HF tensors over all its values are
    stacked, in index order, along `dim` (every index must be present); export indexes them out."""
    dim: int = 0
    """The mlm tensor's dim that `stack` indexes (the foreign tensor's that `unstack` does)."""
    copy: bool = False
    """The HF tensor is another copy of the mlm tensor, which a template without `copy` also names:
    import checks that they are equal and drops it (`mlm.convert.hf.engine`), export writes it. Its
    mlm template may lack placeholders of the HF one."""
    unstack: str | None = None
    """A placeholder of the mlm templates that the foreign template lacks: the foreign tensor holds
    every value of it along `dim` (Megatron's `decoder.layers.<sub>`: all layers on one axis)."""
    split_dim: int = 0
    """The dim of the foreign tensor (of one unstacked slice) that a split cuts."""
    grouped: bool | int = False
    """The split is per group: each group holds its share of every piece in turn (Megatron's
    `linear_qkv`, `mlm.convert.layouts.split_grouped`); True: the KeyMap's KV groups, a number: that
    many groups (Qwen3-Next's per-key-head `in_proj_qkvz`, per-head query and gate)."""

    @property
    def identity(self) -> bool:
        """The tensor converts to itself (no split, transpose, stack, unstack or copy)."""
        plain = self.stack is None and self.unstack is None
        return len(self.mlm) == 1 and not self.transpose and plain and not self.copy


Target = str | tuple[str, ...] | Rule | None
"""A table value: an mlm template, several (split), a Rule, or None (drop the key)."""


def transposed(*mlm: str) -> Rule:
    """The HF tensor is the transpose of the mlm tensor (or of the mlm tensors, concatenated)."""
    return Rule(mlm, transpose=True)


def stacked(mlm: str, over: str = "expert", dim: int = 0) -> Rule:
    """The HF tensors over every value of `over` are one mlm tensor, stacked along `dim`."""
    return Rule((mlm,), stack=over, dim=dim)


def copied(mlm: str) -> Rule:
    """The HF tensor is a copy of the mlm tensor `mlm` (checked and dropped on import, written on export)."""
    return Rule((mlm,), copy=True)


def moved(table: Mapping[str, Target], hf: tuple[str, str], mlm: tuple[str, str]) -> dict[str, Target]:
    """The entries of `table` whose HF template starts with `hf[0]`, that prefix replaced by
    `hf[1]` and each mlm template's prefix `mlm[0]` by `mlm[1]`: a decoder layer's templates
    under another name (DeepSeek-V3's MTP layers: `model.layers.{layer}.` → `model.layers.{depth}.`,
    `layers.{layer}.` → `mtp.{depth}.layer.`)."""

    def move(template: str, old: str, new: str) -> str:
        assert template.startswith(old), f"{template} does not start with {old}"
        return new + template[len(old) :]

    out: dict[str, Target] = {}
    for template, target in table.items():
        if not template.startswith(hf[0]):
            continue
        r = _rule(target)
        out[move(template, *hf)] = None if r is None else replace(r, mlm=tuple(move(m, *mlm) for m in r.mlm))
    return out


def _rule(target: Target) -> Rule | None:
    """A table value as a Rule (None stays None: the key is dropped)."""
    if isinstance(target, str):
        return Rule((target,))
    if isinstance(target, tuple):
        return Rule(target)
    return target


def _fields(template: str) -> list[str]:
    return [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]


def _pattern(template: str) -> re.Pattern:
    parts = [
        re.escape(text) + (f"(?P<{f}>\\d+)" if f is not None else "")
        for text, f, _, _ in string.Formatter().parse(template)
    ]
    return re.compile("".join(parts))


def _rows(shape: torch.Size, r: Rule) -> int:
    """The size of one split piece along the split dim: of the mlm tensor, or of one of its
    stacked slices."""
    rest = [n for d, n in enumerate(shape) if r.stack is None or d != r.dim]
    return rest[r.split_dim]


@dataclass(frozen=True)
class Unit:
    """One conversion step: the HF keys that make the mlm keys, or are made from them."""

    template: str
    """The Hugging Face template."""
    rule: Rule
    hf: tuple[str, ...]
    """The HF key, or one per value of the stacked placeholder, in index order."""
    mlm: tuple[str, ...]
    """The mlm key, or one per piece of a split."""


class KeyMap:
    """An adapter's template table for given placeholder counts, e.g. {"layer": 32}.

    `name` ("Hugging Face llama") starts the error messages, `hint` ends the one about unknown
    keys; `prefix` is one some checkpoints leave out of their keys (GPT-2's `transformer.`);
    `offsets` (placeholder → n) says that a placeholder's value v stands as v + n in Hugging Face
    keys (DeepSeek-V3's `{depth}`: num_layers); `groups`: the KV groups of a `grouped` split."""

    def __init__(
        self,
        table: Mapping[str, Target],
        counts: Mapping[str, int],
        name: str,
        prefix: str = "",
        hint: str = "",
        offsets: Mapping[str, int] | None = None,
        groups: int = 1,
    ):
        self.rules: dict[str, Rule | None] = {}
        for template, target in table.items():
            r = _rule(target)
            fields = _fields(template)
            assert set(fields) <= PLACEHOLDERS.keys() and len(set(fields)) == len(fields), template
            if r is not None:
                inner = set(fields) - {r.stack} | ({r.unstack} - {None})
                assert r.stack is None or r.stack in fields, f"{template}: stacks over {r.stack!r}"
                assert r.unstack is None or (r.unstack not in fields and r.stack is None), template
                assert all(set(_fields(m)) <= inner if r.copy else set(_fields(m)) == inner for m in r.mlm), (
                    f"{template} → {r.mlm}"
                )
                assert not r.copy or (r.stack is None and not r.transpose and len(r.mlm) == 1), template
            self.rules[template] = r
        self.counts, self.name, self.prefix, self.hint = dict(counts), name, prefix, hint
        self.offsets, self.groups = dict(offsets or {}), groups
        self._patterns = [(_pattern(t), t) for t in self.rules]

    def hf_key(self, template: str, index: Mapping[str, int]) -> str:
        """The Hugging Face key of `template` at `index` (offsets added)."""
        return template.format(**{f: i + self.offsets.get(f, 0) for f, i in index.items()})

    def locate(self, key: str) -> tuple[str, dict[str, int], str] | None:
        """(template, placeholder values, key with the prefix) of a Hugging Face key; None if no
        template names it. Where several templates name it (DeepSeek-V3's `model.layers.{layer}.…`
        and `model.layers.{depth}.…`), the first whose values are within the counts."""
        found = self._matches(key)
        within = [f for f in found if not self._beyond(f[1])]
        return (within or found or [None])[0]

    def _matches(self, key: str) -> list[tuple[str, dict[str, int], str]]:
        found = []
        for k in (key, self.prefix + key) if self.prefix and not key.startswith(self.prefix) else (key,):
            for pattern, template in self._patterns:
                m = pattern.fullmatch(k)
                if m is None:
                    continue
                index = {f: int(i) - self.offsets.get(f, 0) for f, i in m.groupdict().items()}
                if all(i >= 0 for i in index.values()):
                    found.append((template, index, k))
        return found

    def _beyond(self, index: Mapping[str, int]) -> list[str]:
        """What in `index` exceeds the counts ([]: nothing)."""
        return [
            f"{f} {i}, but {PLACEHOLDERS[f]}={self.counts[f]}"
            for f, i in index.items()
            if i >= self.counts[f]
        ]

    def unit(self, template: str, index: Mapping[str, int]) -> Unit:
        """The conversion step of `template` at `index` (the stacked placeholder's value is ignored)."""
        r = self.rules[template]
        assert r is not None, template
        if r.stack is None:
            hf = (self.hf_key(template, index),)
        else:
            hf = tuple(self.hf_key(template, {**index, r.stack: i}) for i in range(self.counts[r.stack]))
        values = [{}] if r.unstack is None else [{r.unstack: i} for i in range(self.counts[r.unstack])]
        mlm = tuple(m.format(**index, **v) for v in values for m in r.mlm)
        return Unit(template, r, hf, mlm)

    def units(self) -> Iterator[Unit]:
        """Every conversion step the counts imply: templates in table order, indices ascending."""
        for template, r in self.rules.items():
            if r is None:
                continue
            fields = [f for f in _fields(template) if f != r.stack]
            for values in itertools.product(*(range(self.counts[f]) for f in fields)):
                yield self.unit(template, dict(zip(fields, values, strict=True)))

    def plan(self, keys: Iterable[str]) -> tuple[list[Unit], dict[str, str]]:
        """The steps that convert the stored Hugging Face `keys`, in the order of each step's first
        key, and key with the prefix → key as stored. Dropped keys are left out. MlmError for keys no
        template names, indices beyond the counts, and stacks with members missing."""
        unknown: list[str] = []
        steps: dict[Unit, None] = {}
        stored: dict[str, str] = {}
        for key in keys:
            found = self.locate(key)
            if found is None:
                unknown.append(key)
                continue
            template, index, full = found
            if self._beyond(index):  # beyond the counts however the key is read
                readings = ["; ".join(self._beyond(i)) for _, i, _ in self._matches(key)]
                unknown.append(f"{key} ({'; or '.join(dict.fromkeys(readings))})")
            elif self.rules[template] is not None:
                steps[self.unit(template, index)] = None
                stored[full] = key
        if unknown:
            raise MlmError(
                f"{self.name} state has keys mlm does not know: {', '.join(unknown)}; "
                f"known templates: {', '.join(self.rules)}{self.hint}"
            )
        lacking = [
            f"{k} ({u.rule.stack} {i} of {PLACEHOLDERS[u.rule.stack]}={len(u.hf)}, stacked into {u.mlm[0]})"
            for u in steps
            if u.rule.stack is not None
            for i, k in enumerate(u.hf)
            if k not in stored
        ]
        if lacking:
            raise MlmError(f"{self.name} state lacks {', '.join(lacking)}")
        return list(steps), stored

    def to_mlm(
        self, unit: Unit, hf: Sequence[torch.Tensor], shapes: Mapping[str, torch.Size] | None = None
    ) -> list[tuple[str, torch.Tensor]]:
        """(mlm key, tensor) from the tensors of `unit.hf`, in that order. `shapes` (mlm key →
        shape) gives the sizes of a split. An unchanged tensor is returned as it is (shared memory)."""
        r = unit.rule
        assert len(hf) == len(unit.hf), f"{unit.mlm}: {len(hf)} tensors for {len(unit.hf)} keys"
        if r.unstack is not None:
            values, n = hf[0].unbind(r.dim), len(r.mlm)
            if len(values) * n != len(unit.mlm):
                raise MlmError(
                    f"{self.name} {unit.hf[0]}: {len(values)} along dim {r.dim}, but "
                    f"{PLACEHOLDERS[r.unstack]}={len(unit.mlm) // n}"
                )
            out = []
            for i, v in enumerate(values):
                keys = unit.mlm[i * n : (i + 1) * n]
                out += zip(keys, self._split(v, keys, r, shapes), strict=True)
            return out
        # per HF tensor, its pieces
        pieces = [self._split(t.t().contiguous() if r.transpose else t, unit.mlm, r, shapes) for t in hf]
        if r.stack is None:
            return list(zip(unit.mlm, pieces[0], strict=True))
        return [
            (m, torch.stack(ps, r.dim)) for m, ps in zip(unit.mlm, zip(*pieces, strict=True), strict=True)
        ]

    def to_hf(self, unit: Unit, mlm: Sequence[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        """(HF key, tensor) from the tensors of `unit.mlm`, in that order; the reverse of `to_mlm`."""
        r = unit.rule
        assert len(mlm) == len(unit.mlm), f"{unit.template}: {len(mlm)} tensors for {len(unit.mlm)} keys"
        if r.unstack is not None:
            n = len(r.mlm)
            values = [self._fuse(mlm[i : i + n], r) for i in range(0, len(mlm), n)]
            return [(unit.hf[0], torch.stack(values, r.dim))]
        if r.stack is None:
            per_key = [tuple(mlm)]
        else:
            for m, t in zip(unit.mlm, mlm, strict=True):
                assert t.shape[r.dim] == len(unit.hf), (
                    f"{m}: shape {list(t.shape)}, {len(unit.hf)} along dim {r.dim}"
                )
            per_key = list(zip(*(t.unbind(r.dim) for t in mlm), strict=True))
        fused = [self._fuse(parts, r) for parts in per_key]
        return [(key, t.t() if r.transpose else t) for key, t in zip(unit.hf, fused, strict=True)]

    def _split(
        self, t: torch.Tensor, keys: Sequence[str], r: Rule, shapes: Mapping[str, torch.Size] | None
    ) -> tuple[torch.Tensor, ...]:
        """Foreign tensor `t` cut into the pieces of the mlm `keys` (sizes from `shapes`)."""
        if len(keys) == 1:
            return (t,)
        assert shapes is not None, f"{keys}: a split needs the mlm shapes"
        sizes = [_rows(shapes[m], r) for m in keys]
        return split_grouped(t, sizes, self._groups(r)) if r.grouped else t.split(sizes, r.split_dim)

    def _fuse(self, parts: Sequence[torch.Tensor], r: Rule) -> torch.Tensor:
        """The inverse of `_split`."""
        if len(parts) == 1:
            return parts[0]
        return (
            fuse_grouped(list(parts), self._groups(r)) if r.grouped else torch.cat(list(parts), r.split_dim)
        )

    def _groups(self, r: Rule) -> int:
        """The groups of `r`'s grouped split: its own number, or the KeyMap's KV groups."""
        return self.groups if r.grouped is True else int(r.grouped)
