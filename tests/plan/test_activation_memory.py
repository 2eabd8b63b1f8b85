"""Activation memory like Megatron's: what one Llama layer saves for backward in bf16 autocast,
counted with saved_tensors_hooks as tests/plan/test_plan.py counts it, against Megatron's ~34·s·b·h
and the planner's formula (`mlm.plan.memory.layer_activation_bytes`).

At Llama-3-8B's ratios (ffn 3.5·h, 4 query heads per key/value group) the lean layer saves
    norms' inputs 2·2, the normed input q/k/v share 2 and gate/up share 2, q/k/v 3, attention
    output 2, SwiGLU's gate and up 14, down's input 7  →  34·s·b·h (+ the fp32 logsumexp);
before (fp32 residual stream, norms keeping fp32 inputs and x̂, per-linear autocast copies,
SwiGLU's four f-wide tensors) it was 59·s·b·h.
"""

from __future__ import annotations

import pytest
import torch

from mlm.config import load_config
from mlm.layout import Layout
from mlm.model.gpt import build_model
from mlm.plan.memory import layer_activation_bytes

S, B, H = 64, 2, 128  # tokens, micro-batch, hidden
LLAMA_8B_RATIOS = [
    f"model.hidden_size={H}",
    "model.num_attention_heads=8",
    "model.num_query_groups=2",  # GQA 4:1
    f"model.ffn_hidden_size={H * 7 // 2}",  # 3.5·h
    "model.num_layers=1",
    "model.vocab_size=256",
    f"data.seq_length={S}",
    f"train.micro_batch_size={B}",
    f"train.global_batch_size={B}",
    "train.precision=bf16",
]


def _layer_saved_bytes(cfg) -> tuple[int, int]:
    """(bytes of the distinct storages one layer's forward under bf16 autocast saves for backward,
    parameters excluded; of those, the bytes that are not activations: autocast's bf16 copies of
    the linear weights and the RoPE tables, which the planner counts per stage)."""
    model = build_model(cfg.model, "cpu", seed=1)
    model.train()
    block = model.layers["0"]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            saved[st.data_ptr()] = st.nbytes()
        return t

    x = torch.randn(B, S, H, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        x_BTD = model.residual(x)  # the embedding's cast into the layers (not counted: a cast saves nothing)
        rope = model.rope(S, x.device)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = block(x_BTD, rope)
    out.float().sum().backward()  # the saved tensors suffice for backward
    weights = sum(m.weight.numel() for m in block.modules() if isinstance(m, torch.nn.Linear))
    return sum(saved.values()), 2 * weights + sum(t.numel() * t.element_size() for t in rope)


@pytest.mark.parametrize("fp32_residual", [False, True], ids=["bf16-residual", "fp32-residual"])
def test_llama_layer_saves_at_most_36_sbh_in_bf16_and_the_planner_counts_it(fp32_residual):
    cfg = load_config(
        None, [*LLAMA_8B_RATIOS, f"model.fp32_residual_connection={str(fp32_residual).lower()}"]
    )
    saved, not_activations = _layer_saved_bytes(cfg)
    counted = saved - not_activations
    layout = Layout(1, 1, 1, B, B)
    planned = sum(layer_activation_bytes(cfg, layout).values())
    assert planned == counted, (planned, counted, layer_activation_bytes(cfg, layout))
    per_sbh = counted / (S * B * H)
    # 34 + the attention's fp32 logsumexp (4·heads/h = 0.25); the fp32 residual stream adds 2·2
    # for the two norms' fp32 inputs
    assert per_sbh == pytest.approx(34.25 + (4 if fp32_residual else 0))
    if not fp32_residual:
        assert per_sbh <= 36
