"""Mamba-2 (`Mamba2ForCausalLM`) ⇄ mlm: every layer an RMSNorm and a Mamba-2 mixer (pattern
`MMM…`, no MLP), an RMSNorm at the end.

HF fuses z | x | B | C | dt into `in_proj` and x | B | C into `conv1d` (`[channels, 1, K]`);
mlm keeps each piece (`in_z` … `in_dt`, `conv_x` … `conv_C`), so import splits them in that
order and export concatenates them. Mamba-2 has no position limit: config.json's
`max_position_embeddings` when present, else 4096 (what `mlm serve` admits; raise it in the
checkpoint's config to serve longer).
"""

from __future__ import annotations

import math

from mlm.config import MambaConfig, ModelConfig
from mlm.convert.hf.adapter import Adapter
from mlm.convert.keymap import Target
from mlm.errors import MlmError

MIXER = "layers.{layer}.attn"
MAMBA_MIXER: dict[str, Target] = {
    "in_proj.weight": tuple(f"{MIXER}.in_{p}.weight" for p in ("z", "x", "B", "C", "dt")),
    "conv1d.weight": tuple(f"{MIXER}.conv_{p}.weight" for p in "xBC"),
    "conv1d.bias": tuple(f"{MIXER}.conv_{p}.bias" for p in "xBC"),
    "dt_bias": f"{MIXER}.dt_bias",
    "A_log": f"{MIXER}.A_log",
    "D": f"{MIXER}.D",
    "norm.weight": f"{MIXER}.norm.weight",
    "out_proj.weight": f"{MIXER}.out.weight",
}
"""A Mamba-2 mixer's keys (after `…mixer.`) → mlm's (Nemotron-H's mixers have the same)."""

KEYS: dict[str, Target] = {
    "backbone.embeddings.weight": "embed.weight",
    "backbone.layers.{layer}.norm.weight": "layers.{layer}.attn_norm.weight",
    **{f"backbone.layers.{{layer}}.mixer.{k}": v for k, v in MAMBA_MIXER.items()},
    "backbone.norm_f.weight": "final_norm.weight",
    "lm_head.weight": "output.weight",
}

DEFAULT_POSITIONS = 4096
INFINITY = {"__float__": "Infinity"}
"""How transformers writes an infinite float to config.json (its `time_step_limit`)."""


def _limit(value, where: str) -> float:
    """A config.json float that may be infinite: a number, "Infinity", or transformers' INFINITY."""
    if isinstance(value, dict) and set(value) == {"__float__"}:
        value = value["__float__"]
    try:
        return float(value)
    except (TypeError, ValueError):
        raise MlmError(f"Hugging Face config {where}={value!r}: expected a number or Infinity") from None


def mamba_from_hf(a: Adapter, c: dict, hidden: int, prefix: str = "") -> MambaConfig:
    """model.mamba from a config.json's Mamba-2 fields (`prefix`: Nemotron-H's `mamba_`)."""
    if not c.get("use_conv_bias", True) or c.get("use_bias", False):
        raise MlmError(
            f"Hugging Face config use_conv_bias={c.get('use_conv_bias')}, use_bias={c.get('use_bias')}: "
            "mlm's Mamba-2 has a convolution bias and no projection biases (use_conv_bias=true, use_bias=false)"
        )
    if c.get("hidden_act", "silu") not in ("silu", "swish") and not prefix:
        raise MlmError(f"Hugging Face config hidden_act={c['hidden_act']!r}: mlm's Mamba-2 uses SiLU")
    limits = c.get("time_step_limit") or (0.0, math.inf)
    lo, hi = (_limit(v, "time_step_limit") for v in limits)
    heads, head_dim = a.get(c, f"{prefix}num_heads"), a.get(c, f"{prefix}head_dim")
    return MambaConfig(
        num_heads=heads,
        head_dim=head_dim,
        state_dim=a.get(c, "ssm_state_size" if prefix else "state_size"),
        num_groups=a.get(c, "n_groups"),
        conv_kernel=a.get(c, "conv_kernel"),
        chunk_size=a.get(c, "chunk_size"),
        dt_min=float(c.get("time_step_min", 0.001)),
        dt_max=float(c.get("time_step_max", 0.1)),
        dt_init_floor=float(c.get("time_step_floor", 1e-4)),
        dt_limit_min=float(lo),
        dt_limit_max=None if math.isinf(hi) else float(hi),
    )


def mamba_to_hf(m: MambaConfig, hidden: int) -> dict:
    """config.json's Mamba-2 fields (Mamba2Config's names) of model.mamba."""
    return {
        "num_heads": m.heads(hidden),
        "head_dim": m.head_dim,
        "state_size": m.state_dim,
        "n_groups": m.num_groups,
        "conv_kernel": m.conv_kernel,
        "chunk_size": m.chunk_size,
        "time_step_min": m.dt_min,
        "time_step_max": m.dt_max,
        "time_step_floor": m.dt_init_floor,
        "time_step_limit": [m.dt_limit_min, INFINITY if m.dt_limit_max is None else m.dt_limit_max],
        "use_conv_bias": True,
        "use_bias": False,
    }


class Mamba2Adapter(Adapter):
    model_type = "mamba2"
    hf_class = "Mamba2ForCausalLM"
    since = "4.44"
    from_hf = KEYS

    def config_from_hf(self, c: dict) -> ModelConfig:
        D, layers = self.get(c, "hidden_size"), self.get(c, "num_hidden_layers")
        mamba = mamba_from_hf(self, c, D)
        expand = c.get("expand", 2)
        if D * expand != mamba.inner(D):
            raise MlmError(
                f"Hugging Face config hidden_size={D} × expand={expand} != num_heads={mamba.num_heads} × "
                f"head_dim={mamba.head_dim}: transformers refuses such a Mamba-2 config too"
            )
        return ModelConfig(
            num_layers=layers,
            hidden_size=D,
            vocab_size=self.get(c, "vocab_size"),
            max_position_embeddings=int(c.get("max_position_embeddings", DEFAULT_POSITIONS)),
            normalization="rmsnorm",
            norm_eps=float(c.get("layer_norm_epsilon", 1e-5)),
            layer_pattern="M" * layers,
            tie_embeddings=bool(c.get("tie_word_embeddings", False)),
            fp32_residual_connection=bool(c.get("residual_in_fp32", True)),
            init_std=float(c.get("initializer_range", 0.1)),
            mamba=mamba,
        )

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        self.require(cfg, dict(normalization="rmsnorm", add_bias=False), mlp=(None,), attention="mamba")
        D = cfg.hidden_size
        return {
            "architectures": [self.hf_class],
            "model_type": self.model_type,
            "vocab_size": cfg.vocab_size,
            "hidden_size": D,
            "num_hidden_layers": cfg.num_layers,
            "expand": cfg.mamba.inner(D) // D,
            **mamba_to_hf(cfg.mamba, D),
            "hidden_act": "silu",
            "layer_norm_epsilon": cfg.norm_eps,
            "residual_in_fp32": cfg.fp32_residual_connection,
            "rescale_prenorm_residual": False,
            "tie_word_embeddings": cfg.tie_embeddings,
            "initializer_range": cfg.init_std,
            "max_position_embeddings": cfg.max_position_embeddings,
        }


MAMBA2 = Mamba2Adapter()
