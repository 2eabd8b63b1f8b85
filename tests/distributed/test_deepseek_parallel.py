"""DeepSeek-V3-style models train on a mesh as in one process: Multi-Latent Attention under tp 2
with sequence parallelism and under pp 2; multi-token prediction under pp 2 (the last stage
holds an embedding copy, its gradient summed with the first stage's) and under cp 2 (the tokens
ahead shifted before the split), with both cp attention implementations. One model carries all
of it (MLA with a query latent and YaRN, the DeepSeek router: sigmoid, expert bias, groups,
scaling, a shared expert, a dense first layer; two MTP depths), so each mesh also checks their
combinations. Plus: the MTP loss against a direct computation, and the clear errors.

Also: pp 2 with vpp 2, and pp 2 with tied embeddings (one last-stage copy for both uses).

Every rank is a real gloo process. Tolerance: fp32, 1e-5 relative on losses, MTP losses and
final weights (test_parallel_training's, which explains why not bitwise).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mlm.config import Config, MLAConfig, ModelConfig, RopeConfig, load_config
from mlm.convert.hf import config_to_hf
from mlm.convert.trtllm.config import architecture
from mlm.errors import MlmError
from mlm.model import build_model
from mlm.model.kinds.mtp.module import MTPTargets
from mlm.parallel.context import zigzag_indices
from mlm.parallel.mesh import check_tensor_parallel
from tests.helpers.distributed import run_ranks
from tests.helpers.parallel import assert_matches, logged, reference_run, run_sets, train_rank

DEEPSEEK = {
    "model.num_layers": 4,
    "model.num_query_groups": 4,
    "model.attention_kind": "mla",
    "model.mla.q_lora_rank": 32,
    "model.mla.kv_lora_rank": 16,
    "model.mla.qk_nope_head_dim": 16,
    "model.mla.qk_rope_head_dim": 8,
    "model.mla.v_head_dim": 12,
    "model.rope.scaling_factor": 4.0,
    "model.rope.scaling_type": "yarn",
    "model.rope.original_max_position_embeddings": 16,
    "model.rope.yarn_mscale_all_dim": 1.0,
    "model.mlp_kind": "moe",
    "model.first_k_dense": 1,
    "model.moe.num_experts": 4,
    "model.moe.ffn_hidden_size": 48,
    "model.moe.router_topk": 2,
    "model.moe.router_score_function": "sigmoid",
    "model.moe.router_enable_expert_bias": "true",
    "model.moe.router_num_groups": 2,
    "model.moe.router_group_topk": 1,
    "model.moe.router_topk_scaling_factor": 2.5,
    "model.moe.seq_aux_loss_coeff": 1e-2,
    "model.moe.shared_expert_ffn_hidden_size": 32,
    "model.mtp_num_layers": 2,
    "model.mtp_loss_scaling_factor": 0.3,
    "train.train_iters": 3,
}


@pytest.fixture(scope="module")
def ds_reference(tmp_path_factory, tiny_data):
    tmp = tmp_path_factory.mktemp("reference")
    losses, weights = reference_run(tmp, tiny_data, **DEEPSEEK)
    return losses, weights, logged(tmp / "one", "mtp_loss.")


# Adam's eps 1e-3: an update's sensitivity to its gradient is lr / eps for gradients below eps, and
# at 1e-4 a few kv_down elements (gradients ~1e-6) turned rounding-level gradient differences
# (3.6e-7 – 5.7e-7 of the largest, as for the query-latent model: tests/distributed/test_tensor_parallel.py)
# into weight differences of 1e-4 relative after one step
NO_QUERY_LATENT = {
    **DEEPSEEK,
    "model.mla.q_lora_rank": None,
    "model.mtp_num_layers": 1,
    "optimizer.adam_eps": 1e-3,
}


def test_mla_without_a_query_latent_under_tp_matches_one_process(tmp_path, tiny_data):
    """Queries straight from the hidden state (DeepSeek-V2-Lite): the query projection enters the
    tp region on its own, the key/value latents on theirs."""
    ref = reference_run(tmp_path / "ref", tiny_data, **NO_QUERY_LATENT)
    sets = run_sets(
        tmp_path,
        tiny_data,
        "mesh",
        **NO_QUERY_LATENT,
        **{"parallel.tp": 2, "parallel.sequence_parallel": "true"},
    )
    assert_matches(tmp_path, run_ranks(2, train_rank, sets), *ref)


def test_mtp_with_tied_embeddings_under_pp_matches_one_process(tmp_path, tiny_data):
    """Tied embeddings and MTP want the same last-stage copy: one copy, one gradient sum. Adam's
    eps 1e-3 for NO_QUERY_LATENT's reason: at 1e-4 three kv_down elements with ~1e-6 gradients
    turned the embedding gradient's other summation order (two stages' copies) into weight
    differences of 2e-4 relative after 3 steps, while the losses agree bit for bit."""
    tied = {**DEEPSEEK, "model.tie_embeddings": "true", "optimizer.adam_eps": 1e-3}
    ref = reference_run(tmp_path / "ref", tiny_data, **tied)
    sets = run_sets(tmp_path, tiny_data, "mesh", **tied, **{"parallel.pp": 2})
    assert_matches(tmp_path, run_ranks(2, train_rank, sets), *ref)


@pytest.mark.parametrize(
    "world,parallel",
    [
        (2, {"parallel.tp": 2, "parallel.sequence_parallel": "true"}),
        (2, {"parallel.tp": 2}),
        (2, {"parallel.pp": 2}),
        (2, {"parallel.pp": 2, "parallel.vpp": 2}),
        (2, {"parallel.cp": 2, "parallel.cp_comm_type": "p2p"}),
        (2, {"parallel.cp": 2, "parallel.cp_comm_type": "all_gather"}),
    ],
    ids=["tp2-sp", "tp2", "pp2", "pp2-vpp2", "cp2-p2p", "cp2-all_gather"],
)
def test_deepseek_model_on_a_mesh_matches_one_process(tmp_path, tiny_data, ds_reference, world, parallel):
    sets = run_sets(tmp_path, tiny_data, "mesh", **DEEPSEEK, **parallel)
    losses, weights, mtp = ds_reference
    assert set(mtp) == {"mtp_loss.1", "mtp_loss.2"} and all(len(v) == 3 for v in mtp.values())
    assert any(k.startswith("mtp.1.") for k in weights) and "embed.weight" in weights
    assert_matches(tmp_path, run_ranks(world, train_rank, sets), losses, weights)
    got = logged(tmp_path / "mesh", "mtp_loss.")
    for name, values in mtp.items():
        assert got[name] == pytest.approx(values, rel=1e-5), name


def test_mtp_loss_equals_a_direct_computation():
    """Depth k at position i: eh_proj([enorm(embed(t[i+k])) ; hnorm(h^{k-1}_i)]) → layer → norm →
    output, against t[i+k+1], averaged over the T − k positions that have it; h⁰ is the main
    model's final-normed hidden state. Computed here token by token from the modules."""
    torch.manual_seed(0)
    cfg = ModelConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        vocab_size=50,
        attention_kind="mla",
        mla=MLAConfig(q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4),
        mtp_num_layers=2,
    )
    model = build_model(cfg).eval()
    tokens = torch.randint(0, 50, (2, 13))  # samples [B, T + 1]
    T = tokens.shape[1] - 1
    h = model.hidden_states(tokens[:, :-1])
    got = model.mtp_losses(h, MTPTargets.of(tokens, 2))
    rope = model.rope(T, h.device)
    prev = model.final_norm(h)
    want = []
    for k, depth in enumerate(model.mtp.values(), start=1):
        ahead = torch.cat([tokens[:, k:], tokens.new_zeros(2, k - 1)], 1)[:, :T]  # t[i+k], 0 past the end
        x = depth.eh_proj(torch.cat([depth.enorm(model.embed(ahead)), depth.hnorm(prev)], -1))
        prev = depth.final_norm(depth.layer(x, rope))
        logits = F.linear(prev, model.output.weight)[..., : cfg.vocab_size]
        n = T - k  # positions i < T - k have the label t[i+k+1]
        want.append(
            F.cross_entropy(logits[:, :n].reshape(-1, cfg.vocab_size), tokens[:, k + 1 :].reshape(-1))
        )
    torch.testing.assert_close(got, torch.stack(want), rtol=1e-6, atol=0)


