"""`mlm data build`: tokenize raw text into a Megatron indexed dataset.

Three stages overlap: a reader thread parses inputs into batches (in order), the calling
thread encodes each batch with the tokenizer's native threads (SentencePiece and HF
tokenizers release the GIL), and a writer thread turns ids into arrays and streams them to
`PREFIX.bin`. Queues are bounded, so memory stays a few batches whatever the input size.
Outputs are written under temporary names and renamed into place only when complete.

With `chat`, the documents are conversations (`mlm.data.conversations`): the calling thread
renders each with the chat template (one thread: the template keeps state while it renders),
and the writer streams a second dataset beside the tokens, `PREFIX_loss_mask`, uint8, 1 where
the token is the assistant's.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import operator
import queue
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mlm.chat import load_chat_template
from mlm.console import throughput_progress
from mlm.data.conversations import conversation_tokens, parse_conversation
from mlm.data.readers import BadInput, SourceStats, expand_inputs, input_format, iter_documents, iter_lines
from mlm.datasets.indexed import IndexedDatasetWriter, check_dtype_fits, data_paths, optimal_dtype
from mlm.datasets.meta import loss_mask_prefix, meta_path, new_meta
from mlm.errors import MlmError
from mlm.fileio import atomic_outputs, check_writable
from mlm.tokenizer import Tokenizer, load_tokenizer

_DONE = object()


@dataclass
class BuildOptions:
    """Everything `mlm data build` takes; see `mlm data build --help`."""

    inputs: list[str]
    output_prefix: str
    tokenizer: str
    merges: str | None = None
    eod_token: str | None = None
    json_key: str | None = None
    """None: "text", or with `chat` "messages" where a line has it, else "conversations"."""
    input_format: str = "auto"
    text_unit: str = "file"
    append_eod: bool = False
    workers: int = 2
    batch_bytes: int = 4 << 20
    dtype: str | None = None
    overwrite: bool = False
    skip_bad_lines: bool = False
    progress: bool = True
    chat: bool = False
    """Documents are conversations: tokens from the chat template, and a loss mask beside them."""
    chat_template: str | None = None
    """A Jinja file to use instead of the tokenizer's chat template."""
    seq_length: int | None = None
    """With `chat`: a conversation of more than seq_length + 1 tokens is a bad line."""

    def __post_init__(self):
        if self.input_format not in ("auto", "jsonl", "text"):
            raise MlmError(f"input_format={self.input_format!r}: must be auto, jsonl or text")
        if self.text_unit not in ("file", "line"):
            raise MlmError(f"text_unit={self.text_unit!r}: must be file (one document per file) or line")
        if self.workers < 1:
            raise MlmError(f"workers={self.workers}: must be at least 1")
        if self.seq_length is not None and self.seq_length < 1:
            raise MlmError(f"--seq-length {self.seq_length}: must be at least 1")
        if self.chat:
            self._check_chat()
            return
        if self.json_key is None:
            self.json_key = "text"
        for option, value in (("--chat-template", self.chat_template), ("--seq-length", self.seq_length)):
            if value is not None:
                raise MlmError(f"{option} {value}: only used with --chat; add --chat, or drop {option}")

    def _check_chat(self) -> None:
        if self.append_eod:
            raise MlmError(
                "--append-eod with --chat: the chat template writes its own end-of-turn tokens, so no "
                "eod is appended to a conversation; drop --append-eod"
            )
        if self.input_format == "text":
            raise MlmError(
                "--input-format text with --chat: conversations are read from JSONL, one per line; "
                "use --input-format jsonl (or auto)"
            )


@dataclass
class BuildSummary:
    prefix: str
    documents: int = 0
    empty_documents: int = 0
    tokens: int = 0
    input_bytes: int = 0
    seconds: float = 0.0
    dtype: str = ""
    sources: list[SourceStats] = field(default_factory=list)
    assistant_tokens: int | None = None
    """With --chat: the tokens the loss mask marks (None for a plain build)."""

    @property
    def skipped(self) -> Counter:
        total: Counter = Counter()
        for s in self.sources:
            total.update(s.skipped)
        return total


