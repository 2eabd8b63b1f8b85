"""Mixture-of-experts models against Hugging Face transformers: Mixtral, Qwen2-MoE, Qwen3-MoE.

Tiny random models (hidden 64, 2–4 layers, 4 experts, top-2, balancing losses off) are built in
code and saved with `save_pretrained`, whose files name the experts one by one (transformers 5
fuses them in memory only). mlm's logits must be transformers' in fp32; the saved tensors must
come back bit for bit through mlm, with the same keys; the layer rule (decoder_sparse_step,
mlp_only_layers) must give the same layers; `mlm convert` must round-trip through the CLI; bad
input must raise one MlmError naming the key or field.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from mlm import hf as adapters  # noqa: E402
from mlm.config import ModelConfig, MoEConfig  # noqa: E402
from mlm.convert import hf as convert  # noqa: E402
from mlm.convert import hf_io  # noqa: E402
from mlm.errors import MlmError  # noqa: E402
from mlm.hf import config_from_hf, config_to_hf, hf_to_mlm, load_hf_into, mlm_to_hf  # noqa: E402
from mlm.hf.qwen3_moe import QWEN3_MOE  # noqa: E402
from mlm.model.gpt import GPT  # noqa: E402

from test_bad_input import mlm  # noqa: E402
from test_hf_numerics import VOCAB, _randomize  # noqa: E402

SEQ = 48
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    num_experts_per_tok=2,
    router_aux_loss_coef=0.0,  # balancing losses off
    output_router_logits=False,
    attn_implementation="eager",
)


def _hf(cls: str, config_cls: str, **config) -> torch.nn.Module:
    """A tiny random transformers model of class `cls`; skipped where this transformers lacks it
    (Mixtral came in 4.36, Qwen2-MoE in 4.40, Qwen3-MoE in 4.51)."""
    if not hasattr(transformers, cls):
        pytest.skip(f"transformers {transformers.__version__} has no {cls}")
    cfg = getattr(transformers, config_cls)(**{**COMMON, **config})
    torch.manual_seed(0)
    model = getattr(transformers, cls)(cfg).float().eval()
    _randomize(model, 7)
    return model


def mixtral(**config):
    defaults = dict(num_hidden_layers=2, intermediate_size=48, num_local_experts=4)
    return _hf("MixtralForCausalLM", "MixtralConfig", **{**defaults, **config})


def qwen2_moe(**config):
    defaults = dict(
        num_hidden_layers=3,
        intermediate_size=96,
        moe_intermediate_size=48,
        shared_expert_intermediate_size=80,
        num_experts=4,
    )
    return _hf("Qwen2MoeForCausalLM", "Qwen2MoeConfig", **{**defaults, **config})


def qwen3_moe(**config):
    defaults = dict(
        num_hidden_layers=2,
        intermediate_size=96,
        moe_intermediate_size=48,
        num_experts=4,
        head_dim=32,  # ≠ hidden / heads (16): kv_channels
        norm_topk_prob=True,
    )
    return _hf("Qwen3MoeForCausalLM", "Qwen3MoeConfig", **{**defaults, **config})


MODELS = {
    "mixtral": lambda: mixtral(),
    "mixtral-tied": lambda: mixtral(tie_word_embeddings=True),
    "qwen2_moe": lambda: qwen2_moe(),  # norm_topk_prob=false: router_pre_softmax
    # 4 layers, step 2, layer 3 dense by list: experts in layer 1 only
    "qwen2_moe-sparse": lambda: qwen2_moe(
        num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=True
    ),
    "qwen3_moe": lambda: qwen3_moe(),
    "qwen3_moe-sparse": lambda: qwen3_moe(num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=False),
}


def saved(model, path) -> dict[str, torch.Tensor]:
    """The tensors `save_pretrained` writes (per-expert keys), as stored."""
    model.save_pretrained(path)
    state = {}
    for _, tensors in hf_io.iter_weight_files(path):
        state.update(tensors)
    return state


@pytest.fixture(scope="module", params=list(MODELS))
def pair(request):
    """(name, HF model, mlm model with the same weights, mlm config)."""
    hf = MODELS[request.param]()
    cfg = config_from_hf(hf.config.to_dict())
    return request.param, hf, load_hf_into(GPT(cfg).eval(), hf), cfg


def assert_logits_and_loss_match(hf, mlm_model, tokens_BT: torch.Tensor) -> None:
    """mlm's logits within 1e-5 of the largest HF logit, and the loss within 1e-5 relative."""
    V = hf.config.vocab_size
    with torch.no_grad():
        ref = hf(input_ids=tokens_BT, labels=tokens_BT)
        logits = mlm_model(tokens_BT)[..., :V]
    scale = ref.logits.abs().max().item()
    assert scale > 1.0  # not a comparison of near-zero logits
    torch.testing.assert_close(logits, ref.logits, atol=1e-5 * scale, rtol=0)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, V), tokens_BT[:, 1:].reshape(-1))
    assert abs(loss.item() - ref.loss.item()) <= 1e-5 * ref.loss.item(), (loss.item(), ref.loss.item())


