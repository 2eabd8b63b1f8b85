"""Megatron's mixed precision (train.param_dtype=bf16): bf16 parameters, fp32 main weights and
gradients in the optimizer, the parameter all-gather overlapped with the next forward.

Tolerances (measured on CPU, tiny-llama, 2 layers, h 64, seq 32, lr 1e-2):
- 50 steps, bf16 parameters against fp32: max |Δloss| / loss 1.5e-2 measured; asserted ≤ 2e-2.
  10 steps of fp16 parameters (loss scale 1024): 2.8e-4; asserted ≤ 2e-2.
- tp2 × dp2 (distributed optimizer), dp2 (distributed optimizer), dp2 (replicated) and pp2 × dp2
  with tied embeddings (distributed optimizer) against one process, all in bf16 parameters, 5
  steps: max |Δloss| / loss measured 2.7e-4, 5.0e-5, 0 and 4.3e-5 (asserted ≤ 2e-2); the fp32
  main weights' ‖Δ‖ / ‖w‖ per tensor at most 3.5e-2, 1.7e-3, 0 and 1.9e-3 on a 2-core Intel Xeon;
  tp2 × dp2 gives 5.0e-2 on a 2-core AMD EPYC, whose bf16 GEMMs round otherwise (asserted ≤ 7e-2).
  tp's partial sums round to bf16 where one process's do not, and Adam turns that noise in
  near-zero gradients into ±lr steps: today's bf16 autocast with fp32 parameters differs from
  one process at tp2 by the same 3.3e-2.
- overlapped against waited parameter all-gathers, and a resumed bf16 run against a straight
  one: bitwise.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from mlm.checkpoint import ShardedTensor, load_checkpoint
from mlm.config import load_config
from mlm.errors import MlmError
from mlm.train.trainer import Trainer
from tests.helpers.common import tiny_sets
from tests.helpers.distributed import run_ranks

BF16 = {"train.precision": "bf16", "train.param_dtype": "bf16"}
RTOL = 2e-2
WEIGHTS_RTOL = 7e-2


def _cfg(tmp_path, data, name, **extra):
    sets = {"model.hidden_dropout": 0.0, "logging.log_interval": 100, **extra}
    return load_config(None, tiny_sets(tmp_path / name, data, **sets))


def _saved(ckpt_dir, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint's model group, read as stored (fp32)."""
    out = {k: torch.empty(v.shape, dtype=torch.float32) for k, v in like.items()}
    load_checkpoint(ckpt_dir, {"model": [ShardedTensor.full(k, v) for k, v in out.items()]})
    return out


def test_param_dtype_must_be_the_compute_dtype():
    with pytest.raises(MlmError, match="train.param_dtype=bf16"):
        load_config(None, ["train.param_dtype=bf16"])  # precision fp32
    with pytest.raises(MlmError, match="train.precision=fp16"):
        load_config(None, ["train.precision=fp16", "train.param_dtype=bf16"])
    assert load_config(None, ["train.precision=fp16", "train.param_dtype=fp16"]).train.param_dtype == "fp16"


def test_bf16_params_track_fp32_over_50_steps(tmp_path, tiny_data):
    steps = {"train.train_iters": 50, "train.global_batch_size": 2}
    fp32 = Trainer(_cfg(tmp_path, tiny_data, "fp32", **steps)).train()
    trainer = Trainer(_cfg(tmp_path, tiny_data, "bf16", **steps, **BF16))
    bf16 = trainer.train()
    assert {p.dtype for p in trainer.model.parameters()} == {torch.bfloat16}
    mains = trainer.optimizer.mains
    assert mains and all(m.dtype == torch.float32 for m in mains.values())
    for name, p in trainer.model.named_parameters():  # the parameters are the main weights rounded
        assert torch.equal(p, mains[name].to(torch.bfloat16)), name
    rel = max(abs(a - b) / b for a, b in zip(bf16, fp32, strict=True))
    print(f"bf16 parameters vs fp32, 50 steps: max |Δloss|/loss {rel:.2e}")
    assert rel <= RTOL, rel
    assert bf16 != fp32  # the parameters really are bf16
    assert bf16[-1] < bf16[0] - 1.0  # and it learns


