"""Qwen3-Next (`Qwen3NextForCausalLM`) ⇄ mlm: Gated DeltaNet layers (`gdn`, `G`) and gated
attention layers (`*`, as `layer_types` says), each with an MLP: Qwen2-MoE's mixture of experts
(softmax top-k, a shared expert scaled by sigmoid(shared_expert_gate x)) or a dense SwiGLU MLP, by
Qwen's decoder_sparse_step / mlp_only_layers rule.

- Every norm of the layers and the final norm computes x̂ · (1 + w) (`model.norm_zero_centered`);
  the Gated DeltaNet's own output norm keeps a plain weight.
- Attention: `q_proj` holds per head [query | gate] (split per head into `attn.q` and `attn.gate`,
  `model.attention_output_gate`), per-head q/k norms, RoPE on the first `partial_rotary_factor` of
  each head's dims (`model.rotary_percent`).
- Gated DeltaNet: `in_proj_qkvz` holds per key head [q | k | v (r heads) | z (r heads)] and
  `in_proj_ba` per key head [b (r) | a (r)] (r value heads per key head; split per key head into
  `in_q`, `in_k`, `in_v`, `in_z` and `in_b`, `in_a`); `conv1d` is q | k | v flat.
"""

from __future__ import annotations

from dataclasses import replace

from mlm.config import GatedDeltaNetConfig, ModelConfig, MoEConfig, RopeConfig
from mlm.convert.hf.llama import DENSE_MLP, rmsnorm_swiglu_fields, rope_parameters
from mlm.convert.hf.moe import ROUTER_RULES, sparse_layers, sparse_layers_to_hf
from mlm.convert.hf.qwen2_moe import QWEN_EXPERTS, QwenMoeAdapter
from mlm.convert.keymap import KeyMap, Rule, Target
from mlm.errors import MlmError

_L, _M = "model.layers.{layer}.", "layers.{layer}."
MIXERS = {"linear_attention": "G", "full_attention": "*"}
"""Qwen3-Next's `layer_types` → pattern symbols."""


def keys(cfg: ModelConfig) -> dict[str, Target]:
    """The key table for `cfg`, layer by layer: a layer's mixer keys are its kind's (both kinds
    name their output projection `attn.out`), and the grouped splits need the head counts."""
    gdn = {
        "in_proj_qkvz.weight": Rule(
            tuple(f"{_M}attn.in_{p}.weight" for p in "qkvz"), grouped=cfg.gdn.num_key_heads
        ),
        "in_proj_ba.weight": Rule(
            (f"{_M}attn.in_b.weight", f"{_M}attn.in_a.weight"), grouped=cfg.gdn.num_key_heads
        ),
        "conv1d.weight": tuple(f"{_M}attn.conv_{p}.weight" for p in "qkv"),
        "A_log": f"{_M}attn.A_log",
        "dt_bias": f"{_M}attn.dt_bias",
        "norm.weight": f"{_M}attn.norm.weight",
        "out_proj.weight": f"{_M}attn.out.weight",
    }
    attention = {
        "q_proj.weight": Rule(
            (f"{_M}attn.q.weight", f"{_M}attn.gate.weight"), grouped=cfg.num_attention_heads
        ),
        "k_proj.weight": f"{_M}attn.k.weight",
        "v_proj.weight": f"{_M}attn.v.weight",
        "o_proj.weight": f"{_M}attn.out.weight",
        "q_norm.weight": f"{_M}attn.q_norm.weight",
        "k_norm.weight": f"{_M}attn.k_norm.weight",
    }
    shared = {
        **{
            f"{_L}mlp.shared_expert.{p}_proj.weight": f"{_M}mlp.shared.{p}.weight"
            for p in ("gate", "up", "down")
        },
        f"{_L}mlp.shared_expert_gate.weight": f"{_M}mlp.shared_gate.weight",
    }
    layer: dict[str, dict[str, Target]] = {
        "gdn": {f"{_L}linear_attn.{k}": v for k, v in gdn.items()},
        "gqa": {f"{_L}self_attn.{k}": v for k, v in attention.items()},
        "dense": DENSE_MLP,
        "moe": {**QWEN_EXPERTS, **shared},
    }
    norms = {f"{_L}input_layernorm.weight": f"{_M}attn_norm.weight"}
    norms[f"{_L}post_attention_layernorm.weight"] = f"{_M}mlp_norm.weight"
    table: dict[str, Target] = {"model.embed_tokens.weight": "embed.weight"}
    for i, spec in enumerate(cfg.layer_specs()):
        for template, target in {**norms, **layer[spec.mixer], **layer[spec.mlp]}.items():
            table[template.replace("{layer}", str(i))] = _at(target, i)
    table |= {"model.norm.weight": "final_norm.weight", "lm_head.weight": "output.weight"}
    return table


def _at(target: Target, i: int) -> Target:
    """`target` with its mlm template's `{layer}` set to `i`."""
    if isinstance(target, str):
        return target.replace("{layer}", str(i))
    if isinstance(target, tuple):
        return tuple(t.replace("{layer}", str(i)) for t in target)
    return replace(target, mlm=tuple(t.replace("{layer}", str(i)) for t in target.mlm))


