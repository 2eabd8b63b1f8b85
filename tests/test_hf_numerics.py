"""mlm against Hugging Face transformers with the same weights (litgpt's `test_against_hf_*`).

Tiny random Llama (GQA, Llama-3.1 RoPE scaling, tied and untied) and GPT-2 models are built in
code, converted with `mlm.hf`, and must give the same logits and loss in fp32; the state dict
must survive HF → mlm → HF bit for bit; bad input must raise MlmError naming key and shapes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from mlm.errors import MlmError  # noqa: E402
from mlm.hf import config_from_hf, config_to_hf, hf_to_mlm, load_hf_into, mlm_to_hf  # noqa: E402
from mlm.model.gpt import GPT  # noqa: E402
from mlm.model.rope import inv_frequencies, rope_tables  # noqa: E402

VOCAB = 300  # not a multiple of 128: exercises the padding of the embedding rows
SEQ = 64  # > original_max_position_embeddings (32), so llama3 scaling changes the frequencies
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


_GAINS = ("norm.weight", "layernorm.weight", "ln_1.weight", "ln_2.weight", "ln_f.weight")


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights of order 0.1 and norm gains around 1, so that logits are O(1) and a swapped or
    mis-transposed tensor shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = 0.1 * torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + noise if name.endswith(_GAINS) else noise)


TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    attn_implementation="eager",
)
"""The shape of the tiny Llama-family models (GQA: 4 heads over 2 key-value heads)."""


def llama(tie: bool, seed: int = 1, **config) -> torch.nn.Module:
    """A tiny random LlamaForCausalLM (GQA, llama3 RoPE scaling); `config` overrides fields."""
    defaults = dict(TINY, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=dict(LLAMA3_ROPE))
    cfg = transformers.LlamaConfig(**{**defaults, **config, "tie_word_embeddings": tie})
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    _randomize(model, seed)
    return model


def gpt2(tie: bool) -> torch.nn.Module:
    cfg = transformers.GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=128,
        tie_word_embeddings=tie,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).float().eval()
    _randomize(model, 2)
    return model


def qwen(version: int, tie: bool, seed: int = 3) -> torch.nn.Module:
    """A tiny random dense Qwen2 (q/k/v biases) or Qwen3 (q/k norms, head_dim 32 ≠ hidden / heads)."""
    common = dict(TINY, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=tie)
    if version == 2:
        cfg, cls = transformers.Qwen2Config(**common), transformers.Qwen2ForCausalLM
    else:
        cfg, cls = transformers.Qwen3Config(**common, head_dim=32), transformers.Qwen3ForCausalLM
    torch.manual_seed(0)
    model = cls(cfg).float().eval()
    _randomize(model, seed)
    return model


MODELS = {
    "qwen2-tied": lambda: qwen(2, tie=True),
    "qwen3": lambda: qwen(3, tie=False),
    "llama": lambda: llama(tie=False),
    "llama-tied": lambda: llama(tie=True),
    "llama-head-dim": lambda: llama(tie=False, head_dim=32),  # head_dim ≠ hidden / heads (kv_channels)
    "gpt2": lambda: gpt2(tie=True),
    "gpt2-untied": lambda: gpt2(tie=False),
}


@pytest.fixture(scope="module", params=list(MODELS))
def pair(request):
    """(HF model, mlm model with the same weights, mlm config)."""
    hf = MODELS[request.param]()
    cfg = config_from_hf(hf.config.to_dict())
    mlm = load_hf_into(GPT(cfg).eval(), hf)
    return hf, mlm, cfg


def test_logits_and_loss_match(pair):
    hf, mlm, cfg = pair
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(input_ids=tokens, labels=tokens)
        logits = mlm(tokens)
    assert logits.shape == (2, SEQ, cfg.padded_vocab_size()) and cfg.padded_vocab_size() == 384
    torch.testing.assert_close(logits[..., :VOCAB], ref.logits, atol=1e-5, rtol=0)
    loss = F.cross_entropy(logits[:, :-1, :VOCAB].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    assert abs(loss.item() - ref.loss.item()) <= 1e-6, (loss.item(), ref.loss.item())
    assert ref.logits.abs().max() > 1.0  # the comparison is not between near-zero logits


def test_llama3_rope_scaling_is_exercised():
    hf = llama(tie=False)
    cfg = config_from_hf(hf.config.to_dict())
    assert cfg.rope_scaling_factor == 8.0 and cfg.rope_original_max_position_embeddings == 32
    ours = inv_frequencies(cfg)
    assert torch.equal(ours, hf.model.rotary_emb.inv_freq)
    cos, sin = hf.model.rotary_emb(torch.zeros(1, SEQ, 1), torch.arange(SEQ)[None])
    assert all(map(torch.equal, rope_tables(cfg, SEQ), (cos[0], sin[0])))  # bit for bit
    unscaled = 1.0 / (10000.0 ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim))
    changed = (ours != unscaled).sum().item()
    assert 0 < changed < len(ours)  # some frequencies scaled or smoothed, the highest left alone


@pytest.mark.parametrize("name", list(MODELS))
def test_state_round_trip_is_bitwise(name):
    hf = MODELS[name]()
    hf_state = hf.state_dict()
    cfg = config_from_hf(hf.config.to_dict())
    mlm_state = hf_to_mlm(hf_state, cfg)
    assert mlm_state.keys() == GPT(cfg).state_dict().keys()
    back, hf_config = mlm_to_hf(mlm_state, cfg, hf.config.model_type)
    dropped = {"model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"}
    if cfg.tie_embeddings:
        dropped.add("lm_head.weight")  # save_pretrained leaves the tied copy out too
    assert back.keys() == hf_state.keys() - dropped
    for k, t in back.items():
        assert t.dtype == hf_state[k].dtype and torch.equal(t, hf_state[k]), k
    again = hf_to_mlm(back, cfg)
    assert all(torch.equal(again[k], v) for k, v in mlm_state.items())
    # the exported config.json rebuilds the same HF model, and the same mlm config
    assert config_from_hf(hf_config) == cfg
    rebuilt = transformers.AutoConfig.for_model(**hf_config)
    hf2 = transformers.AutoModelForCausalLM.from_config(rebuilt, attn_implementation="eager").eval()
    missing, unexpected = hf2.load_state_dict(back, strict=False)
    assert not unexpected and set(missing) <= dropped
    tokens = torch.randint(0, VOCAB, (1, SEQ))
    with torch.no_grad():
        assert torch.equal(hf2(tokens).logits, hf(tokens).logits)


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
    assert cfg.rope_scaling_factor is None and cfg.rope_base == 500000.0


# ---------------------------------------------------------------- bad input


def test_unknown_model_type():
    with pytest.raises(MlmError, match=r"model_type='bert'.*llama, gpt2"):
        config_from_hf({"model_type": "bert", "hidden_size": 64})


@pytest.mark.parametrize(
    "change, match",
    [
        ({"attention_bias": True}, "attention_bias=true"),
        ({"mlp_bias": True}, "mlp_bias=true"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "rope_type='yarn'"),
        ({"hidden_size": None}, "'hidden_size'"),
    ],
)
def test_unsupported_llama_config(change, match):
    d = llama(tie=False).config.to_dict()
    d.update(change)
    with pytest.raises(MlmError, match=match):
        config_from_hf(d)


@pytest.mark.parametrize(
    "version, change, match",
    [
        (
            2,
            {"use_sliding_window": True, "sliding_window": 64},
            "sliding_window=64 < max_position_embeddings=128",
        ),
        (3, {"use_sliding_window": True, "sliding_window": 32}, "no sliding-window attention"),
        (3, {"attention_bias": True}, "attention_bias=true"),
        (2, {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ],
)
def test_unsupported_qwen_config(version, change, match):
    """Dense Qwen configs mlm cannot compute exactly are refused by name (a sliding window used and
    shorter than the context, Qwen3's biases on the attention's four projections)."""
    d = qwen(version, tie=False).config.to_dict()
    d.update(change)
    with pytest.raises(MlmError, match=match):
        config_from_hf(d)
    d.update(use_sliding_window=False)  # a window that is not used is no obstacle
    if "sliding_window" in change:
        assert config_from_hf(d).num_layers == 2


def test_dense_qwen_export_refuses_what_its_config_cannot_say():
    cfg = config_from_hf(qwen(3, tie=False).config.to_dict())
    with pytest.raises(MlmError, match="as Hugging Face qwen2: model.qkv_bias=False"):
        config_to_hf(cfg, "qwen2")
    assert config_to_hf(cfg, "qwen3")["head_dim"] == 32


def test_shape_mismatch_names_key_and_both_shapes():
    hf = llama(tie=False)
    state = dict(hf.state_dict())
    state["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(64, 64)
    with pytest.raises(MlmError) as e:
        hf_to_mlm(state, config_from_hf(hf.config.to_dict()))
    msg = str(e.value)
    assert "model.layers.1.self_attn.k_proj.weight" in msg and "[64, 64]" in msg and "[32, 64]" in msg


def test_gpt2_vocab_mismatch_names_key_and_both_shapes():
    hf = gpt2(tie=True)
    cfg = config_from_hf(dict(hf.config.to_dict(), vocab_size=301))
    with pytest.raises(MlmError) as e:
        hf_to_mlm(hf.state_dict(), cfg)
    msg = str(e.value)
    assert "transformer.wte.weight" in msg and "[300, 64]" in msg and "[301, 64]" in msg


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


def test_load_into_a_model_of_another_config():
    hf = llama(tie=False)
    cfg = config_from_hf(
        dict(hf.config.to_dict(), rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    )
    with pytest.raises(MlmError, match=r"model\.rope_scaling_factor: mlm None, Hugging Face 8\.0"):
        load_hf_into(GPT(cfg), hf)


def test_export_of_a_config_hf_cannot_express():
    cfg = config_from_hf(gpt2(tie=True).config.to_dict())
    with pytest.raises(MlmError, match=r"model\.normalization='layernorm' \(needs 'rmsnorm'\)"):
        config_to_hf(cfg, "llama")
    with pytest.raises(MlmError, match="'t5' is not supported"):
        mlm_to_hf(GPT(cfg).state_dict(), cfg, "t5")
    state = GPT(cfg).state_dict()
    state["layers.0.attn.q.weight"] = torch.zeros(3, 3)
    with pytest.raises(
        MlmError, match=r"layers\.0\.attn\.q\.weight: shape \[3, 3\], but the config needs \[64, 64\]"
    ):
        mlm_to_hf(state, cfg, "gpt2")
