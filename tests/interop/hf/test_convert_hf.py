"""`mlm convert from-hf` and `mlm export hf` against transformers itself: the folder formats and
the command line (the round trip of every architecture: tests/interop/hf/test_hf_adapters.py).

Tiny random Llama (GQA, Llama-3.1 RoPE scaling, tied and untied), GPT-2 and dense Qwen models from
tests/helpers/hf_models.py are saved with `save_pretrained` (single file, sharded, bf16) or as
`pytorch_model.bin` (single, sharded), imported, exported back (sharded or not), and must come
back bit for bit; the imported checkpoint's logits must match transformers' to 1e-5 in fp32;
`from_pretrained` must load the export; casts, tokenizer files, a failed verification, a trained
checkpoint and a training run from an import; bad input must give one message and exit code 2,
with no output left behind.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mlm.checkpoint import read_manifest, resolve_checkpoint  # noqa: E402
from mlm.config import load_config  # noqa: E402
from mlm.convert import hf as adapters  # noqa: E402
from mlm.convert.hf import folder as convert  # noqa: E402
from mlm.convert.hf import io as hf_io  # noqa: E402
from mlm.errors import MlmError  # noqa: E402
from mlm.units import parse_size  # noqa: E402
from tests.helpers.common import ROOT, assert_error, cli, mlm  # noqa: E402
from tests.helpers.hf_models import ARCHS, VOCAB, llama, mistral, read_folder  # noqa: E402

DROPPED = {"model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"}


def save_hf(model, path, fmt: str) -> None:
    """`single`: model.safetensors; `sharded`: several safetensors + index; `bin`: pytorch_model.bin;
    `bf16`: model.safetensors in bfloat16; `bin-sharded`: two .bin files + pytorch_model.bin.index.json."""
    if fmt == "bf16":
        model.to(torch.bfloat16)
    if fmt == "bin-sharded":
        path.mkdir(parents=True)
        model.config.save_pretrained(path)
        state = model.state_dict()
        keys = list(state)
        halves = {
            "pytorch_model-00001-of-00002.bin": keys[::2],
            "pytorch_model-00002-of-00002.bin": keys[1::2],
        }
        for file, part in halves.items():
            torch.save({k: state[k] for k in part}, path / file)
        weight_map = {k: file for file, part in halves.items() for k in part}
        index = {"metadata": {"total_size": sum(t.nbytes for t in state.values())}, "weight_map": weight_map}
        (path / hf_io.BIN_INDEX).write_text(json.dumps(index))
    elif fmt == "bin":
        path.mkdir(parents=True)
        model.config.save_pretrained(path)
        torch.save(model.state_dict(), path / "pytorch_model.bin")
    else:
        model.save_pretrained(path, max_shard_size="100KB" if fmt == "sharded" else "5GB")


@pytest.mark.parametrize(
    "name, fmt, shard",
    [
        ("llama", "sharded", "60KB"),
        ("llama", "bin", "5GB"),
        ("llama-tied", "single", "60KB"),
        ("llama-tied", "bf16", "5GB"),
        ("gpt2", "sharded", "60KB"),
        ("gpt2-untied", "bin", "5GB"),
        ("gpt2", "bin-sharded", "5GB"),
        ("qwen3", "sharded", "60KB"),
    ],
)
def test_round_trip_is_bitwise_and_verified(tmp_path, name, fmt, shard):
    model = ARCHS[name].build()
    save_hf(model, tmp_path / "hf", fmt)
    if fmt == "sharded":
        assert (tmp_path / "hf" / hf_io.SAFETENSORS_INDEX).is_file() and len(
            hf_io.weight_files(tmp_path / "hf")
        ) > 1

    imp = convert.import_hf(tmp_path / "hf", tmp_path / "ckpt")
    # (b) the imported checkpoint's logits are transformers' in fp32
    assert imp.max_abs_diff <= 1e-5 and imp.max_abs_logit > 1.0, imp
    it_dir = resolve_checkpoint(tmp_path / "ckpt")
    manifest = read_manifest(it_dir)
    assert it_dir.name == "iter_0000000" and {k.split("/")[0] for k in manifest["tensors"]} == {"model"}
    assert manifest["source"]["architecture"] == type(model).__name__
    cfg = load_config(tmp_path / "ckpt" / "config.toml")
    assert cfg.model == adapters.config_from_hf(model.config.to_dict()) and cfg.preset == ""
    assert manifest["config"]["model"] == json.loads(json.dumps(cfg.to_dict()["model"]))

    exp = convert.export_hf(tmp_path / "ckpt", tmp_path / "back", max_shard_size=shard)
    assert exp.max_abs_diff <= 1e-5 and exp.dtype == ("bfloat16" if fmt == "bf16" else "float32")
    sharded = shard != "5GB"
    assert (tmp_path / "back" / hf_io.SAFETENSORS_INDEX).is_file() == sharded
    assert (tmp_path / "back" / hf_io.SAFETENSORS).is_file() == (not sharded)

    # (a) bit for bit, same dtypes; the tied lm_head and RoPE buffers are left out as save_pretrained does
    src, back = read_folder(tmp_path / "hf"), read_folder(tmp_path / "back")
    dropped = DROPPED | ({"lm_head.weight"} if model.config.tie_word_embeddings else set())
    assert back.keys() == src.keys() - dropped
    for k, t in back.items():
        assert t.dtype == src[k].dtype and torch.equal(t, src[k]), k

    # (c) transformers loads the export as it is and computes what the original model does
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert {p.dtype for p in again.parameters()} == {p.dtype for p in model.parameters()}
    tokens = torch.randint(0, VOCAB, (1, 32), generator=torch.Generator().manual_seed(0))
    ref = ARCHS[name].build()  # the source weights, upcast (exactly) to fp32, with fp32 RoPE buffers
    ref.load_state_dict({k: v.float() for k, v in src.items()}, strict=False)
    with torch.no_grad():
        ours, theirs = again.float()(input_ids=tokens).logits, ref(input_ids=tokens).logits
    torch.testing.assert_close(ours, theirs)
    assert not list(tmp_path.glob("*.tmp-*"))


@pytest.mark.parametrize("dtype, torch_dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_export_casts_with_stated_tolerance(tmp_path, dtype, torch_dtype):
    save_hf(ARCHS["llama"].build(), tmp_path / "hf", "single")
    convert.import_hf(tmp_path / "hf", tmp_path / "ckpt", verify=False)
    r = convert.export_hf(tmp_path / "ckpt", tmp_path / "back", dtype=dtype)
    assert 0 < r.max_abs_diff <= r.tolerance == convert.TOLERANCE[torch_dtype] * r.max_abs_logit
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["torch_dtype"] == config["dtype"] == r.dtype == str(torch_dtype)[6:]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back")
    assert {p.dtype for p in hf.parameters()} == {torch_dtype}


def test_tokenizer_files_travel_and_generation_config(tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    save_hf(ARCHS["gpt2"].build(), tmp_path / "hf", "single")
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "a": 3}
    Tokenizer(WordLevel(vocab, unk_token="<unk>")).save(str(tmp_path / "hf" / "tokenizer.json"))
    tok_cfg = {"bos_token": "<s>", "eos_token": "</s>"}
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    r = convert.import_hf(tmp_path / "hf", tmp_path / "ckpt", verify=False)
    files = ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]
    assert r.tokenizer_files == files
    manifest = read_manifest(resolve_checkpoint(tmp_path / "ckpt"))
    assert manifest["tokenizer"] == {"path": "tokenizer", "files": files}
    assert all((tmp_path / "ckpt" / "tokenizer" / f).is_file() for f in files)
    assert manifest["config"]["data"]["tokenizer"] == str((tmp_path / "ckpt" / "tokenizer").resolve())
    # a generation_config.json alone travels, but names no tokenizer for mlm train to load
    (tmp_path / "gen").mkdir()
    for f in (tmp_path / "hf").iterdir():
        if f.name not in files[:2]:
            (tmp_path / "gen" / f.name).write_bytes(f.read_bytes())
    r = convert.import_hf(tmp_path / "gen", tmp_path / "gen-ckpt", verify=False)
    gen_manifest = read_manifest(resolve_checkpoint(tmp_path / "gen-ckpt"))
    assert (
        r.tokenizer_files == ["generation_config.json"] and gen_manifest["config"]["data"]["tokenizer"] == ""
    )

    convert.export_hf(tmp_path / "ckpt", tmp_path / "back", verify=False)
    for f in files:  # generation_config.json as the source had it
        assert (tmp_path / "back" / f).read_bytes() == (tmp_path / "hf" / f).read_bytes(), f
    # --tokenizer without a generation_config.json: bos/eos ids from the tokenizer
    (tmp_path / "tok").mkdir()
    for f in files[:2]:
        (tmp_path / "tok" / f).write_bytes((tmp_path / "hf" / f).read_bytes())
    convert.export_hf(tmp_path / "ckpt", tmp_path / "back2", tokenizer=tmp_path / "tok", verify=False)
    gen = json.loads((tmp_path / "back2" / "generation_config.json").read_text())
    assert gen == {"bos_token_id": 1, "eos_token_id": 2}
    # no tokenizer at all (neither copied files nor data.tokenizer): the fields are left out
    config = {**manifest["config"], "data": {**manifest["config"]["data"], "tokenizer": ""}}
    (tmp_path / "ckpt" / "iter_0000000" / "manifest.json").write_text(
        json.dumps({**manifest, "tokenizer": None, "config": config})
    )
    convert.export_hf(tmp_path / "ckpt", tmp_path / "back3", verify=False)
    assert json.loads((tmp_path / "back3" / "generation_config.json").read_text()) == {}


def test_parse_size():
    def size(text):
        return parse_size(text, "--max-shard-size")

    assert size("5GB") == 5 * 10**9 and size("500MB") == 5 * 10**8
    assert size("2GiB") == 2 * 2**30 and size("1000") == 1000
    for bad in ("", "5XB", "-1GB", "0"):
        with pytest.raises(MlmError, match="--max-shard-size"):
            size(bad)


def test_verification_failure_removes_output(tmp_path, monkeypatch, capsys):
    save_hf(ARCHS["llama"].build(), tmp_path / "hf", "single")
    real = adapters.iter_hf_to_mlm

    def broken(*args, passthrough=None, **kwargs):  # a conversion bug: one (square) weight transposed
        for key, t in real(*args, **kwargs):  # (every tensor read: none copied as it is)
            yield key, t.t().contiguous() if key == "layers.1.attn.out.weight" else t

    monkeypatch.setattr(adapters, "iter_hf_to_mlm", broken)
    r = cli(monkeypatch, capsys, "convert", "from-hf", tmp_path / "hf", tmp_path / "ckpt")
    assert_error(r, "verification failed", "above the float32 tolerance", "the output was removed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # neither OUT nor its temporary
    with pytest.raises(MlmError, match=r"verification failed: .* the output was removed"):
        convert.import_hf(tmp_path / "hf", tmp_path / "ckpt")
    monkeypatch.setattr(adapters, "iter_hf_to_mlm", real)
    convert.import_hf(tmp_path / "hf", tmp_path / "ckpt", verify=False)

    real_export = adapters.mlm_to_hf

    def broken_export(*args, **kwargs):  # a conversion bug on the way out: two layers swapped
        state, config = real_export(*args, **kwargs)
        a, b = "model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight"
        state[a], state[b] = state[b], state[a]
        return state, config

    monkeypatch.setattr(adapters, "mlm_to_hf", broken_export)
    with pytest.raises(MlmError, match="verification failed"):
        convert.export_hf(tmp_path / "ckpt", tmp_path / "back")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "hf"]
    convert.export_hf(tmp_path / "ckpt", tmp_path / "back", verify=False)  # --no-verify keeps it
    assert (tmp_path / "back" / "model.safetensors").is_file()


# ---------------------------------------------------------------- the CLI and bad input


def test_cli_in_a_new_process_exports_bf16_shards(tmp_path, monkeypatch, capsys):
    """The commands as a user runs them (the round trip of every architecture, in this process:
    test_hf_adapters.py's test_cli_round_trip), with --dtype and --max-shard-size, and their bad values."""
    save_hf(ARCHS["llama-tied"].build(), tmp_path / "hf", "single")
    r = mlm("convert", "from-hf", tmp_path / "hf", tmp_path / "ckpt")
    assert r.returncode == 0, r.stderr
    assert "imported LlamaForCausalLM" in r.stderr and "logits verified: max |diff|" in r.stderr
    r = mlm(
        "export",
        "hf",
        tmp_path / "ckpt",
        tmp_path / "back",
        "--dtype",
        "bf16",
        "--max-shard-size",
        "50KB",
    )
    assert r.returncode == 0, r.stderr
    assert "exported LlamaForCausalLM" in r.stderr and "bfloat16" in r.stderr and "GB/s" in r.stderr
    assert (tmp_path / "back" / hf_io.SAFETENSORS_INDEX).is_file()
    run = lambda *args: cli(monkeypatch, capsys, "export", "hf", *args)  # noqa: E731
    assert_error(run(tmp_path / "ckpt", tmp_path / "back"), "already exists", "rm -r")
    assert_error(run(tmp_path / "ckpt", tmp_path / "x", "--dtype", "int8"), "fp32, bf16, fp16")
    assert_error(run(tmp_path / "ckpt", tmp_path / "x", "--max-shard-size", "5XB"), "5GB, 500MB")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    "old, new",
    [
        (["convert", "--from-hf", "A", "B"], "mlm convert --from-hf is now: mlm convert from-hf A B"),
        (["convert", "A", "--to-hf", "B", "--dtype", "bf16"], "is now: mlm export hf A B --dtype bf16"),
        (["convert", "--from-megatron", "A", "B"], "is now: mlm convert from-megatron A B"),
        (["convert", "--from-dcp", "A", "B"], "is now: mlm convert from-torchtitan A B"),
        (["convert", "A", "--to-megatron", "B"], "is now: mlm export megatron A B"),
        (["convert", "A", "B", "--tp", "2"], "(a reshard) is now: mlm convert reshard A B --tp 2"),
        (["export", "trtllm", "--from-trtllm", "A", "B"], "is now: mlm convert from-trtllm A B"),
    ],
)
def test_old_command_forms_name_the_new_command(monkeypatch, capsys, old, new):
    """The forms from before the subcommands stop with one line (exit 2) naming the command to run."""
    r = cli(monkeypatch, capsys, *old)
    assert_error(r, new)
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_cli_help_lists_the_subcommands_without_importing_torch():
    r = mlm("convert", "--help")
    commands = r.stdout.split("Commands:")[1].split()
    assert r.returncode == 0 and {"reshard", "from-hf", "from-megatron", "from-torchtitan"} <= set(commands)
    r = mlm("export", "--help")
    assert r.returncode == 0 and {"hf", "megatron", "trtllm"} <= set(r.stdout.split("Commands:")[1].split())
    r = mlm("convert", "reshard", "--help")  # each subcommand's own options only
    assert "--tp" in r.stdout and "--consolidate" in r.stdout and "--weights-only" not in r.stdout
    r = mlm("export", "hf", "--help")
    assert "--max-shard-size" in r.stdout and "--tp" not in r.stdout
    code = "import sys\nfrom cli.main import app\ntry:\n    app(['convert', '--help'])\nexcept SystemExit:\n    pass\n"
    code += "print('torch' in sys.modules)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT).stdout
    assert out.strip().splitlines()[-1] == "False"


