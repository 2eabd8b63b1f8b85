"""What only some Hugging Face families have, beyond tests/interop/hf/test_hf_adapters.py (DeepSeek-V3's:
tests/interop/hf/test_hf_deepseek.py, which needs a newer transformers).

Dense (Llama, GPT-2, Qwen): Llama-3.1 RoPE scaling bit for bit, GPT-2's original checkpoints (keys
without `transformer.`, mask buffers), transformers 4.x and 5.x config spellings, and bad layer
keys, tied weights that differ, and mlm states that have no Hugging Face form, each refused with
one MlmError naming the key and shapes.

Mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE): the layer rule (decoder_sparse_step,
mlp_only_layers) gives transformers' layers, both ways; transformers 4.x config keys; experts
missing, unknown or misplaced, experts fused as transformers 5 holds them in memory, and mlm
tensors without a Hugging Face name are refused with one MlmError naming the key."""

from __future__ import annotations

import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mlm.convert.hf import config_from_hf, config_to_hf, hf_to_mlm, load_hf_into, mlm_to_hf  # noqa: E402
from mlm.convert.hf.qwen3_moe import QWEN3_MOE  # noqa: E402
from mlm.errors import MlmError  # noqa: E402
from mlm.model.gpt import GPT  # noqa: E402
from mlm.model.rope import inv_frequencies, rope_tables  # noqa: E402
from tests.helpers.hf_models import (  # noqa: E402
    ARCHS,
    LLAMA3_ROPE,
    SEQ,
    gpt2,
    llama,
    mixtral,
    qwen,
    qwen3_moe,
    saved,
)


def test_llama3_rope_scaling_is_exercised():
    hf = llama(tie=False)
    cfg = config_from_hf(hf.config.to_dict())
    assert cfg.rope.scaling_factor == 8.0 and cfg.rope.original_max_position_embeddings == 32
    ours = inv_frequencies(cfg)
    assert torch.equal(ours, hf.model.rotary_emb.inv_freq)
    cos, sin = hf.model.rotary_emb(torch.zeros(1, SEQ, 1), torch.arange(SEQ)[None])
    assert all(map(torch.equal, rope_tables(cfg, SEQ), (cos[0], sin[0])))  # bit for bit
    unscaled = 1.0 / (10000.0 ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim))
    changed = (ours != unscaled).sum().item()
    assert 0 < changed < len(ours)  # some frequencies scaled or smoothed, the highest left alone


def test_gpt2_checkpoint_without_prefix_and_with_mask_buffers():
    """Original GPT-2 checkpoints name keys without `transformer.` and carry `attn.bias` buffers."""
    hf = gpt2(tie=True)
    cfg = config_from_hf(hf.config.to_dict())
    old = {k.removeprefix("transformer."): v for k, v in hf.state_dict().items()}
    old["h.0.attn.bias"] = torch.ones(1, 1, 128, 128)
    old["h.1.attn.masked_bias"] = torch.tensor(-1e4)
    new = hf_to_mlm(hf.state_dict(), cfg)
    assert all(torch.equal(v, new[k]) for k, v in hf_to_mlm(old, cfg).items())


def test_transformers_4x_and_5x_config_shapes_agree():
    d5 = llama(tie=False).config.to_dict()
    assert "rope_parameters" in d5
    d4 = {k: v for k, v in d5.items() if k != "rope_parameters"}
    d4.update(rope_theta=10000.0, rope_scaling={**LLAMA3_ROPE, "type": "llama3"})
    del d4["rope_scaling"]["rope_type"]
    assert config_from_hf(d4) == config_from_hf(d5)
    plain = dict(d4, rope_scaling=None, rope_theta=500000.0)
    cfg = config_from_hf(plain)
    assert cfg.rope.scaling_factor is None and cfg.rope.base == 500000.0


def test_qwen3_config_keeps_its_head_dim():
    """(Its export as qwen2 is refused: test_hf_adapters.py's EXPORT_REFUSALS.)"""
    cfg = config_from_hf(qwen(3, tie=False).config.to_dict())
    assert config_to_hf(cfg, "qwen3")["head_dim"] == 32


# ---------------------------------------------------------------- bad input


