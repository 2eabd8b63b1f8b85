"""What only the dense Hugging Face families have, beyond tests/interop/hf/test_hf_adapters.py:
Llama-3.1 RoPE scaling bit for bit, GPT-2's original checkpoints (keys without `transformer.`,
mask buffers), transformers 4.x and 5.x config spellings, and bad layer keys, tied weights that
differ, and mlm states that have no Hugging Face form, each refused with one MlmError naming the
key and shapes."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mlm.convert.hf import config_from_hf, config_to_hf, hf_to_mlm, mlm_to_hf  # noqa: E402
from mlm.errors import MlmError  # noqa: E402
from mlm.model.gpt import GPT  # noqa: E402
from mlm.model.rope import inv_frequencies, rope_tables  # noqa: E402

from hf_models import LLAMA3_ROPE, SEQ, gpt2, llama, qwen  # noqa: E402


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
