"""A checkpoint's tokenizer is its own copy, in its folder (issue 36, item 4): `mlm export hf`
copied whatever file a manifest named (`/home/u/credentials.json`, `../../dir`) into OUT as
`tokenizer.json`. Now export reads the checkpoint's `tokenizer/` folder or what `--tokenizer`
names, nothing else; `mlm train` keeps a copy of the run's tokenizer there, and resharding carries
it. Canary: the outside file's bytes appear nowhere in OUT."""

import json

import pytest

from mlm.checkpoint.manager import keep_tokenizer, save_streaming
from mlm.config import load_config
from mlm.convert.hf.folder import export_hf
from mlm.convert.reshard import reshard
from mlm.errors import MlmError
from mlm.model.gpt import GPT

SETS = ["preset=tiny-llama", "model.num_layers=1", "model.hidden_size=32", "model.num_attention_heads=2"]
SETS += ["model.vocab_size=64", "data.seq_length=16"]
SECRET = b'{"aws_secret_access_key": "canary-7f3a"}'


def _checkpoint(root, tokenizer=None, record=None):
    config = load_config(None, [*SETS, f"data.tokenizer={tokenizer or ''}"])
    state = GPT(config.model).state_dict()
    tensors = (("model", k, t, tuple(t.shape)) for k, t in state.items())
    extra = {"config": config.to_dict(), "tokenizer": record}
    return save_streaming(root, 1, tensors, extra, ["model"])


def _leaked(out) -> bool:
    return out.exists() and any(SECRET in p.read_bytes() for p in out.rglob("*") if p.is_file())


@pytest.fixture
def secret(tmp_path):
    path = tmp_path / "home" / "credentials.json"
    path.parent.mkdir()
    path.write_bytes(SECRET)
    return path


def test_a_run_tokenizer_outside_the_checkpoint_is_not_read_unless_named(tmp_path, secret, hf_tokenizer_json):
    _checkpoint(tmp_path / "ckpt", tokenizer=secret)
    with pytest.raises(
        MlmError, match=rf"read it from {secret}, outside the checkpoint.*pass --tokenizer PATH"
    ):
        export_hf(tmp_path / "ckpt", tmp_path / "out", verify=False)
    assert not (tmp_path / "out").exists()
    report = export_hf(
        tmp_path / "ckpt", tmp_path / "named", tokenizer=hf_tokenizer_json.parent, verify=False
    )
    assert "tokenizer.json" in report.tokenizer_files and not _leaked(tmp_path / "named")


@pytest.mark.parametrize("path", ["../home", "/abs/dir", "tokenizer/..", None])
def test_a_tokenizer_record_naming_another_folder_is_refused(tmp_path, secret, path):
    record = {"path": str(secret.parent) if path == "/abs/dir" else path, "files": ["tokenizer.json"]}
    _checkpoint(tmp_path / "ckpt", record=record)
    with pytest.raises(
        MlmError, match=r"manifest\.json: the tokenizer record .* does not name the checkpoint's own"
    ):
        export_hf(tmp_path / "ckpt", tmp_path / "out", verify=False)
    assert not _leaked(tmp_path / "out") and not (tmp_path / "out").exists()


def test_a_tokenizer_folder_linking_out_is_refused(tmp_path, secret):
    (secret.parent / "tokenizer.json").write_bytes(SECRET)
    _checkpoint(tmp_path / "ckpt", record={"path": "tokenizer", "files": ["tokenizer.json"]})
    (tmp_path / "ckpt" / "tokenizer").symlink_to(secret.parent)
    for run in (
        lambda: export_hf(tmp_path / "ckpt", tmp_path / "out", verify=False),
        lambda: reshard(tmp_path / "ckpt", tmp_path / "out", tp=1, pp=1, verify=False),
    ):
        with pytest.raises(MlmError, match=r"or that folder links out of it"):
            run()
        assert not (tmp_path / "out").exists()


def test_training_keeps_a_copy_that_export_and_reshard_carry(tmp_path, hf_tokenizer_json, secret):
    root = tmp_path / "ckpt"
    root.mkdir()
    record = keep_tokenizer(root, hf_tokenizer_json)
    assert record == {"path": "tokenizer", "files": ["tokenizer.json"]}
    assert keep_tokenizer(root, secret) == record  # copied once: a later save keeps the first copy
    # the run's data.tokenizer is outside, but the checkpoint's own copy is what export reads
    _checkpoint(root, tokenizer=secret, record=record)
    report = export_hf(root, tmp_path / "hf", verify=False)
    assert report.tokenizer_files == ["tokenizer.json"] and not _leaked(tmp_path / "hf")
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == hf_tokenizer_json.read_bytes()
    reshard(root, tmp_path / "resharded", tp=1, pp=1, verify=False)
    assert (
        tmp_path / "resharded" / "tokenizer" / "tokenizer.json"
    ).read_bytes() == hf_tokenizer_json.read_bytes()
    manifest = json.loads((tmp_path / "resharded" / "iter_0000001" / "manifest.json").read_text())
    assert manifest["tokenizer"] == record