def test_fp16_params_with_loss_scaling_track_fp32(tmp_path, tiny_data):
    steps = {"train.train_iters": 10, "train.global_batch_size": 2}
    fp32 = Trainer(_cfg(tmp_path, tiny_data, "fp32", **steps)).train()
    # fp16 gradients overflow at the default scale 2^16 (one step skipped, as in fp16 autocast)
    fp16 = {"train.precision": "fp16", "train.param_dtype": "fp16", "train.initial_loss_scale": 1024}
    trainer = Trainer(_cfg(tmp_path, tiny_data, "fp16", **steps, **fp16))
    losses = trainer.train()
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float16}
    assert trainer.scaler.skipped == 0
    rel = max(abs(a - b) / b for a, b in zip(losses, fp32, strict=True))
    print(f"fp16 parameters vs fp32, 10 steps: max |Δloss|/loss {rel:.2e}")
    assert rel <= RTOL, rel


@pytest.mark.parametrize("distributed", [False, True], ids=["replicated", "distopt"])
def test_bf16_checkpoint_holds_fp32_main_weights_and_resumes_bitwise(tmp_path, tiny_data, distributed):
    sets = {
        **BF16,
        "model.hidden_dropout": 0.1,  # the RNG must be restored too
        "checkpoint.save": f"'{tmp_path / 'ckpt'}'",
        "checkpoint.save_interval": 3,
        "parallel.distributed_optimizer": str(distributed).lower(),
    }
    straight = Trainer(_cfg(tmp_path, tiny_data, "a", **sets))
    losses = straight.train()
    resumed = Trainer(_cfg(tmp_path, tiny_data, "b", **sets), load=str(tmp_path / "ckpt" / "iter_0000003"))
    assert resumed.train() == losses[3:]  # bitwise
    params = dict(straight.model.named_parameters())
    saved = _saved(tmp_path / "ckpt" / "iter_0000006", params)
    for name, p in resumed.model.named_parameters():
        assert torch.equal(p, params[name]), name
        assert torch.equal(saved[name].to(torch.bfloat16), p), name  # the fp32 weights, rounded
    # fp32 main weights, not the bf16 parameters: most carry bits below bf16's
    assert any(not torch.equal(v, v.to(torch.bfloat16).float()) for v in saved.values())
    if not distributed:
        for name, v in saved.items():
            assert torch.equal(v, straight.optimizer.mains[name]), name
    # the bf16 checkpoint loads into an fp32 run (a change made on purpose), whose weights are then the main weights
    fp32 = {k: v for k, v in sets.items() if not k.startswith("train.")}
    fp32["checkpoint.resume_changes"] = "['train.precision', 'train.param_dtype']"
    into = Trainer(_cfg(tmp_path, tiny_data, "c", **fp32), load=str(tmp_path / "ckpt" / "iter_0000006"))
    for name, p in into.model.named_parameters():
        assert torch.equal(p, saved[name]), name


def _train_rank(rank, world, sets):
    return Trainer(load_config(None, sets)).train()


DISTOPT = {"parallel.distributed_optimizer": "true", "parallel.bucket_size_mb": 0.05}


@pytest.mark.parametrize(
    "world,parallel",
    [
        (4, {"parallel.tp": 2, **DISTOPT}),
        (2, DISTOPT),
        (2, {}),
        # the tied embedding's last-stage copy: its main weights stored once, from the first stage
        (4, {"parallel.pp": 2, "model.tie_embeddings": "true", **DISTOPT}),
    ],
    ids=["tp2xdp2-distopt", "dp2-distopt", "dp2-replicated", "pp2xdp2-tied-distopt"],
)
def test_mesh_in_bf16_params_matches_one_process(tmp_path, tiny_data, world, parallel):
    model = {k: v for k, v in parallel.items() if k.startswith("model.")}
    steps = {"train.train_iters": 5, "checkpoint.save": f"'{tmp_path / 'ckpt'}'", **BF16, **model}
    one = Trainer(_cfg(tmp_path, tiny_data, "one", **{**steps, "checkpoint.save": ""}))
    ref = one.train()
    extra = {"model.hidden_dropout": 0.0, "logging.log_interval": 100, **steps, **parallel}
    per_rank = run_ranks(world, _train_rank, tiny_sets(tmp_path / "mesh", tiny_data, **extra))
    losses = per_rank[0]
    assert all(r == losses for r in per_rank)  # every rank logs the same dp-mean loss
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=RTOL, atol=0)
    # the checkpoint's fp32 main weights against the one process's, as ‖Δ‖ / ‖w‖ per tensor:
    # elementwise, Adam turns bf16 noise in near-zero gradients into ±lr steps
    main = {k: v.detach() for k, v in one.optimizer.mains.items()}
    saved = _saved(tmp_path / "ckpt" / "iter_0000005", main)
    errors = {k: float((saved[k] - v).norm() / v.norm()) for k, v in main.items()}
    rel = max(abs(a - b) / b for a, b in zip(losses, ref, strict=True))
    print(f"bf16 mesh vs one process: max |Δloss|/loss {rel:.2e}, ‖Δw‖/‖w‖ {max(errors.values()):.2e}")
    assert max(errors.values()) <= WEIGHTS_RTOL, errors


