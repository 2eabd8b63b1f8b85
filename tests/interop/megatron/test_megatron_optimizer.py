"""`mlm convert from-megatron` carrying a Megatron-LM run's optimizer state and data position.

megatron-core 0.16.1 (tests/helpers/megatron_ref.py's `train_and_save`, in gloo rank processes) trains a
tiny GPTModel one step under DDP + DistributedOptimizer (Adam) and saves it as Megatron-LM does,
with the optimizer as `fully_reshardable` (world 1) and as `dp_reshardable` (Megatron-LM's
default: dp 2; tp 2; pp 2 through Megatron's 1F1B schedule; tp 2 · pp 2) and as the legacy
layout's `distrib_optim.pt` (`--ckpt-format torch`: dp 2, tp 2, tp 2 · pp 2), then takes a second
step. mlm imports the save: its Adam moments must equal Megatron's own (each dp rank's shard placed
by the optimizer's range maps, tp shards gathered by megatron-core's `partition_dim` marks) bitwise
after the qkv / fc1 splits; the iteration, consumed samples and Adam's step must be carried; `mlm train`
resumes from it; and one AdamW step in mlm from the imported state must give Megatron's weights
after its second step (same gradient: the loss mean(logits²) of the same tokens, same lr).
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import types
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner

from mlm.checkpoint import read_group
from mlm.config import config_from_dict, load_config
from mlm.convert.megatron.dcp import MegatronCheckpoint, checkpoint_dir
from mlm.convert.megatron.importer import import_megatron, mlm_tensors
from mlm.convert.megatron.optim import decode_buckets, read_object, run_settings
from mlm.convert.megatron.unpickle import load_megatron_pickle
from mlm.errors import MlmError
from mlm.model.gpt import GPT
from mlm.train.adamw import adam_state_tensors, make_optimizer, set_adam_step
from tests.helpers.common import mlm  # noqa: E402
from tests.helpers.distributed import run_ranks  # noqa: E402
from tests.helpers.megatron_ref import GROUPS, HEADS, SEQ, inputs, train_and_save  # noqa: E402

VOCAB = 512  # the tiny dataset's SentencePiece vocabulary, so that mlm train can resume on it
BUCKET = 20000  # parameters per DDP bucket in the run with several buckets (4 buckets)
STEP_TOL = 1e-6  # fp32 weights after one more Adam step (lr 1e-3), absolute


def megatron_args(
    bf16: bool, bucket_size: int | None = None, tp: int = 1, pp: int = 1, gpt2: bool = False
) -> argparse.Namespace:
    """The args Megatron-LM saves (the fields the import reads), for a run at iteration 1 (`gpt2`:
    of megatron_ref's GPT-2-like model: LayerNorm, GeLU, biases, learned positions, tied output)."""
    args = argparse.Namespace(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        num_layers=2, num_attention_heads=HEADS, group_query_attention=True, num_query_groups=GROUPS,
        kv_channels=16, max_position_embeddings=SEQ, seq_length=SEQ, norm_epsilon=1e-5, rotary_base=10000,
        swiglu=True, position_embedding_type="rope", padded_vocab_size=VOCAB, bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        lr=1e-3, min_lr=1e-4, lr_decay_style="constant", lr_warmup_iters=0, lr_decay_iters=None,
        train_iters=8, global_batch_size=2, micro_batch_size=1, weight_decay=0.0, start_weight_decay=0.0,
        end_weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, clip_grad=0.0,
        consumed_train_samples=2, overlap_grad_reduce=bucket_size is not None, ddp_bucket_size=bucket_size,
    )  # fmt: skip
    if gpt2:
        args.swiglu, args.position_embedding_type, args.normalization = False, "learned_absolute", "LayerNorm"
        args.add_bias_linear, args.untie_embeddings_and_output_weights = True, False
    return args


@pytest.fixture(
    scope="module",
    params=[
        ("fully_reshardable", 1, False, 1, 1, False),
        ("dp_reshardable", 2, False, 1, 1, False),
        ("dp_reshardable", 2, True, 1, 1, False),
        ("dp_reshardable", 2, False, 2, 1, False),
        ("dp_reshardable", 2, False, 1, 2, False),
        ("dp_reshardable", 4, False, 2, 2, True),
        ("legacy", 2, False, 1, 1, False),
        ("legacy", 2, True, 1, 1, False),
        ("legacy", 2, False, 2, 1, False),
        ("legacy", 4, False, 2, 2, True),
    ],
    ids=[
        "fully-w1",
        "dp-w2",
        "dp-w2-bf16-buckets",
        "dp-tp2",
        "dp-pp2",
        "dp-tp2-pp2-gpt2",
        "legacy-w2",
        "legacy-w2-bf16-buckets",
        "legacy-tp2",
        "legacy-tp2-pp2-gpt2",
    ],  # fmt: skip
)
def imported(request, tmp_path_factory) -> types.SimpleNamespace:
    """The Megatron run (`tmp`/megatron; its `moments` by parameter name, its `scheduler` state;
    `sharding`, `bf16`; the bf16 run also with --overlap-grad-reduce buckets of BUCKET parameters)
    and its import (`tmp`/mlm, `report`)."""
    if importlib.util.find_spec("megatron") is None:  # found, not imported (see test_convert_megatron)
        pytest.skip("megatron-core is not installed (pinned for Python 3.11: pip install -e '.[dev]')")
    sharding, world, bf16, tp, pp, gpt2 = request.param
    tmp = tmp_path_factory.mktemp(sharding)
    args = megatron_args(bf16, BUCKET if bf16 else None, tp, pp, gpt2)
    run_ranks(world, train_and_save, str(tmp / "megatron"), sharding, args, gpt2)
    ref = torch.load(tmp / "megatron" / "reference.pt", weights_only=True)
    report = import_megatron(tmp / "megatron", tmp / "mlm")
    return types.SimpleNamespace(
        tmp=tmp, report=report, sharding=sharding, bf16=bf16, tp=tp, pp=pp, world=world, gpt2=gpt2, **ref
    )


def test_moments_step_and_position_carried(imported):
    tmp, moments, scheduler, sharding = imported.tmp, imported.moments, imported.scheduler, imported.sharding
    optim, manifest, it_dir = read_group(tmp / "mlm", "optim")
    assert it_dir.name == "iter_0000001" and manifest["iteration"] == 1
    assert manifest["consumed_samples"] == 2 and manifest["optimizer_step"] == 1
    assert manifest["source"]["opt_param_scheduler"] == scheduler
    assert manifest["source"]["megatron_optimizer"]["sharding"] == {
        "dp_reshardable": "dp_reshardable", "legacy": "distrib_optim.pt"
    }.get(sharding, "per_parameter")  # fmt: skip
    if sharding == "dp_reshardable":
        # per (tp, pp) rank one bucket, 4 of BUCKET parameters with overlap_grad_reduce, 2 with a
        # tied embedding at pp > 1 (its own bucket on the first and the last stage)
        per_rank = 4 if imported.bf16 else 2 if imported.gpt2 else 1
        keys = MegatronCheckpoint(checkpoint_dir(tmp / "megatron")).optimizer_keys
        assert len([k for k in keys if k.endswith(".param")]) == per_rank * imported.tp * imported.pp
    cfg = config_from_dict(manifest["config"])
    assert (cfg.optimizer.lr, cfg.optimizer.min_lr, cfg.optimizer.decay_style) == (1e-3, 1e-4, "constant")
    assert (cfg.optimizer.adam_beta2, cfg.optimizer.clip_grad, cfg.optimizer.weight_decay) == (0.95, 0.0, 0.0)
    assert (cfg.train.train_iters, cfg.train.global_batch_size, cfg.train.micro_batch_size) == (8, 2, 1)
    # Megatron's parameter names are keys `mlm_tensors` reads (decoder.layers.<n>.<sub>)
    for moment in ("exp_avg", "exp_avg_sq"):
        theirs = {name: m[moment] for name, m in moments.items()}
        fake = types.SimpleNamespace(tensors=theirs, read=theirs.__getitem__)
        expected = dict(mlm_tensors(fake, cfg.model))
        assert len(expected) == (36 if imported.gpt2 else 21)
        for key, t in expected.items():
            assert torch.equal(optim[f"{moment}.{key}"], t), f"{moment}.{key}"
        assert all(t.abs().max() > 0 for t in expected.values())


def test_one_more_step_matches_megatron(imported):
    """mlm's AdamW from the imported moments and step, on the gradient of Megatron's second step,
    gives Megatron's weights after that step (to STEP_TOL; weight decay 0 and no clipping on both
    sides, as the imported config says). fp32 runs only: a bf16 Megatron's gradient and weights
    differ from mlm's fp32 ones by bf16 rounding."""
    tmp = imported.tmp
    if imported.bf16:
        pytest.skip("bf16: Megatron's step is not mlm's fp32 step")
    weights, manifest, _ = read_group(tmp / "mlm")
    optim = read_group(tmp / "mlm", "optim")[0]
    cfg = config_from_dict(manifest["config"])
    model = GPT(cfg.model, VOCAB)
    model.load_state_dict(weights, strict=True)
    model.eval()  # no dropout: the same function as Megatron's
    adamw = make_optimizer(model, cfg.optimizer, torch.device("cpu"))
    for key, t in adam_state_tensors(model, adamw, manifest["optimizer_step"]).items():
        t.copy_(optim[key])
    set_adam_step(adamw, manifest["optimizer_step"])
    model(inputs().flip(1)).float().pow(2).mean().backward()
    adamw.step()
    sets = [f"model.num_attention_heads={HEADS}", f"model.max_position_embeddings={SEQ}"]  # a model-only save
    after = import_megatron(tmp / "megatron" / "after_step_2", tmp / "after", sets)
    assert after.tensors == (36 if imported.gpt2 else 21)
    theirs = read_group(tmp / "after")[0]
    worst = max((p.detach() - theirs[n]).abs().max().item() for n, p in model.named_parameters())
    moved = max((p.detach() - weights[n]).abs().max().item() for n, p in model.named_parameters())
    assert worst < STEP_TOL < moved, (worst, moved)


def test_mlm_train_resumes(imported, tiny_data):
    from mlm.train.trainer import Trainer

    tmp = imported.tmp
    sets = [
        f"run_dir='{tmp / 'run'}'",
        f"data.data_path=['{tiny_data}']",
        "train.train_iters=3",
        "logging.tensorboard=false",
    ]
    trainer = Trainer(load_config(tmp / "mlm" / "config.toml", sets), load=str(tmp / "mlm"))
    assert (trainer.iteration, trainer.optimizer_step, trainer.consumed_samples) == (1, 1, 2)
    losses = trainer.train()
    assert trainer.iteration == 3 and trainer.consumed_samples == 6
    assert len(losses) == 2 and all(0 < x < 20 for x in losses)


def test_weights_only_leaves_the_optimizer_out(imported):
    tmp = imported.tmp
    report = import_megatron(tmp / "megatron", tmp / "weights", weights_only=True)
    _, manifest, it_dir = read_group(tmp / "weights")
    assert it_dir.name == "iter_0000000" and not any(k.startswith("optim/") for k in manifest["tensors"])
    assert any("--weights-only" in n for n in report.notes)


def test_bf16_weights_come_from_the_main_params(imported):
    """With bf16 weights the model group holds the optimizer's fp32 main params: cast to bf16 they
    are Megatron's weights, and they hold more than the weights do."""
    if not imported.bf16:
        pytest.skip("an fp32 run's main params are its weights")
    mains = read_group(imported.tmp / "mlm")[0]
    import_megatron(imported.tmp / "megatron", imported.tmp / "bf16-weights", weights_only=True)
    weights = read_group(imported.tmp / "bf16-weights")[0]
    assert mains.keys() == weights.keys() and len(mains) == 21
    for key, main in mains.items():
        assert main.dtype == torch.float32 and weights[key].dtype == torch.bfloat16
        assert torch.equal(main.to(torch.bfloat16), weights[key]), key
    assert any(not torch.equal(main, weights[k].float()) for k, main in mains.items())


def test_bucket_decoding_rules():
    """Reverse order, 64-element starts, bucket ends from the saved lengths; a misfit is refused."""
    order = [("a", None), ("b", None), ("c", None)]
    shapes = {"a": (40,), "b": (3, 10), "c": (100,)}
    layout = decode_buckets(order, lambda k, i: shapes[k], [100 + 28 + 30 + 34 + 40])
    assert layout == {("c", None): (0, 0), ("b", None): (0, 128), ("a", None): (0, 192)}
    assert decode_buckets(order, lambda k, i: shapes[k], [158, 40]) == {
        ("c", None): (0, 0), ("b", None): (0, 128), ("a", None): (1, 0)
    }  # fmt: skip
    with pytest.raises(MlmError, match="does not fit the saved bucket lengths"):
        decode_buckets(order, lambda k, i: shapes[k], [150, 48])
    with pytest.raises(MlmError, match="fill 1 of the 2"):
        decode_buckets(order, lambda k, i: shapes[k], [232, 64])


def _rewrite(src, out, change) -> None:
    """A copy of the torch_dist save `src` (its tensors and the optimizer's bytes entries) into
    `out`, `change(state, common)` applied first."""
    ckpt = MegatronCheckpoint(checkpoint_dir(src))
    state = {k: ckpt.read(k) for k in ckpt.tensors}
    state.update({k: ckpt.read(k) for k in ckpt.optimizer_keys})
    domains = {k.split(".")[2] for k in ckpt.optimizer_keys if k.startswith("optimizer.distributed.")}
    for name in ("optimizer", "per_bucket_numel_unpadded"):
        for domain in domains:
            key = f"optimizer.distributed.{domain}.{name}/shard_0_1"
            state[key] = [read_object(ckpt, key)]
    common = ckpt.common()
    change(state, common)
    with warnings.catch_warnings():  # "torch.distributed is disabled … save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(
            state, checkpoint_id=str(out), no_dist=True, planner=DefaultSavePlanner(flatten_state_dict=False)
        )
    torch.save(common, out / "common.pt")


