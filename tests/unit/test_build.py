"""`mlm data build`: tokens read back equal the tokenizer's output, for every input kind."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlm.data.build import BuildOptions, build_dataset
from mlm.datasets.indexed import IndexedDataset
from mlm.datasets.meta import read_meta
from mlm.tokenizer import load_tokenizer
from tests.helpers.common import write_jsonl

text_st = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=300)


def build(tmp_path, inputs, tokenizer, name="out", **kw):
    opts = BuildOptions(
        [str(i) for i in inputs], str(tmp_path / name), str(tokenizer), progress=False, overwrite=True, **kw
    )
    return build_dataset(opts), IndexedDataset(tmp_path / name)


def assert_round_trip(ds, tok, texts, append_eod):
    assert ds.num_documents == len(texts)
    for d, text in enumerate(texts):
        expect = tok.encode(text)
        if append_eod and expect:
            expect = expect + [tok.eod_id]
        assert ds.document(d).tolist() == expect, f"document {d}"


@pytest.fixture(params=["sp", "hf", "gpt2"])
def any_tokenizer(request, sp_model, hf_tokenizer_json, gpt2_files):
    return {"sp": sp_model, "hf": hf_tokenizer_json, "gpt2": gpt2_files / "vocab.json"}[request.param]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=st.lists(text_st, min_size=1, max_size=12), append_eod=st.booleans())
def test_round_trip_random_documents(tmp_path, any_tokenizer, texts, append_eod):
    write_jsonl(tmp_path / "in.jsonl", texts)
    tok = load_tokenizer(any_tokenizer)
    summary, ds = build(
        tmp_path, [tmp_path / "in.jsonl"], any_tokenizer, append_eod=append_eod, batch_bytes=200
    )
    assert_round_trip(ds, tok, texts, append_eod)
    assert summary.empty_documents == sum(1 for t in texts if not tok.encode(t))


def test_round_trip_huge_and_empty_documents(tmp_path, sp_model, sample_texts):
    huge = "".join(sample_texts[:30]) * 3  # several MB in one document
    texts = ["", huge, "", "x", huge[:1000]]
    write_jsonl(tmp_path / "in.jsonl", texts)
    summary, ds = build(tmp_path, [tmp_path / "in.jsonl"], sp_model, append_eod=True, batch_bytes=1 << 16)
    tok = load_tokenizer(sp_model)
    assert_round_trip(ds, tok, texts, append_eod=True)
    assert summary.empty_documents == 2
    # an empty document is a document entry with no sequence and no eod (Megatron's behaviour)
    assert np.diff(ds.document_indices).tolist() == [0, 1, 0, 1, 1]


def test_sentencepiece_eod_is_eos(sp_model):
    tok = load_tokenizer(sp_model)
    assert tok.eod_id == tok.sp.eos_id() == 2


def test_compressed_and_text_inputs(tmp_path, sp_model, sample_texts):
    texts = sample_texts[:6]
    lines = "".join(json.dumps({"content": t}) + "\n" for t in texts).encode()
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(lines))
    (tmp_path / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
    tok = load_tokenizer(sp_model)
    _, ds = build(tmp_path, [tmp_path / "a.jsonl.gz", tmp_path / "b.jsonl.zst"], sp_model, json_key="content")
    assert_round_trip(ds, tok, texts + texts, append_eod=False)

    (tmp_path / "one.txt").write_text(texts[0])
    (tmp_path / "two.txt").write_text(texts[1])
    _, ds = build(tmp_path, [tmp_path / "one.txt", tmp_path / "two.txt"], sp_model, name="files")
    assert_round_trip(ds, tok, texts[:2], append_eod=False)

    (tmp_path / "lines.txt").write_text("first line\nsecond line\n\nfourth\n")
    _, ds = build(tmp_path, [tmp_path / "lines.txt"], sp_model, name="lines", text_unit="line")
    assert_round_trip(ds, tok, ["first line", "second line", "", "fourth"], append_eod=False)


def test_meta_sidecar(tmp_path, sp_model, corpus_jsonl):
    summary, ds = build(tmp_path, [corpus_jsonl], sp_model, append_eod=True)
    meta = read_meta(tmp_path / "out")
    tok = meta["tokenizer"]
    assert tok["kind"] == "sentencepiece" and tok["vocab_size"] == 512 and tok["eod_id"] == 2
    assert len(tok["sha256"]) == 64
    assert meta["documents"] == ds.num_documents == summary.documents
    assert meta["tokens"] == ds.num_tokens and meta["dtype"] == "uint16"
    assert meta["sources"][0]["documents"] == ds.num_documents


def test_workers_do_not_change_the_output(tmp_path, sp_model, corpus_jsonl):
    build(tmp_path, [corpus_jsonl], sp_model, name="w1", workers=1, batch_bytes=5000)
    build(tmp_path, [corpus_jsonl], sp_model, name="w2", workers=2)
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"w1{ext}").read_bytes() == (tmp_path / f"w2{ext}").read_bytes()


def test_failure_leaves_no_output(tmp_path, sp_model, monkeypatch):
    """An error (or Ctrl-C) in the middle removes the temporaries and writes no real file."""
    write_jsonl(tmp_path / "in.jsonl", ["a b c"] * 200)
    from mlm.tokenizer import SentencePieceTokenizer

    calls = {"n": 0}
    original = SentencePieceTokenizer.encode_batch

    def interrupted(self, texts, num_threads=1):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return original(self, texts, num_threads)

    monkeypatch.setattr(SentencePieceTokenizer, "encode_batch", interrupted)
    with pytest.raises(KeyboardInterrupt):
        build(tmp_path, [tmp_path / "in.jsonl"], sp_model, batch_bytes=10)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]
