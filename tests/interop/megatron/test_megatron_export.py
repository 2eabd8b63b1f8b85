"""`mlm export megatron CKPT OUT` against Megatron-core itself, and round trips.

With megatron-core (the `megatron` fixture; GPTModel runs in gloo rank processes,
tests/helpers/megatron_ref.py): an mlm checkpoint of the reference's tiny Llama-like model (random init,
dense and MoE with the all-gather dispatcher) is exported, `dist_checkpointing.load`ed into
GPTModel at tp 1 (and tp 2, dense; and a heterogeneous stack, dense then MoE with a gated shared
expert, whose keys are per layer), and GPTModel's logits must equal mlm's to 1e-5 (fp32,
absolute, max |logit| ≈ 3; measured 1.1e-6 to 1.5e-6); a GPTModel save imported and exported again must equal that save bitwise, tensor by
tensor, with the same `_extra_state` objects; and Megatron → mlm → HF → mlm must give the first
import's tensors bitwise. Without megatron: the export reads back with mlm's own reader
(`mlm convert from-megatron`) bitwise, homogeneous and heterogeneous stacks, and what Megatron cannot hold
is refused, naming it.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from mlm.checkpoint import read_group
from mlm.config import load_config
from mlm.convert.hf.folder import export_hf, import_hf
from mlm.convert.megatron.dcp import MegatronCheckpoint
from mlm.convert.megatron.exporter import export_megatron
from mlm.convert.megatron.importer import import_megatron
from mlm.errors import MlmError
from tests.helpers.common import assert_error, checkpoint_logits, mlm  # noqa: E402
from tests.helpers.distributed import run_ranks  # noqa: E402
from tests.helpers.megatron_helpers import (  # noqa: E402, F401 (megatron: a fixture)
    SETS,
    TOL,
    dcp_entries,
    megatron,
    mlm_checkpoint,
    mlm_logits,
)
from tests.helpers.megatron_ref import (  # noqa: E402
    FFN,
    GROUPS,
    HEADS,
    HIDDEN,
    LAYERS,
    MOE_FFN,
    NUM_EXPERTS,
    SEQ,
    SHARED_FFN,
    TOPK,
    VOCAB,
    gdn_layer_outputs,
    load_reference,
    save_reference,
)

REFERENCE = [  # megatron_ref's GPTModel as an mlm config; init_std 0.1: logits of ±3, which a misplaced tensor moves
    f"model.num_layers={LAYERS}", f"model.hidden_size={HIDDEN}", f"model.num_attention_heads={HEADS}",
    f"model.num_query_groups={GROUPS}", f"model.ffn_hidden_size={FFN}", f"model.vocab_size={VOCAB}",
    f"model.max_position_embeddings={SEQ}", "model.init_std=0.1", f"data.seq_length={SEQ}",
]  # fmt: skip
MOE = [
    "model.mlp_kind=moe", f"model.moe.num_experts={NUM_EXPERTS}", f"model.moe.router_topk={TOPK}",
    f"model.moe.ffn_hidden_size={MOE_FFN}", "model.moe.token_dispatcher=allgather",
]  # fmt: skip


MIXED = [  # megatron_ref's `mixed` stack: dense layer 0, MoE layer 1 with a gated shared expert
    "model.first_k_dense=1", f"model.moe.shared_expert_ffn_hidden_size={SHARED_FFN}", "model.moe.shared_expert_gate=true",
]  # fmt: skip


@pytest.mark.parametrize(
    "moe, world, mixed",
    [(False, 1, False), (False, 2, False), (True, 1, False), (True, 1, True)],
    ids=["dense-tp1", "dense-tp2", "moe-tp1", "mixed-tp1"],
)
@pytest.mark.usefixtures("megatron")
def test_export_loads_into_gptmodel(tmp_path, moe, world, mixed):
    mlm_checkpoint(tmp_path / "mlm", REFERENCE + (MOE if moe else []) + (MIXED if mixed else []))
    report = export_megatron(tmp_path / "mlm", tmp_path / "megatron")
    assert report.tensors == (19 if mixed else 10 if moe else 9) and report.notes[0].startswith(
        "weights only"
    )
    assert (tmp_path / "megatron" / "latest_checkpointed_iteration.txt").read_text() == "5\n"
    it_dir = tmp_path / "megatron" / "iter_0000005"
    assert {p.name for p in it_dir.iterdir()} == {".metadata", "__0_0.distcp", "common.pt", "metadata.json"}
    theirs, common = run_ranks(world, load_reference, str(it_dir), moe, 1, mixed)[0]
    assert (common["iteration"], common["checkpoint_version"], common["args"].num_layers) == (5, 3.0, LAYERS)
    ours = mlm_logits(tmp_path / "mlm")
    assert ours.abs().max() > 1.0  # logits a misplaced tensor would move by O(1)
    diff = (theirs - ours).abs().max().item()
    assert diff <= TOL, (
        diff
    )  # measured 1.3e-6 (tp1), 1.5e-6 (tp2), 1.1e-6 (MoE), 1.2e-6 (mixed); max |logit| ≈ 3


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.usefixtures("megatron")
def test_gptmodel_save_round_trips(tmp_path, moe):
    """Megatron → mlm → Megatron equals GPTModel's own save bitwise (keys, tensors, _extra_state
    objects); Megatron → mlm → HF → mlm gives the first import's tensors bitwise (dense)."""
    src = tmp_path / "gptmodel" / "iter_0000010"
    run_ranks(1, save_reference, str(src), moe)
    sets = SETS + (["model.moe.token_dispatcher=allgather"] if moe else [])
    import_megatron(src, tmp_path / "mlm", sets)
    r = mlm("export", "megatron", tmp_path / "mlm", tmp_path / "back")
    assert r.returncode == 0, r.stderr
    assert "read back with mlm's Megatron reader: every tensor bitwise equal" in " ".join(r.stderr.split())
    theirs, ours = dcp_entries(src), dcp_entries(tmp_path / "back" / "iter_0000000")
    assert theirs.keys() == ours.keys()
    assert sum(v == "bytes" for v in ours.values()) == (20 if moe else 8)  # the _extra_state objects
    for key, tensor in theirs.items():
        assert isinstance(tensor, str) or torch.equal(tensor, ours[key]), key
    if moe:
        return
    first = read_group(tmp_path / "mlm")[0]
    export_hf(tmp_path / "mlm", tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "mlm-again")
    again = read_group(tmp_path / "mlm-again")[0]
    assert again.keys() == first.keys()
    assert all(torch.equal(again[k], first[k]) for k in first)


