"""Nemotron-H (`NemotronHForCausalLM`) ⇄ mlm: a hybrid of Mamba-2 mixers, attention without
positions, squared-ReLU MLPs and mixtures of squared-ReLU experts, one per block as
`layers_block_type` (or the older `hybrid_override_pattern`) says.

HF has one mixer per block (`backbone.layers.{i}.mixer`, its norm `backbone.layers.{i}.norm`);
mlm's layer is a mixer and the MLP after it (`mlm.model.kinds.pattern`), so the key table is
built per config: block i is layer j's mixer (`attn`, `attn_norm`) or MLP (`mlp`, `mlp_norm`).
The Mamba mixers' keys are Mamba-2's (`mlm.convert.hf.mamba2`). transformers clamps the Mamba
time step at `time_step_min` from below and ignores `time_step_limit`: mlm imports that clamp
(`model.mamba.dt_limit_min = dt_min`). The MoE blocks' router is DeepSeek-V3's (sigmoid scores,
a selection-only correction bias, group-limited top-k, normalised and scaled weights) over
non-gated experts, with one ungated shared expert. Not converted yet: the experts' latent
projections (`moe_latent_size`) and MTP layers.
"""

from __future__ import annotations

from mlm.config import ModelConfig, MoEConfig
from mlm.convert.common import attention_options
from mlm.convert.hf.adapter import Adapter
from mlm.convert.hf.mamba2 import MAMBA_MIXER, mamba_from_hf, mamba_to_hf
from mlm.convert.keymap import KeyMap, Target, stacked
from mlm.errors import MlmError

BLOCK_TYPES = {
    "mamba": "M",
    "linear_attention": "M",
    "attention": "*",
    "full_attention": "*",
    "mlp": "-",
    "moe": "E",
}
"""`layers_block_type` entries (5.x names and the older ones) → pattern symbols."""
SAVED_TYPES = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}

ATTENTION = {
    "q_proj.weight": "attn.q.weight",
    "k_proj.weight": "attn.k.weight",
    "v_proj.weight": "attn.v.weight",
    "o_proj.weight": "attn.out.weight",
}
MLP: dict[str, str] = {"up_proj.weight": "mlp.up.weight", "down_proj.weight": "mlp.down.weight"}
MOE: dict[str, str] = {
    "gate.weight": "mlp.router.weight",
    "gate.e_score_correction_bias": "mlp.router.expert_bias",
    "experts.{expert}.up_proj.weight": "mlp.experts.up.weight",
    "experts.{expert}.down_proj.weight": "mlp.experts.down.weight",
    "shared_experts.up_proj.weight": "mlp.shared.up.weight",
    "shared_experts.down_proj.weight": "mlp.shared.down.weight",
}
"""An MoE block's keys (after `…mixer.`) → mlm's under `layers.N.`; the experts one by one on
disk (`{expert}`), stacked into one mlm tensor each."""


def block_pattern(c: dict) -> str:
    """The blocks as pattern symbols, from `layers_block_type` or `hybrid_override_pattern`."""
    types = c.get("layers_block_type") or c.get("layer_types")
    if types is None and c.get("hybrid_override_pattern"):
        return str(c["hybrid_override_pattern"])
    if not types:
        raise MlmError("Hugging Face config (model_type 'nemotron_h') has no 'layers_block_type'")
    unknown = sorted({t for t in types if t not in BLOCK_TYPES})
    if unknown:
        raise MlmError(
            f"Hugging Face config layers_block_type has {unknown}: mlm reads {', '.join(BLOCK_TYPES)}"
        )
    return "".join(BLOCK_TYPES[t] for t in types)


def block_keys(cfg: ModelConfig) -> dict[str, Target]:
    """HF key → mlm key for every block of `cfg`'s layers, in block order."""
    table: dict[str, Target] = {"backbone.embeddings.weight": "embed.weight"}
    block = 0
    for j, spec in enumerate(cfg.layer_specs()):
        halves = []
        if spec.mixer == "mamba":
            halves.append(("attn_norm", _mamba_keys(j)))
        elif spec.mixer is not None:
            halves.append(("attn_norm", {k: f"layers.{j}.{v}" for k, v in ATTENTION.items()}))
        if spec.mlp == "moe":
            halves.append(("mlp_norm", {k: _moe_target(k, f"layers.{j}.{v}") for k, v in MOE.items()}))
        elif spec.mlp is not None:
            halves.append(("mlp_norm", {k: f"layers.{j}.{v}" for k, v in MLP.items()}))
        for norm, keys in halves:
            table[f"backbone.layers.{block}.norm.weight"] = f"layers.{j}.{norm}.weight"
            for k, v in keys.items():
                table[f"backbone.layers.{block}.mixer.{k}"] = v
            block += 1
    table["backbone.norm_f.weight"] = "final_norm.weight"
    table["lm_head.weight"] = "output.weight"
    return table


def _moe_target(hf: str, mlm: str) -> Target:
    """An MoE key's target: the experts' stacked along dim 0."""
    return stacked(mlm) if "{expert}" in hf else mlm


