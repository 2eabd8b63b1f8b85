"""GPT-2 (`GPT2LMHeadModel`) ⇄ mlm: LayerNorm, GELU, learned positions, biases. Its `Conv1D`
weights are stored [in, out] (`transposed`), and q, k, v fused into `c_attn` (split into three mlm
templates). Original GPT-2 checkpoints name keys without `transformer.` and carry causal-mask buffers.
"""

from __future__ import annotations

from mlm.config import ModelConfig
from mlm.convert.hf.adapter import Adapter
from mlm.convert.keymap import Target, transposed
from mlm.errors import MlmError

_QKV = ("layers.{layer}.attn.q", "layers.{layer}.attn.k", "layers.{layer}.attn.v")
KEYS: dict[str, Target] = {
    "transformer.wte.weight": "embed.weight",
    "transformer.wpe.weight": "pos_embed.weight",
    "transformer.h.{layer}.ln_1.weight": "layers.{layer}.attn_norm.weight",
    "transformer.h.{layer}.ln_1.bias": "layers.{layer}.attn_norm.bias",
    "transformer.h.{layer}.attn.c_attn.weight": transposed(*(f"{k}.weight" for k in _QKV)),
    "transformer.h.{layer}.attn.c_attn.bias": tuple(f"{k}.bias" for k in _QKV),
    "transformer.h.{layer}.attn.c_proj.weight": transposed("layers.{layer}.attn.out.weight"),
    "transformer.h.{layer}.attn.c_proj.bias": "layers.{layer}.attn.out.bias",
    "transformer.h.{layer}.attn.bias": None,  # causal-mask buffers of older checkpoints
    "transformer.h.{layer}.attn.masked_bias": None,
    "transformer.h.{layer}.ln_2.weight": "layers.{layer}.mlp_norm.weight",
    "transformer.h.{layer}.ln_2.bias": "layers.{layer}.mlp_norm.bias",
    "transformer.h.{layer}.mlp.c_fc.weight": transposed("layers.{layer}.mlp.up.weight"),
    "transformer.h.{layer}.mlp.c_fc.bias": "layers.{layer}.mlp.up.bias",
    "transformer.h.{layer}.mlp.c_proj.weight": transposed("layers.{layer}.mlp.down.weight"),
    "transformer.h.{layer}.mlp.c_proj.bias": "layers.{layer}.mlp.down.bias",
    "transformer.ln_f.weight": "final_norm.weight",
    "transformer.ln_f.bias": "final_norm.bias",
    "lm_head.weight": "output.weight",
}

ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
"""Hugging Face activation_function → mlm activation."""


class GPT2Adapter(Adapter):
    model_type = "gpt2"
    hf_class = "GPT2LMHeadModel"
    from_hf = KEYS
    prefix = "transformer."

    def config_from_hf(self, c: dict) -> ModelConfig:
        act = c.get("activation_function", "gelu_new")
        if act not in ACTIVATIONS:
            raise MlmError(
                f"Hugging Face config activation_function={act!r}: mlm converts {', '.join(ACTIVATIONS)}"
            )
        rules = {
            "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False,
            "add_cross_attention": False,
        }
        for key, want in rules.items():
            if c.get(key, want) != want:
                raise MlmError(f"Hugging Face config {key}={c[key]}: mlm's attention needs {key}={want}")
        return ModelConfig(
            num_layers=self.get(c, "n_layer"),
            hidden_size=self.get(c, "n_embd"),
            num_attention_heads=self.get(c, "n_head"),
            ffn_hidden_size=c.get("n_inner"),
            vocab_size=self.get(c, "vocab_size"),
            max_position_embeddings=self.get(c, "n_positions"),
            normalization="layernorm",
            norm_eps=float(c.get("layer_norm_epsilon", 1e-5)),
            position_embedding="learned",
            activation=ACTIVATIONS[act],
            add_bias=True,
            tie_embeddings=bool(c.get("tie_word_embeddings", True)),
            # mlm has one rate for embeddings and residuals; GPT-2's embd_pdrop and resid_pdrop are equal (0.1)
            hidden_dropout=float(c.get("resid_pdrop", 0.1)),
            attention_dropout=float(c.get("attn_pdrop", 0.1)),
            init_std=float(c.get("initializer_range", 0.02)),
        )

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        self.require(
            cfg, dict(normalization="layernorm", position_embedding="learned", add_bias=True, qk_norm=False)
        )
        if cfg.activation not in ("gelu_tanh", "gelu") or cfg.query_groups != cfg.num_attention_heads:
            raise MlmError(
                f"this model cannot be written as Hugging Face gpt2: model.activation={cfg.activation!r} "
                f"(needs 'gelu_tanh' or 'gelu'), model.num_query_groups={cfg.num_query_groups} "
                f"(needs unset or {cfg.num_attention_heads}: GPT-2 has no GQA)"
            )
        return {
            "architectures": [self.hf_class],
            "model_type": self.model_type,
            "vocab_size": cfg.vocab_size,
            "n_embd": cfg.hidden_size,
            "n_layer": cfg.num_layers,
            "n_head": cfg.num_attention_heads,
            "n_positions": cfg.max_position_embeddings,
            "n_inner": cfg.ffn_hidden_size,
            "activation_function": "gelu_new" if cfg.activation == "gelu_tanh" else "gelu",
            "layer_norm_epsilon": cfg.norm_eps,
            "resid_pdrop": cfg.hidden_dropout,
            "embd_pdrop": cfg.hidden_dropout,
            "attn_pdrop": cfg.attention_dropout,
            "initializer_range": cfg.init_std,
            "tie_word_embeddings": cfg.tie_embeddings,
            "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False,
        }


GPT2 = GPT2Adapter()