class _Pipe:
    """A bounded queue whose producer stops when the consumer has failed."""

    def __init__(self, stop: threading.Event, size: int = 4):
        self.q: queue.Queue = queue.Queue(size)
        self.stop = stop

    def put(self, item) -> bool:
        while not self.stop.is_set():
            try:
                self.q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def get(self):
        """The next item; re-raises a producer's error; `_DONE` once stopped."""
        while True:
            try:
                item = self.q.get(timeout=0.1)
                break
            except queue.Empty:
                if self.stop.is_set():
                    return _DONE
        if isinstance(item, BaseException):
            raise item
        return item


def _documents(path: Path, stats: SourceStats, opts: BuildOptions) -> Iterator[tuple[object, int]]:
    """(document, raw bytes consumed so far) of one input: texts, or with `chat` `Conversation`s."""
    if opts.chat:
        parse = functools.partial(parse_conversation, key=opts.json_key)
        return iter_lines(path, parse, opts.skip_bad_lines, stats)
    fmt = input_format(path, opts.input_format)
    return iter_documents(path, fmt, opts.json_key, opts.text_unit, opts.skip_bad_lines, stats)


def _read_batches(sources, opts: BuildOptions, out: _Pipe) -> None:
    """Reader thread: batches of (documents, bytes consumed since the last batch, their source's
    stats)."""
    chars = operator.attrgetter("chars") if opts.chat else len
    docs: list = []
    try:
        for path, stats in sources:
            size, last = 0, 0
            for doc, pos in _documents(path, stats, opts):
                docs.append(doc)
                size += chars(doc)
                if size >= opts.batch_bytes:
                    if not out.put((docs, pos - last, stats)):
                        return
                    docs, size, last = [], 0, pos
            if not out.put((docs, stats.bytes - last, stats)):
                return
            docs = []
        out.put(_DONE)
    except BaseException as e:  # hand the error to the consumer, which re-raises it
        if docs:  # after the documents before it: an error the consumer finds in them comes first
            out.put((docs, 0, stats))
        out.put(e)


def _encode_texts(
    tok: Tokenizer, workers: int, texts: list[str], _stats: SourceStats
) -> tuple[list[list[int]]]:
    """The calling thread's stage of a plain build: texts → (ids,)."""
    return (tok.encode_batch(texts, num_threads=workers),)


class _ChatEncoder:
    """The calling thread's stage with `chat`: conversations → (ids, masks). With --skip-bad-lines
    a bad one is left out, and counted in its source's stats by `count_skipped` once the reader
    (which counts documents meanwhile) is done."""

    def __init__(self, tok: Tokenizer, opts: BuildOptions):
        self.template = load_chat_template(tok, opts.chat_template)
        self.tok, self.seq_length, self.skip = tok, opts.seq_length, opts.skip_bad_lines
        self.skipped: list[tuple[SourceStats, str]] = []
        self.assistant_tokens = 0

    def __call__(self, conversations: list, stats: SourceStats) -> tuple[list, list]:
        ids, masks = [], []
        for c in conversations:
            try:
                tokens, mask = conversation_tokens(c, self.template, self.tok, self.seq_length)
            except BadInput as e:
                if not self.skip:
                    raise
                self.skipped.append((stats, e.reason))
                continue
            ids.append(tokens)
            masks.append(mask)
            self.assistant_tokens += sum(mask)
        return ids, masks

    def count_skipped(self) -> None:
        for stats, reason in self.skipped:
            stats.documents -= 1
            stats.skipped[reason] += 1

    def meta(self, prefix: str) -> dict:
        """The `chat` entry of PREFIX.json."""
        return {
            "loss_mask": Path(loss_mask_prefix(prefix)).name,
            "template": self.template.origin,
            "template_sha256": hashlib.sha256(self.template.source.encode()).hexdigest(),
            "marks_generation": self.template.marks_generation,
            "assistant_tokens": self.assistant_tokens,
        }


def _write_batches(writers: list[IndexedDatasetWriter], eod: int | None, inp: _Pipe, errors: list) -> None:
    """Writer thread: each batch's columns (ids, and with `chat` masks) → one array per writer,
    streamed to its .bin."""
    try:
        while (columns := inp.get()) is not _DONE:
            if eod is not None:
                for d in columns[0]:
                    if d:
                        d.append(eod)
            for writer, docs in zip(writers, columns, strict=True):
                lengths = np.fromiter(map(len, docs), np.int64, len(docs))
                total = int(lengths.sum())
                tokens = np.fromiter(itertools.chain.from_iterable(docs), writer.dtype, total)
                writer.add_documents(tokens, lengths)
    except BaseException as e:
        errors.append(e)
        inp.stop.set()