def _dp(imported, meshes: tuple[tuple[int, int], ...] = ((1, 1),)):
    """The fp32 dp_reshardable save at world 2 with (tp, pp) in `meshes`, which the tests below
    rewrite or convert by command (each costs seconds); other runs skip them."""
    if imported.sharding != "dp_reshardable" or imported.bf16 or imported.world != 2:
        pytest.skip("the fp32 dp_reshardable save at world 2 is rewritten")
    if (imported.tp, imported.pp) not in meshes:
        pytest.skip(f"tp {imported.tp} · pp {imported.pp}: covered at {meshes}")
    return imported.tmp


def test_refused_dp_reshardable_layouts(imported):
    """What the bucket decoder cannot reconstruct is refused, naming why and the way out: at tp 1
    main params that are no parameter order's weights, and more dp groups than the args' tp · pp;
    at tp 2 the two tp ranks' buckets swapped (the check of the main params against the weights
    proves which domain is which tp rank), and a virtual pipeline; at pp 2 the stages' buckets
    swapped, and a first stage of its own size."""
    tmp = _dp(imported, ((1, 1), (2, 1), (1, 2)))
    bucket = next(
        k for k in MegatronCheckpoint(checkpoint_dir(tmp / "megatron")).optimizer_keys if k.endswith(".param")
    )

    def shuffled(state, common):
        state[bucket] = state[bucket].flip(0)

    def two_domains(state, common):  # as a tp 2 save writes, under args that say tp 1
        for k in [k for k in state if k.startswith("optimizer.distributed.dp_group_idx_0.gbuf")]:
            state[k.replace("dp_group_idx_0", "dp_group_idx_1")] = state[k]

    def swapped(state, common):
        for k in [k for k in state if k.startswith("optimizer.distributed.dp_group_idx_0.")]:
            other = k.replace("dp_group_idx_0", "dp_group_idx_1")
            state[k], state[other] = state[other], state[k]

    def virtual(state, common):
        common["args"].virtual_pipeline_model_parallel_size = 2

    def uneven(state, common):
        common["args"].decoder_first_pipeline_num_layers = 1

    cases = {
        1: [
            (shuffled, r"bucket layout was not reconstructed \(local order: the decoded main param of .* differs"),
            (two_domains, r"with dp groups \[0, 1\], where the args' tensor_model_parallel_size=1 and "
             r"pipeline_model_parallel_size=1 give one per model-parallel rank 0 … 0"),
        ],
        2: [
            (swapped, r"bucket layout was not reconstructed \(local order: the decoded main param of .* differs"),
            (virtual, r"with args.virtual_pipeline_model_parallel_size=2 \(only an even split"),
        ],
        "pp": [
            (swapped, r"bucket layout was not reconstructed \(local order: dp group 0 \(tp rank 0, pp rank 0\): "
             r"(parameter .* does not fit|the parameters fill)"),
            (uneven, r"with args.decoder_first_pipeline_num_layers=1 \(only an even split"),
        ],
    }  # fmt: skip
    for i, (change, message) in enumerate(cases["pp" if imported.pp > 1 else imported.tp]):
        _rewrite(tmp / "megatron", tmp / f"bad{i}", change)
        with pytest.raises(MlmError, match=message) as e:
            import_megatron(tmp / f"bad{i}", tmp / f"bad{i}-mlm")
        assert "--weights-only" in str(e.value) and not (tmp / f"bad{i}-mlm").exists()
        import_megatron(tmp / f"bad{i}", tmp / f"bad{i}-weights", weights_only=True)


