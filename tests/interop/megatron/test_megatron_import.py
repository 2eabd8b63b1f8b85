"""`mlm convert from-megatron` against Megatron-core itself.

A tiny Llama-like `GPTModel` (GQA, SwiGLU, RoPE; dense, and MoE with 4 experts, top-2, the
all-gather dispatcher) is built by megatron-core 0.16.1 on CPU (tests/helpers/megatron_ref.py, in gloo rank
processes) at tp 1, tp 2, and tp 1 · ep 2, and saved with Megatron's own `dist_checkpointing.save`
(torch_dist); mlm imports the directory and its `GPT` must give GPTModel's logits to 1e-5 (fp32,
absolute; measured 1.6e-7 dense, 1.2e-7 MoE). Those tests skip where megatron-core is not
installed (it is pinned for Python 3.11). Bad input (not a checkpoint, an unknown module, a
.metadata pickle naming a foreign class) is checked without megatron.
"""

from __future__ import annotations

import argparse
import os
import pickle
import re

import pytest
import torch

from mlm.checkpoint import read_group
from mlm.config import config_from_dict, load_config
from mlm.convert.megatron.dcp import MegatronCheckpoint, checkpoint_dir
from mlm.convert.megatron.importer import args_overrides, import_megatron
from mlm.convert.reshard import reshard
from mlm.errors import MlmError
from tests.helpers.common import assert_error, mlm  # noqa: E402
from tests.helpers.distributed import run_ranks  # noqa: E402
from tests.helpers.megatron_helpers import SETS, TINY, TOL, megatron, mlm_logits, write_dcp  # noqa: E402, F401 (megatron: a fixture)
from tests.helpers.megatron_ref import HEADS, SEQ, VOCAB, save_reference  # noqa: E402


@pytest.mark.parametrize(
    "moe, world, ep",
    [(False, 1, 1), (False, 2, 1), (True, 1, 1), (True, 2, 2)],
    ids=["dense-tp1", "dense-tp2", "moe-tp1", "moe-ep2"],
)
@pytest.mark.usefixtures("megatron")
def test_import_matches_gptmodel(tmp_path, moe, world, ep):
    src = tmp_path / "megatron" / "iter_0000010"
    ref = run_ranks(world, save_reference, str(src), moe, ep)[0]
    (tmp_path / "megatron" / "latest_checkpointed_iteration.txt").write_text("10")
    sets = SETS + (["model.moe.token_dispatcher=allgather"] if moe else [])
    if world == 1 and not moe:  # the model config from Megatron-LM's saved args instead of --set
        args = argparse.Namespace(
            num_attention_heads=HEADS, group_query_attention=True, num_query_groups=2, kv_channels=16,
            max_position_embeddings=SEQ, norm_epsilon=1e-5, rotary_base=10000, swiglu=True,
            position_embedding_type="rope", params_dtype=torch.float32, consumed_train_samples=320,
        )  # fmt: skip
        torch.save({"args": args, "iteration": 10, "checkpoint_version": 3.0}, src / "common.pt")
        sets = []
    if world == 2 and not moe:  # through the command line
        r = mlm(
            "convert",
            "from-megatron",
            tmp_path / "megatron",
            tmp_path / "out",
            *(f"--set={s}" for s in sets),
        )
        assert r.returncode == 0, r.stderr
        assert "imported Megatron-core GPTModel" in r.stderr and "21 tensors" in r.stderr, r.stderr
    else:
        report = import_megatron(tmp_path / "megatron", tmp_path / "out", sets)
        if sets:  # no args: the fields taken from mlm's defaults are named
            (note,) = report.notes
            assert note.startswith("no Megatron-LM args in common.pt: rope.base=10000.0, norm_eps=1e-05"), (
                note
            )
            assert ("moe.router_score_function" in note) == moe, note
        else:
            assert report.notes == []
        assert report.tensors == (23 if moe else 21)
    manifest = read_group(tmp_path / "out")[1]
    cfg = config_from_dict(manifest["config"]).model
    if not sets:  # the args' run: its position is recorded
        assert manifest["source"]["iteration"] == 10 and manifest["source"]["consumed_train_samples"] == 320
    assert (cfg.num_query_groups, cfg.kv_channels, cfg.vocab_size) == (2, 16, VOCAB)  # from the shapes
    assert cfg.mlp_kind == ("moe" if moe else "dense")
    diff = (mlm_logits(tmp_path / "out") - ref).abs().max().item()
    assert diff <= TOL, diff
    if world == 2 and not moe:  # the import is an ordinary mlm checkpoint: it reshards, logits kept
        assert reshard(tmp_path / "out", tmp_path / "tp2", 2, 1) <= TOL
    if world == 1 and moe:
        # the same tensors under the Transformer Engine spec's MoE norm name (pre_mlp_layernorm) and
        # with per-layer keys (decoder.layers.N.*, as a heterogeneous stack saves them)
        ckpt = MegatronCheckpoint(src)
        te = {}
        for key in ckpt.tensors:
            tensor = ckpt.read(key)
            sub = key.removeprefix("decoder.layers.")
            sub = sub.replace("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight")
            layers = {f"decoder.layers.{i}.{sub}": t for i, t in enumerate(tensor)}
            te.update(layers if key.startswith("decoder.layers.") else {key: tensor})
        assert "decoder.layers.1.pre_mlp_layernorm.weight" in te
        write_dcp(tmp_path / "te", te)
        import_megatron(tmp_path / "te", tmp_path / "out-te", sets)
        assert (mlm_logits(tmp_path / "out-te") - ref).abs().max().item() <= TOL