def _check_jsonl(paths: list[Path], requested: str) -> None:
    """With --chat: every input must be JSONL."""
    for p in paths:
        if input_format(p, requested) != "jsonl":
            raise MlmError(
                f"{p}: --chat reads JSONL conversations, and this file's name does not end in .jsonl, "
                ".json or .ndjson (optionally .gz or .zst); rename it, or pass --input-format jsonl"
            )


def _outputs(opts: BuildOptions) -> list[Path]:
    """The files a build writes, renamed into place in this order: tokens, (loss mask), meta."""
    masks = list(data_paths(loss_mask_prefix(opts.output_prefix))) if opts.chat else []
    return [*data_paths(opts.output_prefix), *masks, meta_path(opts.output_prefix)]


def build_dataset(opts: BuildOptions) -> BuildSummary:
    paths = expand_inputs(opts.inputs)
    tok = load_tokenizer(opts.tokenizer, opts.merges, opts.eod_token)
    if opts.append_eod and tok.eod_id is None:
        raise MlmError(f"{tok.path}: the tokenizer has no eod/eos token; name one with --eod-token")
    dtype = np.dtype(opts.dtype) if opts.dtype else optimal_dtype(tok.vocab_size)
    check_dtype_fits(dtype, tok.vocab_size)
    if opts.chat:
        _check_jsonl(paths, opts.input_format)
    chat = _ChatEncoder(tok, opts) if opts.chat else None
    encode = chat if chat else functools.partial(_encode_texts, tok, opts.workers)
    finals = _outputs(opts)
    check_writable(finals, opts.overwrite)

    sources = [(p, SourceStats(str(p), p.stat().st_size)) for p in paths]
    summary = BuildSummary(opts.output_prefix, dtype=dtype.name, sources=[s for _, s in sources])
    total_bytes = sum(s.bytes for _, s in sources)
    eod = tok.eod_id if opts.append_eod else None
    t0 = time.perf_counter()
    stop = threading.Event()
    errors: list[BaseException] = []
    with atomic_outputs(finals) as temps:
        *bins, tmp_meta = temps
        writers = [IndexedDatasetWriter(bins[0], bins[1], dtype)]
        if chat:
            writers.append(IndexedDatasetWriter(bins[2], bins[3], np.uint8))
        writer = writers[0]
        to_encode, to_write = _Pipe(stop), _Pipe(stop)
        reader = threading.Thread(target=_read_batches, args=(sources, opts, to_encode), daemon=True)
        writing = threading.Thread(target=_write_batches, args=(writers, eod, to_write, errors), daemon=True)
        reader.start()
        writing.start()
        try:
            with throughput_progress(opts.progress) as bar:
                task = bar.add_task(f"tokenizing {len(paths)} file(s)", total=total_bytes, docs=0, tokens=0)
                docs = tokens = 0
                while (item := to_encode.get()) is not _DONE:
                    batch, nbytes, stats = item
                    columns = encode(batch, stats)
                    docs += len(columns[0])
                    tokens += sum(map(len, columns[0]))
                    if not to_write.put(columns):
                        break
                    bar.update(task, advance=nbytes, docs=docs, tokens=tokens)
                to_write.put(_DONE)
                writing.join()
        finally:
            stop.set()
            for w in writers:
                w.close()
        if errors:
            raise errors[0]
        for w in writers:
            w.finalize()
        summary.documents = writer.num_documents
        summary.empty_documents = writer.num_empty_documents
        summary.tokens = writer.num_tokens
        summary.input_bytes = total_bytes
        summary.seconds = time.perf_counter() - t0
        extra = {}
        if chat:
            chat.count_skipped()
            summary.assistant_tokens = chat.assistant_tokens
            extra["chat"] = chat.meta(opts.output_prefix)
        meta = new_meta(
            tokenizer=tok.info().__dict__,
            dtype=dtype.name,
            append_eod=opts.append_eod,
            json_key=opts.json_key,
            documents=writer.num_documents,
            empty_documents=writer.num_empty_documents,
            sequences=writer.num_sequences,
            tokens=writer.num_tokens,
            sources=[s.as_json() for s in summary.sources],
            **extra,
        )
        Path(tmp_meta).write_text(json.dumps(meta, indent=2) + "\n")
    return summary