def _overlap_rank(rank, world, sets, overlap):
    """3 steps of random tokens on dp2 with the distributed optimizer: the losses, the final
    parameters, and what was in flight when (after step(), at the first layer's forward, after
    the forward)."""
    from mlm.build import build_rank_model
    from mlm.parallel import Mesh
    from mlm.parallel.pipeline import Pipeline
    from mlm.train.optimizer import TrainOptimizer

    cfg = load_config(None, sets)
    mesh = Mesh.build(cfg.parallel)
    model = build_rank_model(
        cfg.model, cfg.parallel, mesh, torch.device("cpu"), seed=cfg.train.seed, train=cfg.train
    )
    opt = TrainOptimizer(model, cfg, mesh, torch.device("cpu"))
    (dist_opt,) = opt.dists
    dist_opt.overlap = overlap
    pipe = Pipeline(model, mesh, cfg.parallel.vpp)
    pending: dict[str, list[int]] = {"after step": [], "first layer": [], "after forward": []}
    first = model.get_submodule("layers.0")
    first.register_forward_pre_hook(lambda m, a: pending["first layer"].append(len(dist_opt.gathers)))
    gen = torch.Generator().manual_seed(rank)
    autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    losses = []
    for _ in range(3):
        micro = [torch.randint(0, cfg.model.vocab_size, (2, 33), generator=gen) for _ in range(2)]
        pending["first layer"].clear()
        losses.append(float(pipe.train_step(micro, 0.5, opt.all_grads, autocast)))
        pending["after forward"].append(len(dist_opt.gathers))
        opt.all_grads.finish()
        opt.clip(1.0)
        opt.step(1e-2, cfg.optimizer.weight_decay)
        opt.zero_grad()
        pending["after step"].append(len(dist_opt.gathers))
    opt.wait_for_params()
    params = [p.detach().float().tolist() for p in model.parameters()]
    return losses, params, pending, len(opt.grads.buckets)


@pytest.mark.parametrize("dtype", [{}, BF16], ids=["fp32", "bf16"])
def test_param_all_gather_overlaps_the_next_forward(tmp_path, tiny_data, dtype):
    parallel = {"parallel.distributed_optimizer": "true", "parallel.bucket_size_mb": 0.02, **dtype}
    sets = tiny_sets(tmp_path, tiny_data, **{"model.hidden_dropout": 0.0, **parallel})
    overlapped = run_ranks(2, _overlap_rank, sets, True)
    waited = run_ranks(2, _overlap_rank, sets, False)
    for (losses, params, pending, buckets), (w_losses, w_params, w_pending, _) in zip(
        overlapped, waited, strict=True
    ):
        assert buckets > 2
        assert pending["after step"] == [buckets] * 3  # step() returned with every gather in flight
        # the first layer ran while the later layers' buckets were still in flight
        assert 0 < pending["first layer"][0] < buckets
        assert pending["after forward"][1:] == [0, 0]  # the forward waited for all of them
        assert w_pending["after step"] == [0] * 3
        assert losses == w_losses and params == w_params  # bitwise


class _LazyGather:
    """An all-gather that happens only when waited for: a parameter read before its wait sees
    the previous step's values of the other rank's shard (deterministically, unlike a race)."""

    def __init__(self, output, input, group, async_op=False):
        self.args = (output, input, group)

    def wait(self):
        from mlm.parallel.data_parallel import all_gather

        if self.args is not None:
            all_gather(*self.args)
            self.args = None


