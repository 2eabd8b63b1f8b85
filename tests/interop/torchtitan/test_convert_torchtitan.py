"""`mlm convert from-torchtitan` on checkpoints torchtitan's own trainer writes, and on hand-made ones.

Against torchtitan (skipped without it; `tests/helpers/titan_writer.py` runs its trainer on CPU): the
llama3 debugmodel trained 6 steps by torchtitan 0.3.0 on 1 rank, and on 2 FSDP ranks with
grouped-query attention and the output layer tied to the embedding (as its Llama 3.2 1B and 3B),
checkpointed with its fused-QKV AdamW state. mlm's logits on the import
must equal those of torchtitan's model loaded back from the checkpoint to 1e-5 (fp32, absolute);
iteration, Adam step and the scheduler's last_epoch must be torchtitan's step; the moments must
equal bitwise the checkpoint's, split and permuted by torchtitan's own code
(`FusedQKVLinear._split_qkv_on_save`, `Llama3StateDictAdapter.to_hf`); `mlm train` resumes.

Hand-made (no torchtitan needed): the source is written as torchtitan's CheckpointManager lays a
step out (plain `torch.distributed.checkpoint.save` of the model's parameters at the top level,
`optimizer` flattened to `state.<param>.*` / `param_groups.<param>.*`, `lr_scheduler.last_epoch`,
`train_state`, `dataloader`), under both of torchtitan's spellings (v0.2.2's `attention.wq` /
`output`, later `attention.qkv_linear.wq` / `lm_head`) and, for v0.3.0, with AdamW's state under
the fused `attention.qkv_linear.wqkv.weight`. The weights are those of a tiny random Hugging Face
`LlamaForCausalLM` (GQA, Llama-3.1 RoPE scaling), taken into torchtitan's layout the way
torchtitan's own HF adapter does (`_reverse_permute` of q_proj / k_proj: rotate-half rows →
adjacent pairs), so the reference is transformers' forward: mlm's logits on the import must equal
transformers' to 1e-5. Adam's moments are made in HF's layout and reverse-permuted (and fused) the
same way: the imported ones must come back bitwise, in the checkpoint and in the AdamW of a
`Trainer` that resumes from it at torchtitan's step and trains one more. Bad input: a directory
that is not DCP, heads not given, a parameter of another model, AMSGrad's state, one parameter
under both spellings, fused and split state of one layer, a moment of another shape, a bytes
entry holding a class.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp

transformers = pytest.importorskip("transformers")

from mlm.checkpoint import read_group  # noqa: E402
from mlm.config import config_from_dict, load_config  # noqa: E402
from mlm.convert.torchtitan.importer import import_torchtitan  # noqa: E402
from mlm.errors import MlmError  # noqa: E402
from tests.helpers.common import assert_error, checkpoint_logits, cli  # noqa: E402
from tests.helpers.hf_models import LLAMA3_ROPE, SEQ, llama  # noqa: E402

TOL = 1e-5  # fp32 logits, absolute (max |logit| ≈ 3.5)
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.save in one process
HEADS, KV_HEADS = 4, 2  # llama()'s
SETS = [
    f"model.num_attention_heads={HEADS}",
    "model.rope.base=10000.0",
    f"model.max_position_embeddings={SEQ}",
    f"model.rope.original_max_position_embeddings={LLAMA3_ROPE['original_max_position_embeddings']}",
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


_HF_TO_MLM = {
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


def mlm_name(hf_name: str) -> str:
    """mlm's name of the Hugging Face Llama parameter `hf_name`."""
    top = {"model.embed_tokens.weight": "embed.weight", "lm_head.weight": "output.weight"}
    if hf_name in top or hf_name == "model.norm.weight":
        return top.get(hf_name, "final_norm.weight")
    n, sub = hf_name.removeprefix("model.layers.").split(".", 1)
    return f"layers.{n}.{_HF_TO_MLM[sub.removesuffix('.weight')]}.weight"


