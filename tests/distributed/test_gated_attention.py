"""Qwen3-Next's attention in mlm's "gqa" mixer, as three model options: zero-centred norms
(model.norm_zero_centered), the attention output gate (model.attention_output_gate) and partial
RoPE (model.rotary_percent).

The mixer with all three against transformers' `Qwen3NextAttention` on the same weights (fp32,
1e-5 relative; HF's q_proj holds [query | gate] per head, mlm's `q` and `gate` apart); the
zero-centred RMSNorm bitwise `Qwen3NextRMSNorm` in fp32 and its weights 0 in a fresh model; a
tiny GPT with the options trains under tp 2 with sequence parallelism as one process does
(test_parallel_training's tolerance); the planner counts its parameters and what a layer saves;
serving generates the training forward's greedy tokens; the config refuses an odd number of
rotated dims and partial RoPE with MLA. model.kernels=triton against torch: tests/unit/test_kernels.py
(case qwen3-next-attention).
"""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3NextConfig
from transformers.models.qwen3_next.modeling_qwen3_next import (
    Qwen3NextAttention,
    Qwen3NextRMSNorm,
    Qwen3NextRotaryEmbedding,
)

from mlm.config import MLAConfig, ModelConfig, load_config
from mlm.errors import MlmError
from mlm.layout import Layout
from mlm.model import build_model
from mlm.model.kinds.gqa.module import Attention
from mlm.model.kinds.norms.module import LayerNorm, RMSNorm
from mlm.model.rope import rope_tables
from mlm.plan.memory import layer_activation_bytes
from tests.helpers.common import saved_storages
from tests.helpers.distributed import run_ranks
from tests.helpers.parallel import assert_matches, reference_run, run_sets, train_rank

QWEN3_NEXT_ATTENTION = {
    "model.qk_norm": "true",
    "model.norm_zero_centered": "true",
    "model.attention_output_gate": "true",
    "model.rotary_percent": 0.25,  # 4 of each head's 16 dims
    "train.train_iters": 3,
}
TINY = ModelConfig(
    hidden_size=32,
    num_attention_heads=4,
    num_query_groups=2,
    kv_channels=16,
    qk_norm=True,
    norm_zero_centered=True,
    attention_output_gate=True,
    rotary_percent=0.25,
    norm_eps=1e-6,
    attention_backend="sdpa",
)


def _hf_attention() -> tuple[Qwen3NextAttention, Qwen3NextRotaryEmbedding]:
    config = Qwen3NextConfig(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        partial_rotary_factor=0.25,
        rms_norm_eps=1e-6,
        num_hidden_layers=1,
        layer_types=["full_attention"],
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    attention = Qwen3NextAttention(config, layer_idx=0)
    with torch.no_grad():
        for p in attention.parameters():  # the norms' weights too: 0 would hide a missing 1 +
            p.normal_(0.0, 0.3)
    return attention, Qwen3NextRotaryEmbedding(config)


def _copy_into_mlm(hf: Qwen3NextAttention, cfg: ModelConfig) -> Attention:
    ours = Attention(cfg)
    H, K = cfg.num_attention_heads, cfg.head_dim
    q_H2KD = hf.q_proj.weight.view(H, 2 * K, -1)  # per head [query | gate]
    with torch.no_grad():
        ours.q.weight.copy_(q_H2KD[:, :K].reshape(H * K, -1))
        ours.gate.weight.copy_(q_H2KD[:, K:].reshape(H * K, -1))
        for a, b in (("k", "k_proj"), ("v", "v_proj"), ("out", "o_proj")):
            getattr(ours, a).weight.copy_(getattr(hf, b).weight)
        for name in ("q_norm", "k_norm"):
            getattr(ours, name).weight.copy_(getattr(hf, name).weight)
    return ours


def test_gqa_with_the_three_options_matches_transformers_qwen3_next_attention():
    hf, rotary = _hf_attention()
    ours = _copy_into_mlm(hf, TINY)
    B, T = 2, 7
    x_BTD = torch.randn(B, T, 32, generator=torch.Generator().manual_seed(1))
    positions_BT = torch.arange(3, 3 + T).expand(B, T)  # not from 0: the tables follow the positions
    causal = torch.full((T, T), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        want, _ = hf(x_BTD, rotary(x_BTD, positions_BT), causal)
        got = ours(x_BTD, rope_tables(TINY, T, positions=positions_BT))
    error = ((got - want).abs().max() / want.abs().max()).item()
    assert error < 1e-5, error  # measured 1.1e-7
    # each option matters: without the gate, or with RoPE over the whole head, the outputs part
    for change in ({"attention_output_gate": False}, {"rotary_percent": 1.0}):
        other = ModelConfig(**{**TINY.__dict__, **change})
        other_module = Attention(other)
        other_module.load_state_dict(ours.state_dict(), strict=False)
        with torch.no_grad():
            differs = other_module(x_BTD, rope_tables(other, T, positions=positions_BT))
        assert (differs - want).abs().max() > 1e-2, change


def test_zero_centred_rms_norm_is_qwen3_next_bitwise_and_starts_at_zero():
    hf = Qwen3NextRMSNorm(16, eps=1e-6)
    ours = RMSNorm(TINY, 16)
    assert torch.equal(ours.weight, torch.zeros(16))
    with torch.no_grad():
        hf.weight.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(2))
        ours.weight.copy_(hf.weight)
    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(3), requires_grad=True)
    want, got = hf(x), ours(x)
    assert torch.equal(got, want)
    dy = torch.randn_like(want)
    (dx_want, dw_want), (dx_got, dw_got) = (
        torch.autograd.grad(y, (x, w), dy) for y, w in ((want, hf.weight), (got, ours.weight))
    )
    assert torch.equal(dx_got, dx_want) and torch.equal(dw_got, dw_want)  # the backward too
    # LayerNorm the same way (Megatron's apply_layernorm_1p): x̂ · (1 + w) + b
    layer = LayerNorm(ModelConfig(normalization="layernorm", norm_zero_centered=True), 16)
    plain = torch.nn.LayerNorm(16, eps=layer.eps)
    with torch.no_grad():
        layer.weight.copy_(ours.weight)
        layer.bias.normal_()
        plain.weight.copy_(1 + ours.weight)
        plain.bias.copy_(layer.bias)
    assert torch.equal(layer(x), plain(x))


