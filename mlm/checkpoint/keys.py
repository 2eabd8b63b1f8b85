"""Names of the optimizer's tensors in a checkpoint: Adam's moments of parameter NAME are
`exp_avg.NAME` and `exp_avg_sq.NAME` (in the `optim` group), whatever the mesh or optimizer
sharding, so a checkpoint holds the optimizer as one process would."""

from __future__ import annotations

MOMENTS = ("exp_avg", "exp_avg_sq")


def moment_key(moment: str, name: str) -> str:
    """("exp_avg", "layers.0.attn.q.weight") → "exp_avg.layers.0.attn.q.weight"."""
    assert moment in MOMENTS, moment
    return f"{moment}.{name}"


def param_of(key: str) -> str:
    """The parameter a checkpoint key belongs to: "exp_avg_sq.embed.weight" → "embed.weight"
    (a weight's own key is returned as it is)."""
    head, _, rest = key.partition(".")
    return rest if head in MOMENTS and rest else key
