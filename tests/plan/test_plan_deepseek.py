"""`mlm plan` for DeepSeek-style models: the planner's parameters of every preset equal the built
model's (the per-rank comparison under tp 2 × pp 2 × ep 2 with MLA and MTP is in test_plan.py's
4-rank test); the compute term is the FLOPs of MLA (down-projections whole on every tp rank, over
its own tokens) and of the MTP depths; MLA's tp collectives move the latents, not the hidden
state; DeepSeek-V3's 61 layers split over 16 stages; and a sane plan for it on 512 H100s.
"""

from __future__ import annotations

import dataclasses

import pytest

from mlm.config import load_config
from mlm.flops import eh_proj_flops, flops_per_token, mixer_flops
from mlm.hardware import PROFILES
from mlm.layout import Layout
from mlm.model import parameter_counts
from mlm.plan.candidates import evaluate
from mlm.plan.hardware import load_hardware
from mlm.plan.job import make_job
from mlm.plan.memory import parameter_counts as planned_counts
from mlm.plan.memory import rank_stage
from mlm.plan.report import model_line
from mlm.plan.search import Constraints, plan, search, uneven_split
from mlm.plan.software import Software
from mlm.presets import PRESETS


@pytest.mark.parametrize("preset", list(PRESETS))
def test_planned_parameter_counts_equal_the_built_models(preset):
    cfg = load_config(overrides=[f"preset={preset}"])
    assert planned_counts(cfg) == parameter_counts(cfg.model)


def test_compute_time_is_the_flops_of_mla_and_mtp():
    # one GEMM efficiency whatever the shape, and the attention core as two GEMMs over every score
    # (no flash attention), so the compute term is FLOPs / (peak × efficiency)
    hw = dataclasses.replace(PROFILES["h100-80g"], gemm_half=0.0)
    sets = ["preset=tiny-deepseek", "model.mlp_kind=dense", "model.mtp_num_layers=2"]
    unfused = Software("unfused", flash_attention=False)
    job = make_job(None, sets, 8, 8, hw, 256, 16, None, "bf16", unfused)
    m, rate = job.cfg.model, hw.peak("bf16") * hw.gemm_max
    tokens = 2 * 256  # one micro-batch of 2 per rank: dp 8 at tp 1, 2 micro-batches at tp 2
    per_token = flops_per_token(m, 256)
    one = evaluate(job, Layout(1, 1, 8, 2, 16))
    assert one.timing.terms["GEMMs and attention"] == pytest.approx(tokens * per_token / rate, rel=1e-12)
    # under tp 2 every GEMM splits but MLA's down-projections (3 layers and 2 MTP depths) and
    # eh_proj, which each rank computes whole over its own tokens (Megatron's layout): without
    # sequence parallelism the whole sequence, under it the rank's half
    whole = (3 + 2) * mixer_flops(m, "mla", 256).replicated + 2 * eh_proj_flops(m)
    two = evaluate(job, Layout(2, 1, 4, 2, 16))
    expected = 2 * tokens * ((per_token - whole) / 2 + whole) / rate
    assert two.timing.terms["GEMMs and attention"] == pytest.approx(expected, rel=1e-12)
    two_sp = evaluate(job, Layout(2, 1, 4, 2, 16, sequence_parallel=True))
    assert two_sp.timing.terms["GEMMs and attention"] == pytest.approx(
        2 * tokens * per_token / 2 / rate, rel=1e-12
    )