def test_a_fresh_model_starts_its_zero_centred_norms_at_zero():
    cfg = ModelConfig(**{**TINY.__dict__, "mtp_num_layers": 1})
    model = build_model(cfg, "cpu", seed=1)
    norms = {n: p for n, p in model.named_parameters() if n.endswith("norm.weight")}
    # layer norms, q/k norms, the final norm, MTP's
    assert {"layers.0.attn.q_norm.weight", "final_norm.weight", "mtp.0.enorm.weight"} <= set(norms)
    assert all(torch.equal(p, torch.zeros_like(p)) for p in norms.values()), norms
    assert model.layers["0"].attn.gate.weight.std() > 0.01  # drawn like q


@pytest.fixture(scope="module")
def gated_reference(tmp_path_factory, tiny_data):
    return reference_run(tmp_path_factory.mktemp("gated"), tiny_data, **QWEN3_NEXT_ATTENTION)


def test_qwen3_next_attention_trains_under_tp2_with_sequence_parallelism_as_one_process(
    tmp_path, tiny_data, gated_reference
):
    losses, weights = gated_reference
    parallel = {"parallel.tp": 2, "parallel.sequence_parallel": "true"}
    sets = run_sets(tmp_path, tiny_data, "mesh", **QWEN3_NEXT_ATTENTION, **parallel)
    assert_matches(tmp_path, run_ranks(2, train_rank, sets), losses, weights)
    assert weights["layers.0.attn.gate.weight"].shape == (64, 64)  # saved whole
    assert not torch.equal(weights["final_norm.weight"], torch.zeros(64))  # trained from 0


