"""Key templates: how Hugging Face tensor names map onto mlm's, indexed, split and stacked.

A template names a family of keys through placeholders: `{layer}` (0 … num_layers − 1) and, for
mixture-of-experts models, `{expert}` (0 … num_experts − 1). An adapter's table maps each Hugging
Face template to the mlm template(s) it becomes, or to None (the key is dropped). A value is
a `Rule`, or short for one: a string (one mlm template) or a tuple (several, see `split`).
A rule says which layout changes happen on the way:

- split: several mlm templates: the HF tensor is cut along dim 0 into them, in the sizes of the
  mlm tensors (GPT-2's fused `c_attn` → q, k, v); export concatenates them.
- transpose: the HF tensor is stored [in, out] (GPT-2's `Conv1D`), mlm's `nn.Linear` [out, in].
- stack: a placeholder of the HF template that the mlm template lacks: the HF tensors over all
  its values are stacked, in index order, along a new dim of one mlm tensor; export indexes
  them back out. Every index must be present:

      "model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight":
          stacked("layers.{layer}.mlp.experts.gate.weight", over="expert", dim=0)
      # per layer, num_experts HF tensors [F, D] ⇄ one mlm tensor [num_experts, F, D]

Import transposes, then splits, then stacks; export does the reverse. `KeyMap` applies a table
for given placeholder counts; `mlm.hf.engine` checks shapes against the model and streams.
"""

from __future__ import annotations

import itertools
import re
import string
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from mlm.errors import MlmError

PLACEHOLDERS = {"layer": "num_layers", "expert": "moe.num_experts"}
"""Each placeholder a template may hold → the config field that counts its values."""


@dataclass(frozen=True)
class Rule:
    """What the tensors one Hugging Face template names become in mlm."""

    mlm: tuple[str, ...]
    """The mlm template, or several: the HF tensor is split along dim 0 into them."""
    transpose: bool = False
    """The HF tensor is stored [in, out] (GPT-2's Conv1D)."""
    stack: str | None = None
    """A placeholder of the HF template, not of the mlm one, whose values are stacked along `dim`."""
    dim: int = 0
    """The mlm tensor's dim that `stack` indexes."""

    @property
    def identity(self) -> bool:
        """The tensor converts to itself (no split, transpose or stack)."""
        return len(self.mlm) == 1 and not self.transpose and self.stack is None


Target = str | tuple[str, ...] | Rule | None
"""A table value: an mlm template, several (split), a Rule, or None (drop the key)."""


def transposed(*mlm: str) -> Rule:
    """The HF tensor is the transpose of the mlm tensor (or of the mlm tensors, concatenated)."""
    return Rule(mlm, transpose=True)


def stacked(mlm: str, over: str = "expert", dim: int = 0) -> Rule:
    """The HF tensors over every value of `over` are one mlm tensor, stacked along `dim`."""
    return Rule((mlm,), stack=over, dim=dim)


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
    """The rows of one split piece: dim 0 of the mlm tensor, or of one of its stacked slices."""
    rest = [n for d, n in enumerate(shape) if r.stack is None or d != r.dim]
    return rest[0]


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
    keys; `prefix` is one some checkpoints leave out of their keys (GPT-2's `transformer.`)."""

    def __init__(
        self,
        table: Mapping[str, Target],
        counts: Mapping[str, int],
        name: str,
        prefix: str = "",
        hint: str = "",
    ):
        self.rules: dict[str, Rule | None] = {}
        for template, target in table.items():
            r = _rule(target)
            fields = _fields(template)
            assert set(fields) <= PLACEHOLDERS.keys() and len(set(fields)) == len(fields), template
            if r is not None:
                inner = set(fields) - {r.stack}
                assert r.stack is None or r.stack in fields, f"{template}: stacks over {r.stack!r}"
                assert all(set(_fields(m)) == inner for m in r.mlm), f"{template} → {r.mlm}"
            self.rules[template] = r
        self.counts, self.name, self.prefix, self.hint = dict(counts), name, prefix, hint
        self._patterns = [(_pattern(t), t) for t in self.rules]

    def locate(self, key: str) -> tuple[str, dict[str, int], str] | None:
        """(template, placeholder values, key with the prefix) of a Hugging Face key; None if no template names it."""
        for k in (key, self.prefix + key) if self.prefix and not key.startswith(self.prefix) else (key,):
            for pattern, template in self._patterns:
                m = pattern.fullmatch(k)
                if m is not None:
                    return template, {f: int(i) for f, i in m.groupdict().items()}, k
        return None

    def unit(self, template: str, index: Mapping[str, int]) -> Unit:
        """The conversion step of `template` at `index` (the stacked placeholder's value is ignored)."""
        r = self.rules[template]
        assert r is not None, template
        mlm = tuple(m.format(**index) for m in r.mlm)
        if r.stack is None:
            return Unit(template, r, (template.format(**index),), mlm)
        n = self.counts[r.stack]
        return Unit(template, r, tuple(template.format(**{**index, r.stack: i}) for i in range(n)), mlm)

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
            beyond = [
                f"{f} {i}, but {PLACEHOLDERS[f]}={self.counts[f]}"
                for f, i in index.items()
                if i >= self.counts[f]
            ]
            if beyond:
                unknown.append(f"{key} ({'; '.join(beyond)})")
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
        pieces = []  # per HF tensor, its pieces
        for t in hf:
            if r.transpose:
                t = t.t().contiguous()
            if len(unit.mlm) > 1:
                assert shapes is not None, f"{unit.template}: a split needs the mlm shapes"
                pieces.append(t.split([_rows(shapes[m], r) for m in unit.mlm]))
            else:
                pieces.append((t,))
        if r.stack is None:
            return list(zip(unit.mlm, pieces[0], strict=True))
        return [
            (m, torch.stack(ps, r.dim)) for m, ps in zip(unit.mlm, zip(*pieces, strict=True), strict=True)
        ]

    def to_hf(self, unit: Unit, mlm: Sequence[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        """(HF key, tensor) from the tensors of `unit.mlm`, in that order; the reverse of `to_mlm`."""
        r = unit.rule
        assert len(mlm) == len(unit.mlm), f"{unit.template}: {len(mlm)} tensors for {len(unit.mlm)} keys"
        if r.stack is None:
            per_key = [tuple(mlm)]
        else:
            for m, t in zip(unit.mlm, mlm, strict=True):
                assert t.shape[r.dim] == len(unit.hf), (
                    f"{m}: shape {list(t.shape)}, {len(unit.hf)} along dim {r.dim}"
                )
            per_key = list(zip(*(t.unbind(r.dim) for t in mlm), strict=True))
        out = []
        for key, parts in zip(unit.hf, per_key, strict=True):
            t = torch.cat(parts) if len(parts) > 1 else parts[0]
            out.append((key, t.t() if r.transpose else t))
        return out
