"""The MTP depth's own parameters and FLOPs (torch-free): enorm and hnorm over the hidden state,
eh_proj [D, 2D] joining them, a final norm, all replicated over tp; the depth's layer is a layer
of the last layer's kinds, which its own specs count (`mlm.plan.memory`, `mlm.flops`)."""

from __future__ import annotations

from mlm.model import kinds
from mlm.model.kinds.spec import Param


def own_params(m, prefix: str) -> tuple[list[Param], list[Param]]:
    """(the parameters before its layer: enorm, hnorm, eh_proj; after it: final_norm) of the depth
    at `prefix` (`mtp.{d}`), in the module's order."""
    norm = kinds.norm(m.normalization)
    before = norm.params(m, f"{prefix}.enorm") + norm.params(m, f"{prefix}.hnorm")
    before.append(
        Param(f"{prefix}.eh_proj.weight", m.hidden_size * 2 * m.hidden_size, linear=True, rows=m.hidden_size)
    )
    return before, norm.params(m, f"{prefix}.final_norm")


def eh_proj_flops(m) -> float:
    """Training FLOPs per token of one depth's eh_proj ([D, 2D]): 6·2·D²."""
    return 6 * 2 * m.hidden_size**2
