"""What only DeepSeek-V3 has, beyond tests/interop/hf/test_hf_adapters.py (which compares the
tiny random `DeepseekV3ForCausalLM` of tests/helpers/hf_models.py with transformers, also with YaRN,
without q_lora_rank, with rotate-half RoPE and tied embeddings): its layers and router (the group
limit and the expert biases change which experts are chosen); config.json round trips; an mlm
model with MTP depths exports to DeepSeek's checkpoint layout (`model.layers.{N + d}.*`), imports
back bit for bit and loads in transformers (which skips the MTP layers) with the same logits;
`mlm convert` round-trips MTP depths and keeps the expert biases float32 in a bf16 export; bad
input raises one MlmError naming the key or field and the fix.
"""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV3ForCausalLM"):
    pytest.skip(
        f"transformers {transformers.__version__} has no DeepseekV3ForCausalLM (it came in 4.51)",
        allow_module_level=True,
    )

from mlm.config import ModelConfig, MoEConfig  # noqa: E402
from mlm.convert import hf as adapters  # noqa: E402
from mlm.convert.hf import config_from_hf, config_to_hf, hf_to_mlm, load_hf_into, mlm_to_hf  # noqa: E402
from mlm.convert.hf import folder as convert  # noqa: E402
from mlm.convert.hf import io as hf_io  # noqa: E402
from mlm.errors import MlmError  # noqa: E402
from mlm.model.gpt import GPT, build_model  # noqa: E402
from tests.helpers.common import mlm  # noqa: E402
from tests.helpers.hf_models import ARCHS, DS_LAYERS, DS_SEQ, DS_VOCAB, YARN, deepseek, saved  # noqa: E402

VOCAB, SEQ, N = DS_VOCAB, DS_SEQ, DS_LAYERS
MLA = [name for name, arch in ARCHS.items() if arch.family == "mla"]


def tokens(seed: int = 3, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=MLA)
def pair(request):
    """(name, HF model, mlm model with the same weights, mlm config)."""
    hf = ARCHS[request.param].build()
    cfg = config_from_hf(hf.config.to_dict())
    return request.param, hf, load_hf_into(GPT(cfg).eval(), hf), cfg


def test_layers_follow_the_hf_layer_rule(pair):
    name, hf, mlm_model, cfg = pair
    assert cfg.attention_kind == "mla" and [s.mlp for s in cfg.layer_specs()] == [
        "moe" if type(layer.mlp).__name__ == "DeepseekV3MoE" else "dense" for layer in hf.model.layers
    ]


def test_the_router_is_exercised(pair):
    """The group limit and the expert bias change which experts are chosen on these tokens, so
    the logit comparison covers them."""
    name, hf, mlm_model, cfg = pair
    if cfg.moe.router_num_groups is None:
        pytest.skip("no group limit in this model")
    from mlm.model.kinds.moe.router import route

    h = torch.randn(256, 32, generator=torch.Generator().manual_seed(1))
    router = mlm_model.layers["2"].mlp.router
    logits = h @ router.weight.T
    plain = MoEConfig(**{**vars(cfg.moe), "router_num_groups": None, "router_group_topk": None})
    chosen = route(logits, cfg.moe, router.expert_bias)[1].sort(-1).values
    assert not torch.equal(chosen, route(logits, plain, router.expert_bias)[1].sort(-1).values)
    assert not torch.equal(chosen, route(logits, cfg.moe, None)[1].sort(-1).values)


