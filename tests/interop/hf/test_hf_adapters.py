"""Every Hugging Face architecture mlm converts, against transformers itself (litgpt's
`test_against_hf_*`), one test per property parametrised over `hf_models.ARCHS`: Llama (GQA,
Llama-3.1 RoPE scaling, tied and untied, head_dim ≠ hidden / heads), Mistral, GPT-2 (tied and
untied), dense Qwen2 and Qwen3, the mixtures of experts Mixtral, Qwen2-MoE and Qwen3-MoE (their
layer rules: decoder_sparse_step, mlp_only_layers), and DeepSeek-V3 (YaRN, no q_lora_rank,
rotate-half RoPE, tied).

For each: mlm's logits and loss are transformers' in fp32 (dense: 1e-5 absolute, loss 1e-6;
MoE and MLA: 1e-5 of the largest logit, loss 1e-5 relative); the saved tensors survive
HF → mlm → HF bit for bit, configs included, and the result loads in transformers with the same
logits; `mlm convert from-hf` then `mlm export hf` gives the same files back, both steps verified,
and the export loads in transformers as the same class and generates mlm's greedy tokens. Configs,
states and loads mlm cannot compute exactly are refused with one MlmError naming the field.
What only one family has (GPT-2's checkpoints, MoE layer rules and expert keys, DeepSeek's router
and MTP depths) is in test_hf_dense.py, test_hf_moe.py and test_hf_deepseek.py.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from mlm.checkpoint import read_group, read_manifest, resolve_checkpoint  # noqa: E402
from mlm.config import MLAConfig, ModelConfig, MoEConfig, RopeConfig, load_config  # noqa: E402
from mlm.convert import hf as adapters  # noqa: E402
from mlm.convert.hf import config_from_hf, config_to_hf, hf_to_mlm, load_hf_into, mlm_to_hf  # noqa: E402
from mlm.convert.hf import io as hf_io  # noqa: E402
from mlm.errors import MlmError  # noqa: E402
from mlm.model.generate import greedy  # noqa: E402
from mlm.model.gpt import GPT  # noqa: E402
from tests.helpers.common import cli  # noqa: E402
from tests.helpers.hf_models import ARCHS, YARN, gpt2, llama, read_folder, saved, tokens  # noqa: E402

ROPE_BUFFERS = {"model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"}
"""In a transformers 4 model's state dict, not in its files: mlm leaves them out too."""
PADDED = {300: 384, 100: 128}  # vocabulary → mlm's embedding rows (a multiple of 128)


@pytest.fixture(scope="module", params=list(ARCHS))
def pair(request):
    """(name, HF model, mlm model with the same weights, mlm config)."""
    hf = ARCHS[request.param].build()
    cfg = config_from_hf(hf.config.to_dict())
    return request.param, hf, load_hf_into(GPT(cfg).eval(), hf), cfg


def test_logits_and_loss_match(pair):
    name, hf, mlm_model, cfg = pair
    arch, V = ARCHS[name], hf.config.vocab_size
    ids = tokens(2, arch.seq, V, 3)
    with torch.no_grad():
        ref = hf(input_ids=ids, labels=ids)
        logits = mlm_model(ids)
    assert logits.shape == (2, arch.seq, cfg.padded_vocab_size()) and cfg.padded_vocab_size() == PADDED[V]
    logits = logits[..., :V]
    scale = ref.logits.abs().max().item()
    assert scale > 1.0  # the comparison is not between near-zero logits
    torch.testing.assert_close(logits, ref.logits, atol=1e-5 * scale if arch.relative else 1e-5, rtol=0)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))
    tol = 1e-5 * ref.loss.item() if arch.relative else 1e-6
    assert abs(loss.item() - ref.loss.item()) <= tol, (loss.item(), ref.loss.item())
    # the architecture an export picks: the source's, else the one the config implies
    assert adapters.arch_of(cfg, type(hf).__name__) == hf.config.model_type
    assert adapters.arch_of(cfg) == ("llama" if name.startswith("mistral") else hf.config.model_type)