def test_unknown_missing_and_extra_layer_keys():
    hf = llama(tie=False)
    cfg = config_from_hf(hf.config.to_dict())
    state = dict(hf.state_dict())
    with pytest.raises(MlmError, match=r"model\.layers\.0\.self_attn\.foo\.weight"):
        hf_to_mlm({**state, "model.layers.0.self_attn.foo.weight": torch.zeros(1)}, cfg)
    extra = {**state, "model.layers.2.mlp.up_proj.weight": state["model.layers.1.mlp.up_proj.weight"]}
    with pytest.raises(MlmError, match=r"layer 2, but num_layers=2"):
        hf_to_mlm(extra, cfg)
    del state["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(MlmError, match=r"lacks model\.layers\.1\.mlp\.up_proj\.weight"):
        hf_to_mlm(state, cfg)


def test_tied_config_with_untied_weights():
    hf = llama(tie=False)
    cfg = config_from_hf(dict(hf.config.to_dict(), tie_word_embeddings=True))
    with pytest.raises(MlmError, match="lm_head.weight differs from model.embed_tokens.weight"):
        hf_to_mlm(hf.state_dict(), cfg)


def test_export_of_a_state_hf_cannot_take():
    cfg = config_from_hf(gpt2(tie=True).config.to_dict())
    with pytest.raises(MlmError, match="'t5' is not supported"):
        mlm_to_hf(GPT(cfg).state_dict(), cfg, "t5")
    state = GPT(cfg).state_dict()
    state["layers.0.attn.q.weight"] = torch.zeros(3, 3)
    with pytest.raises(
        MlmError, match=r"layers\.0\.attn\.q\.weight: shape \[3, 3\], but the config needs \[64, 64\]"
    ):
        mlm_to_hf(state, cfg, "gpt2")


MOE = [name for name, arch in ARCHS.items() if arch.family == "moe"]


@pytest.mark.parametrize("name", MOE)
def test_layers_follow_the_hf_layer_rule(name):
    hf = ARCHS[name].build()
    cfg = config_from_hf(hf.config.to_dict())
    mlm_model = load_hf_into(GPT(cfg).eval(), hf)
    theirs = ["moe" if "Sparse" in type(layer.mlp).__name__ else "dense" for layer in hf.model.layers]
    assert [s.mlp for s in cfg.layer_specs()] == theirs
    assert [type(layer.mlp).__name__ for layer in mlm_model.layers.values()] == [
        "MoE" if k == "moe" else "MLP" for k in theirs
    ]
    if name == "qwen2_moe-sparse":
        assert theirs == ["dense", "moe", "dense", "dense"] and cfg.mlp_kind_freq == [0, 1, 0, 0]
        hf_config = config_to_hf(cfg, "qwen2_moe")
        assert (hf_config["decoder_sparse_step"], hf_config["mlp_only_layers"]) == (2, [3])
    if name == "qwen3_moe-sparse":
        assert theirs == ["moe", "dense", "moe"]
        hf_config = config_to_hf(cfg, "qwen3_moe")
        assert (hf_config["decoder_sparse_step"], hf_config["mlp_only_layers"]) == (1, [1])


def test_transformers_4x_config_keys():
    """transformers 4.x writes Qwen3-MoE's count as num_experts and RoPE as rope_theta."""
    d = qwen3_moe().config.to_dict()
    old = {k: v for k, v in d.items() if k not in ("num_local_experts", "rope_parameters")}
    old.update(num_experts=d.get("num_local_experts", d.get("num_experts")), rope_theta=10000.0)
    assert config_from_hf(old) == config_from_hf(d)
    cfg = config_from_hf({**old, "router_aux_loss_coef": 0.02})
    assert cfg.moe.aux_loss_coeff == 0.02 and config_to_hf(cfg, "qwen3_moe")["router_aux_loss_coef"] == 0.02


# ---------------------------------------------------------------- bad input


def test_expert_keys_missing_unknown_or_misplaced(tmp_path):
    hf = ARCHS["qwen2_moe-sparse"].build()
    state = saved(hf, tmp_path)
    cfg = config_from_hf(hf.config.to_dict())
    lacking = {k: v for k, v in state.items() if k != "model.layers.1.mlp.experts.2.up_proj.weight"}
    with pytest.raises(MlmError) as e:
        hf_to_mlm(lacking, cfg)
    assert str(e.value) == (
        "Hugging Face qwen2_moe state lacks model.layers.1.mlp.experts.2.up_proj.weight "
        "(expert 2 of moe.num_experts=4, stacked into layers.1.mlp.experts.up.weight)"
    )
    unknown = {**state, "model.layers.1.mlp.experts.0.foo.weight": torch.zeros(1)}
    with pytest.raises(MlmError, match=r"does not know: model\.layers\.1\.mlp\.experts\.0\.foo\.weight"):
        hf_to_mlm(unknown, cfg)
    expert = state["model.layers.1.mlp.experts.0.up_proj.weight"]
    beyond = {**state, "model.layers.1.mlp.experts.4.up_proj.weight": expert}
    with pytest.raises(MlmError, match=r"experts\.4\.up_proj\.weight \(expert 4, but moe\.num_experts=4\)"):
        hf_to_mlm(beyond, cfg)
    # a dense layer's key in the MoE layer, and experts in a dense one: no place in the config
    for key in ("model.layers.1.mlp.up_proj.weight", "model.layers.0.mlp.experts.0.up_proj.weight"):
        extra = {key.replace("experts.0", f"experts.{e}"): expert for e in range(4)}
        with pytest.raises(MlmError, match=rf"has {re.escape(key)}.*no tensor for .*1: gqa \+ moe"):
            hf_to_mlm({**state, **extra}, cfg)


def test_in_memory_fused_experts_are_named_not_dropped():
    """transformers 5 holds experts fused ([E, 2F, D]); such a state dict is refused by name
    (load_hf_into converts a model's own tensors to the saved layout first)."""
    hf = mixtral()
    fused = [k for k in hf.state_dict() if "gate_up_proj" in k]
    if not fused:
        pytest.skip(f"transformers {transformers.__version__} keeps Mixtral's experts apart in memory")
    with pytest.raises(MlmError, match=rf"does not know: .*{re.escape(fused[0])}"):
        hf_to_mlm(hf.state_dict(), config_from_hf(hf.config.to_dict()))


def test_an_mlm_tensor_without_a_hugging_face_name_stops_the_export(monkeypatch):
    """(The configs an export refuses: test_hf_adapters.py's EXPORT_REFUSALS.)"""
    cfg = config_from_hf(qwen3_moe().config.to_dict())
    table = {k: v for k, v in QWEN3_MOE.from_hf.items() if "k_norm" not in k}
    monkeypatch.setattr(QWEN3_MOE, "from_hf", table)
    with pytest.raises(
        MlmError, match=r"layers\.0\.attn\.k_norm\.weight, .* have no Hugging Face qwen3_moe name"
    ):
        mlm_to_hf(GPT(cfg).state_dict(), cfg, "qwen3_moe")
