"""`mlm plan`: the memory model against bytes counted on the real objects and bytes autograd saves,
the paper's activation formula by hand, the 70B/512-GPU plan, the plan file and `mlm train --plan`
round trip, calibration, and the errors.

One 4-rank gloo spawn does all multi-rank work: it builds five meshes in turn (the model, the
gradient buffer and the optimizer exactly as the trainer builds them, one real training step so
that Adam's state exists), counts weights / gradients / optimizer bytes (must equal the prediction)
and the bytes one micro-batch's forward saves for backward (within 10 %), then trains from a plan
file through `mlm train --plan`.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from mlm.config import load_config
from mlm.errors import MlmError
from mlm.layout import Layout
from mlm.model.kinds.mtp.module import MTPTargets
from mlm.parallel.context import zigzag_indices
from mlm.plan.candidates import evaluate
from mlm.plan.hardware import load_hardware
from mlm.plan.job import Job, make_job
from mlm.plan.memory import (
    korthikanti_layer_bytes,
    micro_batch_activation_bytes,
    model_state_bytes,
    rank_stage,
)
from mlm.plan.search import check_cp, check_layout, plan
from mlm.planfile import read_plan, train_overrides, world_size_note, write_plan
from tests.helpers.common import tiny_sets
from tests.helpers.distributed import run_ranks

# A model in the regime the formulas describe (hidden 128, seq 128, micro-batch 2), 4 layers so
# that pp 2 × vpp 2 has one layer per chunk; small buckets so that several are padded.
MODEL = {
    "model.num_layers": 4,
    "model.hidden_size": 128,
    "model.num_attention_heads": 4,
    "model.num_query_groups": 2,
    "model.ffn_hidden_size": 352,
    "model.vocab_size": 500,
    "model.max_position_embeddings": 128,
    "data.seq_length": 128,
    "train.micro_batch_size": 2,
    "train.global_batch_size": 8,
    "parallel.bucket_size_mb": 0.05,
}
GPT2 = {
    "model.normalization": "layernorm",
    "model.activation": "gelu_tanh",
    "model.add_bias": True,
    "model.position_embedding": "learned",
    "model.tie_embeddings": True,
    "model.num_query_groups": "none",
}
# an MoE model: layer 0 dense, 8 experts top-2 (the loop implementation: on CPU `auto` is bmm,
# which pads every expert to the busiest one's tokens; GPUs run grouped_mm, unpadded)
MOE = {
    "model.mlp_kind": "moe",
    "model.first_k_dense": 1,
    "model.moe.num_experts": 8,
    "model.moe.router_topk": 2,
    "model.moe.ffn_hidden_size": 96,
    "model.moe.aux_loss_coeff": 0.01,
    "model.moe.experts_impl": "loop",
}
# a DeepSeek-V3-shaped model: multi-latent attention with a query latent (its down-projections
# replicated over tp), the DeepSeek router with a shared expert, one MTP depth on the last stage
DEEPSEEK = {
    **MOE,
    "model.num_query_groups": "none",
    "model.attention_kind": "mla",
    "model.mla.q_lora_rank": 48,
    "model.mla.kv_lora_rank": 32,
    "model.mla.qk_nope_head_dim": 16,
    "model.mla.qk_rope_head_dim": 8,
    "model.mla.v_head_dim": 24,
    "model.moe.router_score_function": "sigmoid",
    "model.moe.router_enable_expert_bias": True,
    "model.moe.shared_expert_ffn_hidden_size": 64,
    "model.mtp_num_layers": 1,
}
# world 4: (name, extra settings); dp is what is left of 4 ranks
# Megatron's mixed precision: bf16 parameters, fp32 main weights (counted as optimizer state) and gradients
BF16_PARAMS = {"train.precision": "bf16", "train.param_dtype": "bf16"}

MESHES = [
    ("tp2 dp2", {"parallel.tp": 2}),
    (
        "tp2 dp2 sp selective distopt",
        {
            "parallel.tp": 2,
            "parallel.sequence_parallel": True,
            "model.recompute": "selective",
            "parallel.distributed_optimizer": True,
        },
    ),
    (
        "tp2 pp2 vpp2 sp full",
        {
            "parallel.tp": 2,
            "parallel.pp": 2,
            "parallel.vpp": 2,
            "parallel.sequence_parallel": True,
            "model.recompute": "full",
        },
    ),
    ("pp2 dp2 gpt2 tied distopt", {"parallel.pp": 2, "parallel.distributed_optimizer": True, **GPT2}),
    # bf16 parameters: 2-byte weights, fp32 gradients, fp32 main weights sharded like the moments
    (
        "tp2 dp2 distopt bf16-params",
        {"parallel.tp": 2, "parallel.distributed_optimizer": True, **BF16_PARAMS},
    ),
    ("pp2 dp2 bf16-params", {"parallel.pp": 2, **BF16_PARAMS}),
    (
        "dp4 distopt bf16-reduce",
        {"parallel.distributed_optimizer": True, "parallel.grad_reduce_dtype": "bf16"},
    ),
    # MoE: ep folded over tp and dp (edp 1), and over dp alone with the experts' optimizer state
    # sharded over edp 2
    (
        "tp2 dp2 sp ep4 moe shared",
        {
            "parallel.tp": 2,
            "parallel.sequence_parallel": True,
            "parallel.ep": 4,
            **MOE,
            "model.moe.shared_expert_ffn_hidden_size": 64,
            "model.moe.shared_expert_gate": True,
        },
    ),
    ("dp4 ep2 moe distopt", {"parallel.ep": 2, "parallel.distributed_optimizer": True, **MOE}),
    # context parallelism: gradients and the optimizer's shards over dp × cp; each attention
    # implementation's saved tensors, with and without recompute
    (
        "cp2 dp2 p2p distopt",
        {"parallel.cp": 2, "parallel.cp_comm_type": "p2p", "parallel.distributed_optimizer": True},
    ),
    (
        "cp2 tp2 sp all_gather",
        {
            "parallel.cp": 2,
            "parallel.tp": 2,
            "parallel.sequence_parallel": True,
            "parallel.cp_comm_type": "all_gather",
        },
    ),
    ("cp2 pp2 p2p selective", {"parallel.cp": 2, "parallel.pp": 2, "model.recompute": "selective"}),
    ("cp4 all_gather", {"parallel.cp": 4, "parallel.cp_comm_type": "all_gather"}),
    # MLA's replicated down-projections and head-split up-projections under tp, the MTP depth and
    # the embedding copy on the last stage, its MoE layer's experts over ep
    (
        "tp2 pp2 sp ep2 mla mtp",
        {
            "parallel.tp": 2,
            "parallel.pp": 2,
            "parallel.sequence_parallel": True,
            "parallel.ep": 2,
            **DEEPSEEK,
        },
    ),
]


def _cfg(extra: dict):
    value = lambda v: str(v).lower() if isinstance(v, bool) else v  # noqa: E731 - TOML booleans
    return load_config(None, [f"{k}={value(v)}" for k, v in {**MODEL, **extra}.items()])


def _layout(cfg, world: int) -> Layout:
    p = cfg.parallel
    return Layout(
        p.tp,
        p.pp,
        world // (p.tp * p.pp * p.cp),
        cfg.train.micro_batch_size,
        cfg.train.global_batch_size,
        p.vpp,
        p.sequence_parallel,
        cfg.model.recompute,
        p.distributed_optimizer,
        cp=p.cp,
        ep=p.ep,
        cp_comm_type=p.cp_comm_type,
    )


def _storages(tensors) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def _measure(cfg, mesh, autocast=None) -> dict:
    """Build as the trainer does, run one step, count model state; then the bytes one micro-batch's
    forward (every chunk of this rank, with the loss; under `autocast` if given) saves for backward."""
    from mlm.build import build_rank_model
    from mlm.parallel.pipeline import Pipeline
    from mlm.train.optimizer import TrainOptimizer

    device = torch.device("cpu")
    model = build_rank_model(cfg.model, cfg.parallel, mesh, device, seed=cfg.train.seed, train=cfg.train)
    opt = TrainOptimizer(model, cfg, mesh, device)
    pipe = Pipeline(model, mesh, cfg.parallel.vpp)
    b, s, n = (
        cfg.train.micro_batch_size,
        cfg.data.seq_length,
        cfg.train.global_batch_size // (cfg.train.micro_batch_size * mesh.dp),
    )
    gen = torch.Generator().manual_seed(mesh.dp_rank)
    micro = [torch.randint(0, cfg.model.vocab_size, (b, s + 1), generator=gen) for _ in range(n)]
    pipe.train_step(micro, 1.0 / n, opt.all_grads)
    pipe.sync_tied_embedding()
    opt.all_grads.finish()
    opt.clip(1.0)
    opt.step(1e-3, cfg.optimizer.weight_decay)
    if opt.dists:  # one per gradient buffer (dense over dp, experts over edp)
        tensors = []
        for d in opt.dists:
            steps = [st["step"] for st in d._adam.state.values()] if d._adam else []
            tensors += [d.exp_avg, d.exp_avg_sq, *steps, *([d.main] if d.main is not None else [])]
        optimizer = _storages(tensors)
    else:  # with bf16 parameters the fp32 main weights too (the optimizer's)
        states = [t for st in opt.adamw.state.values() for t in st.values()]
        optimizer = _storages(states + list(opt.mains.values()))
    counted = {
        "weights": _storages(list(model.parameters())),
        "gradients": sum(g.buffer.untyped_storage().nbytes() for g in opt.all_grads.buckets),
        "optimizer": optimizer,
        "names": [(k, v.numel()) for k, v in model.named_parameters()],
    }
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            saved[st.data_ptr()] = st.nbytes()
        return t

    model.train()
    keep = []  # hold every output, so no storage is freed and its address reused mid-count
    region = torch.autocast("cpu", dtype=autocast) if autocast else torch.autocast("cpu", enabled=False)
    # under context parallelism this rank's tokens of the sequence (the pipeline's zigzag split)
    pos = zigzag_indices(s, mesh.cp, mesh.cp_rank) if mesh.cp > 1 else None
    inputs, labels = micro[0][:, :-1], micro[0][:, 1:]
    if pos is not None:
        inputs, labels = inputs[:, pos], labels[:, pos]
    t = s // mesh.cp
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), region:
        for c, chunk in enumerate(model.chunks):
            if chunk.first:
                x = inputs
            else:
                x = torch.randn(b, t // model.sequence_shards, cfg.model.hidden_size, requires_grad=True)
            if chunk.last:
                h = model.hidden_states(x, pos, chunk=c)
                keep.append(model.head_loss(h, labels))
                if model.mtp is not None:  # the MTP depths, as the pipeline's last stage runs them
                    ahead = MTPTargets.of(micro[0], cfg.model.mtp_num_layers, mesh.cp)
                    ahead = ahead.split(pos) if pos is not None else ahead
                    keep.append(model.mtp_losses(h, ahead, pos))
            else:
                keep.append(model(x, pos, chunk=c))
    counted["activations"] = sum(saved.values())
    return counted


def _ranks_main(rank, world, data, run_dir, plan_path):
    from cli.train import train
    from mlm.parallel import Mesh

    results = []
    for name, extra in MESHES:
        cfg = _cfg(extra)
        mesh = Mesh.build(cfg.parallel)
        dp_cp_rank = (
            mesh.dp_rank * mesh.cp + mesh.cp_rank
        )  # the dense buffer's shard (the dp_cp group's order)
        autocast = torch.bfloat16 if cfg.train.precision == "bf16" else None
        results.append((name, mesh.pp_rank, (dp_cp_rank, mesh.edp_rank), _measure(cfg, mesh, autocast)))
    batching = ("train.micro_batch_size", "train.global_batch_size")  # the plan's, not tiny_sets'
    sets = [s for s in tiny_sets(run_dir, data, **{"train.train_iters": 3}) if not s.startswith(batching)]
    train(
        config=None,
        overrides=sets,
        load=None,
        auto_resume=False,
        dry_run=False,
        world_size=None,
        png=None,
        plan=plan_path,
    )
    return results


def _tiny_plan(tmp_path):
    """A plan for the tiny model on 4 CPU 'GPUs' whose mesh has both tp and pp (the best such)."""
    from cli.plan import plan as plan_command

    sets = [
        "preset=tiny-llama",
        "model.num_layers=2",
        "model.hidden_size=64",
        "model.ffn_hidden_size=128",
        "model.vocab_size=512",
        "model.max_position_embeddings=64",
    ]
    job = make_job(None, sets, 4, 4, load_hardware("h100-80g"), 32, 8, None, "fp32")
    ranked = plan(job).ranked
    pick = next(i for i, c in enumerate(ranked, 1) if c.layout.tp > 1 and c.layout.pp > 1)
    path = tmp_path / "plan.toml"
    kwargs = dict(
        gpus=4,
        config=None,
        preset=None,
        overrides=sets,
        gpus_per_node=4,
        hardware="h100-80g",
        seq_length=32,
        global_batch=8,
        tokens=None,
        precision="fp32",
        optimizer="auto",
        ep=None,
        cp=None,
        top=3,
        pick=pick,
        explain=True,
        output=str(path),
        png=None,
        calibrate=[],
        save_profile=None,
    )
    plan_command(**kwargs)
    return path, ranked[pick - 1].layout, kwargs


def test_memory_model_against_real_ranks_and_train_from_plan(tmp_path, tiny_data):
    plan_path, layout, kwargs = _tiny_plan(tmp_path)
    run_dir = tmp_path / "run"
    per_rank = run_ranks(4, _ranks_main, tiny_data, str(run_dir), str(plan_path))

    errors = {}
    for rank_results in per_rank:
        for (name, extra), (got_name, pp_rank, ranks, counted) in zip(MESHES, rank_results, strict=True):
            assert name == got_name
            cfg = _cfg(extra)
            lo = _layout(cfg, 4)
            stage = rank_stage(cfg, lo.tp, lo.pp, lo.vpp, pp_rank, ep=lo.ep)
            assert [(p.name, p.numel) for p in stage.params] == counted["names"], name
            predicted = model_state_bytes(cfg, stage, lo, *ranks)
            for k in ("weights", "gradients", "optimizer"):
                assert predicted[k] == counted[k], (name, pp_rank, ranks, k, predicted[k], counted[k])
            act = micro_batch_activation_bytes(cfg, lo, stage)
            err = act / counted["activations"] - 1
            errors[(name, pp_rank)] = err
            assert abs(err) < 0.10, (name, pp_rank, act, counted["activations"])
    print("activation error per case:", {k: f"{v:+.1%}" for k, v in errors.items()})

    # the round trip: the run used the plan's mesh, batching and recompute
    ran = load_config(run_dir / "config.toml")
    assert (ran.parallel.tp, ran.parallel.pp, ran.parallel.vpp) == (layout.tp, layout.pp, layout.vpp)
    assert ran.parallel.sequence_parallel == layout.sequence_parallel
    assert ran.parallel.distributed_optimizer == layout.distributed_optimizer
    assert (ran.train.micro_batch_size, ran.model.recompute) == (layout.micro_batch, layout.recompute)
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps if r["split"] == "train"] == [1, 2, 3]

    # calibration from that run: the refitted profile predicts the measured step
    from mlm.plan.calibrate import calibrate, load_run

    hw = load_hardware("h100-80g")
    run = load_run(run_dir / "metrics.jsonl", 4, 4, hw)
    assert run.layout == layout
    new, c, _ = calibrate(hw, [run])
    assert c > 1 and new.gemm_max < hw.gemm_max  # a CPU is slower than an H100
    after = load_run(run_dir / "metrics.jsonl", 4, 4, new)
    predicted = after.compute_s + after.comm_s
    assert predicted == pytest.approx(after.measured_s, rel=0.05)


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"model.recompute": "selective"},
        {"model.recompute": "full"},
        {"train.precision": "bf16"},
        {"model.hidden_dropout": 0.1},
        GPT2,
        {**MOE, "model.moe.shared_expert_ffn_hidden_size": 64, "model.moe.shared_expert_gate": True},
        {**MOE, "train.precision": "bf16"},
        DEEPSEEK,
        {**DEEPSEEK, "train.precision": "bf16", "model.mla.q_lora_rank": "none"},
        {**DEEPSEEK, "model.recompute": "full", "model.mtp_num_layers": 2},
        {"model.fused_cross_entropy": True},
        {**DEEPSEEK, "model.fused_cross_entropy": True, "train.precision": "bf16"},
        BF16_PARAMS,
        {**MOE, **BF16_PARAMS},
    ],
    ids=[
        *("none", "selective", "full", "bf16-autocast", "dropout", "gpt2", "moe-shared", "moe-bf16"),
        *("mla-mtp", "mla-no-q-latent-bf16", "mla-mtp2-full", "fused-ce", "mla-mtp-fused-ce-bf16"),
        *("bf16-params", "moe-bf16-params"),
    ],
)
def test_memory_model_one_process(extra):
    from mlm.parallel import Mesh

    cfg = _cfg({"train.global_batch_size": 2, **extra})  # one micro-batch per step: fast
    bf16 = cfg.train.precision == "bf16"  # the forward under autocast, as the trainer runs it
    counted = _measure(cfg, Mesh.single(), torch.bfloat16 if bf16 else None)
    lo = _layout(cfg, 1)
    stage = rank_stage(cfg, 1, 1, 1, 0)
    for k in ("weights", "gradients", "optimizer"):
        assert model_state_bytes(cfg, stage, lo)[k] == counted[k], k
    act = micro_batch_activation_bytes(cfg, lo, stage)
    assert abs(act / counted["activations"] - 1) < 0.10, (act, counted["activations"])


# Dense MLA layers (no routing imbalance: the activations are exact), with and without a query
# latent, fp32 and bf16 autocast, on 2 ranks: tp 2 with and without sequence parallelism, dp 2.
MLA_DENSE = {**DEEPSEEK, "model.mlp_kind": "dense", "model.mtp_num_layers": 0, "model.num_layers": 2}
MLA_EXACT = {
    "tp2 sp": {"parallel.tp": 2, "parallel.sequence_parallel": True},
    "tp2 sp bf16": {"parallel.tp": 2, "parallel.sequence_parallel": True, "train.precision": "bf16"},
    "tp2 sp no-q-latent": {
        "parallel.tp": 2,
        "parallel.sequence_parallel": True,
        "model.mla.q_lora_rank": "none",
    },
    "tp2 sp no-q-latent bf16": {
        "parallel.tp": 2,
        "parallel.sequence_parallel": True,
        "model.mla.q_lora_rank": "none",
        "train.precision": "bf16",
    },
    "tp2 bf16": {"parallel.tp": 2, "train.precision": "bf16"},
    "tp2 no-q-latent": {"parallel.tp": 2, "model.mla.q_lora_rank": "none"},
    "dp2": {},
    "dp2 no-q-latent bf16": {"model.mla.q_lora_rank": "none", "train.precision": "bf16"},
}


def _mla_cfg(extra: dict):
    return _cfg({**MLA_DENSE, "train.global_batch_size": 4, **extra})


def _mla_ranks_main(rank, world):
    from mlm.parallel import Mesh

    out = {}
    for name, extra in MLA_EXACT.items():
        cfg = _mla_cfg(extra)
        bf16 = torch.bfloat16 if cfg.train.precision == "bf16" else None
        out[name] = _measure(cfg, Mesh.build(cfg.parallel), bf16)["activations"]
    return out


def test_mla_activations_exact_on_tp_ranks():
    """MLA in Megatron's layout: the down-projections and their norms on the rank's e/u tokens,
    the latents (not the hidden state) gathered for the up-projections, q without a query latent
    on the gathered hidden state. The planner's bytes equal what autograd saves on each rank, to
    the byte. (The model of the layout before, the hidden state gathered for the down-projections
    and the latents computed over the whole sequence on every tp rank, is +9.1 % per layer on a
    tp 2 + SP rank in fp32, +13.6 % in bf16.)"""
    for rank in run_ranks(2, _mla_ranks_main):
        for name, extra in MLA_EXACT.items():
            cfg = _mla_cfg(extra)
            lo = _layout(cfg, 2)
            stage = rank_stage(cfg, lo.tp, 1, 1, 0)
            # at tp 1 F.cross_entropy also saves 20 bytes of scalars the planner leaves out (as
            # for GQA); under tp the vocabulary-parallel loss is counted whole
            scalars = 20 if lo.tp == 1 else 0
            assert micro_batch_activation_bytes(cfg, lo, stage) + scalars == rank[name], name


def test_korthikanti_formula_gpt3_175b():
    # GPT-3 175B, Korthikanti et al. 2022 Table 2 / eq. 1-2: s = 2048, b = 1, h = 12288, a = 96, t = 8.
    # sbh = 2048 · 12288 = 25,165,824; 5as/h = 5 · 96 · 2048 / 12288 = 80.
    sbh = 25_165_824
    assert korthikanti_layer_bytes(2048, 1, 12288, 96, 1, "none") == 114 * sbh  # 34 + 80
    assert korthikanti_layer_bytes(2048, 1, 12288, 96, 8, "tp") == 23 * sbh  # 10 + 24/8 + 80/8
    assert korthikanti_layer_bytes(2048, 1, 12288, 96, 8, "tp+sp") == 14.25 * sbh  # 114 / 8
    assert korthikanti_layer_bytes(2048, 1, 12288, 96, 8, "selective+sp") == 4.25 * sbh  # 34 / 8
    assert korthikanti_layer_bytes(2048, 1, 12288, 96, 8, "full") == 2 * sbh
    # per layer in GB: 2.87 (none), 0.58 (tp), 0.36 (tp+sp), 0.107 (selective+sp)
    assert round(114 * sbh / 1e9, 2) == 2.87


def test_llama3_70b_on_512_h100(capsys):
    job = make_job(None, ["preset=llama3-70b"], 512, 8, load_hardware("h100-80g"), 8192, 1024, None, "bf16")
    result = plan(job)
    best = result.ranked[0]
    check_layout(job, best.layout)  # valid: divisibility, batch, schedule
    assert best.fits and best.memory.total <= 80e9
    assert best.layout.gpus == 512 and best.layout.tp <= 8
    assert all(
        a.timing.tokens_per_s_per_gpu >= b.timing.tokens_per_s_per_gpu
        for a, b in zip(result.ranked, result.ranked[1:], strict=False)
    )
    assert result.rejected[(16, 1)].startswith("model.num_query_groups=8 is not divisible by parallel.tp=16")
    # tp 1 × pp 1 fits only with FSDP: 70B's replicated or ZeRO-1 state is above 80 GB on its own
    flat = [c for c in result.ranked if (c.layout.tp, c.layout.pp) == (1, 1)]
    assert flat and all(c.layout.fsdp for c in flat) and (1, 1) not in result.rejected
    unsharded = plan(job, "distributed").rejected[(1, 1)]
    assert unsharded.startswith("needs ") and "> 80.0 GB" in unsharded
    from rich.console import Console

    from mlm.plan.report import explain

    Console(width=200).print(explain(job, best))
    out = capsys.readouterr().out
    for term in (
        "weights",
        "gradients",
        "optimizer",
        "activations",
        "headroom",
        "GEMMs and attention",
        "memory-bound ops",
        "launch overhead (exposed)",
        "data loading",
        "tp collectives",
        "pipeline bubble",
        "dp (exposed)",
        "MFU",
        "Korthikanti",
    ):
        assert term in out, term


def test_plan_file_round_trip_and_refusals(tmp_path):
    job = make_job(None, ["preset=tiny-llama"], 8, 8, load_hardware("a100-80g"), 256, 64, None, "bf16")
    from mlm.plan.report import plan_dict

    best = plan(job).ranked[0]
    path = tmp_path / "p.toml"
    write_plan(path, plan_dict(job, best, "tiny-llama", ["model.num_layers=4", "train.seed=1"]))
    spec = read_plan(path)
    assert spec["mesh"]["tp"] == best.layout.tp and spec["prediction"]["memory_gb"]["total"] > 0
    cfg = load_config(None, train_overrides(spec) + ["parallel.bucket_size_mb=1"])
    assert (cfg.parallel.tp, cfg.parallel.pp, cfg.model.num_layers) == (best.layout.tp, best.layout.pp, 4)
    assert cfg.train.seed == 1234  # only the plan's model overrides carry over
    assert world_size_note(spec, 8) is None
    note = world_size_note(spec, 16)
    assert "made for 8 GPUs" in note and "16 ranks" in note

    path.write_text(path.read_text().replace("version = 1", "version = 7"))
    with pytest.raises(MlmError, match="plan version 7; this mlm reads version 1"):
        read_plan(path)
    path.write_text('format = "mlm-plan"\nversion = 1\n')
    with pytest.raises(MlmError, match=r"no \[model\] table"):
        read_plan(path)


def test_impossible_requests():
    hw = load_hardware("h100-80g")
    with pytest.raises(MlmError, match="--gpus 100 is not a multiple of --gpus-per-node 8: .*96 or 104"):
        make_job(None, ["preset=llama3-8b"], 100, 8, hw)
    job = make_job(None, ["preset=llama3-405b"], 8, 8, hw, 8192, 64, None, "bf16")
    with pytest.raises(MlmError, match=r"does not fit on 8 × h100-80g .* it needs at least (\d+) GPUs"):
        plan(job)


def test_custom_hardware_profile(tmp_path):
    p = tmp_path / "mine.toml"
    p.write_text('base = "h100-80g"\nhbm_bytes = 40e9\ngemm_max = 0.5\n')
    hw = load_hardware(str(p))
    assert (hw.hbm_bytes, hw.gemm_max, hw.peak_bf16) == (40e9, 0.5, 989e12)
    p.write_text("peak_bf16 = 1e15\n")
    with pytest.raises(MlmError, match="missing hardware keys"):
        load_hardware(str(p))
    with pytest.raises(MlmError, match="not a known profile"):
        load_hardware("h900")


def test_evaluate_penalises_tp_across_nodes():
    cfg = load_config(
        None,
        [
            "preset=llama3-8b",
            "train.precision=bf16",
            "train.global_batch_size=64",
            "train.micro_batch_size=1",
        ],
    )
    job = Job(cfg, 16, 8, load_hardware("h100-80g"))
    inside = evaluate(job, Layout(8, 1, 2, 1, 64, sequence_parallel=True))
    wide = evaluate(Job(cfg, 16, 4, job.hardware), Layout(8, 1, 2, 1, 64, sequence_parallel=True))
    assert wide.timing.terms["tp collectives"] > 5 * inside.timing.terms["tp collectives"]
    assert wide.timing.terms["GEMMs and attention"] == inside.timing.terms["GEMMs and attention"]


# ---------------------------------------------------------------- MoE: expert parallelism


def _moe_job(preset: str, gpus: int, gpus_per_node: int = 8, sets=()) -> Job:
    return make_job(
        None,
        [f"preset={preset}", *sets],
        gpus,
        gpus_per_node,
        load_hardware("h100-80g"),
        4096,
        512,
        None,
        "bf16",
    )


def test_ep_divides_expert_state_over_ranks():
    """Mixtral-8x7B on 64 GPUs, tp2 pp4 dp8: the experts (96 % of the weights) split over ep; the
    distributed optimizer shards their Adam state over edp = dp·tp / ep instead of dp."""
    job = _moe_job("mixtral-8x7b", 64)
    by_ep = {}
    for ep in (1, 2, 4, 8):
        lo = Layout(2, 4, 8, 1, 512, sequence_parallel=True, distributed_optimizer=True, ep=ep)
        check_layout(job, lo)
        by_ep[ep] = evaluate(job, lo).memory.components
    weights = [by_ep[ep]["weights"] for ep in (1, 2, 4, 8)]
    assert all(a > b for a, b in zip(weights, weights[1:], strict=False)), weights
    # 8 layers per stage of 8 experts × 3 × 4096 × 14336 bf16 weights (a plan's train.param_dtype
    # auto: bf16 parameters in bf16 on CUDA): 5.6 GB at ep 1, a 1/ep share
    experts = 8 * 8 * 3 * 4096 * 14336 * 2
    assert weights[0] - weights[3] == pytest.approx(experts * (1 - 1 / 8), rel=1e-3)
    assert by_ep[8]["gradients"] < by_ep[1]["gradients"] / 4
    # the optimizer: at ep 1 every expert is sharded over dp 8; at ep 8 each rank's one expert
    # per layer over edp = 16 / 8 = 2 ranks; the experts' Adam state per rank: 8 B · E/ep/edp
    assert by_ep[1]["optimizer"] / by_ep[8]["optimizer"] == pytest.approx(2, rel=0.1)
    assert by_ep[8]["optimizer"] < by_ep[1]["optimizer"]
    assert by_ep[1].get("communication buffers", 0) < by_ep[8]["communication buffers"]  # a2a buffers


def test_all_to_all_time_grows_with_the_nodes_ep_spans():
    job = _moe_job("qwen3-30b-a3b", 64)
    lo = lambda ep: Layout(1, 1, 64, 1, 512, distributed_optimizer=True, ep=ep)  # noqa: E731
    a2a = {ep: evaluate(job, lo(ep)).timing.terms["ep all-to-all"] for ep in (1, 2, 4, 8, 16, 32, 64)}
    assert a2a[1] == 0 and a2a[2] > 0
    # about 4 · tokens · k · D · bytes · (ep − 1)/ep per MoE layer: inside a node the bytes grow
    # as (ep − 1)/ep, across nodes most of them move to the ~9× slower network
    assert a2a[2] < a2a[4] < a2a[8] < a2a[16] < a2a[32] < a2a[64]
    assert a2a[16] > 3 * a2a[8]
    tokens, k, D, layers = 4096 * 512 // 64, 8, 2048, 48
    # dispatch and combine in bf16 (the norm's output is bf16), backward the same: 8 bytes per
    # copy and element; 8 micro-batches
    in_node = layers * tokens * k * D * (2 + 2 + 2 + 2) * (8 - 1) / 8 / job.hardware.intra_bandwidth
    latency = layers * 8 * 4 * job.hardware.intra_latency
    assert a2a[8] == pytest.approx(in_node + latency, rel=1e-9)
    # the same ep 8 spanning two nodes of 4 GPUs costs more than inside one node of 8
    wide = evaluate(_moe_job("qwen3-30b-a3b", 64, 4), lo(8)).timing.terms["ep all-to-all"]
    assert wide > 3 * a2a[8]
    # a dense model has no exchange
    dense = make_job(None, ["preset=llama3-8b"], 64, 8, load_hardware("h100-80g"), 4096, 512, None, "bf16")
    assert evaluate(dense, Layout(1, 1, 64, 1, 512)).timing.terms["ep all-to-all"] == 0


def test_search_chooses_ep_for_qwen3_moe(tmp_path, capsys):
    job = _moe_job("qwen3-30b-a3b", 64)
    result = plan(job)
    best = result.ranked[0]
    lo = best.layout
    check_layout(job, lo)
    assert lo.ep > 1 and 128 % lo.ep == 0 and (lo.dp * lo.cp * lo.tp) % lo.ep == 0
    assert {c.layout.ep for c in result.ranked} > {1, lo.ep}  # several sizes were tried and fit
    assert f"ep{lo.ep}" in str(lo)
    # MFU counts the active parameters' FLOPs: the same step at the dense count would be ~9× more
    assert 0.1 < best.timing.mfu < 0.75
    from rich.console import Console

    from mlm.plan.report import explain, plan_dict

    Console(width=200).print(explain(job, best))
    out = capsys.readouterr().out
    assert "ep all-to-all" in out and f"experts: 128 over ep {lo.ep}" in out and "expert outputs" in out
    path = tmp_path / "moe.toml"
    write_plan(path, plan_dict(job, best, "qwen3-30b-a3b", []))
    spec = read_plan(path)
    assert spec["mesh"]["ep"] == lo.ep
    assert f"parallel.ep={lo.ep}" in train_overrides(spec)
    inner = lo.tp * lo.pp * lo.cp
    odd = next(n for n in range(inner, 1000, inner) if (n // lo.pp) % lo.ep)  # a whole dp, ep does not fold
    assert f"ep={lo.ep} does not divide dp × cp × tp = {odd // lo.pp}" in world_size_note(spec, odd)
    assert "does not divide" not in world_size_note(spec, 2 * job.gpus)
    pinned = plan(job, ep=4).ranked
    assert pinned and all(c.layout.ep == 4 for c in pinned)


def test_bad_ep_is_rejected():
    job = _moe_job("qwen3-30b-a3b", 64)
    with pytest.raises(
        MlmError, match=r"ep=3 does not divide model.moe.num_experts=128: .* choose one of 1, 2, 4"
    ):
        plan(job, ep=3)
    with pytest.raises(MlmError, match="ep=3 does not divide model.moe.num_experts=128"):
        check_layout(job, Layout(1, 1, 64, 1, 512, ep=3))
    # ep must divide the stage's dp × cp × tp ranks it folds over
    with pytest.raises(MlmError, match=r"ep\(128\) must divide dp\(64\)"):
        check_layout(job, Layout(1, 1, 64, 1, 512, ep=128))
    with pytest.raises(MlmError, match="turn sequence parallelism on"):
        check_layout(job, Layout(2, 1, 32, 1, 512, ep=4))
    dense = make_job(None, ["preset=llama3-8b"], 8, 8, load_hardware("h100-80g"), 4096, 64, None, "bf16")
    with pytest.raises(MlmError, match="no MoE layers"):
        plan(dense, ep=2)


# ---------------------------------------------------------------- context parallelism


def _cp_bf16_main(rank, world):
    from mlm.parallel import Mesh

    out = []
    for comm in ("p2p", "all_gather"):
        cfg = _cfg({"parallel.cp": 2, "parallel.cp_comm_type": comm, "train.precision": "bf16"})
        out.append(_measure(cfg, Mesh.build(cfg.parallel), torch.bfloat16)["activations"])
    return out


def test_memory_model_cp_under_autocast():
    """cp 2 on 2 ranks in bf16: the ring saves its output and logsumexp in bf16 (its forward runs
    under autocast), all_gather a bf16 mask; both within 10 % (measured: ±0.0 %)."""
    per_rank = run_ranks(2, _cp_bf16_main)
    for i, comm in enumerate(("p2p", "all_gather")):
        cfg = _cfg({"parallel.cp": 2, "parallel.cp_comm_type": comm, "train.precision": "bf16"})
        act = micro_batch_activation_bytes(cfg, _layout(cfg, 2), rank_stage(cfg, 1, 1, 1, 0))
        for counted in per_rank:
            assert abs(act / counted[i] - 1) < 0.10, (comm, act, counted[i])


def _job_8b_128k(gpus_per_node: int = 8) -> Job:
    return make_job(
        None, ["preset=llama3-8b"], 64, gpus_per_node, load_hardware("h100-80g"), 131072, 64, None, "bf16"
    )


def test_cp_divides_activations_and_keeps_the_work_per_gpu():
    """llama3-8b at seq 131072 on 64 H100s, tp 8: cp 8 holds 1/8 of each sequence per rank, so every
    per-token activation is 1/8 of cp 1's; what attention adds depends on the implementation."""
    job = _job_8b_128k()
    lo = lambda cp, dp, comm="p2p", rc="none": Layout(  # noqa: E731
        8,
        1,
        dp,
        1,
        64,
        sequence_parallel=True,
        recompute=rc,
        distributed_optimizer=True,
        cp=cp,
        cp_comm_type=comm,
    )
    one, ring, gather = (evaluate(job, x) for x in (lo(1, 8), lo(8, 1), lo(8, 1, "all_gather")))
    for c in (ring, gather):
        check_layout(job, c.layout)
    assert ring.memory.components["activations"] < one.memory.components["activations"] / 6
    layer = {
        k: v for k, v in ring.memory.per_layer.items() if k not in ("ring output", "attention logsumexp")
    }
    for k, v in layer.items():  # every tensor over the rank's tokens: exactly 1/8
        assert v == pytest.approx(one.memory.per_layer[k] / 8), k
    # the ring keeps its merged output (and a bf16 logsumexp); its by-hand blocks are transient
    assert ring.memory.per_layer["ring output"] == 16384 * 4096 / 8 * 2
    assert ring.memory.components["attention workspace (transient)"] == pytest.approx(
        4 * 4 * 16384**2 * 4 + 16384**2 + 3 * 16384 * 4 * 128 * 4
    )
    # all_gather keeps the other ranks' keys and values ([b, S − s, G/t, K] × 2) and a s × S mask
    assert gather.memory.per_layer["gathered k, v (other cp ranks)"] == 2 * (131072 - 16384) * 1 * 128 * 2
    assert gather.memory.per_layer["cp attention mask"] == 16384 * 131072 * 2
    # weights replicated over cp; the distributed optimizer shards over dp × cp (8 either way)
    for k in ("weights", "gradients", "optimizer"):
        assert ring.memory.components[k] == one.memory.components[k], k
    # the same work per GPU (8 × the micro-batches of 1/8 the tokens), plus the cp exchange
    assert ring.timing.terms["GEMMs and attention"] == pytest.approx(one.timing.terms["GEMMs and attention"])
    assert one.timing.terms["cp exchange (exposed)"] == 0 < gather.timing.terms["cp exchange (exposed)"]