def test_mtp_shares_under_context_parallelism_add_up():
    """The cp shares of each depth's loss average to the whole sequence's (as the main loss's do)."""
    torch.manual_seed(0)
    tokens = torch.randint(0, 50, (2, 17))
    whole = MTPTargets.of(tokens, 2)
    for k in (1, 2):
        logits = torch.randn(2, 16, 50)
        full = F.cross_entropy(logits.flatten(0, 1), whole.labels(k).flatten(), reduction="none")
        total = (full * whole.weights(k).flatten()).sum()
        shares = []
        for r in range(2):
            part = MTPTargets.of(tokens, 2, shares=2).split(zigzag_indices(16, 2, r))
            idx = zigzag_indices(16, 2, r)
            ce = F.cross_entropy(logits[:, idx].flatten(0, 1), part.labels(k).flatten(), reduction="none")
            shares.append((ce * part.weights(k).flatten()).sum())
        torch.testing.assert_close(sum(shares) / 2, total)
        assert int((whole.weights(k) > 0).sum()) == 2 * (16 - k)


def test_bad_deepseek_settings_are_refused():
    with pytest.raises(MlmError, match=r"num_query_groups=2 with attention_kind=mla"):
        ModelConfig(num_attention_heads=4, num_query_groups=2, attention_kind="mla")
    with pytest.raises(MlmError, match=r"qk_rope_head_dim=5: RoPE rotates pairs"):
        MLAConfig(qk_rope_head_dim=5)
    with pytest.raises(MlmError, match=r"num_attention_heads=6 is not divisible by parallel.tp=4"):
        check_tensor_parallel(
            ModelConfig(hidden_size=48, num_attention_heads=6, attention_kind="mla"), 128, 4
        )
    with pytest.raises(MlmError, match=r"model.qk_norm=True with attention_kind=mla: .* unset them"):
        ModelConfig(attention_kind="mla", qk_norm=True)
    with pytest.raises(MlmError, match=r"mtp_num_layers=1 with position_embedding='learned'"):
        ModelConfig(position_embedding="learned", mtp_num_layers=1)
    yarn = ModelConfig(rope=RopeConfig(scaling_factor=4.0, scaling_type="yarn"))
    with pytest.raises(
        MlmError, match=r"cannot be written as Hugging Face llama: model.rope.scaling_type='yarn'"
    ):
        config_to_hf(yarn, "llama")
    with pytest.raises(MlmError, match=r"cannot be written as TensorRT-LLM: model.rope.scaling_type='yarn'"):
        architecture(yarn)
    with pytest.raises(MlmError, match=r"mtp_num_layers=1: TensorRT-LLM's layouts .* have no multi-token"):
        architecture(ModelConfig(mtp_num_layers=1))
    with pytest.raises(MlmError, match=r"mtp_num_layers=4 with data.seq_length=4"):
        load_config(None, ["model.mtp_num_layers=4", "data.seq_length=4"])
    assert isinstance(load_config(None, ["model.mtp_num_layers=3", "data.seq_length=4"]), Config)