@pytest.mark.parametrize(
    "sets",
    [
        [],
        MOE,
        # a heterogeneous stack (dense layer 0, MoE layer 1: per-layer keys) with a gated shared expert
        MOE + MIXED,
        # GPT-2-like: LayerNorm, learned positions, biases, tied output, tanh GELU, MHA
        [
            "model.normalization=layernorm",
            "model.position_embedding=learned",
            "model.add_bias=true",
            "model.tie_embeddings=true",
            "model.num_query_groups=4",
            "model.activation=gelu_tanh",
        ],  # fmt: skip
        # Qwen3-MoE-like attention (q/k norms, q/k/v biases) with DeepSeek-style sigmoid routing and expert bias
        MOE
        + ["model.qk_norm=true", "model.qkv_bias=true", "model.moe.router_score_function=sigmoid"]
        + ["model.moe.router_enable_expert_bias=true"],
    ],
    ids=["dense", "moe", "heterogeneous", "gpt2", "qwen-like"],
)
def test_export_reads_back_with_mlm(tmp_path, sets):
    """mlm → Megatron (the CLI) → mlm (`--from-megatron`, config from the exported args) is bitwise."""
    state = mlm_checkpoint(tmp_path / "mlm", REFERENCE + sets, iteration=7)
    if sets:
        report = export_megatron(tmp_path / "mlm", tmp_path / "megatron")
        assert any(
            n.startswith("model.activation=gelu_tanh: Megatron-core's GPTModel") for n in report.notes
        ) == ("model.activation=gelu_tanh" in sets)
    else:  # through the command line
        r = mlm("export", "megatron", tmp_path / "mlm", tmp_path / "megatron")
        assert r.returncode == 0, r.stderr
        assert "weights only" in r.stderr
    it_dir = tmp_path / "megatron" / "iter_0000007"
    with torch.serialization.safe_globals([argparse.Namespace]):
        common = torch.load(it_dir / "common.pt", weights_only=True)
    args = vars(common["args"])
    assert (common["iteration"], common["checkpoint_version"]) == (7, 3.0)
    assert (args["iteration"], args["consumed_train_samples"], args["padded_vocab_size"]) == (7, 40, VOCAB)
    assert (args["seq_length"], args["kv_channels"], args["num_attention_heads"]) == (
        SEQ,
        HIDDEN // HEADS,
        HEADS,
    )
    assert args["num_experts"] == (NUM_EXPERTS if sets and sets[0] == MOE[0] else None)
    keys = set(MegatronCheckpoint(it_dir).tensors)
    if "model.first_k_dense=1" in sets:  # Megatron's layout for a heterogeneous stack
        assert args["moe_layer_freq"] == [0, 1]
        assert "decoder.layers.1.mlp.shared_experts.gate_weight" in keys
        assert "decoder.layers.0.mlp.linear_fc2.weight" in keys
    else:
        assert "decoder.layers.self_attention.linear_qkv.weight" in keys
    import_megatron(tmp_path / "megatron", tmp_path / "back")  # the model from the exported args
    back, manifest, _ = read_group(tmp_path / "back")
    assert back.keys() == state.keys()
    assert all(torch.equal(back[k], state[k]) for k in state)
    assert manifest["source"]["iteration"] == 7 and manifest["source"]["consumed_train_samples"] == 40