@pytest.mark.parametrize("name", list(ARCHS))
def test_state_round_trip_is_bitwise(tmp_path, name):
    """HF (as saved) → mlm → HF is bitwise, configs included; the model's own state dict (tied
    lm_head, RoPE buffers under transformers 4) converts to the same mlm tensors; the result
    loads in transformers and computes the source's logits."""
    arch, hf = ARCHS[name], ARCHS[name].build()
    src = saved(hf, tmp_path / "hf")
    assert all(any(fragment in k for k in src) for fragment in arch.saved_keys)
    cfg = config_from_hf(json.loads((tmp_path / "hf" / "config.json").read_text()))
    assert cfg == config_from_hf(hf.config.to_dict())
    mlm_state = hf_to_mlm(src, cfg)
    assert mlm_state.keys() == GPT(cfg).state_dict().keys()
    back, hf_config = mlm_to_hf(mlm_state, cfg, hf.config.model_type)
    assert back.keys() == src.keys()
    for k, t in back.items():
        assert t.dtype == src[k].dtype and torch.equal(t, src[k]), k
    again = hf_to_mlm(back, cfg)
    assert all(torch.equal(again[k], v) for k, v in mlm_state.items())
    # in memory: save_pretrained leaves the tied copy and the RoPE buffers out, as mlm_to_hf does
    memory = adapters.saved_state(hf)
    dropped = ROPE_BUFFERS | ({"lm_head.weight"} if cfg.tie_embeddings else set())
    assert back.keys() == memory.keys() - dropped
    from_memory = hf_to_mlm(memory, cfg)
    assert all(torch.equal(from_memory[k], v) for k, v in mlm_state.items())
    # the exported config.json rebuilds the same HF model, and the same mlm config
    assert config_from_hf(hf_config) == cfg
    (tmp_path / "back").mkdir()
    hf_io.write_safetensors(back, tmp_path / "back", 10**9)
    (tmp_path / "back" / "config.json").write_text(json.dumps(hf_config))
    hf2, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "back", attn_implementation="eager", output_loading_info=True
    )
    assert not info["unexpected_keys"] and set(info["missing_keys"]) <= dropped, info
    ids = tokens(1, arch.seq, hf.config.vocab_size, 4)
    with torch.no_grad():
        assert torch.equal(hf2.eval()(input_ids=ids).logits, hf(input_ids=ids).logits)


def _verified(stderr: str) -> tuple[float, float]:
    """(max |diff|, max |logit|) of the CLI's "logits verified" line."""
    m = re.search(
        r"logits verified: max \|diff\| (\S+) ≤ \S+ \(max \|logit\| (\S+)\)", " ".join(stderr.split())
    )
    assert m, stderr
    return float(m[1]), float(m[2])