def test_logits_and_loss_match(pair):
    name, hf, mlm_model, cfg = pair
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    assert_logits_and_loss_match(hf, mlm_model, tokens)
    assert adapters.arch_of(cfg) == hf.config.model_type


def test_layers_follow_the_hf_layer_rule(pair):
    name, hf, mlm_model, cfg = pair
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


def assert_round_trip(hf, tmp_path, tokens_BT: torch.Tensor) -> dict[str, torch.Tensor]:
    """HF (as saved) → mlm → HF is bitwise, configs included, and the exported folder loads in
    transformers and computes the source's logits on `tokens_BT`; returns the saved tensors."""
    src = saved(hf, tmp_path / "hf")
    cfg = config_from_hf(json.loads((tmp_path / "hf" / "config.json").read_text()))
    assert cfg == config_from_hf(hf.config.to_dict())
    mlm_state = hf_to_mlm(src, cfg)
    assert mlm_state.keys() == GPT(cfg).state_dict().keys()
    back, hf_config = mlm_to_hf(mlm_state, cfg, hf.config.model_type)
    assert back.keys() == src.keys()
    for k, t in back.items():
        assert t.dtype == src[k].dtype and torch.equal(t, src[k]), k
    assert config_from_hf(hf_config) == cfg
    (tmp_path / "back").mkdir()
    hf_io.write_safetensors(back, tmp_path / "back", 10**9)
    (tmp_path / "back" / "config.json").write_text(json.dumps(hf_config))
    again = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "back", attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        assert torch.equal(again(input_ids=tokens_BT).logits, hf(input_ids=tokens_BT).logits)
    return src


@pytest.mark.parametrize("name", list(MODELS))
def test_state_round_trip_is_bitwise(tmp_path, name):
    tokens = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(4))
    src = assert_round_trip(MODELS[name](), tmp_path, tokens)
    assert any(".experts.3." in k for k in src)  # per-expert keys, as the files hold them


def test_transformers_4x_config_keys():
    """transformers 4.x writes Qwen3-MoE's count as num_experts and RoPE as rope_theta."""
    d = qwen3_moe().config.to_dict()
    old = {k: v for k, v in d.items() if k not in ("num_local_experts", "rope_parameters")}
    old.update(num_experts=d.get("num_local_experts", d.get("num_experts")), rope_theta=10000.0)
    assert config_from_hf(old) == config_from_hf(d)
    cfg = config_from_hf({**old, "router_aux_loss_coef": 0.02})
    assert cfg.moe.aux_loss_coeff == 0.02 and config_to_hf(cfg, "qwen3_moe")["router_aux_loss_coef"] == 0.02


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_convert_round_trip_is_verified(tmp_path, name):
    hf = MODELS[name]()
    src = saved(hf, tmp_path / "hf")
    r = convert.import_hf(tmp_path / "hf", tmp_path / "ckpt")
    assert r.architecture == type(hf).__name__ and r.max_abs_diff <= 1e-5 and r.max_abs_logit > 1.0
    r = convert.export_hf(tmp_path / "ckpt", tmp_path / "back")
    assert r.architecture == type(hf).__name__ and r.max_abs_diff <= 1e-5
    back = {}
    for _, tensors in hf_io.iter_weight_files(tmp_path / "back"):
        back.update(tensors)
    assert back.keys() == src.keys() and all(torch.equal(back[k], src[k]) for k in back)


