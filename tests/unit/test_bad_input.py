"""Bad input: one clear message naming file and line, exit code 2, and no output left behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.common import assert_error, mlm


def build(tmp_path, tokenizer, *extra, name="in.jsonl"):
    return mlm(
        "data",
        "build",
        "-i",
        tmp_path / name,
        "-o",
        tmp_path / "out",
        "-t",
        tokenizer,
        "--no-progress",
        *extra,
    )


def assert_no_output(tmp_path):
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("out")]


def test_malformed_json_line(tmp_path, sp_model):
    (tmp_path / "in.jsonl").write_text('{"text": "a"}\n{"text": "b"}\n{"text": "c",,}\n')
    r = build(tmp_path, sp_model)
    assert_error(r, "in.jsonl:3: not valid JSON", "--skip-bad-lines")
    assert_no_output(tmp_path)


def test_missing_key(tmp_path, sp_model):
    (tmp_path / "in.jsonl").write_text('{"text": "a"}\n{"content": "b"}\n')
    assert_error(build(tmp_path, sp_model), "in.jsonl:2: no key 'text' (keys: content)", "--json-key")
    assert_no_output(tmp_path)


def test_non_utf8_bytes(tmp_path, sp_model):
    (tmp_path / "in.jsonl").write_bytes(b'{"text": "a"}\n{"text": "caf\xe9"}\n')
    assert_error(build(tmp_path, sp_model), "in.jsonl:2: not valid UTF-8 (byte 0xe9")
    assert_no_output(tmp_path)


def test_skip_bad_lines_counts_and_reports(tmp_path, sp_model):
    (tmp_path / "in.jsonl").write_bytes(
        b'{"text": "a"}\n{"text": \n{"x": 1}\n{"text": "\xff"}\n{"text": "ok"}\n'
    )
    r = build(tmp_path, sp_model, "--skip-bad-lines")
    assert r.returncode == 0, r.stderr
    err = " ".join(r.stderr.split())
    for reason in ("skipped: bad JSON │ 1", "skipped: missing key │ 1", "skipped: not UTF-8 │ 1"):
        assert reason in err, err
    from mlm.datasets.indexed import IndexedDataset

    assert IndexedDataset(tmp_path / "out").num_documents == 2


@pytest.mark.parametrize(
    "name,content,message",
    [
        ("tok.model", b"this is not a model", "tok.model: not a SentencePiece model"),
        ("tokenizer.json", b'{"not": "a tokenizer"}', "tokenizer.json: not a Hugging Face tokenizer.json"),
    ],
)
def test_tokenizer_file_that_is_not_one(tmp_path, name, content, message):
    (tmp_path / "in.jsonl").write_text('{"text": "a"}\n')
    (tmp_path / name).write_bytes(content)
    assert_error(build(tmp_path, tmp_path / name), message)
    assert_no_output(tmp_path)


def test_output_exists_needs_overwrite(tmp_path, sp_model):
    (tmp_path / "in.jsonl").write_text('{"text": "a"}\n')
    assert build(tmp_path, sp_model).returncode == 0
    before = (tmp_path / "out.bin").read_bytes()
    assert_error(build(tmp_path, sp_model), "output already exists", "--overwrite")
    assert (tmp_path / "out.bin").read_bytes() == before
    assert build(tmp_path, sp_model, "--overwrite").returncode == 0


def test_vocab_too_large_for_dtype(tmp_path):
    from tokenizers import Tokenizer, models

    vocab = {f"w{i}": i for i in range(70_000)}
    vocab["[UNK]"] = 70_000
    Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "in.jsonl").write_text('{"text": "w1"}\n')
    assert_error(
        build(tmp_path, tmp_path / "tokenizer.json", "--dtype", "uint16"),
        "vocab size 70001 does not fit dtype uint16",
        "--dtype int32",
    )
    assert_no_output(tmp_path)
    # left to choose, the dtype is int32 (Megatron: uint16 only below 65500)
    assert build(tmp_path, tmp_path / "tokenizer.json").returncode == 0
    from mlm.datasets.indexed import IndexedDataset

    assert IndexedDataset(tmp_path / "out").dtype.name == "int32"


def test_missing_input_and_tokenizer(tmp_path, sp_model):
    assert_error(build(tmp_path, sp_model, name="nope.jsonl"), "input not found")
    (tmp_path / "in.jsonl").write_text('{"text": "a"}\n')
    assert_error(build(tmp_path, tmp_path / "none.model"), "tokenizer not found")


def test_truncated_compressed_input(tmp_path, sp_model):
    import gzip

    data = gzip.compress(b'{"text": "a"}\n' * 1000)
    (tmp_path / "in.jsonl.gz").write_bytes(data[: len(data) // 2])
    assert_error(build(tmp_path, sp_model, name="in.jsonl.gz"), "in.jsonl.gz: cannot read")
    assert_no_output(tmp_path)


@pytest.mark.parametrize("code", ["EROFS", "EACCES"])
def test_output_folder_that_cannot_be_written(tmp_path, sp_model, corpus_jsonl, monkeypatch, code):
    """`mlm data build` into a read-only or unwritable folder (simulated: every write and every
    removal under it fails, as on a read-only mount; root ignores mode 555): one MlmError line naming
    the folder, not open()'s traceback and then the cleanup's."""
    import builtins
    import errno
    import os

    from mlm.data.build import BuildOptions, build_dataset
    from mlm.errors import MlmError

    out = tmp_path / "ro"
    out.mkdir()
    err = getattr(errno, code)
    real_open, real_unlink = builtins.open, Path.unlink

    def denied(path):
        return OSError(err, os.strerror(err), str(path))

    def guarded_open(file, mode="r", *args, **kwargs):
        if str(file).startswith(str(out)) and any(m in mode for m in "wax+"):
            raise denied(file)
        return real_open(file, mode, *args, **kwargs)

    def guarded_unlink(self, missing_ok=False):
        if str(self).startswith(str(out)):
            raise denied(self)
        return real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(builtins, "open", guarded_open)
    monkeypatch.setattr(Path, "unlink", guarded_unlink)
    opts = BuildOptions([str(corpus_jsonl)], str(out / "data"), str(sp_model), progress=False)
    with pytest.raises(MlmError) as e:
        build_dataset(opts)
    msg = str(e.value)
    assert msg.startswith(f"cannot write in {out}: {os.strerror(err)}") and "\n" not in msg, msg
    assert e.value.__cause__ is None and e.value.__context__ is not None  # raised from the write error
    monkeypatch.undo()
    assert list(out.iterdir()) == []


def test_output_folder_without_permission_by_the_cli(tmp_path, sp_model):
    """The same through the CLI with a real mode-555 folder: exit 2, one line, nothing written
    (skipped as root, whom mode bits do not stop)."""
    import os

    if os.geteuid() == 0:
        pytest.skip("root writes through mode 555")
    (tmp_path / "in.jsonl").write_text('{"text": "hello"}\n')
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o555)
    r = mlm("data", "build", "-i", tmp_path / "in.jsonl", "-o", ro / "out", "-t", sp_model, "--no-progress")
    assert_error(r, f"cannot write in {ro}")
    assert list(ro.iterdir()) == []