@pytest.mark.parametrize("name", list(ARCHS))
def test_cli_round_trip(tmp_path, monkeypatch, capsys, name):
    """`mlm convert from-hf` then `mlm export hf` (in this process): the import's logits are
    transformers' (1e-5 absolute; MLA: 1e-5 of the largest logit), its checkpoint says where it
    came from; the export (sharded) holds the saved tensors bit for bit and loads in transformers
    as the same class, which generates the greedy tokens of the imported checkpoint's model."""
    arch, hf = ARCHS[name], ARCHS[name].build()
    cls = type(hf).__name__
    src = saved(hf, tmp_path / "hf")

    def tolerance(logit: float) -> float:
        return 1e-5 * logit if arch.cli_relative else 1e-5

    r = cli(monkeypatch, capsys, "convert", "from-hf", tmp_path / "hf", tmp_path / "ckpt")
    assert r.returncode == 0, r.stderr
    assert f"imported {cls}" in r.stderr and "note:" not in r.stderr, r.stderr
    diff, logit = _verified(r.stderr)
    assert diff <= tolerance(logit) and logit > 1.0, r.stderr
    it_dir = resolve_checkpoint(tmp_path / "ckpt")
    manifest = read_manifest(it_dir)
    assert it_dir.name == "iter_0000000" and {k.split("/")[0] for k in manifest["tensors"]} == {"model"}
    assert manifest["source"]["architecture"] == cls
    cfg = load_config(tmp_path / "ckpt" / "config.toml")
    assert cfg.model == config_from_hf(hf.config.to_dict()) and cfg.preset == ""
    assert manifest["config"]["model"] == json.loads(json.dumps(cfg.to_dict()["model"]))
    toml = (tmp_path / "ckpt" / "config.toml").read_text()
    assert all(line in toml for line in arch.toml), toml

    r = cli(
        monkeypatch, capsys, "export", "hf", tmp_path / "ckpt", tmp_path / "back", "--max-shard-size", "100KB"
    )
    assert r.returncode == 0, r.stderr
    assert f"exported {cls}" in r.stderr and " float32, " in r.stderr, r.stderr
    diff, logit = _verified(r.stderr)
    assert diff <= tolerance(logit), r.stderr
    assert len(hf_io.weight_files(tmp_path / "back")) > 1
    back = read_folder(tmp_path / "back")
    assert back.keys() == src.keys()
    for k, t in back.items():
        assert t.dtype == src[k].dtype and torch.equal(t, src[k]), k
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    assert {k: written[k] for k in arch.exported} == arch.exported

    assert not list(tmp_path.glob("*.tmp-*"))

    # transformers loads the export as it is: the source's class, dtype and logits, mlm's greedy tokens
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(again) is type(hf) and {p.dtype for p in again.parameters()} == {torch.float32}
    ids = tokens(1, 32, hf.config.vocab_size, 0)
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids).logits, hf(input_ids=ids).logits)
    state, _, _ = read_group(tmp_path / "ckpt")
    ours = GPT(cfg.model, state["embed.weight"].shape[0])
    ours.load_state_dict(state)
    prompt = [5, 17, 42, 7, 99, 3]
    with torch.no_grad():
        theirs = again.generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(prompt) :].tolist()
        assert greedy(ours.eval(), prompt, 12) == theirs


# ---------------------------------------------------------------- bad input


def test_unknown_model_type():
    with pytest.raises(MlmError, match=r"model_type='bert'.*llama, gpt2"):
        config_from_hf({"model_type": "bert", "hidden_size": 64})


