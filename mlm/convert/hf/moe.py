"""What the mixture-of-experts adapters (Mixtral, Qwen2-MoE, Qwen3-MoE) share: the `{expert}`
count, the router and balancing-loss fields of config.json, and Qwen's rule for which layers have
experts. The field mapping, and why one balancing-loss coefficient weighs differently in mlm and
transformers: docs/hf.md (Mixtures of experts).
"""

from __future__ import annotations

from mlm.config import ModelConfig
from mlm.convert.hf.adapter import Adapter
from mlm.errors import MlmError

ROUTER_RULES = {
    "moe.router_score_function": "softmax",
    "moe.router_num_groups": None,
    "moe.router_topk_scaling_factor": None,
    "moe.router_enable_expert_bias": False,
    "moe.capacity_factor": None,
}
"""What Hugging Face's softmax top-k routers need of `model.moe` (no groups, scaling, expert bias
or token dropping: each changes which experts or weights a token gets)."""


class MoEAdapter(Adapter):
    """An adapter whose templates also take `{expert}`."""

    hint = (
        ". The templates name the experts one by one, as save_pretrained writes them; transformers 5 "
        "holds them fused in memory (mlp.experts.gate_up_proj, mlp.experts.down_proj): convert the "
        "saved files, or a model's mlm.convert.hf.saved_state(model)"
    )

    def counts(self, cfg: ModelConfig) -> dict[str, int]:
        return {"layer": cfg.num_layers, "expert": cfg.moe.num_experts}

    def num_experts(self, c: dict) -> int:
        """config.json's expert count, under either name."""
        for key in ("num_local_experts", "num_experts"):
            if c.get(key) is not None:
                return c[key]
        raise MlmError(
            f"Hugging Face config (model_type {self.model_type!r}) has neither 'num_local_experts' nor "
            "'num_experts'; is it a complete config.json?"
        )

    def router(self, c: dict, renormalise: bool) -> dict:
        """The `model.moe` fields of the router: `renormalise` is norm_topk_prob (Mixtral: true)."""
        return dict(
            num_experts=self.num_experts(c),
            router_topk=self.get(c, "num_experts_per_tok"),
            router_pre_softmax=not renormalise,
            aux_loss_coeff=float(c.get("router_aux_loss_coef", 0.001)),
        )

    def router_to_hf(self, cfg: ModelConfig) -> dict:
        return {
            "num_experts_per_tok": cfg.moe.router_topk,
            "router_aux_loss_coef": cfg.moe.aux_loss_coeff,
            "output_router_logits": False,
        }


def sparse_layers(a: Adapter, c: dict, num_experts: int) -> int | list[int]:
    """`mlp_kind_freq` from Qwen's decoder_sparse_step and mlp_only_layers (1: every layer)."""
    n, step = a.get(c, "num_hidden_layers"), c.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or step < 1:
        raise MlmError(f"Hugging Face config decoder_sparse_step={step!r}: must be a positive integer")
    dense = set(c.get("mlp_only_layers") or [])
    flags = [int(num_experts > 0 and i not in dense and (i + 1) % step == 0) for i in range(n)]
    return 1 if all(flags) else flags


def sparse_layers_to_hf(cfg: ModelConfig) -> dict:
    """decoder_sparse_step and mlp_only_layers that give `cfg`'s MoE layers: the step leaving the
    fewest layers to list (the smallest of those)."""
    moe = {i for i, s in enumerate(cfg.layer_specs()) if s.mlp == "moe"}
    best: tuple[int, list[int]] = (1, sorted(set(range(cfg.num_layers)) - moe))
    for step in range(2, cfg.num_layers + 1):
        picked = {i for i in range(cfg.num_layers) if (i + 1) % step == 0}
        if moe <= picked and len(picked - moe) < len(best[1]):
            best = (step, sorted(picked - moe))
    return {"decoder_sparse_step": best[0], "mlp_only_layers": best[1]}
