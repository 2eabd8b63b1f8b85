"""`mlm export trtllm`: TensorRT-LLM checkpoints written as TensorRT-LLM's own converters write them.

Tiny random Llama (GQA), Llama-3.1 RoPE scaling (one KV head, tied), GPT-2 and Mixtral (MoE)
checkpoints are exported at (tp, pp) in {(1,1), (2,1), (1,2), (2,2)} and read back: every global
tensor bit for bit and the same logits. The names and per-rank shapes are checked against tables
written by hand from TensorRT-LLM's converters (not from mlm's code), as are config.json's fields,
the crossed SwiGLU names, the per-rank QKV with KV heads repeated over tp, lm_head's padding, and
Mixtral's float32 router and stacked experts (up then gate, F split over tp). `--check` must catch
a wrong name, shape, dtype and mapping; a checkpoint trained at tp 2 exports to tp 1 and tp 4; bad
input, and every MoE variant TensorRT-LLM's layout cannot hold, gives one message.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from mlm.checkpoint import read_group
from mlm.checkpoint.manager import save_streaming
from mlm.config import Config, DataConfig, ModelConfig, MoEConfig, RopeConfig, load_config
from mlm.convert.trtllm.check import check_trtllm
from mlm.convert.trtllm.exporter import export_trtllm
from mlm.convert.trtllm.importer import read_trtllm
from mlm.errors import MlmError
from mlm.model.gpt import GPT
from mlm.verify import prompt_logits
from tests.helpers.common import tiny_sets


def mlm(monkeypatch, capsys, *args) -> tuple[int, str, str]:
    """Run the CLI in this process (as `mlm ARGS`): (exit code, stdout, stderr with lines unwrapped)."""
    from cli.main import main

    monkeypatch.setattr(sys, "argv", ["mlm", *map(str, args)])
    try:
        main()
    except SystemExit as e:
        code = e.code or 0
    out, err = capsys.readouterr()
    return code, out, " ".join(err.split())


V = 301  # odd: lm_head pads to a multiple of tp
MODELS = {
    "llama-gqa": dict(num_layers=3, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96),
    "llama3-rope": dict(
        num_layers=2,
        num_attention_heads=4,
        num_query_groups=1,
        ffn_hidden_size=96,
        rope=RopeConfig(base=500000.0, scaling_factor=8.0, original_max_position_embeddings=32),
        tie_embeddings=True,
    ),
    "llama-head-dim": dict(  # head_size 32 ≠ hidden / heads (kv_channels)
        num_layers=2, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96, kv_channels=32
    ),
    "mixtral": dict(  # every layer MoE: 4 experts of F 48, top-2 (ffn_hidden_size is unused)
        num_layers=3,
        num_attention_heads=4,
        num_query_groups=2,
        mlp_kind="moe",
        moe=MoEConfig(num_experts=4, ffn_hidden_size=48, router_topk=2),
    ),
    "gpt2": dict(
        num_layers=2,
        num_attention_heads=4,
        normalization="layernorm",
        position_embedding="learned",
        activation="gelu_tanh",
        add_bias=True,
        tie_embeddings=True,
    ),
}
MESHES = [(1, 1), (2, 1), (1, 2), (2, 2)]


def model_config(name: str) -> ModelConfig:
    return ModelConfig(
        hidden_size=64, vocab_size=V, max_position_embeddings=64, norm_eps=1e-5, **MODELS[name]
    )


def write_checkpoint(path, cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """A checkpoint of random weights of order 0.1 (norm gains around 1, vocabulary padding rows 0),
    so that logits are O(1) and a misplaced tensor shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in GPT(cfg).state_dict().items()}
    state = {}
    for k, shape in shapes.items():
        t = 0.1 * torch.randn(shape, generator=gen)
        if k.endswith("norm.weight"):
            t += 1.0
        if k in ("embed.weight", "output.weight"):
            t[V:] = 0
        state[k] = t
    extra = {"config": Config(model=cfg, data=DataConfig(seq_length=64)).to_dict()}
    save_streaming(path, 0, (("model", k, t, tuple(t.shape)) for k, t in state.items()), extra, ["model"])
    return state


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("src")
    return {name: (root / name, write_checkpoint(root / name, model_config(name))) for name in MODELS}


