"""`mlm data tokenizer train`: a SentencePiece BPE or unigram model from JSONL or text.

Documents are cut into chunks of whole lines (newlines kept, so code and prose keep their
layout) and SentencePiece samples at most `max_sentences` of them. Normalisation is the
identity and whitespace is kept, so decode(encode(text)) == text; byte fallback covers
any character outside the vocabulary. Ids: unk 0, bos 1, eos 2 (eos is the eod), then the
user-defined special tokens.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from mlm.console import throughput_progress
from mlm.data.readers import SourceStats, expand_inputs, input_format, iter_documents
from mlm.errors import MlmError
from mlm.fileio import atomic_outputs, check_writable

CHUNK_BYTES = 2048  # below SentencePiece's max_sentence_length (4192 bytes)


@dataclass
class TokenizerTrainOptions:
    inputs: list[str]
    output: str
    vocab_size: int = 8000
    model_type: str = "bpe"
    byte_fallback: bool = True
    special_tokens: list[str] = field(default_factory=lambda: ["<|eod|>"])
    json_key: str = "text"
    input_format: str = "auto"
    text_unit: str = "file"
    max_sentences: int = 1_000_000
    character_coverage: float = 0.9995
    threads: int = 2
    seed: int = 1234
    overwrite: bool = False
    progress: bool = True

    def __post_init__(self):
        if self.model_type not in ("bpe", "unigram"):
            raise MlmError(f"model_type={self.model_type!r}: must be bpe or unigram")
        if self.vocab_size < 64:
            raise MlmError(f"vocab_size={self.vocab_size}: must be at least 64")
        if not self.output.endswith(".model"):
            raise MlmError(f"output={self.output!r}: a SentencePiece model file must end in .model")


def _chunks(text: str) -> Iterator[str]:
    """Whole lines grouped into pieces of at most CHUNK_BYTES (longer lines are cut)."""
    buf, size = [], 0
    for line in text.splitlines(keepends=True):
        n = len(line.encode("utf-8"))
        if size + n > CHUNK_BYTES and buf:
            yield "".join(buf)
            buf, size = [], 0
        while n > CHUNK_BYTES:
            yield line[: CHUNK_BYTES // 4]
            line = line[CHUNK_BYTES // 4 :]
            n = len(line.encode("utf-8"))
        buf.append(line)
        size += n
    if buf:
        yield "".join(buf)


def train_tokenizer(opts: TokenizerTrainOptions) -> dict:
    import sentencepiece as spm

    paths = expand_inputs(opts.inputs)
    out = Path(opts.output)
    check_writable([out], opts.overwrite)
    sources = [SourceStats(str(p), p.stat().st_size) for p in paths]
    counts = {"documents": 0, "chunks": 0}

    def sentences(bar, task) -> Iterator[str]:
        done = 0
        for path, stats in zip(paths, sources, strict=True):
            fmt = input_format(path, opts.input_format)
            for text, pos in iter_documents(path, fmt, opts.json_key, opts.text_unit, False, stats):
                counts["documents"] += 1
                for c in _chunks(text):
                    if c.strip():
                        counts["chunks"] += 1
                        yield c
                bar.update(task, completed=done + pos, docs=counts["documents"])
            done += stats.bytes
        bar.update(task, description=f"training {opts.model_type} (vocab {opts.vocab_size})")

    spm.set_random_generator_seed(opts.seed)
    model = io.BytesIO()
    with throughput_progress(opts.progress) as bar:
        task = bar.add_task("reading", total=sum(s.bytes for s in sources), docs=0)
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=sentences(bar, task),
                model_writer=model,
                vocab_size=opts.vocab_size,
                model_type=opts.model_type,
                byte_fallback=opts.byte_fallback,
                user_defined_symbols=opts.special_tokens,
                character_coverage=opts.character_coverage,
                input_sentence_size=opts.max_sentences,
                shuffle_input_sentence=True,
                normalization_rule_name="identity",
                remove_extra_whitespaces=False,
                add_dummy_prefix=False,
                allow_whitespace_only_pieces=True,
                split_digits=True,
                max_sentence_length=4 * CHUNK_BYTES,
                num_threads=opts.threads,
                hard_vocab_limit=False,
                minloglevel=2,
            )
        except RuntimeError as e:
            raise MlmError(f"SentencePiece could not train on {len(paths)} file(s): {e}") from None
    with atomic_outputs([out]) as (tmp,):
        tmp.write_bytes(model.getvalue())
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    return {"output": str(out), "vocab_size": sp.vocab_size(), **counts}
