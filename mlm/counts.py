"""Parameter counts of a model: the main model, as papers and model cards publish it, and the
multi-token prediction depths apart (DeepSeek-V3: "671B total, 37B active" without its MTP
module, "685B" on Hugging Face with it). Torch-free: `mlm.model.parameter_counts` fills it from
the model built on the meta device, `mlm.plan.memory.parameter_counts` from the planner's
per-rank parameter list (tests check that they agree)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class ParameterCounts:
    """Exact parameter counts, main model and MTP depths apart."""

    total: int
    """The main model: embedding, layers, final norm, output layer."""
    active: int
    """What one token's forward through the main model uses: the total less, in every MoE layer,
    the (E − k)/E share of the routed experts it skips (a dense model's active count is its total)."""
    mtp: int = 0
    """The MTP depths' own parameters (norms, eh_proj, their layer, final norm); they share the
    main model's embedding and output layer, which `total` counts."""
    mtp_active: int = 0
    """What one token's pass through the MTP depths uses of `mtp` (their MoE layers' k experts)."""

    @property
    def built(self) -> int:
        """Every parameter the model holds: the main model and the MTP depths."""
        return self.total + self.mtp

    def describe(self, fmt: Callable[[float], str] = "{:,}".format) -> str:
        """ "total 671.03G, active 37.55G (+ MTP 11.61G, 688.10M active)" with `fmt` for each
        number; just the total for a dense model without MTP."""
        text = (
            f"total {fmt(self.total)}, active {fmt(self.active)}"
            if self.active != self.total
            else fmt(self.total)
        )
        if self.mtp:
            text += f" (+ MTP {fmt(self.mtp)}" + (
                f", {fmt(self.mtp_active)} active)" if self.mtp_active != self.mtp else ")"
            )
        return text