def _lazy_moe_rank(rank, world, sets, overlap):
    """3 steps on dp2 (ep 1: the experts in the dense buffer) of a MoE model under the distributed
    optimizer, the gathers lazy: the losses and the final parameters."""
    from unittest import mock

    from mlm.build import build_rank_model
    from mlm.parallel import Mesh
    from mlm.parallel.pipeline import Pipeline
    from mlm.train.optimizer import TrainOptimizer

    cfg = load_config(None, sets)
    mesh = Mesh.build(cfg.parallel)
    model = build_rank_model(
        cfg.model, cfg.parallel, mesh, torch.device("cpu"), seed=cfg.train.seed, train=cfg.train
    )
    opt = TrainOptimizer(model, cfg, mesh, torch.device("cpu"))
    for d in opt.dists:
        d.overlap = overlap
    pipe = Pipeline(model, mesh, cfg.parallel.vpp)
    gen = torch.Generator().manual_seed(rank)
    losses = []
    with mock.patch("mlm.parallel.dist_optim.all_gather", _LazyGather):
        for _ in range(3):
            micro = [torch.randint(0, cfg.model.vocab_size, (2, 33), generator=gen) for _ in range(2)]
            losses.append(float(pipe.train_step(micro, 0.5, opt.all_grads, contextlib.nullcontext)))
            opt.all_grads.finish()
            opt.clip(1.0)
            opt.step(1e-2, cfg.optimizer.weight_decay)
            opt.zero_grad()
        opt.wait_for_params()
    return losses, [p.detach().tolist() for p in model.parameters()]


def test_every_parameter_is_waited_for_before_the_forward_reads_it(tmp_path, tiny_data):
    """MoE reads its router's and its stacked experts' weights outside their own modules'
    forwards: the waits must come from the layer. With gathers that happen only when waited for,
    the overlapped run equals the waiting one bitwise only if nothing is read early."""
    moe = {
        "model.mlp_kind": "moe",
        "model.first_k_dense": 1,
        "model.moe.num_experts": 4,
        "model.moe.router_topk": 2,
        "model.moe.ffn_hidden_size": 32,
    }
    parallel = {"parallel.distributed_optimizer": "true", "parallel.bucket_size_mb": 0.02}
    sets = tiny_sets(tmp_path, tiny_data, **{"model.hidden_dropout": 0.0, **moe, **parallel})
    overlapped = run_ranks(2, _lazy_moe_rank, sets, True)
    waited = run_ranks(2, _lazy_moe_rank, sets, False)
    assert overlapped == waited


def test_plan_prices_bf16_params_and_carries_them_into_training(tmp_path):
    from cli.plan import plan as plan_command
    from mlm.planfile import read_plan, train_overrides

    model = ["preset=tiny-llama", "model.num_layers=2", "model.hidden_size=64", "model.vocab_size=512"]
    written = {}
    for dtype in ("fp32", "bf16"):
        path = tmp_path / f"{dtype}.toml"
        plan_command(
            gpus=4,
            config=None,
            preset=None,
            overrides=[*model, f"train.param_dtype={dtype}"],
            gpus_per_node=4,
            hardware="h100-80g",
            seq_length=32,
            global_batch=8,
            tokens=None,
            precision="bf16",
            optimizer="auto",
            ep=None,
            cp=None,
            top=1,
            pick=1,
            explain=False,
            output=str(path),
            png=None,
            calibrate=[],
            save_profile=None,
        )
        written[dtype] = read_plan(path)
    sets = train_overrides(written["bf16"])
    assert load_config(None, sets).train.param_dtype == "bf16"
    assert load_config(None, train_overrides(written["fp32"])).train.param_dtype == "fp32"
    fp32, bf16 = (written[d]["prediction"]["memory_gb"] for d in ("fp32", "bf16"))
    assert written["fp32"]["mesh"] == written["bf16"]["mesh"]  # dp4 (a tiny model): the same layout
    assert bf16["weights"] == pytest.approx(fp32["weights"] / 2)
    assert bf16["gradients"] == fp32["gradients"]  # fp32 either way
    assert bf16["weight_casts"] == 0 < fp32["weight_casts"]


def test_an_fp32_residual_stream_needs_fp32_parameters():
    sets = ["train.precision=bf16", "train.param_dtype=bf16", "model.fp32_residual_connection=true"]
    with pytest.raises(
        MlmError, match=r"fp32_residual_connection=true with train.param_dtype='bf16'.*param_dtype=fp32"
    ):
        load_config(None, sets)