def _mamba_keys(j: int) -> dict[str, Target]:
    def at(target):
        if isinstance(target, tuple):
            return tuple(t.replace("{layer}", str(j)) for t in target)
        return target.replace("{layer}", str(j))

    return {k: at(v) for k, v in MAMBA_MIXER.items()}


class NemotronHAdapter(Adapter):
    model_type = "nemotron_h"
    hf_class = "NemotronHForCausalLM"
    since = "4.55"
    from_hf: dict[str, Target] = {}
    """Built per config (`keymap`): a block's keys depend on the pattern."""
    float32_keys = ("e_score_correction_bias",)  # selection-only: rounding would change the choice

    def counts(self, cfg: ModelConfig) -> dict[str, int]:
        return {"layer": cfg.num_layers, "expert": cfg.moe.num_experts}

    def keymap(self, cfg: ModelConfig) -> KeyMap:
        return KeyMap(
            block_keys(cfg), self.counts(cfg), f"Hugging Face {self.model_type}", self.prefix, self.hint
        )

    def config_from_hf(self, c: dict) -> ModelConfig:
        pattern = block_pattern(c)
        refused = [
            (c.get("moe_latent_size") is not None, f"moe_latent_size={c.get('moe_latent_size')}"),
            (
                c.get("num_nextn_predict_layers", 0) > 0,
                f"num_nextn_predict_layers={c.get('num_nextn_predict_layers')}",
            ),
            (c.get("attention_bias", False), "attention_bias=true"),
            (c.get("mlp_bias", False), "mlp_bias=true"),
            (c.get("mamba_proj_bias", False), "mamba_proj_bias=true"),
            (c.get("mlp_hidden_act", "relu2") != "relu2", f"mlp_hidden_act={c.get('mlp_hidden_act')!r}"),
            (c.get("mamba_hidden_act", "silu") != "silu", f"mamba_hidden_act={c.get('mamba_hidden_act')!r}"),
            (c.get("sliding_window") is not None, f"sliding_window={c.get('sliding_window')}"),
        ]
        bad = [what for cond, what in refused if cond]
        if bad:
            raise MlmError(
                f"Hugging Face nemotron_h config with {', '.join(bad)}: mlm converts Nemotron-H's Mamba-2, "
                "attention (no biases, no window), squared-ReLU MLP and MoE blocks (no latent projections), "
                "without MTP layers"
            )
        D, H = self.get(c, "hidden_size"), self.get(c, "num_attention_heads")
        mamba = mamba_from_hf(self, c, D, prefix="mamba_")
        mamba.dt_limit_min, mamba.dt_limit_max = mamba.dt_min, None  # transformers' runtime clamp
        from mlm.model.kinds.pattern import parse

        layers, _ = parse(pattern, "Hugging Face layers_block_type")
        return ModelConfig(
            num_layers=len(layers),
            hidden_size=D,
            num_attention_heads=H,
            num_query_groups=c.get("num_key_value_heads") or H,
            kv_channels=ModelConfig.kv_channels_from(D, H, c.get("head_dim")),
            ffn_hidden_size=self.get(c, "intermediate_size"),
            vocab_size=self.get(c, "vocab_size"),
            max_position_embeddings=self.get(c, "max_position_embeddings"),
            normalization="rmsnorm",
            norm_eps=float(c.get("layer_norm_epsilon", 1e-5)),
            position_embedding="none",
            activation="squared_relu",
            layer_pattern=pattern,
            tie_embeddings=bool(c.get("tie_word_embeddings", False)),
            fp32_residual_connection=bool(c.get("residual_in_fp32", False)),
            attention_dropout=float(c.get("attention_dropout", 0.0)),
            init_std=float(c.get("initializer_range", 0.02)),
            mamba=mamba,
            moe=self._router(c) if "E" in pattern else MoEConfig(),
        )

    def _router(self, c: dict) -> MoEConfig:
        """`model.moe` from Nemotron-H's MoE fields: DeepSeek-V3's router (transformers' NemotronHTopkRouter)."""
        k, groups, group_topk = (
            self.get(c, "num_experts_per_tok"),
            c.get("n_group", 1),
            c.get("topk_group", 1),
        )
        bad = []
        if groups > 1 and k != 2 * group_topk:
            bad.append(
                f"num_experts_per_tok={k} with n_group={groups}, topk_group={group_topk}: transformers scores "
                "each group by the sum of its top 2 experts, mlm (as Megatron) by its top "
                "num_experts_per_tok / topk_group; the same groups only when num_experts_per_tok = 2 × topk_group"
            )
        if (k > 1) != bool(c.get("norm_topk_prob", True)):
            bad.append(
                f"norm_topk_prob={c.get('norm_topk_prob', True)} with num_experts_per_tok={k}: mlm's sigmoid "
                "router divides the top-k weights by their sum exactly when k > 1"
            )
        if bad:
            raise MlmError(f"Hugging Face nemotron_h config: {'; '.join(bad)}")
        return MoEConfig(
            num_experts=self.get(c, "n_routed_experts"),
            ffn_hidden_size=self.get(c, "moe_intermediate_size"),
            router_topk=k,
            router_score_function="sigmoid",
            router_enable_expert_bias=True,
            router_num_groups=groups if groups > 1 else None,
            router_group_topk=group_topk if groups > 1 else None,
            router_topk_scaling_factor=float(c.get("routed_scaling_factor", 1.0)),
            shared_expert_ffn_hidden_size=self.get(c, "moe_shared_expert_intermediate_size"),
        )

    def _router_to_hf(self, cfg: ModelConfig) -> tuple[dict, list[str]]:
        """Nemotron-H's MoE fields for `cfg` (none without MoE layers), and what they cannot express."""
        if "moe" not in cfg.mlp_kinds():
            return {}, []
        m = cfg.moe
        need = dict(
            router_score_function="sigmoid",
            router_enable_expert_bias=True,
            capacity_factor=None,
            shared_expert_gate=False,
            aux_loss_coeff=0.0,
            seq_aux_loss_coeff=0.0,
            z_loss_coeff=0.0,
        )
        bad = [
            f"model.moe.{k}={getattr(m, k)!r} (needs {v!r})" for k, v in need.items() if getattr(m, k) != v
        ]
        if not m.shared_expert_ffn_hidden_size:
            bad.append("model.moe.shared_expert_ffn_hidden_size unset (Nemotron-H's MoE has a shared expert)")
        fields = {
            "n_routed_experts": m.num_experts,
            "moe_intermediate_size": cfg.expert_ffn_size,
            "moe_shared_expert_intermediate_size": m.shared_expert_ffn_hidden_size,
            "n_shared_experts": 1,
            "num_experts_per_tok": m.router_topk,
            "n_group": m.router_num_groups or 1,
            "topk_group": m.router_group_topk or 1,
            "norm_topk_prob": m.router_topk > 1,
            "routed_scaling_factor": m.router_topk_scaling_factor or 1.0,
            "moe_latent_size": None,
        }
        return fields, bad

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        m = cfg.mamba
        kinds = {(s.mixer, s.mlp) for s in cfg.layer_specs()}
        allowed = {(a, b) for a in ("mamba", "gqa", None) for b in ("dense", "moe", None)} - {(None, None)}
        rules = dict(
            normalization="rmsnorm", position_embedding="none", activation="squared_relu", add_bias=False
        )
        bad = [
            f"model.{k}={getattr(cfg, k)!r} (needs {v!r})" for k, v in rules.items() if getattr(cfg, k) != v
        ]
        if not kinds <= allowed:
            bad.append(f"layer kinds {sorted(kinds, key=str)} (needs mamba, gqa, dense and moe only)")
        bad += attention_options(cfg)
        if cfg.qkv_bias or cfg.qk_norm or cfg.mtp_num_layers:
            bad.append("q/k/v biases, q/k norms or MTP depths (Nemotron-H has none)")
        if m.dt_limit_min != m.dt_min or m.dt_limit_max is not None:
            bad.append(
                f"model.mamba.dt_limit_min={m.dt_limit_min}, dt_limit_max={m.dt_limit_max} (transformers clamps "
                f"Nemotron-H's time step to [time_step_min, ∞): needs dt_limit_min = dt_min = {m.dt_min}, no max)"
            )
        moe, moe_bad = self._router_to_hf(cfg)
        bad += moe_bad
        if bad:
            raise MlmError(f"this model cannot be written as Hugging Face nemotron_h: {'; '.join(bad)}")
        D = cfg.hidden_size
        mamba = mamba_to_hf(m, D)
        return {
            "architectures": [self.hf_class],
            "model_type": self.model_type,
            "vocab_size": cfg.vocab_size,
            "hidden_size": D,
            "layers_block_type": [SAVED_TYPES[s] for s in cfg.pattern()],
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.query_groups,
            "head_dim": cfg.head_dim,
            "max_position_embeddings": cfg.max_position_embeddings,
            "attention_bias": False,
            "attention_dropout": cfg.attention_dropout,
            "intermediate_size": cfg.ffn_size,
            "mlp_hidden_act": "relu2",
            "mlp_bias": False,
            "mamba_num_heads": mamba["num_heads"],
            "mamba_head_dim": mamba["head_dim"],
            "ssm_state_size": mamba["state_size"],
            "n_groups": mamba["n_groups"],
            "conv_kernel": mamba["conv_kernel"],
            "chunk_size": mamba["chunk_size"],
            "time_step_min": m.dt_min,
            "time_step_max": m.dt_max,
            "time_step_floor": m.dt_init_floor,
            "use_conv_bias": True,
            "mamba_proj_bias": False,
            "use_bias": False,
            "mamba_hidden_act": "silu",
            **moe,
            "num_nextn_predict_layers": 0,
            "layer_norm_epsilon": cfg.norm_eps,
            "residual_in_fp32": cfg.fp32_residual_connection,
            "tie_word_embeddings": cfg.tie_embeddings,
            "initializer_range": cfg.init_std,
        }


NEMOTRON_H = NemotronHAdapter()