def test_refused_without_the_run_position(imported):
    tmp = _dp(imported)
    _rewrite(tmp / "megatron", tmp / "noiter", lambda state, common: common.pop("iteration"))
    with pytest.raises(MlmError, match=r"lacks Megatron-LM's iteration .* \(--weights-only\)"):
        import_megatron(tmp / "noiter", tmp / "noiter-mlm")


def test_command_line(imported, tmp_path):
    tmp = _dp(imported)  # Megatron-LM's default layout (each command costs seconds)
    r = mlm("convert", "from-megatron", tmp / "megatron", tmp_path / "cli", "--no-progress")
    assert r.returncode == 0, r.stdout + r.stderr
    out = " ".join(r.stderr.split())  # the console writes to stderr
    assert "63 tensors" in out and "Adam step 1, iteration 1, 2 samples consumed" in out
    r = mlm("convert", "reshard", tmp_path / "cli", tmp_path / "x", "--weights-only")
    assert r.returncode == 2 and "No such option: --weights-only" in r.stderr  # imports only


def test_run_settings_carry_equal_meanings_only():
    """Sample counts become iterations where whole global batches, else sample settings (the train
    length whole steps, as Megatron-LM trains); Megatron's schedule, warm-up
    position and weight-decay groups are carried as settings; what mlm has no equal for is named
    in a note, not carried."""
    settings, notes = run_settings(
        {"lr": 3e-4, "min_lr": 3e-5, "global_batch_size": 8, "lr_warmup_samples": 80, "lr_decay_samples": 801,
         "train_samples": 1605, "lr_decay_style": "inverse-square-root", "weight_decay": 0.1,
         "weight_decay_incr_style": "linear", "start_weight_decay": 0.0, "end_weight_decay": 0.1,
         "lr_warmup_init": 1e-5, "decoupled_lr": 1e-4}
    )  # fmt: skip
    megatron = {
        "optimizer.warmup_offset": 0,
        "optimizer.weight_decay_exempt": "1d",
        "model.train_padded_vocab": True,
    }
    assert settings == {
        "optimizer.lr": 3e-4, "optimizer.min_lr": 3e-5, "train.global_batch_size": 8,
        "optimizer.warmup_iters": 10, "optimizer.decay_samples": 801, "train.train_iters": 200,
        "optimizer.decay_style": "inverse-square-root",
        "optimizer.weight_decay_incr_style": "linear", "optimizer.start_weight_decay": 0.0,
        "optimizer.end_weight_decay": 0.1, "optimizer.lr_warmup_init": 1e-5, **megatron,
    }  # fmt: skip
    text = " ".join(notes)
    assert (
        "args.train_samples=1605 is not a whole number of global batches (8): 200 steps, as Megatron-LM"
        in text
    )
    assert "args.decoupled_lr=0.0001 (the embeddings' own learning rate) has no mlm equal" in text
    wsd = {"lr_decay_style": "WSD", "lr_wsd_decay_style": "minus_sqrt", "lr_wsd_decay_iters": 50,
           "lr_warmup_fraction": 0.0125, "train_iters": 1000}  # fmt: skip
    assert run_settings(wsd) == (
        {"optimizer.decay_style": "wsd", "optimizer.wsd_decay_iters": 50, "optimizer.wsd_decay_style": "minus_sqrt",
         "optimizer.warmup_fraction": 0.0125, "train.train_iters": 1000, **megatron},
        [],
    )  # fmt: skip