def test_cp_exchange_time():
    """The ring's transfers hide behind attention while they are shorter than one step's attention
    compute; all_gather's do not; a cp group across nodes uses the network."""
    from mlm.plan.timing import cp_exchange_time

    job = _job_8b_128k()
    hw, m = job.hardware, job.cfg.model
    lo = Layout(1, 1, 8, 1, 64, cp=8, recompute="none")
    kv = 2 * 16384 * 8 * 128 * 2  # one message: K and V of 16384 tokens, 8 groups, bf16
    # at seq 131072 a step's attention (1/8 of 4·s·S·H·K FLOPs) outlasts the transfer: only the
    # dK/dV accumulators' last send home is exposed
    rate = hw.peak("bf16") * 0.5
    step = 16384 * 4 * 131072 * 32 * 128 / rate / 8
    assert kv / hw.intra_bandwidth < step
    assert cp_exchange_time(job.cfg, job, lo, rate, "gqa") == pytest.approx(
        kv * 2 / hw.intra_bandwidth + hw.intra_latency
    )
    # with no compute to hide behind (an infinitely fast GPU) every transfer counts: cp − 1 forward,
    # cp − 1 backward with the fp32 accumulators (3 × the bf16 bytes), the last send home; and
    # across nodes of 4 GPUs the ring runs on the network
    wide = _job_8b_128k(gpus_per_node=4)
    for j, (bw, lat) in (
        (job, (hw.intra_bandwidth, hw.intra_latency)),
        (wide, (hw.inter_bandwidth, hw.inter_latency)),
    ):
        every = 7 * (kv / bw + lat) + 7 * (kv * 3 / bw + lat) + kv * 2 / bw + lat
        assert cp_exchange_time(j.cfg, j, lo, float("inf"), "gqa") == pytest.approx(every)
    # recompute repeats the forward ring
    full = Layout(1, 1, 8, 1, 64, cp=8, recompute="full")
    assert cp_exchange_time(job.cfg, job, full, float("inf"), "gqa") == pytest.approx(
        every_in_node := (
            14 * (kv / hw.intra_bandwidth + hw.intra_latency)
            + 7 * (kv * 3 / hw.intra_bandwidth + hw.intra_latency)
            + kv * 2 / hw.intra_bandwidth
            + hw.intra_latency
        )
    )
    assert every_in_node > 0
    # all_gather: K and V all-gathered forward, reduce-scattered backward, 7/8 of the whole each
    ag = Layout(1, 1, 8, 1, 64, cp=8, recompute="none", cp_comm_type="all_gather")
    one = 2 * (7 / 8 * kv * 8 / 2 / hw.intra_bandwidth + hw.intra_latency)
    assert cp_exchange_time(job.cfg, job, ag, rate, "gqa") == pytest.approx(2 * one)
    assert m.query_groups == 8