def test_config_round_trip():
    """config.json → mlm → config.json keeps every field transformers computes with, and
    transformers 4.x (rope_scaling, DeepSeek's "type") and 5.x (rope_parameters) spellings agree."""
    d = deepseek(rope_scaling=dict(YARN), num_nextn_predict_layers=2).config.to_dict()
    cfg = config_from_hf(d)
    assert (cfg.first_k_dense, cfg.mtp_num_layers, cfg.rope.scaling_type) == (1, 2, "yarn")
    assert (cfg.moe.router_num_groups, cfg.moe.router_group_topk, cfg.moe.router_topk) == (4, 2, 4)
    assert cfg.moe.shared_expert_ffn_hidden_size == 16 and cfg.moe.router_topk_scaling_factor == 2.5
    out = config_to_hf(cfg, "deepseek_v3")
    for key in (
        "vocab_size hidden_size intermediate_size moe_intermediate_size num_hidden_layers "
        "num_attention_heads num_key_value_heads q_lora_rank kv_lora_rank qk_nope_head_dim "
        "qk_rope_head_dim v_head_dim rope_interleave first_k_dense_replace n_routed_experts "
        "num_experts_per_tok n_group topk_group routed_scaling_factor norm_topk_prob n_shared_experts "
        "max_position_embeddings rms_norm_eps tie_word_embeddings attention_bias num_nextn_predict_layers"
    ).split():
        assert out[key] == d[key], key
    theirs = d["rope_parameters"]
    assert {k: out["rope_scaling"][k] for k in YARN} == {k: theirs[k] for k in YARN}
    assert out["rope_theta"] == theirs["rope_theta"]
    assert config_from_hf(out) == cfg
    old = {k: v for k, v in d.items() if k != "rope_parameters"}  # DeepSeek's own config.json
    old.update(rope_theta=theirs["rope_theta"], rope_scaling={**YARN, "type": "yarn"})
    del old["rope_scaling"]["rope_type"]
    assert config_from_hf(old) == cfg
    # DeepSeek's balancing-loss fields (not transformers'): the sequence-wise loss
    assert config_from_hf({**d, "aux_loss_alpha": 0.001, "seq_aux": True}).moe.seq_aux_loss_coeff == 0.001
    assert config_from_hf({**d, "aux_loss_alpha": 0.001, "seq_aux": False}).moe.aux_loss_coeff == 0.001
    # every layer dense: an MLA model without experts, dense in DeepSeek's MTP layers too
    dense = config_from_hf({**d, "first_k_dense_replace": 5})
    assert dense.mlp_kind == "dense" and config_to_hf(dense, "deepseek_v3")["first_k_dense_replace"] == 5


# ---------------------------------------------------------------- MTP in DeepSeek's layout


def mtp_model(depths: int = 2, **config) -> GPT:
    """An mlm model of the tiny config with MTP depths, random weights and expert biases."""
    cfg = config_from_hf(deepseek(num_nextn_predict_layers=depths, **config).config.to_dict())
    model = build_model(cfg, seed=5)
    gen = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("expert_bias"):
                p.copy_(0.2 * torch.rand(p.shape, generator=gen))
            elif name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return model.eval()


def write_hf(state: dict, config: dict, path) -> None:
    path.mkdir()
    hf_io.write_safetensors(state, path, 10**9)
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("tie", [False, True])
def test_mtp_exports_in_deepseek_layout_and_comes_back_bitwise(tmp_path, tie):
    model = mtp_model(tie_word_embeddings=tie)
    cfg, state = model.cfg, model.state_dict()
    hf_state, hf_config = mlm_to_hf(state, cfg, "deepseek_v3")
    assert hf_config["num_nextn_predict_layers"] == 2
    for d in range(2):
        layer = f"model.layers.{N + d}."
        for key in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "embed_tokens", "shared_head.head"):
            assert layer + key + ".weight" in hf_state, key
        assert layer + "self_attn.kv_b_proj.weight" in hf_state  # a whole (MoE) decoder layer
        assert layer + "mlp.experts.7.down_proj.weight" in hf_state
        assert torch.equal(hf_state[layer + "eh_proj.weight"], state[f"mtp.{d}.eh_proj.weight"])
        assert torch.equal(hf_state[layer + "embed_tokens.weight"], state["embed.weight"][:VOCAB])
        head = state["embed.weight" if tie else "output.weight"][:VOCAB]
        assert torch.equal(hf_state[layer + "shared_head.head.weight"], head)
    assert ("lm_head.weight" in hf_state) is not tie
    back = hf_to_mlm(hf_state, cfg)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    # the copies may be left out (mlm holds them once)
    lean = {k: v for k, v in hf_state.items() if not k.endswith(("embed_tokens.weight", "head.weight"))}
    lean["model.embed_tokens.weight"] = hf_state["model.embed_tokens.weight"]
    lean.update({k: hf_state[k] for k in ("lm_head.weight",) if k in hf_state})
    back = hf_to_mlm(lean, cfg)
    assert all(torch.equal(back[k], state[k]) for k in state)
    # transformers loads the folder (it skips model.layers.{N + d}.*) and gives mlm's logits
    write_hf(hf_state, hf_config, tmp_path / "hf")
    transformers.logging.set_verbosity_error()
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        ref, ours = hf(input_ids=tokens()).logits, model(tokens())[..., :VOCAB]
    diff, scale = (ours - ref).abs().max().item(), ref.abs().max().item()
    assert diff <= 1e-5 * max(scale, 1.0), (diff, scale)


