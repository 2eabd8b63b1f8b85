"""What the two recurrent mixer kinds share, each in a hybrid with attention, dense MLPs and MoE
layers: Mamba-2 ("mamba", M; model.mamba) and Gated DeltaNet ("gdn", G; model.gdn).

- Packed documents restart the state: logits of packed documents equal each one alone (1e-5).
- The hybrid trains under tp 2 with sequence parallelism, pp 2, dp 2 with the distributed optimizer
  and ep 2 as one process does (fp32, 3 steps, 1e-5 relative: test_parallel_training's tolerance),
  packed documents on; the checkpoint holds each tensor whole.
- Context parallelism refuses the kind by name; the planner counts its parameters from its spec.
- Serving decodes it from state slots with the training forward's logits through chunked prefill,
  decode and preemption, and gives every slot back.

Kind-specific checks (transformers' numerics, tp divisibility, presets): tests/unit/test_mamba.py
and tests/unit/test_gdn.py; serving the imported hybrids (engine and HTTP): tests/serve/test_serve_hybrids.py.
"""

from __future__ import annotations

import pytest
import torch

from mlm.config import GatedDeltaNetConfig, MambaConfig, ModelConfig, load_config
from mlm.errors import MlmError
from mlm.model import build_model
from tests.helpers.common import engine_checking_logits
from tests.helpers.distributed import run_ranks
from tests.helpers.parallel import assert_matches, reference_run, run_sets, train_rank

MOE = {
    "model.num_layers": 4,
    "model.moe.num_experts": 4,
    "model.moe.ffn_hidden_size": 48,
    "model.moe.router_topk": 2,
    "model.moe.aux_loss_coeff": 1e-2,
    "data.reset_attention_mask": "true",  # packed documents restart the recurrent state
    "train.train_iters": 3,
    # Adam moves a weight by lr · g / (|g| + eps): for |g| near eps it passes on the gradient's
    # fp32 rounding (1e-7 of the largest |g|) times lr / eps. With test_parallel_training's eps
    # 1e-4 the Mamba hybrid's weights at tp 2 were 1.3e-5 apart (its gradients agree to 1e-6
    # against fp64; the gdn hybrid's 3.5e-6): eps 1e-3 keeps the comparison about the layout.
    "optimizer.adam_eps": 1e-3,
}
KINDS = {
    "mamba": (
        {
            **MOE,
            "model.layer_pattern": "'M-*EM-*E'",
            "model.mamba.head_dim": 8,
            "model.mamba.state_dim": 16,
            "model.mamba.num_groups": 2,
            "model.mamba.chunk_size": 16,
        },
        ModelConfig(
            num_layers=3,
            hidden_size=32,
            vocab_size=64,
            layer_pattern="MM-M",
            mamba=MambaConfig(head_dim=8, state_dim=16, num_groups=2, chunk_size=8),
        ),
        ("layers.0.attn.in_x.weight", (16 * 8, 64)),
    ),
    "gdn": (
        {
            **MOE,
            "model.layer_pattern": "'G-*EG-*E'",
            "model.gdn.num_key_heads": 2,
            "model.gdn.num_value_heads": 4,
            "model.gdn.key_head_dim": 8,
            "model.gdn.value_head_dim": 8,
            "model.gdn.chunk_size": 16,
        },
        ModelConfig(
            num_layers=3,
            hidden_size=32,
            vocab_size=64,
            layer_pattern="GG-G",
            gdn=GatedDeltaNetConfig(
                num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=6, chunk_size=8
            ),
        ),
        ("layers.0.attn.in_v.weight", (4 * 8, 64)),
    ),
}
"""kind → (the hybrid's settings, a small model of it, a tensor and its whole shape)."""


@pytest.mark.parametrize("kind", KINDS)
def test_packed_documents_restart_the_state(kind):
    """Logits of three packed documents equal each document run alone (fp32, 1e-5)."""
    model = build_model(KINDS[kind][1], "cpu", seed=3).eval()
    lengths = [11, 1, 20]  # one shorter than the convolution, one across chunks
    tokens = torch.randint(0, 64, (1, sum(lengths)), generator=torch.Generator().manual_seed(0))
    documents = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    with torch.no_grad():
        packed = model(tokens, documents=documents)
        alone = torch.cat([model(part) for part in tokens.split(lengths, dim=1)], dim=1)
        mixed = model(tokens)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(mixed[:, lengths[0] :], alone[:, lengths[0] :], atol=1e-3)  # it matters


@pytest.fixture(scope="module")
def hybrid_references(tmp_path_factory, tiny_data):
    """One process's losses and weights for each kind's hybrid, computed once."""
    cache = {}

    def get(kind):
        if kind not in cache:
            cache[kind] = reference_run(tmp_path_factory.mktemp(kind), tiny_data, **KINDS[kind][0])
        return cache[kind]

    return get


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "parallel",
    [
        {"parallel.tp": 2, "parallel.sequence_parallel": "true"},
        {"parallel.pp": 2},
        {"parallel.distributed_optimizer": "true", "parallel.bucket_size_mb": 0.02},
        {"parallel.ep": 2},
    ],
    ids=["tp2-sp", "pp2", "dp2-distopt", "ep2"],
)
def test_a_hybrid_trains_in_parallel_as_one_process(tmp_path, tiny_data, hybrid_references, kind, parallel):
    losses, weights = hybrid_references(kind)
    sets = run_sets(tmp_path, tiny_data, "mesh", **KINDS[kind][0], **parallel)
    assert_matches(tmp_path, run_ranks(2, train_rank, sets), losses, weights)
    name, shape = KINDS[kind][2]
    assert weights[name].shape == shape  # saved whole, whatever the layout


@pytest.mark.parametrize("kind", KINDS)
def test_context_parallelism_refuses_the_kind_by_name(tmp_path, tiny_data, kind):
    with pytest.raises(MlmError, match=f"parallel.cp=2 with the mixer kind.*{kind}: they are not"):
        load_config(None, run_sets(tmp_path, tiny_data, "cp", **KINDS[kind][0], **{"parallel.cp": 2}))


@pytest.mark.parametrize("kind", KINDS)
def test_the_planner_counts_the_kind_from_its_spec(tmp_path, tiny_data, kind):
    from mlm.model import parameter_counts
    from mlm.plan import memory

    cfg = load_config(None, run_sets(tmp_path, tiny_data, "plan", **KINDS[kind][0]))
    assert memory.parameter_counts(cfg) == parameter_counts(cfg.model)


@pytest.mark.parametrize("kind", KINDS)
def test_serving_decodes_the_hybrid_from_state_slots(tmp_path, tiny_data, kind):
    from mlm.inference.engine import EngineConfig
    from mlm.inference.sampling import SamplingParams

    cfg = load_config(None, run_sets(tmp_path, tiny_data, "serve", **KINDS[kind][0]))
    model = build_model(cfg.model, "cpu", seed=7).eval()
    prompts = [[(7 * i + 3 * j) % 500 + 1 for j in range(5 + 4 * i)] for i in range(4)]
    # few blocks: sequences are preempted and recompute; 12 tokens a step: chunked prefill
    config = EngineConfig(
        max_seqs=4, max_tokens_per_step=12, block_size=8, num_blocks=5, packed_weights=False
    )
    engine, checked = engine_checking_logits(model, config)
    outs = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0))
    assert all(len(o.token_ids) == 16 for o in outs)
    assert engine.stats.preemptions > 0 and len(checked) >= 4 * 16
    pool = engine.runner.states
    assert pool.num_free == pool.num_slots
