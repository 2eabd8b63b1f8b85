"""The plain decoder-only transformer (`gpt`), the module kinds its layers are built from
(`layers`), and what is computed from its config (`stats`)."""

from mlm.model.gpt import GPT, Chunk, build_model
from mlm.model.stats import active_parameter_count, flops_per_token, parameter_count, parameter_counts

__all__ = [
    "GPT",
    "Chunk",
    "active_parameter_count",
    "build_model",
    "flops_per_token",
    "parameter_count",
    "parameter_counts",
]