HYBRID = [  # Megatron's HybridModel: Mamba alone, attention + MLP, Mamba + MoE (one Megatron layer per symbol)
    "model.layer_pattern='M*-ME'", "model.num_layers=3", "model.position_embedding='none'",
    "model.activation=squared_relu", "model.mamba.head_dim=16", "model.mamba.state_dim=8",
    "model.mamba.num_groups=2", *MOE[1:],
]  # fmt: skip


def test_hybrid_export_reads_back_with_mlm(tmp_path):
    """A Mamba hybrid is written as Megatron's HybridModel (names from Megatron-LM's
    `MambaMixer.sharded_state_dict` and `HybridStack`: one `decoder.layers.<i>` per pattern symbol,
    in_proj in its five pieces, conv1d in three, `decoder.final_norm`) and read back bitwise, its
    config from the exported args."""
    state = mlm_checkpoint(tmp_path / "mlm", REFERENCE + HYBRID, iteration=3)
    report = export_megatron(tmp_path / "mlm", tmp_path / "megatron")
    assert report.architecture == "Megatron-core HybridModel" and report.verified
    it_dir = tmp_path / "megatron" / "iter_0000003"
    with torch.serialization.safe_globals([argparse.Namespace]):
        args = vars(torch.load(it_dir / "common.pt", weights_only=True)["args"])
    assert args["hybrid_layer_pattern"] == "M*-ME" and args["num_layers"] is None
    assert (args["mamba_head_dim"], args["mamba_state_dim"], args["mamba_num_groups"]) == (16, 8, 2)
    assert args["mamba_num_heads"] == 2 * HIDDEN // 16 and args["squared_relu"]
    keys = set(MegatronCheckpoint(it_dir).tensors)
    assert {
        "decoder.final_norm.weight",
        "decoder.layers.0.mixer.in_proj.layer_norm_weight",
        "decoder.layers.0.mixer.in_proj.weight.dt",
        "decoder.layers.0.mixer.conv1d.bias.C",
        "decoder.layers.1.self_attention.linear_qkv.weight",
        "decoder.layers.2.mlp.linear_fc1.layer_norm_weight",  # the MLP of mlm's layer 1: symbol 2
        "decoder.layers.3.mixer.out_proj.weight",
        "decoder.layers.4.mlp.router.weight",
    } <= keys
    assert not any(k.startswith("decoder.layers.5") for k in keys)
    import_megatron(tmp_path / "megatron", tmp_path / "back")
    back, _, _ = read_group(tmp_path / "back")
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    assert read_group(tmp_path / "back")[1]["config"]["model"]["layer_pattern"] == "M*-ME"


GDN = [  # a gated delta net + MLP, attention + MLP, Mamba alone
    "model.layer_pattern='G-*-M'", "model.num_layers=3", "model.mamba.head_dim=16", "model.mamba.state_dim=8",
    "model.mamba.num_groups=2", "model.gdn.num_key_heads=2", "model.gdn.num_value_heads=4",
    "model.gdn.key_head_dim=8", "model.gdn.value_head_dim=8",
]  # fmt: skip


