"""The model's own promises: recompute changes nothing, Megatron's FLOPs formula, parameter counts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mlm.config import ModelConfig, load_config
from mlm.errors import MlmError
from mlm.model import build_model, flops_per_token, parameter_count
from mlm.parallel.recompute import apply_recompute


def loss_and_grads(cfg: ModelConfig, tokens: torch.Tensor):
    model = build_model(cfg, seed=3)
    apply_recompute(model, cfg.recompute)
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits[..., : cfg.vocab_size].flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recompute_gives_the_same_loss_and_gradients(recompute):
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=100)
    tokens = torch.randint(0, 100, (2, 17), generator=torch.Generator().manual_seed(0))
    ref_loss, ref_grads = loss_and_grads(ModelConfig(**base), tokens)
    loss, grads = loss_and_grads(ModelConfig(**base, recompute=recompute), tokens)
    assert torch.equal(loss, ref_loss)
    for n, g in ref_grads.items():  # recomputation repeats the same ops: bitwise on CPU
        assert torch.equal(grads[n], g), n


def test_flops_match_megatrons_gpt_formula():
    """For a GPT (MHA, 4h GeLU MLP) Megatron's 72·B·s·l·h²·(1 + s/(6h) + V/(12·h·l)) per batch."""
    cfg = load_config(overrides=["preset=gpt2-124m"]).model
    s, h, layers, V = 1024, cfg.hidden_size, cfg.num_layers, cfg.padded_vocab_size()
    megatron = 72 * s * layers * h * h * (1 + s / (6 * h) + V / (12 * h * layers)) / s
    assert flops_per_token(cfg, s) == pytest.approx(megatron, rel=1e-12)


def test_parameter_counts_of_published_models():
    # Llama-3.1-8B: 8,030,261,248 parameters (the published count); GPT-2 124M with the
    # vocabulary padded from 50257 to 50304 rows: 124,439,808 + 47 × 768.
    assert parameter_count(load_config(overrides=["preset=llama3-8b"]).model) == 8_030_261_248
    assert parameter_count(load_config(overrides=["preset=gpt2-124m"]).model) == 124_439_808 + 47 * 768


def test_too_long_sequence_is_a_clear_error():
    model = build_model(ModelConfig(max_position_embeddings=8, position_embedding="learned", vocab_size=50))
    with pytest.raises(MlmError, match="beyond model.max_position_embeddings=8"):
        model(torch.zeros(1, 9, dtype=torch.long))


@pytest.mark.parametrize("fused", [False, True])
def test_train_padded_vocab_is_megatrons_loss(fused):
    """model.train_padded_vocab: the padding rows are drawn like the others and the loss's softmax
    covers every padded logit (Megatron-LM's); off (mlm's default) they are zeros and left out.
    Both the plain and the chunked (fused) loss, against F.cross_entropy on the model's logits."""
    base = dict(
        num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=100, make_vocab_size_divisible_by=64
    )
    tokens = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    for padded in (True, False):
        model = build_model(ModelConfig(**base, fused_cross_entropy=fused, train_padded_vocab=padded), seed=3)
        rows = model.embed.weight[100:]
        assert rows.shape[0] == 28 and bool(rows.abs().sum() > 0) is padded
        with torch.no_grad():
            h = model.hidden_states(tokens[:, :-1])
            logits = model.logits(h)[..., : 128 if padded else 100]
            want = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            torch.testing.assert_close(model.head_loss(h, tokens[:, 1:]), want, rtol=1e-6, atol=1e-6)