def test_unknown_architecture(tmp_path, monkeypatch, capsys):
    (tmp_path / "hf").mkdir()
    config = {"architectures": ["MambaForCausalLM"], "model_type": "mamba", "vocab_size": 10}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    r = cli(monkeypatch, capsys, "convert", "from-hf", tmp_path / "hf", tmp_path / "out")
    assert_error(r, "'MambaForCausalLM'", "not supported", "LlamaForCausalLM", "GPT2LMHeadModel")
    assert not (tmp_path / "out").exists()


def test_missing_shard_and_missing_weights(tmp_path, monkeypatch, capsys):
    run = lambda *args: cli(monkeypatch, capsys, "convert", "from-hf", *args)  # noqa: E731
    save_hf(ARCHS["gpt2"].build(), tmp_path / "hf", "sharded")
    shards = hf_io.weight_files(tmp_path / "hf")
    shards[1].unlink()
    r = run(tmp_path / "hf", tmp_path / "out")
    assert_error(r, hf_io.SAFETENSORS_INDEX, f"missing from {tmp_path / 'hf'}: {shards[1].name}")
    for p in [*shards, tmp_path / "hf" / hf_io.SAFETENSORS_INDEX]:
        p.unlink(missing_ok=True)
    assert_error(run(tmp_path / "hf", tmp_path / "out"), "no weights found")
    assert_error(run(tmp_path / "nowhere", tmp_path / "out"), "no such directory")
    assert not (tmp_path / "out").exists()