def test_search_picks_cp_where_cp1_does_not_fit(tmp_path, capsys):
    """llama3-70b at seq 131072 on 128 H100s in nodes of 4 (tp ≤ 4): at cp 1 the first pipeline
    rank holds every layer's input of its in-flight micro-batches, with an fp32 residual stream
    80 × 131072 × 8192 / 4 × 4 B = 86 GB even under full recompute, so nothing fits; cp splits the
    sequence and it does. (The default bf16 stream halves those inputs, and cp 1 fits.)"""
    sets = ["preset=llama3-70b", "model.fp32_residual_connection=true"]
    job = make_job(None, sets, 128, 4, load_hardware("h100-80g"), 131072, 64, None, "bf16")
    with pytest.raises(MlmError, match="does not fit on 128 × h100-80g"):
        plan(job, cp=1)
    best = plan(job).ranked[0]
    lo = best.layout
    check_layout(job, lo)
    assert lo.cp > 1 and best.fits and lo.tp <= 4 and lo.gpus == 128
    from rich.console import Console

    from mlm.plan.report import explain, plan_dict

    Console(width=250).print(explain(job, best))
    out = " ".join(capsys.readouterr().out.split())
    chunks, local = 2 * lo.cp, 131072 // lo.cp
    assert f"context parallel: each 131072-token sequence in {chunks} chunks of {131072 // chunks}" in out
    assert f"holds chunks r and {chunks - 1}−r ({local} tokens)" in out
    assert "cp exchange (exposed)" in out and f"{lo.mesh()} sp," in out and f"--layout {lo}" in out
    # the plan file carries cp and the attention implementation into the run's config
    path = tmp_path / "cp.toml"
    write_plan(path, plan_dict(job, best, "llama3-70b", []))
    spec = read_plan(path)
    assert (spec["mesh"]["cp"], spec["mesh"]["cp_comm_type"]) == (lo.cp, lo.cp_comm_type)
    cfg = load_config(None, train_overrides(spec))
    assert (cfg.parallel.cp, cfg.parallel.cp_comm_type, cfg.data.seq_length) == (
        lo.cp,
        lo.cp_comm_type,
        131072,
    )
    from mlm.train.dry_run import dry_run

    dry_run(cfg, 128)  # mlm train accepts the mesh
    # a plan written before cp_comm_type (and the layout text) existed still reads (the run keeps its config's)
    old = path.read_text().replace(f'cp_comm_type = "{lo.cp_comm_type}"\n', "")
    path.write_text(old.replace(f'layout = "{lo}"\n', ""))
    assert not any(s.startswith("parallel.cp_comm_type") for s in train_overrides(read_plan(path)))
    pinned = plan(job, cp=4).ranked
    assert pinned and {c.layout.cp for c in pinned} == {4}
    # a pinned cp that leaves too few ranks for the weights: the GPUs it would need
    with pytest.raises(MlmError, match=r"it needs at least \d+ GPUs"):
        plan(job, cp=32)


