"""The Mamba-2 mixer kind ("mamba", pattern symbol M) and the imported hybrids: tp needs whole heads
and groups, the planner's saved bytes of a Mamba layer are autograd's, and the Nemotron-H preset has
its published size. Serving them: tests/serve/test_serve_hybrids.py.
What the recurrent kinds share (packed documents, parallel equivalence, cp refusal, serving from
state slots): tests/distributed/test_recurrent_mixers.py. HF numerics and conversion:
tests/interop/hf/test_hf_adapters.py (cases mamba2*, nemotron_h*, qwen3_next); the scan itself:
tests/unit/test_kernel_ssd.py.
"""

from __future__ import annotations

import pytest
import torch

from mlm.config import load_config
from mlm.errors import MlmError
from mlm.model import build_model
from tests.helpers.common import saved_storages
from tests.helpers.parallel import run_sets

MAMBA = {
    "model.mamba.head_dim": 8,
    "model.mamba.state_dim": 16,
    "model.mamba.num_groups": 2,
    "model.mamba.chunk_size": 16,
}
HYBRID = {
    **MAMBA,
    "model.num_layers": 4,
    "model.layer_pattern": "'M-*EM-*E'",
    "model.moe.num_experts": 4,
    "model.moe.ffn_hidden_size": 48,
    "model.moe.router_topk": 2,
}


def test_tensor_parallelism_needs_whole_heads_and_groups(tmp_path, tiny_data):
    from mlm.parallel.mesh import check_tensor_parallel

    m = load_config(None, run_sets(tmp_path, tiny_data, "tp", **HYBRID)).model
    check_tensor_parallel(m, m.padded_vocab_size(2), 2)
    with pytest.raises(MlmError, match=r"num_groups=2 must both divide over parallel.tp=4"):
        check_tensor_parallel(m, m.padded_vocab_size(4), 4)


def test_the_planner_counts_what_a_mamba_layer_saves(tmp_path, tiny_data):
    """What one Mamba-2 layer (mixer alone) saves for backward, planned from its spec against the
    tensors autograd keeps (fp32, one rank), counted as tests/plan/test_activation_memory.py counts."""
    from mlm.layout import Layout
    from mlm.plan import memory

    cfg = load_config(
        None, run_sets(tmp_path, tiny_data, "plan", **{**HYBRID, "model.layer_pattern": "'M*-M-*E'"})
    )
    m, S = cfg.model, cfg.data.seq_length
    planned = sum(memory.layer_activation_bytes(cfg, Layout(1, 1, 1, 2, 2), m.layer_specs()[0]).values())
    model = build_model(m, "cpu", seed=1).train()
    x = torch.randn(2, S, m.hidden_size, requires_grad=True)
    with saved_storages(model) as saved:
        out = model.layers["0"](x)
    out.sum().backward()
    assert planned == pytest.approx(sum(saved.values()), rel=0.02), (planned, sum(saved.values()))


def test_the_nemotron_h_preset_has_its_published_size_and_plans():
    """nemotron-h-8b counts 8,100,852,736 parameters (the published checkpoint's), and `mlm plan`
    lays it out on 64 GPUs with tp dividing its 8 B/C groups."""
    from mlm.hardware import PROFILES
    from mlm.model import parameter_counts
    from mlm.plan.job import Job
    from mlm.plan.search import search

    cfg = load_config(None, ["preset=nemotron-h-8b"])
    assert parameter_counts(cfg.model).total == 8_100_852_736
    assert cfg.model.pattern().count("M") == 24 and cfg.model.pattern().count("*") == 4
    result = search(Job(cfg, 64, 8, PROFILES["h100-80g"]))
    best = result.ranked[0]
    assert 8 % best.layout.tp == 0 and best.fits
    assert "num_groups=8 must both divide over parallel.tp=16" in result.rejected[16, 1]