def assert_same_model(state, cfg, back, back_cfg):
    assert back.keys() == state.keys()
    for k, t in state.items():
        assert torch.equal(back[k][: t.shape[0]], t), k  # bit for bit (vocabulary padding may differ)
        assert not back[k][t.shape[0] :].any(), k
    assert torch.equal(
        prompt_logits(back, back_cfg, back["embed.weight"].shape[0]),
        prompt_logits(state, cfg, state["embed.weight"].shape[0]),
    )


@pytest.mark.parametrize("tp,pp", MESHES, ids=[f"tp{t}pp{p}" for t, p in MESHES])
@pytest.mark.parametrize("name", list(MODELS))
def test_round_trip_every_mesh(ckpts, tmp_path, name, tp, pp):
    src, state = ckpts[name]
    report = export_trtllm(src, tmp_path / "trt", tp=tp, pp=pp)
    assert report.max_abs_diff == 0.0 and report.dtype == "float32"
    assert sorted(p.name for p in (tmp_path / "trt").iterdir()) == sorted(
        ["config.json", *(f"rank{r}.safetensors" for r in range(tp * pp))]
    )
    assert check_trtllm(tmp_path / "trt") == []
    back_cfg, back = read_trtllm(tmp_path / "trt")
    assert_same_model(state, model_config(name), back, back_cfg)


# Per-rank names and shapes written by hand from TensorRT-LLM's converters
# (NVIDIA/TensorRT-LLM tensorrt_llm/models/llama/convert.py `load_weights_from_hf_model` and
# tensorrt_llm/models/gpt/convert.py `load_weights_from_hf_model`; docs/source/architecture/checkpoint.md):
# layers renumbered per pipeline stage, Mapping.pp_layers giving the extra layer to the first stage,
# qkv = (H/tp + 2·max(G/tp, 1))·K rows, vocab_embedding unsplit, lm_head ceil(V/tp) rows per rank.
LLAMA_LAYER = {  # D 64, H 4, G 2, K 16, F 96 at tp 2: qkv (2 + 2·1)·16 = 64 rows
    "input_layernorm.weight": (64,),
    "attention.qkv.weight": (64, 64),
    "attention.dense.weight": (64, 32),
    "post_layernorm.weight": (64,),
    "mlp.fc.weight": (48, 64),
    "mlp.gate.weight": (48, 64),
    "mlp.proj.weight": (64, 48),
}
LLAMA_TP2_PP2 = {  # 3 layers: stage 0 holds layers 0, 1; stage 1 layer 2 (as its layer 0)
    0: {
        "transformer.vocab_embedding.weight": (301, 64),
        **{f"transformer.layers.{i}.{k}": s for i in (0, 1) for k, s in LLAMA_LAYER.items()},
    },
    1: {
        **{f"transformer.layers.0.{k}": s for k, s in LLAMA_LAYER.items()},
        "transformer.ln_f.weight": (64,),
        "lm_head.weight": (151, 64),
    },
}
GPT2_LAYER = {  # D 64, H 4, F 256 at tp 2: qkv 3·64/2 = 96 rows; row-parallel biases whole
    "input_layernorm.weight": (64,),
    "input_layernorm.bias": (64,),
    "attention.qkv.weight": (96, 64),
    "attention.qkv.bias": (96,),
    "attention.dense.weight": (64, 32),
    "attention.dense.bias": (64,),
    "post_layernorm.weight": (64,),
    "post_layernorm.bias": (64,),
    "mlp.fc.weight": (128, 64),
    "mlp.fc.bias": (128,),
    "mlp.proj.weight": (64, 128),
    "mlp.proj.bias": (64,),
}
GPT2_TP2 = {
    "transformer.vocab_embedding.weight": (301, 64),
    "transformer.position_embedding.weight": (64, 64),
    **{f"transformer.layers.{i}.{k}": s for i in (0, 1) for k, s in GPT2_LAYER.items()},
    "transformer.ln_f.weight": (64,),
    "transformer.ln_f.bias": (64,),
    "lm_head.weight": (151, 64),
}