def test_bad_cp_is_refused():
    job = _job_8b_128k()
    with pytest.raises(MlmError, match=r"data.seq_length=131072 is not divisible by 2 × parallel.cp = 6"):
        plan(job, cp=3)
    with pytest.raises(MlmError, match=r"cp=128 does not divide --gpus 64"):
        plan(job, cp=128)
    with pytest.raises(MlmError, match=r"tp\(1\) × pp\(1\) × dp\(8\) × cp\(3\) = 24 ≠ --gpus 64"):
        check_layout(job, Layout(1, 1, 8, 1, 64, cp=3))
    odd = make_job(None, ["preset=llama3-8b"], 64, 8, load_hardware("h100-80g"), 4000, 64, None, "bf16")
    with pytest.raises(
        MlmError, match=r"data.seq_length=4000 is not divisible by 2 × parallel.cp = 64: context"
    ):
        check_layout(odd, Layout(1, 1, 2, 1, 64, cp=32))
    with pytest.raises(MlmError, match=r"leaves 2048 tokens per rank, not divisible by tp=3"):
        check_cp(job.cfg, 64, 3)
    dropping = dataclasses.replace(job.cfg, model=dataclasses.replace(job.cfg.model, attention_dropout=0.1))
    with pytest.raises(MlmError, match=r"attention dropout is not built under context parallelism"):
        check_cp(dropping, 2)
    # the planner's torch-free rule is mlm train's
    from mlm.parallel.context import check_context_parallel

    for seq in (30, 36, 4096, 131072):
        for cp in (1, 2, 3, 4, 8):
            for shards in (1, 2, 8):
                cfg = dataclasses.replace(job.cfg, data=dataclasses.replace(job.cfg.data, seq_length=seq))
                try:
                    check_context_parallel(seq, cp, shards)
                    want = None
                except MlmError as e:
                    want = str(e)
                try:
                    check_cp(cfg, cp, shards)
                    got = None
                except MlmError as e:
                    got = str(e)
                assert got == want, (seq, cp, shards)
