"""DeepSeek-V3 (`DeepseekV3ForCausalLM`, transformers ≥ 4.51) ⇄ mlm: multi-latent attention, the
first `first_k_dense_replace` layers dense and the rest MoE with DeepSeek's sigmoid router and
shared experts, YaRN RoPE, and the MTP depths in DeepSeek's own checkpoint layout (depth d at
`model.layers.{num_hidden_layers + d}`, with copies of the embedding and head). The key and field
tables, and the router configs refused because transformers computes them otherwise: docs/hf.md
(DeepSeek-V3 section); the folder: docs/formats-foreign.md.
"""

from __future__ import annotations

from dataclasses import replace

from mlm.config import MLAConfig, ModelConfig, MoEConfig, RopeConfig
from mlm.convert.hf.adapter import Adapter
from mlm.convert.hf.llama import DENSE_MLP, LLAMA_RULES, rmsnorm_swiglu_fields, rope_parameters
from mlm.convert.hf.moe import MoEAdapter
from mlm.convert.hf.qwen2_moe import QWEN_EXPERTS
from mlm.convert.keymap import Target, copied, moved
from mlm.errors import MlmError

_L, _M = "model.layers.{layer}.", "layers.{layer}."
LAYER_KEYS: dict[str, Target] = {
    _L + "input_layernorm.weight": _M + "attn_norm.weight",
    _L + "self_attn.q_proj.weight": _M + "attn.q.weight",
    _L + "self_attn.q_a_proj.weight": _M + "attn.q_down.weight",
    _L + "self_attn.q_a_layernorm.weight": _M + "attn.q_norm.weight",
    _L + "self_attn.q_b_proj.weight": _M + "attn.q_up.weight",
    _L + "self_attn.kv_a_proj_with_mqa.weight": _M + "attn.kv_down.weight",
    _L + "self_attn.kv_a_layernorm.weight": _M + "attn.kv_norm.weight",
    _L + "self_attn.kv_b_proj.weight": _M + "attn.kv_up.weight",
    _L + "self_attn.o_proj.weight": _M + "attn.out.weight",
    _L + "self_attn.rotary_emb.inv_freq": None,
    _L + "post_attention_layernorm.weight": _M + "mlp_norm.weight",
    **DENSE_MLP,
    **QWEN_EXPERTS,
    _L + "mlp.gate.e_score_correction_bias": _M + "mlp.router.expert_bias",
    **{
        f"{_L}mlp.shared_experts.{p}_proj.weight": f"{_M}mlp.shared.{p}.weight"
        for p in ("gate", "up", "down")
    },
}
"""One decoder layer's keys (dense or MoE)."""

_D = "model.layers.{depth}."
MTP_KEYS: dict[str, Target] = {
    _D + "enorm.weight": "mtp.{depth}.enorm.weight",
    _D + "hnorm.weight": "mtp.{depth}.hnorm.weight",
    _D + "eh_proj.weight": "mtp.{depth}.eh_proj.weight",
    **moved(LAYER_KEYS, (_L, _D), (_M, "mtp.{depth}.layer.")),
    _D + "shared_head.norm.weight": "mtp.{depth}.final_norm.weight",
    _D + "embed_tokens.weight": copied("embed.weight"),
    _D + "shared_head.head.weight": copied("output.weight"),
}
"""MTP depth d, stored at layer index num_hidden_layers + d (the `{depth}` offset)."""

KEYS: dict[str, Target] = {
    "model.embed_tokens.weight": "embed.weight",
    **LAYER_KEYS,
    "model.norm.weight": "final_norm.weight",
    "model.rotary_emb.inv_freq": None,
    "model.rotary_emb.original_inv_freq": None,
    "lm_head.weight": "output.weight",
    **MTP_KEYS,
}