def fuse_qkv(state: dict[str, dict]) -> dict[str, dict]:
    """AdamW's per-parameter `state` as torchtitan v0.3.0 keeps it for its FusedQKVLinear: the
    layers' qkv_linear.{wq,wk,wv} entries as one `wqkv.weight`, rows per KV group (the group's
    query heads, its key head, its value head), as its `_merge_qkv_on_load` builds the weight
    (torchtitan 0.3.0, torchtitan/models/common/attention.py lines 902-926: reshape wq to
    (n_kv, heads_per_kv, head_dim, dim), wk and wv to (n_kv, 1, head_dim, dim), cat on dim 1)."""
    out = {k: v for k, v in state.items() if ".qkv_linear." not in k}
    hd = 64 // HEADS
    for qk in [k for k in state if k.endswith(".qkv_linear.wq.weight")]:
        q, k, v = (state[qk.replace(".wq.", f".{w}.")] for w in ("wq", "wk", "wv"))
        fused = {"step": q["step"]}
        for m in ("exp_avg", "exp_avg_sq"):
            parts = [
                q[m].reshape(KV_HEADS, HEADS // KV_HEADS, hd, -1),
                k[m].reshape(KV_HEADS, 1, hd, -1),
                v[m].reshape(KV_HEADS, 1, hd, -1),
            ]
            fused[m] = torch.cat(parts, dim=1).reshape(-1, q[m].shape[1])
        out[qk.replace(".wq.", ".wqkv.")] = fused
    return out


def save_titan(path, model, *, spelling=0, moments=None, step=7, ntokens=None, fused=False, extra=None):
    """A torchtitan step directory of `model` (HF); `moments`: {HF name: (exp_avg, exp_avg_sq)} in
    HF's layout, saved as AdamW's state at Adam step `step` (`fused`: v0.3.0's fused q/k/v state,
    spelling 1 only) with the scheduler, train_state and a dp-1 dataloader."""
    hf_state = dict(model.state_dict())
    hf_state.pop("lm_head.weight") if model.config.tie_word_embeddings else None
    names = titan_names(hf_state, spelling)
    states = {names[k]: to_titan(k, v).clone() for k, v in hf_state.items()}
    if moments is not None:
        state = {
            names[k]: {
                "step": torch.tensor(float(step)),
                "exp_avg": to_titan(k, m).clone(),
                "exp_avg_sq": to_titan(k, v).clone(),
            }
            for k, (m, v) in moments.items()
        }
        state = fuse_qkv(state) if fused else state
        groups = {p: {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1} for p in state}
        states["optimizer"] = {"state": state, "param_groups": groups}
        # LRSchedulersContainer.state_dict: LambdaLR's whole state (v0.1.0 to v0.2.2), {"last_epoch"} (v0.3.0)
        states["lr_scheduler"] = {"last_epoch": step}
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
    ours = checkpoint_logits(tmp_path / "ckpt", tokens)[..., : theirs.shape[-1]]
    assert (ours - theirs).abs().max().item() <= TOL  # measured 2.4e-6 (untied), 2.0e-6 (tied)
    manifest = read_group(tmp_path / "ckpt")[1]
    assert manifest["iteration"] == 0 and not any(k.startswith("optim/") for k in manifest["tensors"])
    assert config_from_dict(manifest["config"]).model.tie_embeddings is tie
    assert any("model-only save" in n for n in report.notes)


@pytest.mark.parametrize("spelling, fused", [(0, False), (1, True)], ids=["v0.2.2", "v0.3.0-fused"])
def test_optimizer_state_lands_and_training_resumes(tmp_path, tiny_data, spelling, fused):
    """AdamW's moments (split from the fused wqkv, permuted like their weights) bitwise, and `mlm
    train` resumes at torchtitan's step: iteration 7, Adam step 7, 28 samples consumed (896 tokens
    of 32), then one step."""
    from mlm.train.trainer import Trainer

    model = llama(tie=False, vocab_size=512)  # the tiny dataset's SentencePiece vocabulary
    gen = torch.Generator().manual_seed(3)
    moments = {
        k: (torch.randn(p.shape, generator=gen), torch.rand(p.shape, generator=gen))
        for k, p in model.named_parameters()
    }
    save_titan(
        tmp_path / "checkpoint" / "step-3", llama(tie=False, vocab_size=512, seed=2), spelling=spelling
    )
    save_titan(
        tmp_path / "checkpoint" / "step-7",
        model,
        spelling=spelling,
        moments=moments,
        step=7,
        ntokens=7 * 4 * 32,
        fused=fused,
    )
    import_torchtitan(tmp_path / "checkpoint", tmp_path / "ckpt", [*SETS, "data.seq_length=32"])

    optim, manifest, it_dir = read_group(tmp_path / "ckpt", "optim")
    assert it_dir.name == "iter_0000007"  # the highest step-N of the folder
    assert (manifest["iteration"], manifest["optimizer_step"], manifest["consumed_samples"]) == (7, 7, 28)
    assert manifest["source"]["train_state.ntokens_seen"] == 896
    assert manifest["source"]["lr_scheduler.last_epoch"] == 7
    names = {k: mlm_name(k) for k in moments}
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
    r = cli(
        monkeypatch, capsys, "convert", "from-torchtitan", tmp_path / "checkpoint", tmp_path / "ckpt", *sets
    )
    assert r.returncode == 0, r.stderr
    assert "imported torchtitan Llama 3" in " ".join(r.stderr.split())
    assert json.loads((tmp_path / "ckpt" / "iter_0000000" / "manifest.json").read_text())["source"]

    # the heads (and RoPE base) are not in the checkpoint
    r = cli(monkeypatch, capsys, "convert", "from-torchtitan", tmp_path / "checkpoint", tmp_path / "out1")
    assert_error(r, "does not say its num_attention_heads or rope.base", "--set model.num_attention_heads=N")
    # not a DCP directory
    (tmp_path / "empty").mkdir()
    r = cli(monkeypatch, capsys, "convert", "from-torchtitan", tmp_path / "empty", tmp_path / "out2", *sets)
    assert_error(r, "not a torch DCP checkpoint", "step-N/")
    # an entry of another model, named
    extra = {"layers.0.attention.q_norm.weight": torch.ones(16)}
    save_titan(tmp_path / "qknorm", model, extra=extra)
    r = cli(monkeypatch, capsys, "convert", "from-torchtitan", tmp_path / "qknorm", tmp_path / "out3", *sets)
    assert_error(r, "'layers.0.attention.q_norm.weight' is not read by mlm convert from-torchtitan")
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
    # v0.3.0's fused state beside a split part's, and a moment of another shape
    split = "optimizer.state.layers.0.attention.qkv_linear.wq.weight"
    extra = {f"{split}.{m}": torch.zeros(64, 64) for m in ("exp_avg", "exp_avg_sq")}
    extra[f"{split}.step"] = torch.tensor(1.0)
    save_titan(tmp_path / "both_state", model, spelling=1, moments=moments, step=1, fused=True, extra=extra)
    with pytest.raises(
        MlmError, match=r"both layers.0.attention.qkv_linear.wqkv.weight and its part layers.0"
    ):
        import_torchtitan(tmp_path / "both_state", tmp_path / "ckpt", SETS)
    short = {**moments, "model.norm.weight": (torch.zeros(32), torch.zeros(32))}
    save_titan(tmp_path / "short", model, spelling=1, moments=short, step=1, fused=True)
    with pytest.raises(MlmError, match=r"norm.weight.exp_avg has shape \[32\] but norm.weight has \[64\]"):
        import_torchtitan(tmp_path / "short", tmp_path / "ckpt", SETS)
    # a bytes entry holding a class: not unpickled
    import argparse

    extra = {"train_state": {"step": argparse.Namespace(step=1), "ntokens_seen": 64}}
    save_titan(tmp_path / "pickled", model, moments=moments, step=1, ntokens=64, extra=extra)
    with pytest.raises(
        MlmError,
        match=r"train_state.step not read: it names argparse.Namespace, a class outside plain values",
    ):
        import_torchtitan(tmp_path / "pickled", tmp_path / "ckpt", SETS)
    assert not (tmp_path / "ckpt").exists()
    # a model-only save in bf16 (torchtitan's export_dtype): imported as stored
    save_titan(tmp_path / "bf16", model.to(torch.bfloat16))
    report = import_torchtitan(tmp_path / "bf16", tmp_path / "ckpt", SETS)
    state = read_group(tmp_path / "ckpt")[0]
    assert report.dtype == "bfloat16" and torch.equal(
        state["layers.0.attn.v.weight"], model.state_dict()["model.layers.0.self_attn.v_proj.weight"]
    )


@pytest.fixture(scope="session")
def titan():
    """tests/helpers/titan_writer.py, where torchtitan is installed (session-scoped, so that a skip comes
    before the session's data fixtures are built)."""
    pytest.importorskip("torchtitan")
    from tests.helpers import titan_writer

    return titan_writer


@pytest.mark.slow
@pytest.mark.parametrize(
    "ranks, kv_heads, tied", [(1, None, False), (2, 4, True)], ids=["1-rank", "2-ranks-fsdp-gqa-tied"]
)
def test_checkpoint_of_torchtitan_trainer(
    titan, tmp_path, corpus_jsonl, hf_tokenizer_json, tiny_data, ranks, kv_heads, tied
):
    """torchtitan 0.3.0 trains its debugmodel 6 steps and checkpoints (tests/helpers/titan_writer.py): the
    import's logits are its model's, its step and scheduler position are torchtitan's, AdamW's
    moments are the checkpoint's (the fused wqkv's split by torchtitan's own code), and `mlm train`
    resumes from it."""
    from mlm.train.trainer import Trainer
    from tests.helpers.distributed import run_ranks

    tokens = (torch.arange(titan.SEQ) * 7 % 600).view(1, -1)  # within the tokenizer's 600
    out, tokenizer = tmp_path / "titan", hf_tokenizer_json.parent
    theirs = torch.from_numpy(
        run_ranks(ranks, titan.train, out, corpus_jsonl, tokenizer, kv_heads, tied, tokens)[0]
    )
    sets = [f"model.num_attention_heads={titan.HEADS}", f"model.rope.base={titan.THETA}"]
    import_torchtitan(out / "checkpoint", tmp_path / "ckpt", [*sets, f"data.seq_length={titan.SEQ}"])

    ours = checkpoint_logits(tmp_path / "ckpt", tokens)[..., : theirs.shape[-1]]
    # measured 1.4e-6 (1 rank), 1.9e-6 (2 ranks); max |logit| ≈ 6
    assert (ours - theirs).abs().max().item() <= TOL
    optim, manifest, it_dir = read_group(tmp_path / "ckpt", "optim")
    source = manifest["source"]
    assert it_dir.name == "iter_0000006" and source["lr_scheduler.last_epoch"] == source["train_state.step"]
    assert (manifest["iteration"], manifest["optimizer_step"], source["train_state.step"]) == (6, 6, 6)
    consumed = titan.STEPS * titan.BATCH * ranks  # ntokens_seen is per rank
    assert (source["dataloader.world_size"], manifest["consumed_samples"]) == (ranks, consumed)
    moments = titan.hf_moments(out / "checkpoint" / "step-6", kv_heads, tied)
    assert len(optim) == 2 * len(moments) == 2 * (2 + (not tied) + 9 * 6)
    assert config_from_dict(manifest["config"]).model.tie_embeddings is tied
    for k, (m, v) in moments.items():
        assert torch.equal(optim[f"exp_avg.{mlm_name(k)}"], m), k
        assert torch.equal(optim[f"exp_avg_sq.{mlm_name(k)}"], v), k

    batch = titan.BATCH * ranks
    run = [
        f"run_dir='{tmp_path / 'run'}'",
        f"data.data_path=['{tiny_data}']",  # token ids < 512 of the model's 2048
        f"train.micro_batch_size={titan.BATCH}",
        f"train.global_batch_size={batch}",
        "train.train_iters=7",
        "logging.tensorboard=false",
    ]
    trainer = Trainer(load_config(tmp_path / "ckpt" / "config.toml", run), load=str(tmp_path / "ckpt"))
    assert (trainer.iteration, trainer.optimizer_step, trainer.consumed_samples) == (6, 6, consumed)
    losses = trainer.train()
    assert len(losses) == 1 and 0 < losses[0] < 10
    assert (trainer.iteration, trainer.optimizer_step, trainer.consumed_samples) == (7, 7, consumed + batch)
