"""The time model's software profiles and memory-bound terms (`mlm.plan.software`, `mlm.plan.work`):
byte counts by hand for one layer, and each profile switch moving the term it should."""

from __future__ import annotations

import dataclasses

import pytest

from mlm.config import LayerSpec
from mlm.errors import MlmError
from mlm.layout import Layout
from mlm.plan.candidates import evaluate
from mlm.plan.hardware import load_hardware
from mlm.plan.job import make_job
from mlm.plan.software import PROFILES, Software, load_software
from mlm.plan.work import layer_work, loss_work

DENSE = LayerSpec("gqa", "dense", "rmsnorm")
MOE_LAYER = LayerSpec("gqa", "moe", "rmsnorm")

GPT = [
    "model.num_layers=4",
    "model.hidden_size=1024",
    "model.num_attention_heads=16",
    "model.vocab_size=51200",
    'model.normalization="layernorm"',
    'model.position_embedding="learned"',
    'model.activation="gelu"',
    "model.add_bias=true",
    "model.hidden_dropout=0.1",
    "model.attention_dropout=0.1",
    "model.max_position_embeddings=2048",
    'train.param_dtype="bf16"',
]


def _job(software: Software, sets=GPT, seq=2048):
    return make_job(None, sets, 8, 8, load_hardware("a100-80g"), seq, 64, None, "bf16", software)


def test_gpt_layer_bytes_by_hand_megatron_2021():
    """One GPT layer, one micro-batch of 2 × 2048 tokens, tp 2 without sequence parallelism, as
    Megatron-LM ran it in 2021 (`mlm/plan/work.py` lists the passes):
    norms 2 × (2 + 3) h, residual bias-dropout-add 2 × (3.5 + 3.5) h (both on all e tokens, replicated
    over tp), the output copy (2 + 2) h/t, the fused softmax (2 + 3) and attention dropout (2.5 + 2.5)
    over (H/t)·S scores per token, fused bias-GeLU (2 + 3) f/t; A = 2 bytes."""
    sw = PROFILES["megatron-2021"]
    job = _job(sw)
    lo = Layout(2, 1, 4, 2, 64)
    e, h, t, f, S, H = 2 * 2048, 1024, 2, 4096, 2048, 16
    per_token = 2 * 5 * h + 2 * 7 * h + 4 * h / t + 10 * (H / t) * S + 5 * f / t
    w = layer_work(job.cfg, lo, sw, DENSE, "none")
    assert w.bytes == pytest.approx(e * per_token * 2, rel=1e-12)
    # selective recompute runs the softmax and dropout forward again: (2 + 2.5) more passes
    again = layer_work(job.cfg, lo, sw, DENSE, "selective")
    assert again.bytes - w.bytes == pytest.approx(e * 4.5 * (H / t) * S * 2, rel=1e-12)
    # sequence parallelism splits the norms and residual adds over tp
    sp = layer_work(job.cfg, Layout(2, 1, 4, 2, 64, sequence_parallel=True), sw, DENSE, "none")
    assert w.bytes - sp.bytes == pytest.approx(e * (2 * 5 + 2 * 7) * h / 2 * 2, rel=1e-12)


def test_flash_attention_removes_the_scores_and_halves_the_core():
    old, new = PROFILES["megatron-2021"], dataclasses.replace(PROFILES["megatron-2021"], flash_attention=True)
    lo = Layout(1, 1, 8, 1, 64)
    a, b = evaluate(_job(old), lo).timing, evaluate(_job(new), lo).timing
    assert b.terms["memory-bound ops"] < 0.7 * a.terms["memory-bound ops"]  # the s × s passes
    assert b.terms["GEMMs and attention"] < a.terms["GEMMs and attention"]


def test_fused_kernels_and_weight_casts_move_only_memory_bound_work():
    llama = [
        "preset=tiny-llama",
        "model.hidden_size=1024",
        "model.num_attention_heads=16",
        "model.max_position_embeddings=2048",
        'train.param_dtype="fp32"',  # autocast's per-micro-batch weight casts, which no_casts drops
    ]
    lo = Layout(1, 1, 8, 1, 64)
    plain, fused = (evaluate(_job(PROFILES[n], llama), lo).timing for n in ("mlm", "mlm-triton"))
    assert plain.terms["GEMMs and attention"] == fused.terms["GEMMs and attention"]
    assert plain.terms["memory-bound ops"] > 1.5 * fused.terms["memory-bound ops"]
    no_casts = dataclasses.replace(PROFILES["mlm-triton"], weight_casts=False)
    assert (
        evaluate(_job(no_casts, llama), lo).timing.terms["memory-bound ops"] < fused.terms["memory-bound ops"]
    )