@pytest.mark.parametrize("q_lora", [24, None], ids=["query-latent", "no-query-latent"])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp-sp"])
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_tp_collectives_of_mla_move_the_latents(q_lora, sp, recompute):
    """An MLA layer's attention enters the tp region with its latents (Megatron's layout): Q + C + R
    values per token (the query latent, the key/value latent, the rope key), or without a query
    latent the hidden state for q and C + R; the attention's output and the MLP stay h wide. Each
    region boundary is one all-reduce's bytes (2(t − 1)/t of them: without SP an all-reduce, under
    SP an all-gather and a reduce-scatter) and one latency; full recompute repeats the forward's
    share: the two output all-reduces, or under SP half of every boundary."""
    hw = PROFILES["h100-80g"]
    q = "none" if q_lora is None else q_lora
    sets = [
        "preset=tiny-deepseek",
        "model.mlp_kind=dense",
        "model.mtp_num_layers=0",
        f"model.mla.q_lora_rank={q}",
    ]
    job = make_job(None, sets, 8, 8, hw, 256, 16, None, "bf16")
    m = job.cfg.model
    D, C, R, L = m.hidden_size, m.mla.kv_lora_rank, m.mla.qk_rope_head_dim, m.num_layers
    lo = Layout(2, 1, 4, 2, 16, sequence_parallel=sp, recompute=recompute)
    e, A, bw, lat = 2 * 256, 2, hw.intra_bandwidth, hw.intra_latency
    entries = [q_lora + C + R] if q_lora else [D, C + R]
    widths = [*entries, D, D, D]  # the attention's entries, its output, the MLP's entry and output
    ring = lambda w: (2 - 1) / 2 * e * w * A / bw  # noqa: E731 - one all-gather or reduce-scatter
    layer = sum(2 * ring(w) + lat for w in widths)
    if recompute == "full":
        layer += sum(ring(w) + lat / 2 for w in widths) if sp else 2 * (2 * ring(D) + lat)
    micro = 16 // (2 * 4)
    got = evaluate(job, lo).timing.terms["tp collectives"]
    assert got == pytest.approx(micro * L * layer, rel=1e-12)


def test_prime_layer_counts_split_unevenly():
    # DeepSeek-V3's 61 layers: no even split over any pp > 1; the last stage, which also holds
    # the output layer and the MTP depth, gets one layer fewer than the first
    assert uneven_split(61, 16) == (3, 2)
    assert uneven_split(61, 8) == (7, 6)
    assert uneven_split(61, 2) == (31, 30)
    assert uneven_split(61, 3) == (20, 20)  # symmetric where it exists, as before
    assert uneven_split(126, 16) == (7, 7)
    assert uneven_split(61, 32) is None


def test_deepseek_v3_plan_on_512_h100():
    """DeepSeek trained V3 on 2,048 H800 with PP 16, EP 64, no TP (arXiv 2412.19437 §3), hiding the
    cross-node all-to-all behind DualPipe: 180K GPU-hours per trillion tokens, 1,543 tokens/s per
    GPU (FP8 GEMMs). mlm overlaps no all-to-all, so the planner keeps ep inside a node (ep 8);
    PP 16 over the 61 layers it also finds, at bf16 and about 60% of that rate."""
    job = make_job(None, ["preset=deepseek-v3"], 512, 8, load_hardware("h100-80g"), 4096, 4096, None, "bf16")
    result = plan(job, ep=8, cp=1)
    best = result.ranked[0]
    lo = best.layout
    assert (lo.pp, lo.ep, lo.first_stage_layers, lo.last_stage_layers) == (16, 8, 3, 2)
    assert lo.tp <= 8 and best.fits
    assert 0.2 < best.timing.mfu < 0.5
    assert 0.4 < best.timing.tokens_per_s_per_gpu / 1543 < 1.0
    # tp 1, which DeepSeek used, fits with bf16 parameters (a plan's default in bf16: 6 bytes per
    # parameter before the optimizer) and runs within 1% of the best; with fp32 parameters (8
    # bytes: 27.5 GB of weights and as much of gradients on a 4-layer stage at ep 8) it does not
    tp1 = [c for c in result.ranked if c.layout.tp == 1 and c.layout.pp == 16]
    assert tp1 and tp1[0].timing.tokens_per_s_per_gpu > 0.99 * best.timing.tokens_per_s_per_gpu
    sets = ["preset=deepseek-v3", 'train.param_dtype="fp32"']
    fp32 = make_job(None, sets, 512, 8, load_hardware("h100-80g"), 4096, 4096, None, "bf16")
    assert "needs" in search(fp32, ep=8, cp=1, k=Constraints(tp=1, pp=16)).rejected[(1, 16)]
    # the last rank holds the MTP depth (an MoE layer: its experts split over ep too) and a copy
    # of the embedding for its input
    last = rank_stage(job.cfg, lo.tp, 16, 1, 15, 3, 2, 8)
    names = {p.name for p in last.params}
    assert "embed.weight" in names and "mtp.0.eh_proj.weight" in names and last.mtp == 1
    assert last.layers == [59, 60]
    experts = next(p for p in last.params if p.name == "mtp.0.layer.mlp.experts.up.weight")
    assert experts.expert_parallel and experts.numel == 256 // 8 * 2048 * 7168
    assert model_line(job) == (
        "model: total 671.03G, active 37.55G (+ MTP 11.61G, 688.10M active) parameters, "
        "61 layers + 1 MTP depth, 291.85 GFLOP per token at seq 4096"
    )
