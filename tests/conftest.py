"""Shared fixtures: small tokenizers of each kind, trained once per test session."""

from __future__ import annotations

import os
from pathlib import Path

# Without an NVIDIA GPU, Triton kernels can only run interpreted, and Triton reads this when it is
# first imported, which any module may do (transformers, torch): set it before anything imports
# it, so that tests/unit/test_kernels.py runs in the whole suite (CI), not only on its own.
if not Path("/dev/nvidiactl").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# the helpers' plain asserts explain their failures as the test files' do
pytest.register_assert_rewrite("tests.helpers")

from mlm.data.build import BuildOptions, build_dataset  # noqa: E402
from mlm.data.corpus import stdlib_files  # noqa: E402
from tests.helpers.common import write_jsonl  # noqa: E402

SPECIAL = "<|endoftext|>"


@pytest.fixture(scope="session")
def sample_texts() -> list[str]:
    """A few real documents: the first stdlib sources, plus prose with non-ASCII text."""
    texts = [p.read_text(encoding="utf-8") for p in stdlib_files()[:40]]
    texts += ["Ünïcödé prose — with “quotes”, emoji 🎉 and 日本語.\n" * 3, "short", ""]
    return texts


@pytest.fixture(scope="session")
def corpus_jsonl(tmp_path_factory, sample_texts) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("corpus") / "corpus.jsonl", sample_texts)


@pytest.fixture(scope="session")
def sp_model(tmp_path_factory, corpus_jsonl) -> Path:
    from mlm.data.tokenizer_train import TokenizerTrainOptions, train_tokenizer

    out = tmp_path_factory.mktemp("sp") / "tok.model"
    train_tokenizer(TokenizerTrainOptions([str(corpus_jsonl)], str(out), vocab_size=512, progress=False))
    return out


@pytest.fixture(scope="session")
def hf_tokenizer_json(tmp_path_factory, sample_texts) -> Path:
    """A byte-level BPE tokenizer.json made by the Hugging Face tokenizers library."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=[SPECIAL], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(sample_texts, trainer)
    out = tmp_path_factory.mktemp("hf") / "tokenizer.json"
    tok.save(str(out))
    return out


@pytest.fixture(scope="session")
def gpt2_files(tmp_path_factory, sample_texts) -> Path:
    """GPT-2 style vocab.json + merges.txt in a folder."""
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(sample_texts, vocab_size=600, special_tokens=[SPECIAL])
    out = tmp_path_factory.mktemp("gpt2")
    tok.save_model(str(out))
    return out


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory, corpus_jsonl, sp_model) -> str:
    prefix = tmp_path_factory.mktemp("train_data") / "corpus"
    build_dataset(
        BuildOptions([str(corpus_jsonl)], str(prefix), str(sp_model), append_eod=True, progress=False)
    )
    return str(prefix)