def test_loss_bytes_per_logit():
    job = _job(PROFILES["megatron-2021"])
    lo = Layout(2, 1, 4, 1, 64)
    logits = 2048 * 51200 / 2
    assert loss_work(job.cfg, lo, PROFILES["megatron-2021"]).bytes == 48 * logits
    assert loss_work(job.cfg, lo, PROFILES["megatron-core"]).bytes == 12 * logits


def test_launch_overhead_counts_only_where_the_host_is_slower():
    tiny = ["preset=tiny-llama"]
    lo = Layout(1, 1, 8, 1, 64)
    fast = evaluate(_job(PROFILES["mlm"], tiny, seq=256), lo).timing
    slow = evaluate(_job(dataclasses.replace(PROFILES["mlm"], launch_s=1e-3), tiny, seq=256), lo).timing
    assert slow.terms["launch overhead (exposed)"] > 0.5 * slow.step_s
    big = ["preset=llama3-8b"]
    assert evaluate(_job(PROFILES["mlm"], big, seq=8192), lo).timing.terms["launch overhead (exposed)"] == 0
    assert fast.terms["data loading"] > 0


def test_overlaps_hide_their_collectives():
    sets = ["preset=llama3-8b"]
    job = make_job(
        None, sets, 64, 8, load_hardware("h100-80g"), 8192, 64, None, "bf16", PROFILES["megatron-core"]
    )
    lo = Layout(8, 1, 8, 1, 64, sequence_parallel=True, distributed_optimizer=True)
    base = evaluate(job, lo).timing
    over = evaluate(
        dataclasses.replace(job, software=dataclasses.replace(job.software, tp_overlap=True)), lo
    ).timing
    assert over.terms["tp collectives"] == pytest.approx(base.terms["tp collectives"] / 8)  # the first chunk
    serial = dataclasses.replace(job.software, overlap_grad_reduce=False, overlap_param_gather=False)
    assert (
        evaluate(dataclasses.replace(job, software=serial), lo).timing.terms["dp (exposed)"]
        > base.terms["dp (exposed)"]
    )


def test_fp8_uses_the_fp8_peak_for_the_linear_layers():
    sets = ["preset=llama3-8b"]
    hw = load_hardware("h100-80g")
    lo = Layout(1, 1, 8, 1, 64)
    bf16 = evaluate(make_job(None, sets, 8, 8, hw, 8192, 64, None, "bf16"), lo).timing
    fp8 = evaluate(
        make_job(None, sets + ['train.fp8.format="hybrid"'], 8, 8, hw, 8192, 64, None, "bf16"), lo
    ).timing
    assert fp8.terms["GEMMs and attention"] < 0.75 * bf16.terms["GEMMs and attention"]
    assert fp8.terms["memory-bound ops"] > bf16.terms["memory-bound ops"]  # the casts
    assert fp8.mfu > bf16.mfu  # MFU stays over the bf16 peak