REFUSED_CONFIGS = [  # (case, change to its config.json, the message)
    ("llama", {"attention_bias": True}, "attention_bias=true"),
    ("llama", {"mlp_bias": True}, "mlp_bias=true"),
    ("llama", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    (
        "llama",
        {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
        "rope_type='yarn'",
    ),
    ("llama", {"hidden_size": None}, "'hidden_size'"),
    ("mistral", {"sliding_window": 64}, "sliding_window=64 < max_position_embeddings=128"),
    # dense Qwen: a sliding window used and shorter than the context; Qwen3's attention biases
    (
        "qwen2-tied",
        {"use_sliding_window": True, "sliding_window": 64},
        "sliding_window=64 < max_position_embeddings=128",
    ),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 32}, "no sliding-window attention"),
    ("qwen3", {"attention_bias": True}, "attention_bias=true"),
    ("qwen2-tied", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("mixtral", {"router_jitter_noise": 0.1}, r"router_jitter_noise=0\.1: mlm's router has no jitter"),
    ("mixtral", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("mixtral", {"sliding_window": 64}, "sliding_window=64 < max_position_embeddings=128"),
    ("qwen2_moe", {"use_sliding_window": True, "sliding_window": 64}, "sliding_window=64 <"),
    ("qwen2_moe", {"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size=0"),
    ("qwen2_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step=0"),
    ("qwen3_moe", {"attention_bias": True}, "attention_bias=true"),
    ("qwen3_moe", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type='yarn'"),
    ("qwen3_moe", {"num_experts_per_tok": 5}, r"router_topk=5 exceeds model\.moe\.num_experts=4"),
    ("qwen3_moe", {"num_local_experts": None, "num_experts": None}, "neither 'num_local_experts'"),
    (
        "deepseek_v3",
        {"topk_group": 1},
        r"num_experts_per_tok=4 with n_group=4, topk_group=1: transformers scores each "
        r"group by the sum of its top 2 experts.*here 4 ≠ 2",
    ),
    ("deepseek_v3", {"norm_topk_prob": False}, r"norm_topk_prob=false with num_experts_per_tok=4"),
    (
        "deepseek_v3",
        {"num_experts_per_tok": 1, "n_group": 1},
        r"norm_topk_prob=true with num_experts_per_tok=1",
    ),
    ("deepseek_v3", {"num_key_value_heads": 2}, r"num_key_value_heads=2 ≠ num_attention_heads=4"),
    ("deepseek_v3", {"attention_bias": True}, r"attention_bias=true"),
    ("deepseek_v3", {"scoring_func": "softmax"}, r"scoring_func='softmax'"),
    ("deepseek_v3", {"n_shared_experts": 0}, r"n_shared_experts=0"),
    (
        "deepseek_v3",
        {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}},
        r"rope_type='llama3'",
    ),
    (
        "deepseek_v3",
        {"rope_parameters": {**YARN, "attention_factor": 1.2, "rope_theta": 1e4}},
        r"attention_factor=1\.2",
    ),
    (
        "deepseek_v3",
        {"num_nextn_predict_layers": 1, "first_k_dense_replace": 3},
        r"first_k_dense_replace=3 with num_hidden",
    ),
]


@pytest.mark.parametrize(
    "name, change, match", REFUSED_CONFIGS, ids=[f"{n}-{'-'.join(c)}" for n, c, _ in REFUSED_CONFIGS]
)
def test_unsupported_config_is_refused(name, change, match):
    hf = ARCHS[name].build()
    d = hf.config.to_dict()
    d.update(change)
    with pytest.raises(MlmError, match=match):
        config_from_hf(d)
    if "use_sliding_window" in change:  # a window that is not used is no obstacle
        d.update(use_sliding_window=False)
        assert config_from_hf(d).num_layers == hf.config.num_hidden_layers


def _replace(cfg: ModelConfig, **fields) -> ModelConfig:
    return ModelConfig(**{**vars(cfg), **fields})


LOAD_MISMATCHES = [  # (case, the mlm config from (HF config.json, its mlm config), the message)
    (
        "llama",
        lambda d, cfg: config_from_hf(dict(d, rope_parameters={"rope_type": "default", "rope_theta": 1e4})),
        r"model\.rope\.scaling_factor: mlm None, Hugging Face 8\.0",
    ),
    (
        "qwen2_moe",
        lambda d, cfg: _replace(cfg, moe=MoEConfig(**{**vars(cfg.moe), "router_pre_softmax": False})),
        r"model\.moe\.router_pre_softmax: mlm False, Hugging Face True",
    ),
    (
        "deepseek_v3-yarn",
        lambda d, cfg: _replace(cfg, mla=MLAConfig(**{**vars(cfg.mla), "kv_lora_rank": 16})),
        r"model\.mla\.kv_lora_rank: mlm 16, Hugging Face 12",
    ),
    (
        "deepseek_v3-yarn",
        lambda d, cfg: _replace(cfg, rope=RopeConfig(**{**vars(cfg.rope), "yarn_mscale_all_dim": 0.0})),
        r"model\.rope\.yarn_mscale_all_dim: mlm 0\.0, Hugging Face 1\.0",
    ),
]


@pytest.mark.parametrize(
    "name, other, match",
    LOAD_MISMATCHES,
    ids=["llama-rope", "qwen2_moe-router", "deepseek_v3-mla", "deepseek_v3-yarn"],
)
def test_load_into_a_model_of_another_config(name, other, match):
    hf = ARCHS[name].build()
    d = hf.config.to_dict()
    with pytest.raises(MlmError, match=match):
        load_hf_into(GPT(other(d, config_from_hf(d))), hf)


def _config_of(name: str) -> ModelConfig:
    return config_from_hf(ARCHS[name].build().config.to_dict())


def _deepseek_with_softmax_router() -> ModelConfig:
    cfg = _config_of("deepseek_v3")
    moe = {**vars(cfg.moe), "router_score_function": "softmax", "router_enable_expert_bias": False}
    return _replace(cfg, moe=MoEConfig(**moe))


_MOE_BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, mlp_kind="moe")
_MIXED = lambda: ModelConfig(**_MOE_BASE, mlp_kind_freq=[1, 0], moe=MoEConfig(num_experts=4))  # noqa: E731
EXPORT_REFUSALS = [  # (the mlm config, the architecture asked for, the message)
    (lambda: _config_of("gpt2"), "llama", r"model\.normalization='layernorm' \(needs 'rmsnorm'\)"),
    (lambda: _config_of("qwen3"), "qwen2", "as Hugging Face qwen2: model.qkv_bias=False"),
    (lambda: ModelConfig(qkv_bias=True), "llama", r"model\.qkv_bias=True \(needs False\)"),
    (
        lambda: ModelConfig(**_MOE_BASE, moe=MoEConfig(num_experts=4, router_score_function="sigmoid")),
        "mixtral",
        r"mixtral: model\.moe\.router_score_function='sigmoid' \(needs 'softmax'\)",
    ),
    (
        lambda: ModelConfig(
            **_MOE_BASE,
            moe=MoEConfig(num_experts=4, router_score_function="sigmoid", router_enable_expert_bias=True),
        ),
        "qwen3_moe",
        r"model\.moe\.router_enable_expert_bias=True \(needs False\)",
    ),
    (_MIXED, "mixtral", r"layer kinds .*'dense'.* \(needs only \('gqa', 'moe'\)\)"),
    (_MIXED, "qwen2_moe", "shared_expert_ffn_hidden_size is unset"),
    (_MIXED, "qwen3_moe", r"model\.qk_norm=False \(needs True\)"),
    (
        lambda: ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4),
        "deepseek_v3",
        r"layer kinds \[\('gqa', 'dense'\)\] \(needs only \('mla', 'dense'\)",
    ),
    (_deepseek_with_softmax_router, "deepseek_v3", r"router_score_function='softmax' \(needs 'sigmoid'\)"),
    # MLA or MTP cannot be written as another architecture
    (
        lambda: _config_of("deepseek_v3"),
        "qwen3_moe",
        r"layer kinds .*'mla'.* \(needs only \('gqa', 'dense'\)",
    ),
    (
        lambda: ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, mtp_num_layers=1),
        "llama",
        r"model\.mtp_num_layers=1 \(needs 0: no multi-token prediction",
    ),
]