def test_cli_round_trip(tmp_path):
    hf = MODELS["qwen2_moe-sparse"]()
    src = saved(hf, tmp_path / "hf")
    r = mlm("convert", "from-hf", tmp_path / "hf", tmp_path / "ckpt")
    assert r.returncode == 0, r.stderr
    assert "imported Qwen2MoeForCausalLM" in r.stderr and "logits verified: max |diff|" in r.stderr
    toml = (tmp_path / "ckpt" / "config.toml").read_text()
    assert 'mlp_kind = "moe"' in toml and "mlp_kind_freq = [0, 1, 0, 0]" in toml
    r = mlm("export", "hf", tmp_path / "ckpt", tmp_path / "back", "--max-shard-size", "100KB")
    assert r.returncode == 0, r.stderr
    assert "exported Qwen2MoeForCausalLM" in r.stderr and "logits verified" in r.stderr
    back = {}
    for _, tensors in hf_io.iter_weight_files(tmp_path / "back"):
        back.update(tensors)
    assert len(hf_io.weight_files(tmp_path / "back")) > 1
    assert back.keys() == src.keys() and all(torch.equal(back[k], src[k]) for k in back)


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "make, change, match",
    [
        (mixtral, {"router_jitter_noise": 0.1}, r"router_jitter_noise=0\.1: mlm's router has no jitter"),
        (mixtral, {"hidden_act": "gelu"}, "hidden_act='gelu'"),
        (mixtral, {"sliding_window": 64}, "sliding_window=64 < max_position_embeddings=128"),
        (qwen2_moe, {"use_sliding_window": True, "sliding_window": 64}, "sliding_window=64 <"),
        (qwen2_moe, {"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size=0"),
        (qwen2_moe, {"decoder_sparse_step": 0}, "decoder_sparse_step=0"),
        (qwen3_moe, {"attention_bias": True}, "attention_bias=true"),
        (qwen3_moe, {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type='yarn'"),
        (qwen3_moe, {"num_experts_per_tok": 5}, r"router_topk=5 exceeds model\.moe\.num_experts=4"),
        (qwen3_moe, {"num_local_experts": None, "num_experts": None}, "neither 'num_local_experts'"),
    ],
)
def test_unsupported_configs(make, change, match):
    d = make().config.to_dict()
    d.update(change)
    with pytest.raises(MlmError, match=match):
        config_from_hf(d)


def test_expert_keys_missing_unknown_or_misplaced(tmp_path):
    hf = MODELS["qwen2_moe-sparse"]()
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


def test_load_into_a_model_of_another_router():
    hf = qwen2_moe()
    cfg = config_from_hf(hf.config.to_dict())
    other = ModelConfig(**{**vars(cfg), "moe": MoEConfig(**{**vars(cfg.moe), "router_pre_softmax": False})})
    with pytest.raises(MlmError, match=r"model\.moe\.router_pre_softmax: mlm False, Hugging Face True"):
        load_hf_into(GPT(other), hf)


def test_export_of_configs_hf_cannot_express(monkeypatch):
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, mlp_kind="moe")
    sigmoid = ModelConfig(**base, moe=MoEConfig(num_experts=4, router_score_function="sigmoid"))
    with pytest.raises(
        MlmError, match=r"mixtral: model\.moe\.router_score_function='sigmoid' \(needs 'softmax'\)"
    ):
        config_to_hf(sigmoid, "mixtral")
    biased = ModelConfig(
        **base, moe=MoEConfig(num_experts=4, router_score_function="sigmoid", router_enable_expert_bias=True)
    )
    with pytest.raises(MlmError, match=r"model\.moe\.router_enable_expert_bias=True \(needs False\)"):
        config_to_hf(biased, "qwen3_moe")
    mixed = ModelConfig(**base, mlp_kind_freq=[1, 0], moe=MoEConfig(num_experts=4))
    with pytest.raises(MlmError, match=r"layer kinds .*'dense'.* \(needs only \('gqa', 'moe'\)\)"):
        config_to_hf(mixed, "mixtral")
    with pytest.raises(MlmError, match="shared_expert_ffn_hidden_size is unset"):
        config_to_hf(mixed, "qwen2_moe")
    with pytest.raises(MlmError, match=r"model\.qk_norm=False \(needs True\)"):
        config_to_hf(mixed, "qwen3_moe")
    with pytest.raises(MlmError, match=r"model\.qkv_bias=True \(needs False\)"):
        config_to_hf(ModelConfig(qkv_bias=True), "llama")
    # an mlm tensor without a Hugging Face name stops the export instead of vanishing
    cfg = config_from_hf(qwen3_moe().config.to_dict())
    table = {k: v for k, v in QWEN3_MOE.from_hf.items() if "k_norm" not in k}
    monkeypatch.setattr(QWEN3_MOE, "from_hf", table)
    with pytest.raises(
        MlmError, match=r"layers\.0\.attn\.k_norm\.weight, .* have no Hugging Face qwen3_moe name"
    ):
        mlm_to_hf(GPT(cfg).state_dict(), cfg, "qwen3_moe")