@pytest.mark.usefixtures("megatron")
def test_import_gpt2_like(tmp_path):
    """LayerNorm with biases, GeLU, biases in every linear layer, learned positions, tied output,
    and a vocabulary below the embedding rows (Megatron pads it): GPTModel's logits on the real ones."""
    ref = run_ranks(1, save_reference, str(tmp_path / "megatron"), False, 1, True)[0]
    vocab = VOCAB - 28
    report = import_megatron(tmp_path / "megatron", tmp_path / "out", [*SETS, f"model.vocab_size={vocab}"])
    cfg = config_from_dict(read_group(tmp_path / "out")[1]["config"]).model
    assert (cfg.normalization, cfg.activation, cfg.position_embedding) == ("layernorm", "gelu", "learned")
    assert cfg.add_bias and cfg.tie_embeddings and cfg.vocab_size == vocab
    assert read_group(tmp_path / "out")[0]["embed.weight"].shape[0] == VOCAB  # the padded rows kept
    assert report.tensors == 36  # 4 + 2 layers · (norms, q, k, v, out, up, down: weights and biases)
    diff = (mlm_logits(tmp_path / "out")[..., :vocab] - ref[..., :vocab]).abs().max().item()
    assert diff <= TOL, diff


def test_unknown_module_is_named(tmp_path):
    write_dcp(
        tmp_path / "ckpt",
        {
            "embedding.word_embeddings.weight": torch.zeros(8, 4),
            "decoder.layers.self_attention.core_attention.softmax_offset": torch.zeros(2, 4),
        },
    )
    with pytest.raises(
        MlmError, match=r"Megatron module 'decoder\.layers\.self_attention\.core_attention\.softmax_offset"
    ):
        import_megatron(tmp_path / "ckpt", tmp_path / "out", SETS)
    assert not (tmp_path / "out").exists()


def test_metadata_pickle_is_restricted(tmp_path):
    (tmp_path / "ckpt").mkdir()
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(MlmError, match=r"names io\.open, which a torch DCP metadata file does not hold"):
        import_megatron(tmp_path / "ckpt", tmp_path / "out", SETS)
    assert not marker.exists()


def test_metadata_dotted_names_are_refused(tmp_path):
    """Protocol 4 resolves a dotted name attribute by attribute: `os.system` through a DCP module that
    imports os must not be found."""
    (tmp_path / "ckpt").mkdir()
    payload = (
        b"\x80\x04"  # PROTO 4
        + b"\x8c\x27torch.distributed.checkpoint.filesystem"  # SHORT_BINUNICODE, 39 bytes
        + b"\x8c\x09os.getcwd"  # SHORT_BINUNICODE, 9 bytes
        + b"\x93"  # STACK_GLOBAL
        + b")R."  # EMPTY_TUPLE, REDUCE, STOP: call it
    )
    assert len("torch.distributed.checkpoint.filesystem") == 0x27 and len("os.getcwd") == 9
    assert pickle.loads(payload) == os.getcwd()  # what an unrestricted unpickler does
    (tmp_path / "ckpt" / ".metadata").write_bytes(payload)
    with pytest.raises(MlmError, match=r"names torch\.distributed\.checkpoint\.filesystem\.os\.getcwd"):
        import_megatron(tmp_path / "ckpt", tmp_path / "out", SETS)


def test_optimizer_state_is_left_out_with_a_note(tmp_path):
    """Megatron-LM saves the optimizer by default: its keys are not modules to refuse."""
    write_dcp(
        tmp_path / "ckpt",
        {
            "embedding.word_embeddings.weight": torch.zeros(8, 4),
            "optimizer.state.exp_avg.embedding.word_embeddings.weight": torch.zeros(8, 4),
        },
    )
    ckpt = MegatronCheckpoint(checkpoint_dir(tmp_path / "ckpt"))
    assert list(ckpt.tensors) == ["embedding.word_embeddings.weight"]
    assert ckpt.optimizer_keys == ["optimizer.state.exp_avg.embedding.word_embeddings.weight"]


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(MlmError, match="not a directory"):
        import_megatron(tmp_path / "missing", tmp_path / "out", SETS)
    (tmp_path / "iter_0000001" / "mp_rank_00").mkdir(parents=True)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("1")
    with pytest.raises(MlmError, match=r"holds mp_rank_00 but no model_optim_rng\.pt in them"):
        import_megatron(tmp_path, tmp_path / "out", SETS)


