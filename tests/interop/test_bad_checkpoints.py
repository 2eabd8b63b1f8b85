"""Bad Megatron and torchtitan checkpoints and arguments, refused or read right (from the review of
issue 22's interop): bad input that once crashed with a traceback or blamed the wrong thing (truncated .metadata / .distcp / metadata.json, a common.pt that is not a
dict, a torchtitan step lacking a layer, the wrong direction or tool), Megatron-LM args whose
meaning was dropped or changed (aux-loss lists, openai_gelu, args that change the logits), the
flags `--use-checkpoint-args` does not carry, and the optimizer's bytes entries read through the
one restricted reader. No megatron import: the files are written with plain torch DCP."""

from __future__ import annotations

import argparse
import datetime
import re
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from mlm.convert.megatron.dcp import MegatronCheckpoint
from mlm.convert.megatron.importer import args_overrides, import_megatron
from mlm.errors import MlmError
from tests.helpers.megatron_helpers import TINY, write_dcp  # noqa: E402

SETS = ["model.num_attention_heads=4"]  # TINY's 4 heads of 1


def test_truncated_metadata_is_an_mlm_error(tmp_path):
    write_dcp(tmp_path / "ckpt", TINY)
    meta = tmp_path / "ckpt" / ".metadata"
    meta.write_bytes(meta.read_bytes()[:100])
    with pytest.raises(MlmError, match=r"\.metadata: not a readable torch DCP metadata file .*copy it again"):
        import_megatron(tmp_path / "ckpt", tmp_path / "out", SETS)
    assert not (tmp_path / "out").exists()


def test_common_pt_not_a_dict_is_an_mlm_error(tmp_path):
    write_dcp(tmp_path / "ckpt", TINY)
    torch.save([1, 2], tmp_path / "ckpt" / "common.pt")
    with pytest.raises(
        MlmError, match=r"common\.pt: holds a list, not the dict Megatron's dist_checkpointing"
    ):
        import_megatron(tmp_path / "ckpt", tmp_path / "out", SETS)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "kinds, coeffs, expected",
    [
        # Megatron-LM keeps a list where --moe-router-load-balancing-type / --moe-aux-loss-coeff name
        # several (arguments.py unwraps one-element lists); the export writes what Megatron-LM writes
        ("aux_loss", 0.01, {"model.moe.aux_loss_coeff=0.01"}),
        (
            ["aux_loss", "seq_aux_loss"],
            [0.01, 0.001],
            {"model.moe.aux_loss_coeff=0.01", "model.moe.seq_aux_loss_coeff=0.001"},
        ),
        (["seq_aux_loss"], [0.002], {"model.moe.seq_aux_loss_coeff=0.002"}),
    ],
)
def test_aux_loss_lists_are_read(kinds, coeffs, expected):
    args = argparse.Namespace(moe_router_load_balancing_type=kinds, moe_aux_loss_coeff=coeffs)
    assert expected <= set(args_overrides({"args": args}))


def test_exported_aux_loss_reads_back():
    """--to-megatron's args carry the aux-loss coefficients the way --from-megatron (and Megatron-LM)
    read them."""
    from mlm.config import load_config
    from mlm.convert.megatron.exporter import megatron_args

    sets = ['model.mlp_kind="moe"', "model.moe.num_experts=4", "model.moe.aux_loss_coeff=0.01",
            "model.moe.seq_aux_loss_coeff=0.001", "data.seq_length=8"]  # fmt: skip
    args = megatron_args(load_config(None, sets), 64, 0, 0)
    back = set(args_overrides({"args": args}))
    assert {"model.moe.aux_loss_coeff=0.01", "model.moe.seq_aux_loss_coeff=0.001"} <= back
    single = megatron_args(load_config(None, sets[:3] + sets[4:]), 64, 0, 0)
    assert (single.moe_router_load_balancing_type, single.moe_aux_loss_coeff) == ("aux_loss", 0.01)


BUCKET = "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.float32, torch.float32).bucket_idx_0"
GROUPS = "optimizer.distributed.dp_group_idx_0.optimizer/shard_0_1"


