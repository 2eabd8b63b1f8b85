"""The Gated DeltaNet mixer kind ("gdn", pattern symbol G): one layer equals transformers'
Qwen3NextGatedDeltaNet on the same weights (fp32, 1e-5 relative), tp needs whole key and value
heads, the config checks its heads, and the Qwen3-Next preset has its published size. What the
recurrent kinds share (packed documents, parallel equivalence, cp refusal, serving from state
slots): tests/distributed/test_recurrent_mixers.py. The delta rule itself: tests/unit/test_kernel_delta_rule.py;
model.kernels=triton against torch: tests/unit/test_kernels.py (case "gdn-hybrid").
"""

from __future__ import annotations

import pytest
import torch

from mlm.config import GatedDeltaNetConfig, ModelConfig, load_config
from mlm.errors import MlmError
from tests.helpers.parallel import run_sets

GDN = {
    "model.gdn.num_key_heads": 2,
    "model.gdn.num_value_heads": 4,
    "model.gdn.key_head_dim": 8,
    "model.gdn.value_head_dim": 8,
    "model.gdn.chunk_size": 16,
}
HYBRID = {**GDN, "model.num_layers": 4, "model.layer_pattern": "'G-*-G-*-'"}


def _hf_layer():
    """A tiny Qwen3-Next Gated DeltaNet (2 key heads of 8, 4 value heads of 6, hidden 32) with
    every weight random (A_log, dt_bias and the norm's weight too)."""
    hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    from transformers import Qwen3NextConfig

    config = Qwen3NextConfig(
        hidden_size=32,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=6,
        linear_conv_kernel_dim=4,
        rms_norm_eps=1e-6,
    )
    torch.manual_seed(0)
    layer = hf.Qwen3NextGatedDeltaNet(config, layer_idx=0).float().eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape) * 0.3)
        layer.A_log.copy_(torch.empty(4).uniform_(1, 16).log())
        layer.norm.weight.add_(1.0)
    return layer


def _load_hf(mine, theirs) -> None:
    """Copy HF's weights into mlm's module: in_proj_qkvz holds, per key head g, [q_g (d_k) | k_g
    (d_k) | v_g (r·d_v) | z_g (r·d_v)] and in_proj_ba [b_g (r) | a_g (r)] (`fix_query_key_value_ordering`);
    conv1d's channels are q | k | v flat."""
    G, K, V = theirs.num_k_heads, theirs.head_k_dim, theirs.head_v_dim
    r = theirs.num_v_heads // G
    qkvz = theirs.in_proj_qkvz.weight.unflatten(0, (G, -1)).split([K, K, r * V, r * V], dim=1)
    ba = theirs.in_proj_ba.weight.unflatten(0, (G, -1)).split([r, r], dim=1)
    conv = theirs.conv1d.weight.split([G * K, G * K, theirs.value_dim], dim=0)
    with torch.no_grad():
        for name, w in zip(("q", "k", "v", "z"), qkvz, strict=True):
            getattr(mine, f"in_{name}").weight.copy_(w.flatten(0, 1))
        for name, w in zip(("b", "a"), ba, strict=True):
            getattr(mine, f"in_{name}").weight.copy_(w.flatten(0, 1))
        for name, w in zip(("q", "k", "v"), conv, strict=True):
            getattr(mine, f"conv_{name}").weight.copy_(w)
        for name in ("A_log", "dt_bias"):
            getattr(mine, name).copy_(getattr(theirs, name))
        mine.norm.weight.copy_(theirs.norm.weight)
        mine.out.weight.copy_(theirs.out_proj.weight)


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_a_layer_equals_transformers_qwen3_next(chunk_size):
    """One layer on T=37 tokens (chunks of 16 or 64 here, transformers' 64: neither divides T),
    fp32: the outputs within 1e-5 of the largest |expected| (measured: 4.5e-6 with chunks of 16,
    whose sums round differently from transformers' single chunk; 0 with chunks of 64)."""
    from mlm.model.kinds.gdn.module import GatedDeltaNet

    theirs = _hf_layer()
    gdn = GatedDeltaNetConfig(
        num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=6, chunk_size=chunk_size
    )
    cfg = ModelConfig(hidden_size=32, norm_eps=1e-6, layer_pattern="G-G-", gdn=gdn)
    mine = GatedDeltaNet(cfg).eval()
    _load_hf(mine, theirs)
    x = torch.randn(2, 37, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = theirs(x), mine(x)
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err <= 1e-5, f"relative error {err:.2e}"


def test_tensor_parallelism_needs_whole_key_and_value_heads(tmp_path, tiny_data):
    from mlm.parallel.mesh import check_tensor_parallel

    m = load_config(None, run_sets(tmp_path, tiny_data, "tp", **HYBRID)).model
    check_tensor_parallel(m, m.padded_vocab_size(2), 2)
    with pytest.raises(
        MlmError, match=r"num_key_heads=2 and num_value_heads=4 must both divide over parallel.tp=4"
    ):
        check_tensor_parallel(m, m.padded_vocab_size(4), 4)


def test_the_config_checks_its_heads():
    with pytest.raises(MlmError, match=r"model.gdn.num_value_heads=6 is not a multiple of num_key_heads=4"):
        GatedDeltaNetConfig(num_key_heads=4, num_value_heads=6)


def test_the_qwen3_next_preset_has_its_published_size_and_plans():
    """qwen3-next-80b-a3b counts 79,674,391,296 parameters, 79.05B without the embeddings (published:
    80B, 79B non-embedding), its layers 12 × (3 gdn + 1 gqa), all MoE; `mlm plan` lays it out on 64
    GPUs with whole key and value heads per tp rank."""
    from mlm.hardware import PROFILES
    from mlm.model import parameter_counts
    from mlm.plan.job import Job
    from mlm.plan.search import search

    cfg = load_config(None, ["preset=qwen3-next-80b-a3b"])
    total = parameter_counts(cfg.model).total
    assert total == 79_674_391_296 and round((total - 2 * 151936 * 2048) / 1e9, 2) == 79.05
    assert cfg.model.pattern() == "GEGEGE*E" * 12
    best = search(Job(cfg, 64, 8, PROFILES["h100-80g"])).ranked[0]
    assert 16 % best.layout.tp == 0 and best.fits
