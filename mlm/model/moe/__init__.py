"""Mixture of experts: the router (`router`), the stacked experts (`experts`) and the MLP kind
"moe" that joins them (`layer`), registered on import."""

from mlm.model.moe.layer import MoE

__all__ = ["MoE"]