_SHAPES = {
    "self_attn.q_proj.weight": "rows = num_attention_heads {H} × (qk_nope_head_dim {n} + qk_rope_head_dim {r})",
    "self_attn.q_a_proj.weight": "rows = q_lora_rank {q}",
    "self_attn.q_b_proj.weight": "rows = num_attention_heads {H} × (qk_nope_head_dim {n} + qk_rope_head_dim {r}), "
    "columns = q_lora_rank {q}",
    "self_attn.kv_a_proj_with_mqa.weight": "rows = kv_lora_rank {c} + qk_rope_head_dim {r}",
    "self_attn.kv_b_proj.weight": "rows = num_attention_heads {H} × (qk_nope_head_dim {n} + v_head_dim {v}), "
    "columns = kv_lora_rank {c}",
    "self_attn.o_proj.weight": "columns = num_attention_heads {H} × v_head_dim {v}",
}
"""How config.json sizes the MLA tensors, said with a shape mismatch."""
_MLA_DIMS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
"""The MLA widths, named alike in config.json and `model.mla`."""


def yarn_fields(a: Adapter, c: dict) -> dict:
    """`model.rope` (the base and the YaRN fields) from config.json (`rope_parameters`); the defaults
    are transformers' (a missing factor is max_position_embeddings / original_max_position_embeddings,
    missing betas 32 and 1)."""
    whole = "all qk_rope_head_dim dims; only 1.0 (or none) converts"
    theta, rope_type, r = rope_parameters(c, 10000.0, whole)
    if rope_type == "default":
        return dict(rope=RopeConfig(base=theta))
    if rope_type != "yarn":
        raise MlmError(
            f"rope_scaling rope_type={rope_type!r}: mlm's {a.model_type} supports 'default' (none) and 'yarn'"
        )
    if r.get("original_max_position_embeddings") is None:
        raise MlmError(
            "rope_scaling (yarn) lacks original_max_position_embeddings, the context YaRN stretches "
            "(DeepSeek-V3: 4096); add it to rope_scaling in config.json"
        )
    if r.get("attention_factor") is not None:
        raise MlmError(
            f"rope_scaling attention_factor={r['attention_factor']}: mlm derives YaRN's attention factor "
            "from factor, mscale and mscale_all_dim (as DeepSeek-V3's config does); leave it out"
        )
    if r.get("truncate", True) is not True:
        raise MlmError(
            "rope_scaling truncate=false: mlm rounds YaRN's correction range outwards (truncate=true, "
            "DeepSeek's and transformers' default); remove truncate from rope_scaling or set it true"
        )
    old = int(r["original_max_position_embeddings"])
    factor = r.get("factor") or a.get(c, "max_position_embeddings") / old
    m_all = float(r.get("mscale_all_dim") or 0.0)
    # transformers uses mscale only with a nonzero mscale_all_dim (else mscale(factor) alone);
    # mlm's rope does the same, so an unset mscale is mlm's default 1.0 unless that matters
    mscale = float(r.get("mscale") or (0.0 if m_all else 1.0))
    rope = RopeConfig(
        base=theta,
        scaling_factor=float(factor),
        scaling_type="yarn",
        original_max_position_embeddings=old,
        yarn_beta_fast=float(r.get("beta_fast") or 32.0),
        yarn_beta_slow=float(r.get("beta_slow") or 1.0),
        yarn_mscale=mscale,
        yarn_mscale_all_dim=m_all,
    )
    return dict(rope=rope)


def yarn_to_hf(cfg: ModelConfig) -> dict | None:
    """config.json's rope_scaling for `cfg` (None without scaling)."""
    if cfg.rope.scaling_factor is None:
        return None
    return {
        "type": "yarn",  # DeepSeek's own key; transformers reads either
        "rope_type": "yarn",
        "factor": cfg.rope.scaling_factor,
        "original_max_position_embeddings": cfg.rope.original_max_position_embeddings,
        "beta_fast": cfg.rope.yarn_beta_fast,
        "beta_slow": cfg.rope.yarn_beta_slow,
        "mscale": cfg.rope.yarn_mscale,
        "mscale_all_dim": cfg.rope.yarn_mscale_all_dim,
    }