def test_not_a_gptmodel(tmp_path):
    write_dcp(tmp_path / "ckpt", {"embedding.word_embeddings.weight": torch.zeros(8, 4)})
    with pytest.raises(MlmError, match=r"not a Megatron GPTModel checkpoint: no self_attention\.linear_qkv"):
        import_megatron(tmp_path / "ckpt", tmp_path / "out", SETS)


def test_args_outside_the_allow_list(tmp_path):
    """A common.pt holding a class not allowed is not unpickled: refused, naming the class."""
    write_dcp(tmp_path / "ckpt", TINY)
    torch.save({"args": argparse.Namespace(kind=Marker())}, tmp_path / "ckpt" / "common.pt")
    with pytest.raises(
        MlmError, match=rf"common\.pt: names {re.escape(__name__)}\.Marker, which is outside the classes"
    ):
        import_megatron(tmp_path / "ckpt", tmp_path / "out")


def test_args_mlm_cannot_follow(tmp_path):
    write_dcp(tmp_path / "ckpt", TINY)
    args = argparse.Namespace(num_attention_heads=4, rotary_interleaved=True)
    torch.save({"args": args}, tmp_path / "ckpt" / "common.pt")
    with pytest.raises(MlmError, match=r"rotary_interleaved=True: interleaved RoPE \(mlm rotates halves\)"):
        import_megatron(tmp_path / "ckpt", tmp_path / "out")


class Marker:
    """A class outside common.pt's allow-list."""


def test_cli_bad_input(tmp_path):
    assert_error(
        mlm("convert", "from-megatron", tmp_path, tmp_path / "out"),
        "not a Megatron checkpoint",
        "no torch_dist .metadata file",
    )
    r = mlm("convert", "from-megatron", tmp_path, tmp_path / "out", "--tp", "2")
    assert r.returncode == 2 and "No such option: --tp" in r.stderr  # imports as it is: no mesh
    assert not (tmp_path / "out").exists()
    assert "--weights-only" in mlm("convert", "from-megatron", "--help").stdout


def test_args_that_change_the_model_are_followed():
    """Megatron-LM args that change the logits map to the mlm fields of the same meaning."""
    args = argparse.Namespace(
        num_attention_heads=8, group_query_attention=False, num_query_groups=1, swiglu=False, openai_gelu=True,
        normalization="LayerNorm", use_rope_scaling=True, rope_scaling_factor=32.0, hidden_dropout=0.1,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=2.5,
        moe_router_num_groups=4, moe_router_group_topk=2, moe_router_pre_softmax=False,
        moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-4, moe_z_loss_coeff=None,
    )  # fmt: skip
    sets = set(args_overrides({"args": args}))
    expected = {
        "model.num_attention_heads=8", "model.activation=\"gelu\"", "model.normalization=\"layernorm\"",
        "model.rope.scaling_factor=32.0", "model.rope.scaling_type=\"llama3\"", "model.hidden_dropout=0.1",
        "model.moe.router_score_function=\"sigmoid\"", "model.moe.router_enable_expert_bias=true",
        "model.moe.router_topk_scaling_factor=2.5", "model.moe.router_num_groups=4", "model.moe.router_group_topk=2",
        "model.moe.router_pre_softmax=false", "model.moe.seq_aux_loss_coeff=0.0001",
    }  # fmt: skip
    assert expected <= sets, expected - sets
    assert not any(
        s.startswith(("model.num_query_groups", "model.moe.z_loss", "model.moe.aux_loss")) for s in sets
    )
    load_config(
        None, [*sets, 'model.mlp_kind="moe"', "model.moe.num_experts=8", "data.seq_length=8"]
    )  # valid


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("qk_l2_norm", True, "qk_l2_norm=True: L2-normalized queries and keys"),
        (
            "position_embedding_type",
            "yarn",
            "position_embedding_type='yarn': mlm imports 'rope', 'learned_absolute' and 'none'",
        ),
    ],
)
def test_args_refused(field, value, message):
    with pytest.raises(MlmError, match=re.escape(message)):
        args_overrides({"args": argparse.Namespace(**{field: value})})


def test_squared_relu_and_no_positions_are_read():
    """Nemotron-H's MLP (--squared-relu) and attention without positions (position_embedding_type none)."""
    sets = args_overrides({"args": argparse.Namespace(squared_relu=True, position_embedding_type="none")})
    assert {'model.activation="squared_relu"', 'model.position_embedding="none"'} <= set(sets), sets


def test_missing_layer_is_named(tmp_path):
    """Per-layer keys with a layer absent (a partial copy) are named as such, not as a config mismatch."""
    layers = {
        f"decoder.layers.{i}.self_attention.linear_{name}.weight": torch.zeros(rows, 4)
        for i in (0, 2)
        for name, rows in (("qkv", 12), ("proj", 4))
    }
    write_dcp(tmp_path / "ckpt", {"embedding.word_embeddings.weight": torch.zeros(8, 4), **layers})
    with pytest.raises(
        MlmError, match=r"holds decoder\.layers\.2 but no tensor of layer 1: an incomplete checkpoint"
    ):
        import_megatron(tmp_path / "ckpt", tmp_path / "out", SETS)