def test_transformers_model_holds_no_mtp():
    """config.json's num_nextn_predict_layers counts MTP depths that transformers' model lacks:
    load_hf_into says so, and an import of its saved files leaves them out with a note."""
    hf = deepseek(num_nextn_predict_layers=1)
    cfg = config_from_hf(hf.config.to_dict())
    assert cfg.mtp_num_layers == 1
    with pytest.raises(MlmError) as e:
        load_hf_into(GPT(cfg), hf)
    assert str(e.value).startswith(
        "the Hugging Face model and the mlm model differ: model.mtp_num_layers: mlm 1, Hugging Face 0 "
        "(config.json counts 1 MTP depth(s) (num_nextn_predict_layers) but the weights hold none "
        "(no model.layers.3.* tensors"
    )
    assert "with mtp_num_layers=0" in str(e.value)
    with pytest.raises(
        MlmError, match=r"lacks the \d+ tensors of the MTP depths \(model\.layers\.3\.\*\);.*mtp_num_layers=0"
    ):
        hf_to_mlm(adapters.saved_state(hf), cfg)
    load_hf_into(GPT(ModelConfig(**{**vars(cfg), "mtp_num_layers": 0})), hf)


def test_convert_imports_without_the_mtp_transformers_left_out(tmp_path):
    hf = deepseek(num_nextn_predict_layers=1)
    hf.save_pretrained(tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    r = convert.import_hf(tmp_path / "hf", tmp_path / "ckpt")
    assert r.max_abs_diff <= 1e-5 * r.max_abs_logit and r.max_abs_logit > 1.0
    assert r.notes and "imported without them (model.mtp_num_layers=0)" in r.notes[0]
    assert "mtp_num_layers = 0" in (tmp_path / "ckpt" / "config.toml").read_text()


def test_cli_round_trip_with_mtp(tmp_path):
    """`mlm convert`: the tiny transformers model's saved tensors plus an MTP depth, in DeepSeek's
    layout → mlm checkpoint → the same folder, bit for bit, both steps verified against
    transformers' logits (those of the tiny model: transformers skips the MTP layer)."""
    hf = deepseek(num_nextn_predict_layers=1)
    src = saved(hf, tmp_path / "saved")
    cfg = config_from_hf(hf.config.to_dict())
    main = hf_to_mlm(src, ModelConfig(**{**vars(cfg), "mtp_num_layers": 0}))
    depth = {k: t for k, t in mtp_model(depths=1).state_dict().items() if k.startswith("mtp.")}
    hf_state, hf_config = mlm_to_hf({**main, **depth}, cfg, "deepseek_v3")
    assert all(torch.equal(hf_state[k], t) for k, t in src.items())
    write_hf(hf_state, hf_config, tmp_path / "hf")
    r = mlm("convert", "from-hf", tmp_path / "hf", tmp_path / "ckpt")
    assert r.returncode == 0, r.stderr
    assert "imported DeepseekV3ForCausalLM" in r.stderr and "logits verified: max |diff|" in r.stderr
    assert "note:" not in r.stderr
    toml = (tmp_path / "ckpt" / "config.toml").read_text()
    assert 'attention_kind = "mla"' in toml and "mtp_num_layers = 1" in toml
    r = mlm("export", "hf", tmp_path / "ckpt", tmp_path / "back", "--max-shard-size", "100KB")
    assert r.returncode == 0, r.stderr
    assert "exported DeepseekV3ForCausalLM" in r.stderr and "logits verified" in r.stderr
    back = {}
    for _, tensors in hf_io.iter_weight_files(tmp_path / "back"):
        back.update(tensors)
    assert len(hf_io.weight_files(tmp_path / "back")) > 1
    assert back.keys() == hf_state.keys() and all(torch.equal(back[k], hf_state[k]) for k in back)
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    assert {k: written[k] for k in hf_config} == json.loads(json.dumps(hf_config))


def test_bf16_export_keeps_the_expert_biases_float32(tmp_path):
    """bf16: the expert biases stay float32 (they only select experts, as transformers keeps them).
    (The fp32 round trip of every case: test_hf_adapters.py's test_cli_round_trip.)"""
    src = saved(ARCHS["deepseek_v3-yarn"].build(), tmp_path / "hf")
    convert.import_hf(tmp_path / "hf", tmp_path / "ckpt", verify=False)
    r = convert.export_hf(tmp_path / "ckpt", tmp_path / "bf16", dtype="bf16")
    assert r.max_abs_diff <= r.tolerance
    (_, cast), *_ = hf_io.iter_weight_files(tmp_path / "bf16")
    assert {k for k, t in cast.items() if t.dtype == torch.float32} == {
        k for k in src if k.endswith("e_score_correction_bias")
    }
    assert all(t.dtype in (torch.float32, torch.bfloat16) for t in cast.values())


# ---------------------------------------------------------------- bad input


def test_mtp_copy_that_differs_is_one_clear_error():
    model = mtp_model(depths=1)
    hf_state, _ = mlm_to_hf(model.state_dict(), model.cfg, "deepseek_v3")
    changed = dict(hf_state)
    changed["model.layers.3.embed_tokens.weight"] = hf_state["model.embed_tokens.weight"] + 1e-3
    with pytest.raises(MlmError) as e:
        hf_to_mlm(changed, model.cfg)
    msg = str(e.value)
    assert msg.startswith(
        "Hugging Face deepseek_v3 state: model.layers.3.embed_tokens.weight differs from "
        "model.embed_tokens.weight (float32 [100, 32] CRC-32C "
    )
    assert "use the main model's embedding and output layer, which mlm holds once" in msg
    assert "set num_nextn_predict_layers to 0" in msg
    # another vocabulary (or padding) in the copy: refused before any tensor is read
    for key, rows in (
        ("model.layers.3.embed_tokens.weight", 128),
        ("model.layers.3.shared_head.head.weight", 90),
    ):
        other = {**hf_state, key: torch.zeros(rows, 32)}
        original = "model.embed_tokens.weight" if "embed" in key else "lm_head.weight"
        with pytest.raises(MlmError) as e:
            hf_to_mlm(other, model.cfg)
        assert str(e.value).startswith(
            f"Hugging Face deepseek_v3 state: {key} differs from {original} (shape [{rows}, 32] vs shape [100, 32]): "
            "DeepSeek's MTP depths use the main model's embedding"
        )


@pytest.mark.parametrize(
    "key, shape, note",
    [
        (
            "model.layers.1.self_attn.q_b_proj.weight",
            (40, 16),
            "rows = num_attention_heads 4 × (qk_nope_head_dim 8 + qk_rope_head_dim 4), columns = q_lora_rank 16",
        ),
        (
            "model.layers.0.self_attn.kv_b_proj.weight",
            (4 * 14, 12),
            "rows = num_attention_heads 4 × (qk_nope_head_dim 8 + v_head_dim 6), columns = kv_lora_rank 12",
        ),
        (
            "model.layers.3.self_attn.kv_a_proj_with_mqa.weight",
            (12, 32),
            "rows = kv_lora_rank 12 + qk_rope_head_dim 4",
        ),
    ],
)
def test_mla_dims_that_do_not_match_the_heads(key, shape, note):
    model = mtp_model(depths=1)
    hf_state, _ = mlm_to_hf(model.state_dict(), model.cfg, "deepseek_v3")
    want = list(hf_state[key].shape)
    if list(shape) == want:  # kv_b_proj: nope + v per head, here with v_head_dim 8 instead of 6
        shape = (4 * 16, 12)
    with pytest.raises(MlmError) as e:
        hf_to_mlm({**hf_state, key: torch.zeros(shape)}, model.cfg)
    assert str(e.value) == (
        f"Hugging Face state does not match the config: {key}: shape {list(shape)} in the Hugging Face "
        f"state, but the config needs {want} ({note}) (build the config with config_from_hf from the "
        "checkpoint's own config.json)"
    )


def test_k_over_topk_group_other_than_two_is_refused_both_ways():
    d = deepseek().config.to_dict()
    with pytest.raises(MlmError, match="only when num_experts_per_tok = 2 × topk_group"):
        config_from_hf({**d, "num_experts_per_tok": 2})  # 2 / topk_group 2 = 1
    cfg = config_from_hf(d)
    other = ModelConfig(**{**vars(cfg), "moe": MoEConfig(**{**vars(cfg.moe), "router_topk": 2})})
    with pytest.raises(MlmError, match=r"router_topk=2 with router_group_topk=2 \(needs router_topk = 2"):
        config_to_hf(other, "deepseek_v3")


def test_verification_needs_a_transformers_with_the_class(tmp_path, monkeypatch):
    deepseek().save_pretrained(tmp_path / "hf")
    old = types.ModuleType("transformers")  # a transformers before 4.51
    old.__version__ = "4.50.3"
    monkeypatch.setitem(sys.modules, "transformers", old)
    with pytest.raises(MlmError) as e:
        convert.import_hf(tmp_path / "hf", tmp_path / "ckpt")
    assert str(e.value) == (
        "transformers 4.50.3 has no DeepseekV3ForCausalLM (it came in 4.51), and the logit check loads "
        "the model with it: upgrade (pip install 'transformers>=4.51'), or pass --no-verify to convert "
        "without the check"
    )
    assert not (tmp_path / "ckpt").exists()
