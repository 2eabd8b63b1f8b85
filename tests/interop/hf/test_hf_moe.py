"""What only the mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE) have, beyond
tests/interop/hf/test_hf_adapters.py: the layer rule (decoder_sparse_step, mlp_only_layers) gives
transformers' layers, both ways; transformers 4.x config keys; experts missing, unknown or
misplaced, experts fused as transformers 5 holds them in memory, and mlm tensors without a
Hugging Face name are refused with one MlmError naming the key."""

from __future__ import annotations

import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mlm.convert.hf import config_from_hf, config_to_hf, hf_to_mlm, load_hf_into, mlm_to_hf  # noqa: E402
from mlm.convert.hf.qwen3_moe import QWEN3_MOE  # noqa: E402
from mlm.errors import MlmError  # noqa: E402
from mlm.model.gpt import GPT  # noqa: E402
from tests.helpers.hf_models import ARCHS, mixtral, qwen3_moe, saved  # noqa: E402

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