def _optimizer_ckpt(path, objects: dict) -> MegatronCheckpoint:
    """TINY with a dp_reshardable bucket and the ShardedObjects `objects` (bytes entries, as
    Megatron saves them: unflattened, `torch.save([obj])`)."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    state = {**TINY, **{f"{BUCKET}.{m}": torch.zeros(4) for m in ("param", "exp_avg", "exp_avg_sq")}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(
            {**state, **objects},
            checkpoint_id=str(path),
            no_dist=True,
            planner=DefaultSavePlanner(flatten_state_dict=False),
        )
    return MegatronCheckpoint(path)


def test_optimizer_object_outside_plain_values_is_refused(tmp_path):
    """The distributed optimizer's param groups (a bytes entry) go through the reader's restricted
    torch.load: a foreign class is an MlmError naming it, not a traceback."""
    from mlm.convert.megatron.optim import MegatronOptimizer

    ckpt = _optimizer_ckpt(tmp_path / "ckpt", {GROUPS: [datetime.date(2020, 1, 1)]})
    with pytest.raises(MlmError, match=r"dp_group_idx_0\.optimizer/shard_0_1 not read: .*datetime\.date"):
        MegatronOptimizer(ckpt)


def test_optimizer_object_missing_is_named(tmp_path):
    from mlm.convert.megatron.optim import MegatronOptimizer

    ckpt = _optimizer_ckpt(tmp_path / "ckpt", {})
    with pytest.raises(
        MlmError, match=r"holds no entry optimizer\.distributed\.dp_group_idx_0\.optimizer/shard_0_1"
    ):
        MegatronOptimizer(ckpt)


LLAMA = {  # torchtitan's Llama 3, 2 layers of width 8 (2 heads of 4), MLP 16, vocabulary 32
    "tok_embeddings.weight": torch.zeros(32, 8),
    "norm.weight": torch.ones(8),
    "output.weight": torch.zeros(32, 8),
    **{
        f"layers.{i}.{k}": torch.zeros(*s)
        for i in range(2)
        for k, s in {
            "attention_norm.weight": (8,), "attention.wq.weight": (8, 8), "attention.wk.weight": (8, 8),
            "attention.wv.weight": (8, 8), "attention.wo.weight": (8, 8), "ffn_norm.weight": (8,),
            "feed_forward.w1.weight": (16, 8), "feed_forward.w3.weight": (16, 8), "feed_forward.w2.weight": (8, 16),
        }.items()
    },
}  # fmt: skip
TITAN_SETS = ["model.num_attention_heads=2", "model.rope.base=10000"]


@pytest.mark.parametrize(
    "drop, message",
    [
        ("layers.0.attention.wk.weight", r"lacks layers\.0\.attention\.wk\.weight"),
        ("layers.0.feed_forward.w1.weight", r"lacks layers\.0\.feed_forward\.w1\.weight"),
        ("layers.1.attention.wo.weight", r"lacks layers\.1\.attention\.wo\.weight"),
    ],
)
def test_torchtitan_missing_parameter_is_named(tmp_path, drop, message):
    """A torchtitan checkpoint lacking a parameter of a layer is refused naming the torchtitan key."""
    from mlm.convert.torchtitan.importer import import_torchtitan

    write_dcp(tmp_path / "step-3", {k: v for k, v in LLAMA.items() if k != drop})
    with pytest.raises(MlmError, match=message):
        import_torchtitan(tmp_path, tmp_path / "out", TITAN_SETS)
    assert not (tmp_path / "out").exists()


def test_torchtitan_missing_layer_is_named(tmp_path):
    from mlm.convert.torchtitan.importer import import_torchtitan

    three = {**LLAMA, **{k.replace("layers.1.", "layers.2."): v for k, v in LLAMA.items() if ".1." in k}}
    write_dcp(tmp_path / "step-3", {k: v for k, v in three.items() if not k.startswith("layers.1.")})
    with pytest.raises(MlmError, match=r"holds layers 0, 2: layer 1 is missing"):
        import_torchtitan(tmp_path, tmp_path / "out", TITAN_SETS)


def test_to_megatron_on_a_megatron_dir_says_so(tmp_path):
    from mlm.convert.megatron.exporter import export_megatron

    write_dcp(tmp_path / "iter_0000001", TINY)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("1")
    for src in (tmp_path, tmp_path / "iter_0000001"):
        with pytest.raises(
            MlmError,
            match=r"a Megatron \(or torch DCP\) checkpoint, not an mlm one.*mlm convert from-megatron",
        ):
            export_megatron(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_truncated_data_file_is_an_mlm_error(tmp_path):
    write_dcp(tmp_path / "ckpt", TINY)
    (data,) = (tmp_path / "ckpt").glob("*.distcp")
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    ckpt = MegatronCheckpoint(tmp_path / "ckpt")
    with pytest.raises(MlmError, match=r"not read: the checkpoint's data files are damaged or incomplete"):
        ckpt.read_all(list(TINY))


@pytest.mark.parametrize("text", ['{"sharded_backend": ', "[1]"])
def test_bad_metadata_json_is_an_mlm_error(tmp_path, text):
    write_dcp(tmp_path / "ckpt", TINY)
    (tmp_path / "ckpt" / "metadata.json").write_text(text)
    with pytest.raises(MlmError, match=r"metadata\.json: not Megatron's JSON object"):
        import_megatron(tmp_path / "ckpt", tmp_path / "out", SETS)


def test_export_names_the_flags_use_checkpoint_args_does_not_read():
    """Megatron-LM's --use-checkpoint-args leaves norm_epsilon, RoPE scaling, q/k norms, … at its
    defaults: the export names the flags where the model differs."""
    from mlm.config import load_config
    from mlm.convert.megatron.exporter import megatron_args, unread_flags

    base = ["model.num_attention_heads=4", "model.hidden_size=16", "data.seq_length=8"]
    assert unread_flags(megatron_args(load_config(None, [*base, "model.norm_eps=1e-5"]), 64, 0, 0)) == []
    llama = [*base, "model.norm_eps=1e-6", "model.rope.scaling_factor=32.0", 'model.rope.scaling_type="llama3"',
             "model.qk_norm=true"]  # fmt: skip
    flags = unread_flags(megatron_args(load_config(None, llama), 64, 0, 0))
    assert flags == [
        "--norm-epsilon 1e-06",
        "--use-rope-scaling",
        "--rope-scaling-factor 32.0",
        "--qk-layernorm",
    ]
    moe = [*base, "model.norm_eps=1e-5", 'model.mlp_kind="moe"', "model.moe.num_experts=4",
           "model.moe.aux_loss_coeff=0.01", "model.moe.capacity_factor=1.5"]  # fmt: skip
    flags = unread_flags(megatron_args(load_config(None, moe), 64, 0, 0))
    assert "--moe-aux-loss-coeff 0.01" in flags and "--moe-expert-capacity-factor 1.5" in flags
    assert "--moe-router-load-balancing-type aux_loss" not in flags  # Megatron-LM's default


def test_from_megatron_on_an_mlm_checkpoint_says_so(tmp_path):
    from mlm.checkpoint.manager import save_streaming
    from mlm.config import load_config

    config = load_config(None, ["model.num_attention_heads=4", "model.hidden_size=16", "data.seq_length=8"])
    t = torch.zeros(4)
    save_streaming(
        tmp_path / "mlm",
        3,
        [("model", "final_norm.weight", t, (4,))],
        {"config": config.to_dict()},
        ["model"],
    )
    for src in (tmp_path / "mlm", tmp_path / "mlm" / "iter_0000003"):
        with pytest.raises(
            MlmError, match=r"an mlm checkpoint \(it holds (latest|manifest\.json)\), not a Megatron one"
        ):
            import_megatron(src, tmp_path / "out", SETS)


def test_other_sharded_backend_names_the_way_forward(tmp_path):
    write_dcp(tmp_path / "ckpt", TINY)
    (tmp_path / "ckpt" / "metadata.json").write_text('{"sharded_backend": "zarr"}')
    with pytest.raises(
        MlmError, match=r"sharded_backend 'zarr'; only torch_dist is read: .*--ckpt-convert-format torch_dist"
    ):
        import_megatron(tmp_path / "ckpt", tmp_path / "out", SETS)


def test_from_megatron_on_a_torchtitan_dir_names_from_dcp(tmp_path):
    write_dcp(tmp_path / "step-3", LLAMA)
    with pytest.raises(
        MlmError,
        match=r"a torchtitan checkpoint .*not a Megatron one: import it with mlm convert from-torchtitan",
    ):
        import_megatron(tmp_path / "step-3", tmp_path / "out", SETS)


@pytest.mark.parametrize(
    "field, value, message",
    [  # args Megatron-LM 0.16 saves (TransformerConfig's fields among them) that change the logits
        ("window_size", (128, 0), "window_size=(128, 0): sliding-window attention"),
        ("no_rope_freq", [0, 0, 0, 1], "no_rope_freq=[0, 0, 0, 1]: layers without RoPE"),
        ("no_rope_freq", 4, "no_rope_freq=4: layers without RoPE"),
        ("qk_l2_norm", True, "qk_l2_norm=True: L2-normalized queries and keys"),
        ("attention_output_gate", True, "attention_output_gate=True: a gate on the attention output"),
        ("glu_linear_offset", 1.0, "glu_linear_offset=1.0: an offset added to the GLU's linear half"),
        ("activation_func_clamp_value", 7.0, "activation_func_clamp_value=7.0: clamped activations"),
        ("moe_apply_probs_on_input", True, "moe_apply_probs_on_input=True: router probabilities"),
        ("layernorm_zero_centered_gamma", True, "layernorm_zero_centered_gamma=True: zero-centered"),
    ],
)
def test_args_that_change_the_logits_are_refused(field, value, message):
    with pytest.raises(MlmError, match=re.escape(message)):
        args_overrides({"args": argparse.Namespace(**{field: value})})


@pytest.mark.parametrize(
    "field, value",
    [("window_size", None), ("window_size", (-1, -1)), ("no_rope_freq", None), ("no_rope_freq", [0, 0]),
     ("glu_linear_offset", 0.0), ("activation_func_clamp_value", None), ("qk_l2_norm", False)],
)  # fmt: skip
def test_default_args_are_not_refused(field, value):
    args_overrides({"args": argparse.Namespace(**{field: value})})


def test_openai_gelu_is_exact_gelu_in_gptmodel():
    """Megatron-LM 0.16.1 parses --openai-gelu, but only its legacy models use it: megatron-core's
    GPTModel (core_transformer_config_from_args) computes exact GELU whatever the flag says."""
    sets = args_overrides({"args": argparse.Namespace(swiglu=False, openai_gelu=True)})
    assert 'model.activation="gelu"' in sets


def test_export_of_gelu_tanh_says_gptmodel_computes_exact_gelu(tmp_path):
    from mlm.checkpoint.manager import save_streaming
    from mlm.config import load_config
    from mlm.convert.megatron.exporter import export_megatron
    from mlm.model.gpt import GPT

    config = load_config(None, ["model.num_attention_heads=4", "model.hidden_size=16", 'model.activation="gelu_tanh"',
                                'model.position_embedding="learned"', "data.seq_length=8"])  # fmt: skip
    model = GPT(config.model, config.model.padded_vocab_size())
    state = model.state_dict()
    items = (("model", k, t, tuple(t.shape)) for k, t in state.items())
    save_streaming(tmp_path / "mlm", 1, items, {"config": config.to_dict()}, ["model"])
    report = export_megatron(tmp_path / "mlm", tmp_path / "megatron")
    assert any("Megatron computes exact GELU" in n for n in report.notes)
    assert not any("--openai-gelu to Megatron-LM" in n for n in report.notes)


def test_tracker_naming_an_absent_iteration(tmp_path):
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("100\n")
    with pytest.raises(
        MlmError, match=r"names iter_0000100/, which .* does not hold; copy that iteration folder"
    ):
        import_megatron(tmp_path, tmp_path / "out", SETS)


def test_torchtitan_unreadable_optimizer_state_has_a_way_forward(tmp_path):
    """AMSGrad's max_exp_avg_sq (state mlm's AdamW cannot resume from) is refused naming
    --weights-only, which imports the weights as iteration 0."""
    from mlm.checkpoint import read_group
    from mlm.convert.torchtitan.importer import import_torchtitan

    optim = {
        f"optimizer.state.{k}.{m}": torch.zeros(()) if m == "step" else torch.zeros_like(v)
        for k, v in LLAMA.items()
        for m in ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    }
    write_dcp(tmp_path / "step-3", {**LLAMA, **optim})
    with pytest.raises(
        MlmError, match=r"max_exp_avg_sq' is not read: .*import the weights only \(--weights-only\)"
    ):
        import_torchtitan(tmp_path, tmp_path / "out", TITAN_SETS)
    report = import_torchtitan(tmp_path, tmp_path / "out", TITAN_SETS, weights_only=True)
    assert any("is not imported (--weights-only): iteration 0" in n for n in report.notes)
    state, manifest, _ = read_group(tmp_path / "out")
    assert manifest["iteration"] == 0 and set(state) >= {"embed.weight", "layers.1.mlp.down.weight"}