def test_custom_software_profile(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text('base = "megatron-core"\ntp_overlap = true\nattention_efficiency = 0.6\n')
    sw = load_software(str(path))
    assert (sw.name, sw.tp_overlap, sw.attention_efficiency, sw.fused_cross_entropy) == (
        "mine",
        True,
        0.6,
        True,
    )
    path.write_text('base = "megatron-core"\nflash = true\n')
    with pytest.raises(MlmError, match=r"mine.toml: unknown software keys \['flash'\]"):
        load_software(str(path))
    path.write_text("attention_efficiency = 1.5\n")
    with pytest.raises(MlmError, match=r"attention_efficiency=1.5 must be in \(0, 1\]"):
        load_software(str(path))
    with pytest.raises(MlmError, match="not a known profile"):
        load_software("megatron-1999")
    assert load_software("auto", _job(PROFILES["mlm"]).cfg).name == "mlm-triton"  # model.kernels auto
    assert load_software("auto", _job(PROFILES["mlm"], [*GPT, 'model.kernels="torch"']).cfg).name == "mlm"


@pytest.mark.parametrize("comm", ["p2p", "all_gather"])
def test_cp_exchange_repeats_only_where_selective_recompute_reruns_the_core(comm):
    """Selective recompute repeats the cp exchange's forward only where it re-runs the attention core
    (`selective = "core"`, as `core_seconds` counts it); torchtitan's per-op policy keeps the
    attention output and Megatron's elementwise modules run no attention: their exchange is the
    one of no recompute. Full recompute repeats it under every profile."""
    from mlm.plan.timing import cp_exchange_time, gemm_rates

    sets = ["preset=llama3-8b", "model.num_layers=4"]
    lo = Layout(1, 1, 4, 1, 64, cp=2, cp_comm_type=comm)
    seconds = {}
    for sel in ("core", "elementwise", "op"):
        job = _job(dataclasses.replace(PROFILES["mlm"], selective=sel), sets, seq=8192)
        job = dataclasses.replace(job, hardware=dataclasses.replace(job.hardware, intra_bandwidth=1e9))
        rate = gemm_rates(job, lo)[2]
        seconds[sel] = {
            rc: cp_exchange_time(job.cfg, job, dataclasses.replace(lo, recompute=rc), rate, "gqa")
            for rc in ("none", "selective", "full")
        }
    none = seconds["core"]["none"]
    assert none > 0
    assert seconds["core"]["selective"] > 1.1 * none  # the forward exchange again
    for sel in ("elementwise", "op"):
        assert seconds[sel]["selective"] == pytest.approx(none, rel=1e-12)
        assert seconds[sel]["full"] == pytest.approx(seconds["core"]["full"], rel=1e-12)


MOE = [
    "preset=llama3-8b",
    "model.num_layers=4",
    'model.mlp_kind="moe"',
    "model.moe.num_experts=8",
    "model.moe.router_topk=2",
    "model.moe.ffn_hidden_size=512",
    "model.moe.shared_expert_ffn_hidden_size=1024",
]


def test_fp8_casts_of_an_moe_layer_over_its_experts_widths():
    """Under train.fp8 an MoE layer casts its routed experts' GEMM inputs and output gradients on the
    e/u · k rows they receive at the expert width where the software runs them in fp8
    (`fp8_experts`, Megatron-core's), and the shared experts' at ffn/t on e tokens, not the dense
    MLP's ffn/t on e tokens: by hand for one layer (tp 2 with sequence parallelism, u = 2, k = 2
    of 8 experts, SwiGLU), 2.5 passes of A = 2 bytes each. mlm's fp8 leaves the routed experts in
    bf16: no casts of theirs."""
    seq = 2048
    lo = Layout(2, 1, 4, 1, 64, sequence_parallel=True)
    extra = {}
    for name in ("megatron-core", "mlm"):
        sw = PROFILES[name]
        plain = layer_work(_job(sw, MOE, seq).cfg, lo, sw, MOE_LAYER, "none")
        cfg = _job(sw, MOE + ['train.fp8.format="hybrid"'], seq).cfg
        extra[name] = layer_work(cfg, lo, sw, MOE_LAYER, "none").bytes - plain.bytes
    m, t, e, A = cfg.model, 2, seq, 2
    h, K, H, G, F, S = m.hidden_size, m.head_dim, m.num_attention_heads, m.query_groups, 512, 1024
    attention = (h + H * K / t) + (H * K / t + 2 * G * K / t + h)  # qkv's and out's inputs, gradients
    shared = (h + S / t) + (2 * S / t + h)  # up/gate's and down's inputs, gradients
    routed = (h + F) + (2 * F + h)  # the same per routed row
    rows = e / t * 2
    assert extra["megatron-core"] == pytest.approx(
        2.5 * A * ((attention + shared) * e + routed * rows), rel=1e-12
    )
    assert extra["mlm"] == pytest.approx(2.5 * A * (attention + shared) * e, rel=1e-12)


def test_fp8_routed_experts_at_the_fp8_peak_only_where_the_software_runs_them_so():
    """mlm's fp8 (`mlm.parallel.fp8`) leaves the routed experts' grouped GEMMs in bf16: widening
    the experts adds the same GEMM time with and without train.fp8; Megatron-core (Transformer
    Engine's fp8 grouped GEMMs, `fp8_experts`) adds it over fp8's speedup (1979 / 989 TFLOP/s)."""
    hw = load_hardware("h100-80g")
    lo = Layout(1, 1, 8, 1, 64)

    def added(software: str, fp8: bool) -> float:
        terms = []
        for width in (512, 1024):  # the experts' GEMMs stay at efficiency(512 rows)
            sets = (
                MOE + [f"model.moe.ffn_hidden_size={width}"] + (['train.fp8.format="hybrid"'] if fp8 else [])
            )
            job = make_job(None, sets, 8, 8, hw, 2048, 64, None, "bf16", PROFILES[software])
            terms.append(evaluate(job, lo).timing.terms["GEMMs and attention"])
        return terms[1] - terms[0]

    assert added("mlm", True) == pytest.approx(added("mlm", False), rel=1e-9)
    fp8_speedup = hw.peak("fp8") / hw.peak("bf16")
    assert added("megatron-core", True) == pytest.approx(
        added("megatron-core", False) / fp8_speedup, rel=1e-9
    )


def test_selective_modes_rerun_what_their_docstrings_say():
    """Selective recompute's extra forward work by `Software.selective`, for one Llama layer (tp 2
    with sequence parallelism, fused kernels, A = 2): `elementwise` (Megatron's --recompute-modules
    layernorm, moe_act) re-runs the two norms (2 passes over h on e/u tokens, 1 kernel each) and
    SwiGLU (3 passes over ffn/t on e tokens, 1 kernel), no residual add, RoPE, copy or GEMM; `op`
    (torchtitan's) re-runs every elementwise op (under fp8 the GEMMs' input casts among them) and
    every other GEMM (half the GEMMs' kernels); `core` re-runs the attention core only."""
    sets = ["preset=llama3-8b", "model.num_layers=4"]
    lo = Layout(2, 1, 4, 1, 64, sequence_parallel=True)
    e, A, t = 2048, 2, 2

    def extra(selective, fp8=False):
        sw = dataclasses.replace(PROFILES["mlm-triton"], selective=selective)
        cfg = _job(sw, sets + (['train.fp8.format="hybrid"'] if fp8 else []), 2048).cfg
        plain, again = (layer_work(cfg, lo, sw, DENSE, rc) for rc in ("none", "selective"))
        return cfg.model, again.bytes - plain.bytes, again.kernels - plain.kernels

    m, bytes_, kernels = extra("elementwise")
    h, f = m.hidden_size, m.ffn_size
    assert bytes_ == pytest.approx(A * (2 * 2 * h * e / t + 3 * f / t * e), rel=1e-12)
    assert kernels == 3
    # op: residual adds (3 + 3) and the output copy, RoPE, norms and SwiGLU forward again, 5 GEMMs / 2
    m, bytes_, kernels = extra("op")
    q, kv = m.num_attention_heads * m.head_dim / t, 2 * m.query_groups * m.head_dim / t
    ops = 2 * 2 * h * e / t + 3 * f / t * e + 2 * 3 * h * e / t + 2 * q * e + 2 * (q + kv / 2) * e
    assert bytes_ == pytest.approx(A * ops, rel=1e-12)
    assert kernels == 2 + 1 + 2 + 1 + 2 + 2.5
    _, fp8_bytes, _ = extra("op", fp8=True)  # the GEMMs' input casts (2.5 passes) again
    assert fp8_bytes - bytes_ == pytest.approx(A * 2.5 * (h + q + h + f / t) * e, rel=1e-12)
    _, fp8_bytes, _ = extra("elementwise", fp8=True)  # not under Megatron's elementwise modules
    assert fp8_bytes == pytest.approx(A * (2 * 2 * h * e / t + 3 * f / t * e), rel=1e-12)


@pytest.mark.parametrize(
    "sets, precision",
    [([], "fp32"), (['train.param_dtype="bf16"'], "bf16")],
    ids=["fp32-no-autocast", "bf16-parameters"],
)
def test_weight_casts_only_where_autocast_casts_fp32_weights(sets, precision):
    """`weight_casts` counts autocast's per-micro-batch casts of fp32 weights (6 B forward, 6 B
    backward); in fp32 there is no autocast and bf16 parameters are already in the compute dtype
    (as the memory model's cast cache, `mlm.plan.memory`): only the gradient accumulation's 10 B."""
    from mlm.plan.work import parameter_work

    sw = PROFILES["mlm"]
    cfg = make_job(
        None, ["preset=llama3-8b", *sets], 8, 8, load_hardware("h100-80g"), 2048, 64, None, precision
    ).cfg
    assert parameter_work(cfg, sw, 1000, "none") == 1000 * 10
    autocast = make_job(
        None,
        ["preset=llama3-8b", 'train.param_dtype="fp32"'],
        8,
        8,
        load_hardware("h100-80g"),
        2048,
        64,
        None,
        "bf16",
    ).cfg
    assert parameter_work(autocast, sw, 1000, "none") == 1000 * (12 + 10)


def test_fp8_leaves_the_output_layer_at_the_compute_dtype_peak():
    """train.fp8 runs the transformer layers' linear layers in fp8; the output layer (the logits'
    6·D·V FLOPs per token) stays in bf16 (`mlm.parallel.fp8`, as in Transformer Engine's Megatron
    and torchtitan's float8): doubling the vocabulary adds its GEMMs at the bf16 peak."""
    hw = load_hardware("h100-80g")
    lo = Layout(1, 1, 8, 1, 64)

    def gemms(vocab: int) -> float:
        sets = [
            "preset=llama3-8b",
            "model.num_layers=2",
            f"model.vocab_size={vocab}",
            'train.fp8.format="hybrid"',
        ]
        job = make_job(None, sets, 8, 8, hw, 2048, 64, None, "bf16")
        return evaluate(job, lo).timing.terms["GEMMs and attention"], job

    (small, job), (large, _) = gemms(64000), gemms(128000)
    m = job.cfg.model
    eff = hw.efficiency(min(2048, m.hidden_size, m.ffn_size))
    by_hand = 8 * 2048 * 6 * m.hidden_size * 64000 / (hw.peak("bf16") * eff)  # 8 micro-batches
    assert large - small == pytest.approx(by_hand, rel=1e-9)


@pytest.mark.parametrize(
    "line, message",
    [
        ('fused_norm = "false"', r"fused_norm='false' must be true or false"),
        ("tp_overlap = 1", r"tp_overlap=1 must be true or false"),
        ('attention_efficiency = "0.5"', r"attention_efficiency='0.5' must be a number"),
        ("selective = 2", r"selective=2 must be one of core, elementwise, op"),
    ],
)
def test_custom_software_profile_values_of_the_wrong_type(tmp_path, line, message):
    """A TOML value of the wrong type is an MlmError naming the key, the value and the rule (a
    string "false" would otherwise switch a kernel on)."""
    path = tmp_path / "mine.toml"
    path.write_text(f'base = "megatron-core"\n{line}\n')
    with pytest.raises(MlmError, match=message):
        load_software(str(path))


def test_cp_ring_hides_behind_the_attention_at_its_own_rate():
    """The p2p ring's transfers overlap each step's attention, which runs at the attention's own
    rate (`core_seconds`: the causal half at the profile's attention_efficiency of the compute
    dtype's peak), not at the linear layers' GEMM rate: train.fp8 (GEMMs only) leaves the
    exposed exchange as it is; a faster attention kernel hides less of it. On 100 GB/s links a
    llama3-8b micro-batch of 8192 tokens over cp 2 hides part of its ring."""
    hw = dataclasses.replace(load_hardware("h100-80g"), intra_bandwidth=100e9)
    lo = Layout(1, 1, 4, 1, 64, cp=2)

    def exposed(fp8: bool = False, attention_efficiency: float = 0.35) -> float:
        sets = ["preset=llama3-8b", "model.num_layers=2"] + (['train.fp8.format="hybrid"'] if fp8 else [])
        sw = dataclasses.replace(PROFILES["mlm"], attention_efficiency=attention_efficiency)
        job = make_job(None, sets, 8, 8, hw, 8192, 64, None, "bf16", sw)
        return evaluate(job, lo).timing.terms["cp exchange (exposed)"]

    base = exposed()
    assert base > 0
    assert exposed(fp8=True) == pytest.approx(base, rel=1e-12)
    assert exposed(attention_efficiency=0.7) > 1.2 * base


def test_explain_names_the_peak_the_gemms_run_at():
    """Under train.fp8 the explanation's GEMM efficiency is of fp8's peak (1979 TFLOP/s on an H100),
    the one the linear layers' GEMMs are timed at; MFU stays over the bf16 peak."""
    import io

    from rich.console import Console

    from mlm.plan import report

    hw = load_hardware("h100-80g")
    job = make_job(None, ["preset=llama3-8b", 'train.fp8.format="hybrid"'], 8, 8, hw, 8192, 64, None, "bf16")
    con = Console(file=io.StringIO(), width=200)
    con.print(report.explain(job, evaluate(job, Layout(1, 1, 8, 1, 64))))
    assert "of 1979 TFLOP/s" in con.file.getvalue()