def test_refused_legacy_distrib_optim(imported):
    """What the legacy layout's optimizer reader does not decode is refused, naming why and the way
    out, and --weights-only still imports the weights: at tp 1 the non-distributed optimizer's state
    (in model_optim_rng.pt by parameter index, no distrib_optim.pt), a distrib_optim.pt whose buckets
    are not coalesced, and one whose main params are not the weights; at tp 2 one rank's
    distrib_optim.pt missing."""
    if imported.sharding != "legacy" or imported.pp > 1 or imported.bf16:
        pytest.skip("the fp32 legacy saves at pp 1 are rewritten")
    tmp, rank0 = imported.tmp, "iter_0000001/mp_rank_00"

    def rewrite(i, name, change):
        shutil.copytree(tmp / "megatron", tmp / f"bad{i}")
        path = tmp / f"bad{i}" / rank0 / name
        state = load_megatron_pickle(path)
        if change(state) is False:
            path.unlink()
        else:
            torch.save(state, path)
        return tmp / f"bad{i}"

    def non_distributed(state):  # Adam's state by parameter index, as torch's optimizer saves it
        state["optimizer"]["optimizer"]["state"] = {
            0: {"exp_avg": torch.zeros(3), "exp_avg_sq": torch.zeros(3)}
        }
        (tmp / "bad0" / rank0 / "distrib_optim.pt").unlink()

    def not_coalesced(state):
        state["buckets_coalesced"] = False

    def shuffled(state):
        flat = state[0][torch.float32, torch.float32]
        flat["param"] = flat["param"].flip(0)

    cases = {
        1: [
            ("model_optim_rng.pt", non_distributed, r"optimizer state without distrib_optim.pt \(the non-distributed "
             r"optimizer's, mp_rank_00/model_optim_rng.pt:optimizer.optimizer.state.0.exp_avg, …\) is not imported"),
            ("distrib_optim.pt", not_coalesced, r"distrib_optim.pt: the legacy distrib_optim.pt with buckets not "
             r"coalesced .* is not decoded; have Megatron-LM rewrite the checkpoint as torch_dist"),
            ("distrib_optim.pt", shuffled, r"the distrib_optim.pt bucket layout was not reconstructed \(.*local order: "
             r"the decoded main param of .* differs"),
        ],
        2: [
            ("distrib_optim.pt", lambda state: False, r"mp_rank_00/distrib_optim.pt is missing \(the other rank "
             r"folders hold theirs\)"),
        ],
    }  # fmt: skip
    for i, (name, change, message) in enumerate(cases[imported.tp]):
        bad = rewrite(i, name, change)
        with pytest.raises(MlmError, match=message) as e:
            import_megatron(bad, tmp / f"bad{i}-mlm")
        assert "--weights-only" in str(e.value) and not (tmp / f"bad{i}-mlm").exists()
        import_megatron(bad, tmp / f"bad{i}-weights", weights_only=True)
    # every distrib_optim.pt left behind: the weights, and a note saying why there is no Adam state
    shutil.copytree(tmp / "megatron", tmp / "no-distrib")
    for path in (tmp / "no-distrib").rglob("distrib_optim.pt"):
        path.unlink()
    report = import_megatron(tmp / "no-distrib", tmp / "no-distrib-mlm")
    assert any("param groups but no Adam state, and no distrib_optim.pt" in n for n in report.notes), (
        report.notes
    )
    assert read_group(tmp / "no-distrib-mlm")[1]["iteration"] == 0