def test_out_exists(tmp_path, monkeypatch, capsys):
    save_hf(ARCHS["gpt2"].build(), tmp_path / "hf", "single")
    (tmp_path / "out").mkdir()
    r = cli(monkeypatch, capsys, "convert", "from-hf", tmp_path / "hf", tmp_path / "out")
    assert_error(r, "already exists")
    assert list((tmp_path / "out").iterdir()) == []


def test_mistral_sliding_window_is_refused(tmp_path):
    save_hf(mistral(64), tmp_path / "hf", "single")
    with pytest.raises(
        MlmError, match=r"sliding_window=64 < max_position_embeddings=128: mlm has no sliding"
    ):
        convert.import_hf(tmp_path / "hf", tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def test_export_of_a_trained_checkpoint(tmp_path):
    """A checkpoint as `mlm train` writes it (model and optim groups, the trainer's extra keys, the
    vocabulary padded for tp = 2) exports and loads in transformers with the same logits."""
    from mlm.checkpoint import ShardedTensor, save_checkpoint
    from mlm.config import Config, ModelConfig
    from mlm.model.gpt import GPT

    model_cfg = ModelConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=300
    )
    cfg = Config(model=model_cfg)
    model = GPT(model_cfg, model_cfg.padded_vocab_size(tp=2))
    model.init_weights(seed=5)
    params = dict(model.named_parameters())
    groups = {
        "model": [ShardedTensor.full(k, v.detach()) for k, v in params.items()],
        "optim": [ShardedTensor.full(f"exp_avg.{k}", torch.zeros_like(v)) for k, v in params.items()],
    }
    extra = {"config": cfg.to_dict(), "mesh": {"tp": 2}, "consumed_samples": 8, "optimizer_step": 3}
    save_checkpoint(tmp_path / "run", 3, groups, extra)
    r = convert.export_hf(tmp_path / "run" / "iter_0000003", tmp_path / "hf")
    assert r.architecture == "LlamaForCausalLM" and r.max_abs_diff <= 1e-5 and r.tensors == len(params)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokens = torch.randint(0, 300, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(
            hf(input_ids=tokens).logits, model.eval()(tokens)[..., :300], atol=1e-5, rtol=0
        )


def test_training_starts_from_an_import(tmp_path, tiny_data):
    """The import's config.toml and weights start `mlm train` (a weights-only checkpoint: a new
    run from those weights), whose logits are then transformers'."""
    from mlm.train.trainer import Trainer

    model = llama(tie=False, vocab_size=512)  # the tiny dataset's SentencePiece vocabulary
    model.save_pretrained(tmp_path / "hf")
    convert.import_hf(tmp_path / "hf", tmp_path / "ckpt")
    sets = [
        f"run_dir='{tmp_path / 'run'}'",
        f"data.data_path=['{tiny_data}']",
        "data.seq_length=32",
        "train.micro_batch_size=2",
        "train.global_batch_size=2",
        "train.train_iters=2",
        "logging.tensorboard=false",
    ]
    trainer = Trainer(load_config(tmp_path / "ckpt" / "config.toml", sets), load=str(tmp_path / "ckpt"))
    tokens = torch.arange(32).view(1, 32) * 13 % 512
    with torch.no_grad():
        theirs = model(input_ids=tokens).logits
    torch.testing.assert_close(trainer.pipeline.logits(tokens)[..., :512], theirs, rtol=1e-5, atol=1e-5)
    losses = trainer.train()
    assert trainer.iteration == 2 and len(losses) == 2 and all(0 < x < 10 for x in losses)
