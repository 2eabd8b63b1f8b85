"""The norm kinds' specs: parameters and saved bytes (torch-free)."""

from __future__ import annotations

from mlm.model.kinds import register
from mlm.model.kinds.spec import NormSpec, Param


@register
class RMSNormSpec(NormSpec):
    name = "rmsnorm"
    module = "mlm.model.kinds.norms.module:RMSNorm"
    summary = "RMSNorm (Llama)"

    def params(self, m, prefix, size=None):
        return [Param(f"{prefix}.weight", size or m.hidden_size)]

    def saved(self, m, tokens, R):
        """Its input (`kernels.lean`: the backward recomputes the statistic)."""
        return tokens * (m.hidden_size * R)


@register
class LayerNormSpec(NormSpec):
    name = "layernorm"
    module = "mlm.model.kinds.norms.module:LayerNorm"
    summary = "LayerNorm with a bias (GPT-2)"

    def params(self, m, prefix, size=None):
        return [Param(f"{prefix}.{k}", size or m.hidden_size) for k in ("weight", "bias")]

    def saved(self, m, tokens, R):
        """Its input and fp32 mean and rstd (`torch.native_layer_norm`)."""
        return tokens * (m.hidden_size * R + 8)
