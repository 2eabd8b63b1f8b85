"""`mlm convert --from-dcp` on torchtitan checkpoints (no torchtitan needed).

The source is written here as torchtitan's CheckpointManager lays a step out (plain
`torch.distributed.checkpoint.save` of the model's parameters at the top level, `optimizer` flattened
as `get_optimizer_state_dict(flatten_optimizer_state_dict=True)` gives it, `lr_scheduler`,
`train_state`, `dataloader`), under both of torchtitan's spellings (v0.2.2's `attention.wq` /
`output`, later `attention.qkv_linear.wq` / `lm_head`). The weights are those of a tiny random
Hugging Face `LlamaForCausalLM` (GQA, Llama-3.1 RoPE scaling), taken into torchtitan's layout the
way torchtitan's own HF adapter does (`_reverse_permute` of q_proj / k_proj: rotate-half rows →
adjacent pairs), so the reference is transformers' forward: mlm's logits on the import must equal
transformers' to 1e-5 (fp32, absolute). Adam's moments are made in HF's layout and reverse-permuted
the same way: the imported ones must come back bitwise, in the checkpoint and in the AdamW of a
`Trainer` that resumes from it at torchtitan's step and trains one more. Bad input: a directory
that is not DCP, heads not given, a parameter of another model, AMSGrad's state, one parameter
under both spellings, a bytes entry holding a class.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp

transformers = pytest.importorskip("transformers")

from test_convert_hf import cli  # noqa: E402

from mlm.checkpoint import read_group  # noqa: E402
from mlm.config import config_from_dict, load_config  # noqa: E402
from mlm.convert.torchtitan import import_torchtitan  # noqa: E402
from mlm.errors import MlmError  # noqa: E402

from test_bad_input import assert_error  # noqa: E402
from test_convert_megatron import mlm_logits  # noqa: E402
from test_hf_numerics import LLAMA3_ROPE, SEQ, llama  # noqa: E402

TOL = 1e-5  # fp32 logits, absolute (max |logit| ≈ 3.5)
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.save in one process
HEADS, KV_HEADS = 4, 2  # llama()'s
SETS = [
    f"model.num_attention_heads={HEADS}",
    "model.rope_base=10000.0",
    f"model.max_position_embeddings={SEQ}",
    f"model.rope_original_max_position_embeddings={LLAMA3_ROPE['original_max_position_embeddings']}",
]
_HF = {  # HF name (after model.layers.N.) → torchtitan's, per spelling
    "self_attn.q_proj.weight": ("attention.wq.weight", "attention.qkv_linear.wq.weight"),
    "self_attn.k_proj.weight": ("attention.wk.weight", "attention.qkv_linear.wk.weight"),
    "self_attn.v_proj.weight": ("attention.wv.weight", "attention.qkv_linear.wv.weight"),
    "self_attn.o_proj.weight": ("attention.wo.weight",) * 2,
    "mlp.gate_proj.weight": ("feed_forward.w1.weight",) * 2,
    "mlp.up_proj.weight": ("feed_forward.w3.weight",) * 2,
    "mlp.down_proj.weight": ("feed_forward.w2.weight",) * 2,
    "input_layernorm.weight": ("attention_norm.weight",) * 2,
    "post_attention_layernorm.weight": ("ffn_norm.weight",) * 2,
}


def reverse_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """torchtitan's Llama3StateDictAdapter._reverse_permute (HF rotate-half rows → adjacent pairs)."""
    dim1, dim2 = w.shape
    return w.view(heads, 2, dim1 // heads // 2, dim2).transpose(1, 2).reshape(dim1, dim2)


def titan_names(hf_state: dict, spelling: int) -> dict[str, str]:
    """{HF name: torchtitan name} (spelling 0: v0.2.2, 1: later)."""
    out = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight"}
    if "lm_head.weight" in hf_state:
        out["lm_head.weight"] = ("output.weight", "lm_head.weight")[spelling]
    for key in hf_state:
        if key.startswith("model.layers."):
            n, sub = key.removeprefix("model.layers.").split(".", 1)
            out[key] = f"layers.{n}.{_HF[sub][spelling]}"
    return out


def to_titan(name: str, t: torch.Tensor) -> torch.Tensor:
    if name.endswith("self_attn.q_proj.weight"):
        return reverse_permute(t, HEADS)
    if name.endswith("self_attn.k_proj.weight"):
        return reverse_permute(t, KV_HEADS)
    return t


def save_titan(path, model, *, spelling=0, moments=None, step=7, ntokens=None, extra=None) -> None:
    """A torchtitan step directory of `model` (HF); `moments`: {HF name: (exp_avg, exp_avg_sq)} in
    HF's layout, saved as AdamW's state at Adam step `step` with train_state and a dp-1 dataloader."""
    hf_state = dict(model.state_dict())
    hf_state.pop("lm_head.weight") if model.config.tie_word_embeddings else None
    names = titan_names(hf_state, spelling)
    states = {names[k]: to_titan(k, v).clone() for k, v in hf_state.items()}
    if moments is not None:
        states["optimizer"] = {
            "state": {
                names[k]: {
                    "step": torch.tensor(float(step)),
                    "exp_avg": to_titan(k, m).clone(),
                    "exp_avg_sq": to_titan(k, v).clone(),
                }
                for k, (m, v) in moments.items()
            },
            "param_groups": {names[k]: {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8} for k in moments},
        }
        states["lr_scheduler"] = {"lr_scheduler_0": {"last_epoch": step}}
        states["train_state"] = {"step": step, "ntokens_seen": ntokens}
        states["dataloader"] = {"dp_rank_0": b"torchtitan's dataloader state", "world_size": 1}
    states.update(extra or {})
    dcp.save(states, checkpoint_id=path, no_dist=True)


@pytest.mark.parametrize("spelling, tie", [(0, False), (1, True)], ids=["v0.2.2-untied", "later-tied"])
def test_logits_match_transformers(tmp_path, spelling, tie):
    model = llama(tie=tie)
    save_titan(tmp_path / "checkpoint" / "step-5", model, spelling=spelling)
    report = import_torchtitan(tmp_path / "checkpoint" / "step-5", tmp_path / "ckpt", SETS)
    tokens = (torch.arange(SEQ) * 7 % model.config.vocab_size).view(1, SEQ)
    with torch.no_grad():
        theirs = model(input_ids=tokens).logits
    ours = mlm_logits(tmp_path / "ckpt", tokens)[..., : theirs.shape[-1]]
    assert (ours - theirs).abs().max().item() <= TOL  # measured 2.4e-6 (untied), 2.0e-6 (tied)
    manifest = read_group(tmp_path / "ckpt")[1]
    assert manifest["iteration"] == 0 and not any(k.startswith("optim/") for k in manifest["tensors"])
    assert config_from_dict(manifest["config"]).model.tie_embeddings is tie
    assert any("model-only save" in n for n in report.notes)


def test_optimizer_state_lands_and_training_resumes(tmp_path, tiny_data):
    """AdamW's moments (permuted like their weights) bitwise, and `mlm train` resumes at
    torchtitan's step: iteration 7, Adam step 7, 28 samples consumed (896 tokens of 32), then one step."""
    from mlm.train.trainer import Trainer

    model = llama(tie=False, vocab_size=512)  # the tiny dataset's SentencePiece vocabulary
    gen = torch.Generator().manual_seed(3)
    moments = {
        k: (torch.randn(p.shape, generator=gen), torch.rand(p.shape, generator=gen))
        for k, p in model.named_parameters()
    }
    save_titan(tmp_path / "checkpoint" / "step-3", llama(tie=False, vocab_size=512, seed=2))
    save_titan(tmp_path / "checkpoint" / "step-7", model, moments=moments, step=7, ntokens=7 * 4 * 32)
    import_torchtitan(tmp_path / "checkpoint", tmp_path / "ckpt", [*SETS, "data.seq_length=32"])

    optim, manifest, it_dir = read_group(tmp_path / "ckpt", "optim")
    assert it_dir.name == "iter_0000007"  # the highest step-N of the folder
    assert (manifest["iteration"], manifest["optimizer_step"], manifest["consumed_samples"]) == (7, 7, 28)
    assert manifest["source"]["train_state.ntokens_seen"] == 896
    names = {"model.embed_tokens.weight": "embed.weight", "lm_head.weight": "output.weight"}
    names |= {"model.norm.weight": "final_norm.weight"}
    hf_to_mlm = {
        "self_attn.q_proj": "attn.q",
        "self_attn.k_proj": "attn.k",
        "self_attn.v_proj": "attn.v",
        "self_attn.o_proj": "attn.out",
        "mlp.gate_proj": "mlp.gate",
        "mlp.up_proj": "mlp.up",
        "mlp.down_proj": "mlp.down",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "mlp_norm",
    }
    for k in moments:
        if k.startswith("model.layers."):
            n, sub = k.removeprefix("model.layers.").split(".", 1)
            names[k] = f"layers.{n}.{hf_to_mlm[sub.removesuffix('.weight')]}.weight"
    assert len(optim) == 2 * len(moments)
    for k, (m, v) in moments.items():
        assert torch.equal(optim[f"exp_avg.{names[k]}"], m) and torch.equal(
            optim[f"exp_avg_sq.{names[k]}"], v
        ), k

    sets = [
        f"run_dir='{tmp_path / 'run'}'",
        f"data.data_path=['{tiny_data}']",
        "train.micro_batch_size=2",
        "train.global_batch_size=4",
        "train.train_iters=8",
        "logging.tensorboard=false",
    ]
    trainer = Trainer(load_config(tmp_path / "ckpt" / "config.toml", sets), load=str(tmp_path / "ckpt"))
    assert (trainer.iteration, trainer.optimizer_step, trainer.consumed_samples) == (7, 7, 28)
    loaded = {t.key: t.local for t in trainer.optimizer.checkpoint_groups(7)["optim"]}
    for k, (m, v) in moments.items():  # in the trainer's AdamW (the embedding's rows padded to 512 already)
        assert torch.equal(loaded[f"exp_avg.{names[k]}"], m) and torch.equal(
            loaded[f"exp_avg_sq.{names[k]}"], v
        )
    losses = trainer.train()
    assert len(losses) == 1 and 0 < losses[0] < 10
    assert (trainer.iteration, trainer.optimizer_step, trainer.consumed_samples) == (8, 8, 32)


def test_cli_and_bad_input(tmp_path, monkeypatch, capsys):
    model = llama(tie=False)
    save_titan(tmp_path / "checkpoint" / "step-2", model)
    sets = [a for s in SETS for a in ("--set", s)]
    r = cli(monkeypatch, capsys, "convert", "--from-dcp", tmp_path / "checkpoint", tmp_path / "ckpt", *sets)
    assert r.returncode == 0, r.stderr
    assert "imported torchtitan Llama 3" in " ".join(r.stderr.split())
    assert json.loads((tmp_path / "ckpt" / "iter_0000000" / "manifest.json").read_text())["source"]

    # the heads (and RoPE base) are not in the checkpoint
    r = cli(monkeypatch, capsys, "convert", "--from-dcp", tmp_path / "checkpoint", tmp_path / "out1")
    assert_error(r, "does not say its num_attention_heads or rope_base", "--set model.num_attention_heads=N")
    # not a DCP directory
    (tmp_path / "empty").mkdir()
    r = cli(monkeypatch, capsys, "convert", "--from-dcp", tmp_path / "empty", tmp_path / "out2", *sets)
    assert_error(r, "not a torch DCP checkpoint", "step-N/")
    # an entry of another model, named
    extra = {"layers.0.attention.q_norm.weight": torch.ones(16)}
    save_titan(tmp_path / "qknorm", model, extra=extra)
    r = cli(monkeypatch, capsys, "convert", "--from-dcp", tmp_path / "qknorm", tmp_path / "out3", *sets)
    assert_error(r, "'layers.0.attention.q_norm.weight' is not read by mlm convert --from-dcp")
    assert not any(p.name.startswith("out") for p in tmp_path.iterdir())


def test_refused_and_bf16_sources(tmp_path):
    model = llama(tie=False)
    moments = {k: (torch.zeros(p.shape), torch.zeros(p.shape)) for k, p in model.named_parameters()}
    extra = {"optimizer.state.norm.weight.max_exp_avg_sq": torch.zeros(64)}  # AMSGrad's
    save_titan(tmp_path / "amsgrad", model, moments=moments, step=1, ntokens=64, extra=extra)
    with pytest.raises(MlmError, match="optimizer state 'optimizer.state.norm.weight.max_exp_avg_sq'"):
        import_torchtitan(tmp_path / "amsgrad", tmp_path / "ckpt", SETS)
    # the same parameter under both spellings
    save_titan(
        tmp_path / "both", model, extra={"layers.1.attention.qkv_linear.wv.weight": torch.zeros(32, 64)}
    )
    with pytest.raises(
        MlmError, match="layers.1.attention.wv.weight and layers.1.attention.qkv_linear.wv.weight"
    ):
        import_torchtitan(tmp_path / "both", tmp_path / "ckpt", SETS)
    # a bytes entry holding a class: not unpickled
    import argparse

    extra = {"train_state": {"step": argparse.Namespace(step=1), "ntokens_seen": 64}}
    save_titan(tmp_path / "pickled", model, moments=moments, step=1, ntokens=64, extra=extra)
    with pytest.raises(MlmError, match="not read: a class outside plain values .*argparse.Namespace"):
        import_torchtitan(tmp_path / "pickled", tmp_path / "ckpt", SETS)
    assert not (tmp_path / "ckpt").exists()
    # a model-only save in bf16 (torchtitan's export_dtype): imported as stored
    save_titan(tmp_path / "bf16", model.to(torch.bfloat16))
    report = import_torchtitan(tmp_path / "bf16", tmp_path / "ckpt", SETS)
    state = read_group(tmp_path / "ckpt")[0]
    assert report.dtype == "bfloat16" and torch.equal(
        state["layers.0.attn.v.weight"], model.state_dict()["model.layers.0.self_attn.v_proj.weight"]
    )