@pytest.mark.parametrize(
    "make, arch, match", EXPORT_REFUSALS, ids=[f"{i}-as-{a}" for i, (_, a, _) in enumerate(EXPORT_REFUSALS)]
)
def test_export_of_a_config_hf_cannot_express(make, arch, match):
    with pytest.raises(MlmError, match=match):
        config_to_hf(make(), arch)


@pytest.mark.parametrize(
    "make, change, key, shapes",
    [
        (  # a state tensor of another shape
            lambda: llama(tie=False),
            lambda state, d: ({**state, "model.layers.1.self_attn.k_proj.weight": torch.zeros(64, 64)}, d),
            "model.layers.1.self_attn.k_proj.weight",
            ("[64, 64]", "[32, 64]"),
        ),
        (  # a config of another vocabulary
            lambda: gpt2(tie=True),
            lambda state, d: (state, dict(d, vocab_size=301)),
            "transformer.wte.weight",
            ("[300, 64]", "[301, 64]"),
        ),
    ],
    ids=["llama-state", "gpt2-config"],
)
def test_shape_mismatch_names_key_and_both_shapes(make, change, key, shapes):
    hf = make()
    state, d = change(dict(hf.state_dict()), hf.config.to_dict())
    with pytest.raises(MlmError) as e:
        hf_to_mlm(state, config_from_hf(d))
    msg = str(e.value)
    assert key in msg and all(s in msg for s in shapes), msg