class Qwen3NextAdapter(QwenMoeAdapter):
    model_type = "qwen3_next"
    hf_class = "Qwen3NextForCausalLM"
    since = "4.57"
    from_hf: dict[str, Target] = {}
    """Built per config (`keymap`): the grouped splits need the head counts."""

    def keymap(self, cfg: ModelConfig) -> KeyMap:
        name = f"Hugging Face {self.model_type}"
        return KeyMap(keys(cfg), self.counts(cfg), name, self.prefix, self.hint)

    def config_from_hf(self, c: dict) -> ModelConfig:
        n = self.get(c, "num_hidden_layers")
        types = c.get("layer_types") or [
            "full_attention" if (i + 1) % c.get("full_attention_interval", 4) == 0 else "linear_attention"
            for i in range(n)
        ]
        unknown = sorted({t for t in types if t not in MIXERS})
        bad = [f"layer_types {unknown}"] if unknown else []
        bad += [f"{k}=true" for k in ("attention_bias",) if c.get(k)]
        if c.get("hidden_act", "silu") != "silu":
            bad.append(f"hidden_act={c['hidden_act']!r}")
        if bad:
            raise MlmError(
                f"Hugging Face qwen3_next config with {', '.join(bad)}: mlm converts Qwen3-Next's linear and "
                "full attention layers without biases, SwiGLU MLPs and experts"
            )
        E = self.num_experts(c)
        flags = sparse_layers(self, c, E)
        flags = [flags] * n if isinstance(flags, int) else flags
        pattern = "".join(MIXERS[t] + ("E" if moe else "-") for t, moe in zip(types, flags, strict=True))
        theta, rope_type, r = rope_parameters(c, 10000.0, None)
        if rope_type != "default":
            raise MlmError(
                f"Hugging Face config rope_type={rope_type!r}: mlm converts Qwen3-Next with rope_type default"
            )
        D, H = self.get(c, "hidden_size"), self.get(c, "num_attention_heads")
        moe = (
            MoEConfig(
                **self.router(c, renormalise=bool(c.get("norm_topk_prob", True))),
                ffn_hidden_size=self.get(c, "moe_intermediate_size"),
                shared_expert_ffn_hidden_size=self.get(c, "shared_expert_intermediate_size") or None,
                shared_expert_gate=True,
            )
            if "E" in pattern
            else MoEConfig()
        )
        return ModelConfig(
            **rmsnorm_swiglu_fields(self, c, eps=1e-6),
            layer_pattern=pattern,
            num_query_groups=c.get("num_key_value_heads") or H,
            kv_channels=ModelConfig.kv_channels_from(D, H, c.get("head_dim")),
            rope=RopeConfig(base=theta),
            rotary_percent=float(r.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))),
            qk_norm=True,
            attention_output_gate=True,
            norm_zero_centered=True,
            attention_dropout=float(c.get("attention_dropout", 0.0)),
            gdn=GatedDeltaNetConfig(
                num_key_heads=self.get(c, "linear_num_key_heads"),
                num_value_heads=self.get(c, "linear_num_value_heads"),
                key_head_dim=self.get(c, "linear_key_head_dim"),
                value_head_dim=self.get(c, "linear_value_head_dim"),
                conv_kernel=self.get(c, "linear_conv_kernel_dim"),
            ),
            moe=moe,
        )

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        kinds = {(s.mixer, s.mlp) for s in cfg.layer_specs()}
        rules = dict(
            normalization="rmsnorm",
            position_embedding="rope",
            activation="swiglu",
            add_bias=False,
            qkv_bias=False,
            qk_norm=True,
            attention_output_gate=True,
            norm_zero_centered=True,
        )
        bad = [
            f"model.{k}={getattr(cfg, k)!r} (needs {v!r})" for k, v in rules.items() if getattr(cfg, k) != v
        ]
        if cfg.rope.scaling_factor is not None:
            bad.append(f"model.rope.scaling_factor={cfg.rope.scaling_factor!r} (needs None)")
        if not kinds <= {(a, b) for a in ("gdn", "gqa") for b in ("dense", "moe")}:
            bad.append(f"layer kinds {sorted(kinds)} (needs gdn or gqa, each with dense or moe)")
        if "moe" in cfg.mlp_kinds():
            need = {**ROUTER_RULES, "moe.shared_expert_gate": True}
            bad += [f"model.{k}={_moe(cfg, k)!r} (needs {v!r})" for k, v in need.items() if _moe(cfg, k) != v]
        if bad:
            raise MlmError(f"this model cannot be written as Hugging Face qwen3_next: {'; '.join(bad)}")
        g, m = cfg.gdn, cfg.moe
        moe = {
            "num_experts": m.num_experts,
            "num_experts_per_tok": m.router_topk,
            "moe_intermediate_size": cfg.expert_ffn_size,
            "shared_expert_intermediate_size": m.shared_expert_ffn_hidden_size or 0,
            "norm_topk_prob": not m.router_pre_softmax,
            "router_aux_loss_coef": m.aux_loss_coeff,
            **sparse_layers_to_hf(cfg),
        }
        return {
            "architectures": [self.hf_class],
            "model_type": self.model_type,
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.ffn_size,
            "num_hidden_layers": cfg.num_layers,
            "layer_types": [
                "linear_attention" if s.mixer == "gdn" else "full_attention" for s in cfg.layer_specs()
            ],
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.query_groups,
            "head_dim": cfg.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": cfg.max_position_embeddings,
            "rms_norm_eps": cfg.norm_eps,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": cfg.rope.base,
                "partial_rotary_factor": cfg.rotary_percent,
            },
            "attention_bias": False,
            "attention_dropout": cfg.attention_dropout,
            "linear_num_key_heads": g.num_key_heads,
            "linear_num_value_heads": g.num_value_heads,
            "linear_key_head_dim": g.key_head_dim,
            "linear_value_head_dim": g.value_head_dim,
            "linear_conv_kernel_dim": g.conv_kernel,
            **moe,
            "tie_word_embeddings": cfg.tie_embeddings,
            "initializer_range": cfg.init_std,
        }


def _moe(cfg: ModelConfig, name: str):
    """`cfg`'s field `moe.x`."""
    return getattr(cfg.moe, name.removeprefix("moe."))


QWEN3_NEXT = Qwen3NextAdapter()