def test_the_planner_counts_the_gate_and_what_a_layer_saves(tmp_path, tiny_data):
    from mlm.model import parameter_counts
    from mlm.plan import memory

    cfg = load_config(None, run_sets(tmp_path, tiny_data, "plan", **QWEN3_NEXT_ATTENTION))
    assert memory.parameter_counts(cfg) == parameter_counts(cfg.model)
    ungated = {**QWEN3_NEXT_ATTENTION, "model.attention_output_gate": "false"}
    plain = load_config(None, run_sets(tmp_path, tiny_data, "plain", **ungated))
    h, layers = 64, cfg.model.num_layers
    assert memory.parameter_counts(cfg).total - memory.parameter_counts(plain).total == layers * h * h

    # one layer's saved tensors under bf16 autocast, as tests/plan/test_activation_memory.py counts them;
    # without the q/k norms, whose inputs the planner does not count yet (measured: e·(H + G)·K·A
    # short, with or without these options)
    S, B = 32, 2
    cfg = load_config(
        None,
        run_sets(tmp_path, tiny_data, "saved", **{
            **QWEN3_NEXT_ATTENTION, "model.qk_norm": "false",
            "data.seq_length": S, "train.micro_batch_size": B, "train.global_batch_size": B,
            "train.precision": "bf16", "model.hidden_dropout": 0.0,
        }),
    )  # fmt: skip
    model = build_model(cfg.model, "cpu", seed=1).train()
    x = torch.randn(B, S, h, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        x_BTD, rope = model.residual(x), model.rope(S, x.device)
        with saved_storages(model) as saved:
            out = model.layers["0"](x_BTD, rope)
    out.float().sum().backward()
    block = model.layers["0"]
    weights = sum(m.weight.numel() for m in block.modules() if isinstance(m, torch.nn.Linear))
    norms = [m for m in block.modules() if isinstance(m, RMSNorm)]
    # autocast's bf16 copies of the linear weights, the RoPE tables, the norms' fp32 1 + weight
    not_activations = (
        2 * weights
        + sum(t.numel() * t.element_size() for t in rope)
        + sum(4 * m.weight.numel() for m in norms)
    )
    planned = sum(layer_activation_bytes(cfg, Layout(1, 1, 1, B, B)).values())
    assert planned == sum(saved.values()) - not_activations


def test_serving_generates_the_training_forwards_greedy_tokens(tmp_path, tiny_data):
    """The serving cache holds the keys after partial RoPE; the gate reads the new tokens only."""
    from mlm.inference.engine import Engine, EngineConfig
    from mlm.inference.sampling import SamplingParams

    cfg = load_config(None, run_sets(tmp_path, tiny_data, "serve", **QWEN3_NEXT_ATTENTION))
    model = build_model(cfg.model, "cpu", seed=7).eval()
    prompts = [[(7 * i + 3 * j) % 500 + 1 for j in range(5 + 4 * i)] for i in range(3)]
    # 12 tokens a step: chunked prefill
    config = EngineConfig(
        max_seqs=3, max_tokens_per_step=12, block_size=8, num_blocks=8, packed_weights=False
    )
    outs = Engine(model, config=config).generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))
    for prompt, out in zip(prompts, outs, strict=True):
        tokens = list(prompt)
        with torch.no_grad():
            for _ in range(8):
                tokens.append(int(model(torch.tensor([tokens]))[0, -1, : cfg.model.vocab_size].argmax()))
        assert list(out.token_ids) == tokens[len(prompt) :]


@pytest.mark.parametrize(
    "model,match",
    [
        # 16 dims × 0.1875 = 3
        (
            dict(hidden_size=64, num_attention_heads=4, rotary_percent=0.1875),
            r"= 3 rotated dims: RoPE rotates pairs",
        ),
        (dict(rotary_percent=0.0), r"rotary_percent=0.0: must be in \(0, 1\]"),
        (dict(rotary_percent=1.5), r"rotary_percent=1.5: must be in \(0, 1\]"),
        (
            dict(attention_kind="mla", rotary_percent=0.5, mla=MLAConfig(q_lora_rank=8, kv_lora_rank=8)),
            r"rotary_percent=0.5 with the mixer kind mla: it rotates dims of its own choosing",
        ),
    ],
    ids=["odd-rope-dim", "zero", "above-one", "mla"],
)
def test_config_errors(model, match):
    with pytest.raises(MlmError, match=match):
        ModelConfig(**model)


@pytest.mark.parametrize(
    "name, value", [("norm_zero_centered", True), ("attention_output_gate", True), ("rotary_percent", 0.5)]
)
def test_formats_without_the_options_refuse_them_by_name(name, value):
    """Llama's HF layout, TensorRT-LLM's and Megatron's GPTModel export cannot say these options: each
    refuses a model that sets one, naming it, rather than writing weights that compute other logits."""
    from mlm.convert.hf import config_to_hf
    from mlm.convert.megatron.exporter import unsupported
    from mlm.convert.trtllm.config import architecture

    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, kv_channels=16, **{name: value})
    with pytest.raises(MlmError, match=f"model.{name}="):
        config_to_hf(cfg, "llama")
    with pytest.raises(MlmError, match=f"model.{name}="):
        architecture(cfg)
    assert any(f"model.{name}=" in why for why in unsupported(cfg))