def test_a_gated_delta_net_hybrid_exports_and_reads_back(tmp_path):
    """Gated DeltaNet layers are written with megatron-core's GatedDeltaNet names (in_proj in its six
    pieces, conv1d in three, out_norm) and the `linear_*` args, and read back bitwise."""
    state = mlm_checkpoint(tmp_path / "mlm", REFERENCE + GDN, iteration=2)
    report = export_megatron(tmp_path / "mlm", tmp_path / "megatron")
    assert report.architecture == "Megatron-core HybridModel" and report.verified
    it_dir = tmp_path / "megatron" / "iter_0000002"
    with torch.serialization.safe_globals([argparse.Namespace]):
        args = vars(torch.load(it_dir / "common.pt", weights_only=True)["args"])
    assert args["hybrid_layer_pattern"] == "G-*-M"
    assert (args["linear_num_key_heads"], args["linear_num_value_heads"], args["linear_key_head_dim"]) == (
        2,
        4,
        8,
    )
    keys = set(MegatronCheckpoint(it_dir).tensors)
    assert {
        "decoder.layers.0.self_attention.in_proj.layer_norm_weight",
        "decoder.layers.0.self_attention.in_proj.weight.alpha",
        "decoder.layers.0.self_attention.conv1d.weight.value",
        "decoder.layers.0.self_attention.out_norm.weight",
        "decoder.layers.2.self_attention.linear_qkv.weight",
        "decoder.layers.4.mixer.in_proj.weight.z",
    } <= keys
    import_megatron(tmp_path / "megatron", tmp_path / "back")
    back, manifest, _ = read_group(tmp_path / "back")
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    assert manifest["config"]["model"]["gdn"]["num_value_heads"] == 4


@pytest.mark.usefixtures("megatron")
def test_a_gated_delta_net_layer_computes_as_megatron_cores(tmp_path):
    """The exported layer-0 tensors, loaded into megatron-core 0.16.1's own GatedDeltaNet, give mlm's
    gdn layer's output: fp32, within 1e-5 of the largest value (measured 8e-7 relative)."""
    mlm_checkpoint(tmp_path / "mlm", REFERENCE + GDN, iteration=2)
    export_megatron(tmp_path / "mlm", tmp_path / "megatron")
    (theirs, ours) = run_ranks(
        1, gdn_layer_outputs, str(tmp_path / "megatron" / "iter_0000002"), str(tmp_path / "mlm"), 0
    )[0]
    theirs, ours = torch.from_numpy(theirs), torch.from_numpy(ours)
    scale = theirs.abs().max().item()
    assert scale > 0.1
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5 * scale)


def test_a_gpt_checkpoint_imports_into_an_attention_only_pattern(tmp_path):
    """Megatron's GPTModel → HybridModel reading (gpt_checkpoint_interop): a pattern of attention
    and MLP layers only (`*-*-`) reads a GPTModel checkpoint's layers in order, with the dense
    import's logits."""
    mlm_checkpoint(tmp_path / "mlm", REFERENCE, iteration=1)
    export_megatron(tmp_path / "mlm", tmp_path / "megatron")
    import_megatron(tmp_path / "megatron", tmp_path / "dense")
    import_megatron(tmp_path / "megatron", tmp_path / "pattern", ["model.layer_pattern='*-*-'"])
    tokens = torch.arange(SEQ)[None] % VOCAB
    assert load_config(tmp_path / "pattern" / "config.toml").model.layer_pattern == "*-*-"
    torch.testing.assert_close(
        checkpoint_logits(tmp_path / "pattern", tokens),
        checkpoint_logits(tmp_path / "dense", tokens),
        rtol=0,
        atol=0,
    )


def test_unsupported_is_refused(tmp_path):
    mlm_checkpoint(tmp_path / "qk", REFERENCE + ["model.qk_norm=true", "model.normalization=layernorm"])
    with pytest.raises(
        MlmError, match=r"model\.qk_norm with normalization=layernorm: mlm's q/k norms are RMSNorm"
    ):
        export_megatron(tmp_path / "qk", tmp_path / "out")
    mystery = {"layers.0.mystery.weight": torch.zeros(2)}
    mlm_checkpoint(tmp_path / "extra", REFERENCE, extra_state=mystery)
    with pytest.raises(MlmError, match=r"mlm tensor layers\.0\.mystery\.weight has no Megatron GPTModel key"):
        export_megatron(tmp_path / "extra", tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob("out.tmp-*"))


def test_cli_bad_input(tmp_path):
    r = mlm("export", "megatron", tmp_path, tmp_path / "out", "--tp", "2")
    assert r.returncode == 2 and "No such option: --tp" in r.stderr  # the weights as they are
    assert_error(
        mlm("export", "megatron", tmp_path / "missing", tmp_path / "out"),
        "no such checkpoint",
    )
    assert not (tmp_path / "out").exists()
    assert "megatron" in mlm("export", "--help").stdout