class DeepseekV3Adapter(MoEAdapter):
    model_type = "deepseek_v3"
    hf_class = "DeepseekV3ForCausalLM"
    since = "4.51"
    from_hf = KEYS
    mtp = True
    float32_keys = ("e_score_correction_bias",)  # selection-only: rounding would change the choice
    hint = (
        MoEAdapter.hint + ". MTP depth d is model.layers.{num_hidden_layers + d}.*, "
        "num_nextn_predict_layers of them (config.json)"
    )
    copy_note = (
        "DeepSeek's MTP depths use the main model's embedding and output layer, which mlm holds once "
        "(embed.weight, output.weight), so the copies a checkpoint stores under "
        "model.layers.{num_hidden_layers + d} must equal them (same vocabulary, padding and values); "
        "save the checkpoint with equal copies, or without its MTP layers (remove the "
        "model.layers.{num_hidden_layers + d}.* tensors and set num_nextn_predict_layers to 0)"
    )

    def counts(self, cfg: ModelConfig) -> dict[str, int]:
        return {**super().counts(cfg), "depth": cfg.mtp_num_layers}

    def offsets(self, cfg: ModelConfig) -> dict[str, int]:
        return {"depth": cfg.num_layers}

    def shape_note(self, template: str, cfg: ModelConfig) -> str:
        m = cfg.mla
        sizes = dict(H=cfg.num_attention_heads, n=m.qk_nope_head_dim, r=m.qk_rope_head_dim, v=m.v_head_dim)
        for suffix, note in _SHAPES.items():
            if template.endswith(suffix):
                return note.format(**sizes, c=m.kv_lora_rank, q=m.q_lora_rank)
        return ""

    def config_for_keys(self, cfg: ModelConfig, keys) -> tuple[ModelConfig, str | None]:
        first = f"model.layers.{cfg.num_layers}."
        if not cfg.mtp_num_layers or any(k.startswith(first) for k in keys):
            return cfg, None
        note = (
            f"config.json counts {cfg.mtp_num_layers} MTP depth(s) (num_nextn_predict_layers) but the "
            f"weights hold none (no {first}* tensors: transformers' DeepseekV3ForCausalLM drops them "
            "when it loads and saves)"
        )
        return replace(cfg, mtp_num_layers=0), note

    # ------------------------------------------------------------------ config.json → mlm

    def config_from_hf(self, c: dict) -> ModelConfig:
        if c.get("hidden_act", "silu") != "silu":
            raise MlmError(
                f"Hugging Face config hidden_act={c['hidden_act']!r}: DeepSeek-V3's MLP is SwiGLU; only "
                "'silu' converts (is this a DeepSeek-V3 config.json?)"
            )
        if c.get("attention_bias"):
            raise MlmError(
                "Hugging Face config attention_bias=true: mlm has biases on every linear layer "
                "(add_bias) or none, not on q_a_proj, kv_a_proj_with_mqa and o_proj alone; only "
                "attention_bias=false converts"
            )
        H, N = self.get(c, "num_attention_heads"), self.get(c, "num_hidden_layers")
        if (c.get("num_key_value_heads") or H) != H:
            raise MlmError(
                f"Hugging Face config num_key_value_heads={c['num_key_value_heads']} ≠ "
                f"num_attention_heads={H}: multi-latent attention gives every head its own key and value; "
                "set num_key_value_heads to num_attention_heads (or leave it out)"
            )
        if "q_lora_rank" not in c:
            raise MlmError(
                "Hugging Face config (model_type 'deepseek_v3') has no 'q_lora_rank'; add it: the query "
                "latent's width, or null for none (queries straight from the hidden state)"
            )
        mla = MLAConfig(
            q_lora_rank=c["q_lora_rank"],
            **{k: self.get(c, k) for k in _MLA_DIMS},
            rope_interleave=bool(c.get("rope_interleave", True)),
        )
        dense = c.get("first_k_dense_replace", 3) or 0  # 3: transformers' default
        mtp = int(c.get("num_nextn_predict_layers") or 0)
        if mtp and N - 1 < dense < N + mtp:
            raise MlmError(
                f"Hugging Face config first_k_dense_replace={dense} with num_hidden_layers={N} and "
                f"num_nextn_predict_layers={mtp}: DeepSeek's MTP layers (indices {N}…{N + mtp - 1}) would "
                "mix dense and MoE kinds or differ from the last decoder layer's, whose kind mlm's MTP "
                f"layers take; only first_k_dense_replace < {N} or ≥ {N + mtp} converts"
            )
        return ModelConfig(
            **rmsnorm_swiglu_fields(self, c),
            **yarn_fields(self, c),
            attention_dropout=float(c.get("attention_dropout") or 0.0),
            attention_kind="mla",
            mla=mla,
            mlp_kind="moe" if dense < N else "dense",
            first_k_dense=dense if dense < N else 0,
            mtp_num_layers=mtp,
            moe=self._router(c, moe_layers=dense < N),
        )

    def _router(self, c: dict, moe_layers: bool) -> MoEConfig:
        """`model.moe` from DeepSeek's router fields (refused where transformers computes otherwise,
        checked only when some layer has experts)."""
        E, k = self.get(c, "n_routed_experts"), self.get(c, "num_experts_per_tok")
        groups, group_topk = c.get("n_group", 8) or 1, c.get("topk_group", 4) or 1
        norm, shared = c.get("norm_topk_prob", True), c.get("n_shared_experts", 1) or 0
        bad = []
        if c.get("scoring_func", "sigmoid") != "sigmoid":
            bad.append(f"scoring_func={c['scoring_func']!r}: DeepSeek-V3 scores experts with a sigmoid")
        if c.get("topk_method", "noaux_tc") != "noaux_tc":
            bad.append(
                f"topk_method={c['topk_method']!r}: DeepSeek-V3's router is 'noaux_tc' (bias-corrected, group-limited)"
            )
        if groups > 1 and k != 2 * group_topk:
            bad.append(
                f"num_experts_per_tok={k} with n_group={groups}, topk_group={group_topk}: transformers scores "
                "each group by the sum of its top 2 experts, mlm (as Megatron) by its top "
                "num_experts_per_tok / topk_group; they pick the same groups only when "
                f"num_experts_per_tok = 2 × topk_group (DeepSeek-V3: 8 = 2 × 4), here {k} ≠ {2 * group_topk}"
            )
        if k > 1 and not norm:
            bad.append(
                f"norm_topk_prob=false with num_experts_per_tok={k}: mlm's sigmoid router (Megatron's) "
                "divides the top-k weights by their sum whenever k > 1; only norm_topk_prob=true converts"
            )
        if k == 1 and norm:
            bad.append(
                "norm_topk_prob=true with num_experts_per_tok=1: transformers divides the one weight by "
                "itself (weight 1), mlm keeps its sigmoid score; only norm_topk_prob=false converts"
            )
        if shared < 1:
            bad.append(
                f"n_shared_experts={shared}: mlm's DeepSeek-V3 has at least one shared expert "
                "(transformers builds an empty one for 0)"
            )
        if bad and moe_layers:
            raise MlmError(f"Hugging Face config: {'; '.join(bad)}")
        alpha = float(c.get("aux_loss_alpha") or 0.0)
        seq = bool(c.get("seq_aux", True))
        return MoEConfig(
            num_experts=E,
            ffn_hidden_size=self.get(c, "moe_intermediate_size"),
            router_topk=k,
            router_score_function="sigmoid",
            router_enable_expert_bias=True,
            router_num_groups=groups if groups > 1 else None,
            router_group_topk=group_topk if groups > 1 else None,
            router_topk_scaling_factor=float(c.get("routed_scaling_factor", 2.5)),
            shared_expert_ffn_hidden_size=self.get(c, "moe_intermediate_size") * shared if shared else None,
            seq_aux_loss_coeff=alpha if seq else 0.0,
            aux_loss_coeff=0.0 if seq else alpha,
        )

    # ------------------------------------------------------------------ mlm → config.json

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        kinds = [s.mlp for s in cfg.layer_specs()]
        dense = kinds.index("moe") if "moe" in kinds else cfg.num_layers
        has_moe = dense < cfg.num_layers
        rules = {**LLAMA_RULES, "qkv_bias": False, "qk_norm": False}
        if has_moe:  # DeepSeek's router: sigmoid scores with the expert bias, no token dropping
            rules |= {"moe.router_score_function": "sigmoid", "moe.router_enable_expert_bias": True}
            rules |= {"moe.capacity_factor": None, "moe.shared_expert_gate": False}
        self.require(cfg, rules, mlp=("dense", "moe"), attention="mla")
        m, F = cfg.moe, cfg.expert_ffn_size
        bad = []
        if any(k != "moe" for k in kinds[dense:]):
            bad.append(f"layers {kinds} (needs dense layers first, then only MoE: first_k_dense_replace)")
        if cfg.rope.scaling_factor is not None and cfg.rope.scaling_type != "yarn":
            bad.append(f"model.rope.scaling_type={cfg.rope.scaling_type!r} (needs 'yarn')")
        if has_moe:
            shared = m.shared_expert_ffn_hidden_size
            if not shared or shared % F:
                bad.append(
                    f"model.moe.shared_expert_ffn_hidden_size={shared} (needs a multiple of the experts' "
                    f"width {F}: moe_intermediate_size × n_shared_experts)"
                )
            if m.router_num_groups and m.router_topk != 2 * m.router_group_topk:
                bad.append(
                    f"model.moe.router_topk={m.router_topk} with router_group_topk={m.router_group_topk} "
                    "(needs router_topk = 2 × router_group_topk: transformers scores a group by its top 2)"
                )
            if m.seq_aux_loss_coeff and m.aux_loss_coeff:
                bad.append(
                    "model.moe.seq_aux_loss_coeff and aux_loss_coeff both set (DeepSeek's config has one "
                    "aux_loss_alpha, sequence-wise or not by seq_aux)"
                )
        if bad:
            raise MlmError(
                f"this model cannot be written as Hugging Face {self.model_type}: {'; '.join(bad)}"
            )
        mtp = cfg.mtp_num_layers
        out = {
            "architectures": [self.hf_class],
            "model_type": self.model_type,
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.ffn_size,
            "moe_intermediate_size": F,
            "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_attention_heads,
            "q_lora_rank": cfg.mla.q_lora_rank,
            **{k: getattr(cfg.mla, k) for k in _MLA_DIMS},
            "rope_interleave": cfg.mla.rope_interleave,
            # dense layers first; a model without experts (its MTP layers too) dense throughout
            "first_k_dense_replace": dense if has_moe else cfg.num_layers + mtp,
            "n_routed_experts": m.num_experts,
            "num_experts_per_tok": m.router_topk,
            "n_group": m.router_num_groups or 1,
            "topk_group": m.router_group_topk or 1,
            "routed_scaling_factor": m.router_topk_scaling_factor or 1.0,
            "norm_topk_prob": m.router_topk > 1,
            "n_shared_experts": (m.shared_expert_ffn_hidden_size or 0) // F,
            "scoring_func": "sigmoid",
            "topk_method": "noaux_tc",
            "hidden_act": "silu",
            "max_position_embeddings": cfg.max_position_embeddings,
            "rms_norm_eps": cfg.norm_eps,
            "rope_theta": cfg.rope.base,
            "rope_scaling": yarn_to_hf(cfg),
            "tie_word_embeddings": cfg.tie_embeddings,
            "attention_bias": False,
            "attention_dropout": cfg.attention_dropout,
            "initializer_range": cfg.init_std,
            "num_nextn_predict_layers": mtp,
            "output_router_logits": False,
        }
        if m.seq_aux_loss_coeff or m.aux_loss_coeff:
            out.update(
                aux_loss_alpha=m.seq_aux_loss_coeff or m.aux_loss_coeff, seq_aux=bool(m.seq_aux_loss_coeff)
            )
        return out


DEEPSEEK_V3 = DeepseekV3Adapter()