# Mixtral (tensorrt_llm/models/llama/convert.py `load_weights_from_hf_model`, the MoE branch;
# tensorrt_llm/layers/moe.py `MixtureOfExperts`): E 4, F 48, D 64 at tp 2 (moe_tp_size = tp):
# router [E, D] whole and float32, fc [E, 2·F/tp, D], proj [E, D, F/tp]
MIXTRAL_LAYER = {
    **{k: s for k, s in LLAMA_LAYER.items() if not k.startswith("mlp.")},
    "mlp.router.weight": (4, 64),
    "mlp.fc.weight": (4, 48, 64),
    "mlp.proj.weight": (4, 64, 24),
}
MIXTRAL_TP2 = {
    "transformer.vocab_embedding.weight": (301, 64),
    **{f"transformer.layers.{i}.{k}": s for i in (0, 1, 2) for k, s in MIXTRAL_LAYER.items()},
    "transformer.ln_f.weight": (64,),
    "lm_head.weight": (151, 64),
}


def _shapes(path, rank):
    return {k: tuple(t.shape) for k, t in load_file(path / f"rank{rank}.safetensors").items()}


def test_names_and_shapes_match_tensorrt_llm(ckpts, tmp_path):
    export_trtllm(ckpts["llama-gqa"][0], tmp_path / "llama", tp=2, pp=2)
    for rank in range(4):  # rank = pp_rank · tp + tp_rank
        assert _shapes(tmp_path / "llama", rank) == LLAMA_TP2_PP2[rank // 2], rank
    export_trtllm(ckpts["gpt2"][0], tmp_path / "gpt2", tp=2)
    for rank in range(2):
        assert _shapes(tmp_path / "gpt2", rank) == GPT2_TP2, rank
    export_trtllm(ckpts["mixtral"][0], tmp_path / "mixtral", tp=2)
    for rank in range(2):
        assert _shapes(tmp_path / "mixtral", rank) == MIXTRAL_TP2, rank


def test_mixtral_experts_land_where_tensorrt_llm_puts_them(ckpts, tmp_path):
    src, state = ckpts["mixtral"]
    export_trtllm(src, tmp_path / "tp2", tp=2, dtype="bf16")
    ranks = [load_file(tmp_path / "tp2" / f"rank{r}.safetensors") for r in (0, 1)]
    s = {k: t.bfloat16() for k, t in state.items()}
    up, gate, down = (s[f"layers.1.mlp.experts.{x}.weight"] for x in ("up", "gate", "down"))  # [E, F, D]
    for r, f in enumerate(ranks):  # fc = [w3 (HF up, linear); w1 (HF gate, SiLU'd)], F split first
        rows = slice(24 * r, 24 * (r + 1))
        fc = f["transformer.layers.1.mlp.fc.weight"]
        assert torch.equal(fc, torch.cat([up[:, rows], gate[:, rows]], 1)), r
        assert torch.equal(f["transformer.layers.1.mlp.proj.weight"], down[:, :, rows]), r
        router = f["transformer.layers.1.mlp.router.weight"]
        assert router.dtype == torch.float32  # TensorRT-LLM's router is float32 whatever the dtype
        assert torch.equal(router, state["layers.1.mlp.router.weight"]), r
    c = json.loads((tmp_path / "tp2" / "config.json").read_text())
    # LLaMAConfig.from_hugging_face for HF mixtral: hidden_act swiglu, intermediate_size the
    # experts', MoeConfig(num_experts, top_k, normalization_mode=RENORMALIZE = 1)
    assert c["architecture"] == "MixtralForCausalLM" and c["hidden_act"] == "swiglu"
    assert c["intermediate_size"] == 48 and c["dtype"] == "bfloat16"
    assert c["moe"] == {"num_experts": 4, "top_k": 2, "normalization_mode": 1}
    assert c["mapping"] == {"world_size": 2, "tp_size": 2, "pp_size": 1}  # moe_tp_size defaults to tp
    assert check_trtllm(tmp_path / "tp2") == []
    back_cfg, back = read_trtllm(tmp_path / "tp2")
    assert back_cfg.layer_specs()[0].mlp == "moe" and back_cfg.expert_ffn_size == 48
    assert (back_cfg.moe.num_experts, back_cfg.moe.router_topk) == (4, 2)
    assert back["layers.1.mlp.router.weight"].dtype == torch.float32


def test_values_land_where_tensorrt_llm_puts_them(ckpts, tmp_path):
    src, state = ckpts["llama-gqa"]
    export_trtllm(src, tmp_path / "tp2", tp=2, pp=2, dtype="bf16")
    last = [load_file(tmp_path / "tp2" / f"rank{r}.safetensors") for r in (2, 3)]  # stage 1: layer 2
    s = {k: t.bfloat16() for k, t in state.items()}
    # HF gate_proj (mlm mlp.gate, the silu input) is TensorRT-LLM's mlp.fc; up_proj is mlp.gate
    assert torch.equal(last[1]["transformer.layers.0.mlp.fc.weight"], s["layers.2.mlp.gate.weight"][48:])
    assert torch.equal(last[1]["transformer.layers.0.mlp.gate.weight"], s["layers.2.mlp.up.weight"][48:])
    assert torch.equal(last[1]["transformer.layers.0.mlp.proj.weight"], s["layers.2.mlp.down.weight"][:, 48:])
    # tp rank 1: q heads 2, 3, then its KV head 1's k, then v (K = 16)
    q, k, v = (s[f"layers.2.attn.{x}.weight"] for x in "qkv")
    want = torch.cat([q[32:64], k[16:32], v[16:32]])
    assert torch.equal(last[1]["transformer.layers.0.attention.qkv.weight"], want)
    # lm_head: 301 rows padded to 302, split 151 + 151; the padding row is zero
    head = torch.cat([r["lm_head.weight"] for r in last])
    assert torch.equal(head[:V], s["output.weight"][:V]) and not head[V:].any()
    assert last[0]["lm_head.weight"].dtype == torch.bfloat16


def test_kv_heads_repeat_when_fewer_than_tp(ckpts, tmp_path):
    src, state = ckpts["llama-gqa"]  # 2 KV heads over 4 tp ranks: ranks 0, 1 hold head 0; 2, 3 head 1
    export_trtllm(src, tmp_path / "tp4", tp=4)
    k = state["layers.1.attn.k.weight"]
    for rank in range(4):
        qkv = load_file(tmp_path / "tp4" / f"rank{rank}.safetensors")[
            "transformer.layers.1.attention.qkv.weight"
        ]
        assert qkv.shape == (48, 64)  # 1 q head + 1 k + 1 v, 16 rows each
        g = rank // 2
        assert torch.equal(qkv[16:32], k[16 * g : 16 * (g + 1)]), rank


def test_config_has_what_pretrained_config_reads(ckpts, tmp_path):
    export_trtllm(ckpts["llama3-rope"][0], tmp_path / "llama", tp=2, pp=2, dtype="bfloat16")
    c = json.loads((tmp_path / "llama" / "config.json").read_text())
    # PretrainedConfig's fields (docs/source/architecture/checkpoint.md's table) and LLaMAConfig's
    assert c["architecture"] == "LlamaForCausalLM" and c["dtype"] == "bfloat16"
    assert (c["vocab_size"], c["hidden_size"], c["num_hidden_layers"]) == (301, 64, 2)
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_size"]) == (4, 1, 16)
    assert (c["intermediate_size"], c["max_position_embeddings"], c["norm_epsilon"]) == (96, 64, 1e-5)
    assert c["hidden_act"] == "silu" and c["position_embedding_type"] == "rope_gpt_neox"
    assert c["rotary_base"] == 500000.0 and c["tie_word_embeddings"] is True
    assert c["rotary_scaling"]["rope_type"] == "llama3" and c["rotary_scaling"]["factor"] == 8.0
    assert c["rotary_scaling"]["original_max_position_embeddings"] == 32
    assert c["mapping"] == {"world_size": 4, "tp_size": 2, "pp_size": 2}
    assert c["quantization"]["quant_algo"] is None and c["quantization"]["kv_cache_quant_algo"] is None
    assert c["use_parallel_embedding"] is False and c["logits_dtype"] == "float32"
    export_trtllm(ckpts["gpt2"][0], tmp_path / "gpt2")
    g = json.loads((tmp_path / "gpt2" / "config.json").read_text())
    assert g["architecture"] == "GPTForCausalLM" and g["hidden_act"] == "gelu_new" and g["bias"] is True
    assert g["position_embedding_type"] == "learned_absolute" and g["num_key_value_heads"] == 4


def _edit(path, fn):
    tensors = load_file(path)
    fn(tensors)
    save_file(tensors, path)


def test_check_catches_each_kind_of_damage(ckpts, tmp_path):
    export_trtllm(ckpts["gpt2"][0], tmp_path / "good", tp=2)

    def damaged(name, fn):
        d = tmp_path / name
        shutil.copytree(tmp_path / "good", d)
        fn(d)
        return " | ".join(check_trtllm(d))

    def rename(t):
        t["transformer.layers.0.attention.qkv_proj.weight"] = t.pop(
            "transformer.layers.0.attention.qkv.weight"
        )

    def cut(t):
        t["lm_head.weight"] = t["lm_head.weight"][:150].contiguous()

    def half(t):
        t["transformer.layers.1.mlp.fc.bias"] = t["transformer.layers.1.mlp.fc.bias"].half()

    def mapping(d):
        c = json.loads((d / "config.json").read_text())
        c["mapping"]["world_size"] = 3
        (d / "config.json").write_text(json.dumps(c))

    got = damaged("name", lambda d: _edit(d / "rank0.safetensors", rename))
    assert "rank0.safetensors: transformer.layers.0.attention.qkv.weight is missing" in got
    assert (
        "rank0.safetensors: transformer.layers.0.attention.qkv_proj.weight is not a tensor of this rank"
        in got
    )
    got = damaged("shape", lambda d: _edit(d / "rank1.safetensors", cut))
    assert got == "rank1.safetensors: lm_head.weight has shape [150, 64], the config needs [151, 64]"
    got = damaged("dtype", lambda d: _edit(d / "rank1.safetensors", half))
    assert (
        got == "rank1.safetensors: transformer.layers.1.mlp.fc.bias is float16, config.json dtype is float32"
    )
    got = damaged("mapping", mapping)
    assert "world_size=3 must equal tp_size(2) × pp_size(1)" in got
    got = damaged("missing", lambda d: (d / "rank1.safetensors").unlink())
    assert got == "rank1.safetensors is missing (mapping world_size=2)"


def test_a_moe_trained_with_token_dropping_exports_dropless(tmp_path):
    dropless = model_config("mixtral")
    cfg = dataclasses.replace(dropless, moe=dataclasses.replace(dropless.moe, capacity_factor=0.5))
    state = write_checkpoint(tmp_path / "src", cfg)
    rows = state["embed.weight"].shape[0]
    assert not torch.equal(prompt_logits(state, cfg, rows), prompt_logits(state, dropless, rows))  # it drops
    report = export_trtllm(tmp_path / "src", tmp_path / "trt")  # verified against the dropless model
    assert report.max_abs_diff == 0.0
    back_cfg, back = read_trtllm(tmp_path / "trt")
    assert back_cfg.moe.capacity_factor is None
    assert_same_model(state, dropless, back, back_cfg)


def test_check_and_reader_refuse_moe_they_cannot_hold(ckpts, tmp_path):
    export_trtllm(ckpts["mixtral"][0], tmp_path / "good", tp=2)

    def damaged(name, fn):
        d = tmp_path / name
        shutil.copytree(tmp_path / "good", d)
        fn(d)
        return " | ".join(check_trtllm(d))

    def bf16_router(t):
        t["transformer.layers.0.mlp.router.weight"] = t["transformer.layers.0.mlp.router.weight"].bfloat16()

    def config(**fields):
        def edit(d):
            c = json.loads((d / "config.json").read_text())
            for k, v in fields.items():
                c[k] = {**c[k], **v}
            (d / "config.json").write_text(json.dumps(c))

        return edit

    got = damaged("router", lambda d: _edit(d / "rank0.safetensors", bf16_router))
    assert got == (
        "rank0.safetensors: transformer.layers.0.mlp.router.weight is bfloat16, TensorRT-LLM stores it in float32"
    )
    got = damaged("mode", config(moe={"normalization_mode": 0}))
    assert got == "config.json moe: normalization_mode=0 (mlm reads 1, RENORMALIZE)"
    got = damaged("ep", config(mapping={"moe_tp_size": 1, "moe_ep_size": 2}))
    assert "config.json moe: mapping {'moe_tp_size': 1, 'moe_ep_size': 2, 'moe_cluster_size': -1}" in got
    assert "moe_tp_size = tp_size, moe_ep_size 1" in got


MOE = dict(num_layers=2, hidden_size=64, mlp_kind="moe", moe=MoEConfig(num_experts=4, router_topk=2))


@pytest.mark.parametrize(
    "model,moe,message",
    [
        (
            {},
            {"shared_expert_ffn_hidden_size": 32, "shared_expert_gate": True},
            "(a shared expert with a gate)",
        ),
        (
            {},
            {"router_pre_softmax": True},
            "model.moe.router_pre_softmax=true (top-k weights not renormalised)",
        ),
        (
            {},
            {"router_num_groups": 2, "router_group_topk": 1},
            "model.moe.router_num_groups=2 (group-limited routing)",
        ),
        (
            {},
            {"router_score_function": "sigmoid", "router_enable_expert_bias": True},
            "model.moe.router_score_function='sigmoid' (needs 'softmax'); "
            "model.moe.router_enable_expert_bias=true (a selection bias on the router)",
        ),
        ({}, {"router_topk_scaling_factor": 2.5}, "model.moe.router_topk_scaling_factor=2.5"),
        (
            {},
            {"num_experts": 1, "router_topk": 1},
            "model.moe.num_experts=1 (TensorRT-LLM builds a dense MLP",
        ),
        ({"activation": "gelu"}, {}, "model.activation='gelu'"),
        ({"first_k_dense": 1}, {}, "this model mixes dense and MoE layers (model.first_k_dense"),
        ({"qk_norm": True}, {}, "this model (model.qk_norm=true) has no TensorRT-LLM architecture"),
    ],
)
def test_moe_variants_mixtral_cannot_hold_are_refused(model, moe, message):
    from mlm.convert.trtllm.config import architecture

    cfg = ModelConfig(**{**MOE, **model, "moe": MoEConfig(**{"num_experts": 4, "router_topk": 2, **moe})})
    with pytest.raises(MlmError) as e:
        architecture(cfg)
    assert message in str(e.value)
    if "mixes" not in message and "qk_norm" not in message:
        assert str(e.value).startswith("this MoE model has no TensorRT-LLM layout mlm exports: ")
        assert "MixtralForCausalLM (every layer MoE" in str(e.value)
    if "qk_norm" not in message:
        assert str(e.value).endswith("export it to Hugging Face instead (mlm export hf CKPT OUT)")


def test_cli_export_check_and_import_back(ckpts, tmp_path, monkeypatch, capsys):
    src, state = ckpts["llama3-rope"]
    code, out, err = mlm(
        monkeypatch, capsys, "export", "trtllm", src, tmp_path / "trt", "--tp", 2, "--dtype", "bf16"
    )
    assert code == 0, err
    n = 64  # max_position_embeddings
    assert out.strip() == (
        f"trtllm-build --checkpoint_dir {tmp_path / 'trt'} --output_dir {tmp_path / 'trt'}-engine "
        f"--gemm_plugin auto --max_batch_size 8 --max_input_len {n} --max_seq_len {n} --workers 2"
    )
    assert "exported LlamaForCausalLM" in err and "read back bit for bit" in err and "bfloat16" in err
    code, out, err = mlm(monkeypatch, capsys, "export", "trtllm", "--check", tmp_path / "trt")
    assert code == 0 and "a valid TensorRT-LLM checkpoint" in err
    code, out, err = mlm(monkeypatch, capsys, "convert", "from-trtllm", tmp_path / "trt", tmp_path / "back")
    assert code == 0 and "imported LlamaForCausalLM" in err and "bfloat16" in err, err
    back, manifest, _ = read_group(tmp_path / "back")
    assert manifest["source"]["architecture"] == "LlamaForCausalLM"
    cfg = load_config(tmp_path / "back" / "config.toml").model
    assert cfg.rope.scaling_factor == 8.0 and cfg.tie_embeddings and "output.weight" not in back
    bf16 = {k: t.bfloat16() for k, t in state.items()}
    assert_same_model(bf16, model_config("llama3-rope"), back, cfg)


def _train_rank(rank, world, sets):
    from mlm.train.trainer import Trainer

    return Trainer(load_config(None, sets)).train()


def test_a_checkpoint_trained_at_tp2_exports_to_tp1_and_tp4(tmp_path, tiny_data):
    from tests.helpers.distributed import run_ranks

    model = {"model.num_attention_heads": 4, "model.num_query_groups": 2, "model.num_layers": 2}
    sets = tiny_sets(
        tmp_path / "run",
        tiny_data,
        **model,
        **{"parallel.tp": 2, "train.train_iters": 1, "checkpoint.save": f"'{tmp_path / 'ckpt'}'"},
    )
    run_ranks(2, _train_rank, sets)
    state, manifest, _ = read_group(tmp_path / "ckpt")
    assert manifest["mesh"]["tp"] == 2 and state["embed.weight"].shape[0] == 512  # 512 = 128 · 2 · 2
    for tp in (1, 4):
        assert export_trtllm(tmp_path / "ckpt", tmp_path / f"tp{tp}", tp=tp).max_abs_diff == 0.0
        assert check_trtllm(tmp_path / f"tp{tp}") == []


def test_bad_input(ckpts, tmp_path, monkeypatch, capsys):
    llama = ckpts["llama-gqa"][0]
    with pytest.raises(MlmError, match=r"--dtype 'int8': choose one of bfloat16, float16, float32"):
        export_trtllm(llama, tmp_path / "a", dtype="int8")
    with pytest.raises(MlmError, match=r"--tp 3 does not divide model.num_attention_heads=4"):
        export_trtllm(llama, tmp_path / "b", tp=3)
    with pytest.raises(MlmError, match=r"--pp 4 is more than model.num_layers=3"):
        export_trtllm(llama, tmp_path / "c", pp=4)
    (tmp_path / "exists").mkdir()
    with pytest.raises(MlmError, match=r"exists already exists; pass a new output path"):
        export_trtllm(llama, tmp_path / "exists")
    erf = model_config("gpt2")
    erf.activation = "gelu"
    write_checkpoint(tmp_path / "erf", erf)
    with pytest.raises(MlmError, match=r"no TensorRT-LLM architecture mlm exports.*tanh"):
        export_trtllm(tmp_path / "erf", tmp_path / "d")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["erf", "exists"]  # nothing left behind
    code, _, err = mlm(monkeypatch, capsys, "export", "trtllm", llama, tmp_path / "e", "--tp", 3)
    assert code == 2 and err.startswith("error: --tp 3 does not divide model.num_attention_heads=4"), err
    assert not (tmp_path / "e").exists()
    code, _, err = mlm(monkeypatch, capsys, "export", "trtllm", "--check", tmp_path / "erf")
    assert code == 2 and "config.json: not found; is it a TensorRT-LLM checkpoint folder?" in err, err


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(MODELS))
def test_tensorrt_llm_loads_the_export(ckpts, tmp_path, name):
    """TensorRT-LLM's own classes read the config and load every rank's weights (GPU machines)."""
    pytest.importorskip("tensorrt_llm")
    from tensorrt_llm.models import MODEL_MAP
    from tensorrt_llm.models.modeling_utils import PretrainedConfig

    export_trtllm(ckpts[name][0], tmp_path / "trt", tp=2, pp=2, dtype="float16")
    config = PretrainedConfig.from_checkpoint(str(tmp_path / "trt"))
    assert (config.mapping.world_size, config.mapping.tp_size, config.mapping.pp_size) == (4, 2, 2)
    for rank in range(4):  # load() raises on a missing name or a wrong shape
        MODEL_MAP[config.architecture].from_checkpoint(str(tmp_path / "trt"), rank=rank)
