"""The plain decoder-only transformer and what is computed from its config."""

from mlm.model.gpt import GPT, build_model
from mlm.model.stats import flops_per_token, parameter_count

__all__ = ["GPT", "build_model", "flops_per_token", "parameter_count"]
