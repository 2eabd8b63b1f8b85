"""Layer patterns: Megatron-LM's hybrid layer pattern (`--hybrid-layer-pattern`, formerly
`--hybrid-override-pattern`) read into mlm's layers and printed back.

Megatron builds one layer per symbol: `*` attention, `+` multi-latent attention, `-` dense MLP,
`E` mixture of experts, `M` Mamba, `G` gated delta net (here: whichever kinds are registered, each
spec's `symbol`). mlm's layer is a mixer and the MLP after it (`mlm.model.layers.Block`), so a
mixer symbol starts a layer and an MLP symbol right after it joins that layer: `*-*E` is two
layers (gqa + dense, gqa + moe), `M-M*-` three (Mamba + dense, Mamba alone, gqa + dense), `--` two
MLP-only layers. The numerics are those of one layer per symbol (each half has its own pre-norm
and residual add); the names are mlm's (`layers.{i}.attn`, `layers.{i}.mlp`).

`/` separates the main pattern from its multi-token prediction depths (`main/mtp/mtp`: all
alike, one per depth). `|` (Megatron's pipeline segments) is refused with the way to say the
same thing in mlm (parallel.first_stage_layers, last_stage_layers).
"""

from __future__ import annotations

from mlm.errors import MlmError
from mlm.model.kinds import by_symbol, symbols

Layer = tuple[str | None, str | None]
"""(mixer kind, MLP kind) of one layer; either may be None."""


def _kinds_help() -> str:
    return ", ".join(f"{s} {spec.name}" for s, spec in sorted(symbols().items(), key=lambda kv: kv[1].role))


def parse(text: str, where: str = "model.layer_pattern") -> tuple[list[Layer], int]:
    """`text` → (the main model's layers, MTP depths); MlmError naming the symbol and its position."""
    main, *depths = text.split("/")
    if "|" in text:
        raise MlmError(
            f"{where}={text!r}: '|' (Megatron's pipeline segments) is not read; remove it and give the "
            "first and last stages' layers with parallel.first_stage_layers / parallel.last_stage_layers"
        )
    layers = _layers(main, where, 0)
    if not layers:
        raise MlmError(f"{where}={text!r}: no layers; use symbols {_kinds_help()}, e.g. '*-*-'")
    offset = len(main) + 1
    for depth in depths:
        got = _layers(depth, where, offset)
        if got != layers[-1:]:
            raise MlmError(
                f"{where}={text!r}: the MTP depth {depth!r} after '/' at position {offset} must be one "
                f"layer like the last main layer ({format_pattern(layers[-1:])!r}): mlm's MTP depth "
                "repeats the last layer's kinds (DeepSeek-V3's)"
            )
        offset += len(depth) + 1
    return layers, len(depths)


def _layers(text: str, where: str, offset: int) -> list[Layer]:
    layers: list[list[str | None]] = []
    for i, sym in enumerate(text):
        spec = by_symbol(sym)
        if spec is None:
            at = f"after layer {len(layers) - 1}" if layers else "the first"
            raise MlmError(
                f"{where}: symbol {sym!r} at position {offset + i} ({at}) is not a layer kind; the "
                f"symbols are {_kinds_help()}"
            )
        if spec.role == "mixer":
            layers.append([spec.name, None])
        elif layers and layers[-1][1] is None:  # the MLP after a mixer joins its layer
            layers[-1][1] = spec.name
        else:
            layers.append([None, spec.name])
    return [(a, b) for a, b in layers]


def format_pattern(layers: list[Layer], mtp: int = 0) -> str:
    """The pattern `parse` reads back as `layers` (and `mtp` depths of the last layer's kinds)."""
    by_name = {(spec.role, spec.name): s for s, spec in symbols().items()}

    def sym(role: str, kind: str | None) -> str:
        if kind is None:
            return ""
        if (role, kind) not in by_name:
            raise MlmError(f"{role} kind {kind!r} has no pattern symbol (its spec sets none)")
        return by_name[role, kind]

    text = "".join(sym("mixer", a) + sym("mlp", b) for a, b in layers)
    last = "".join(sym("mixer", a) + sym("mlp", b) for a, b in layers[-1:])
    return text + f"/{last}" * mtp
