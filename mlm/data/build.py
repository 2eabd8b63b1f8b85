"""`mlm data build`: tokenize raw text into a Megatron indexed dataset.

Three stages overlap: a reader thread parses inputs into batches (in order), the calling
thread encodes each batch with the tokenizer's native threads (SentencePiece and HF
tokenizers release the GIL), and a writer thread turns ids into arrays and streams them to
`PREFIX.bin`. Queues are bounded, so memory stays a few batches whatever the input size.
Outputs are written under temporary names and renamed into place only when complete.
"""

from __future__ import annotations

import itertools
import json
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mlm.console import throughput_progress
from mlm.data.readers import SourceStats, expand_inputs, input_format, iter_documents
from mlm.datasets.indexed import IndexedDatasetWriter, check_dtype_fits, data_paths, optimal_dtype
from mlm.datasets.meta import meta_path, new_meta
from mlm.errors import MlmError
from mlm.fileio import atomic_outputs, check_writable
from mlm.tokenizer import load_tokenizer

_DONE = object()


@dataclass
class BuildOptions:
    """Everything `mlm data build` takes; see `mlm data build --help`."""

    inputs: list[str]
    output_prefix: str
    tokenizer: str
    merges: str | None = None
    eod_token: str | None = None
    json_key: str = "text"
    input_format: str = "auto"
    text_unit: str = "file"
    append_eod: bool = False
    workers: int = 2
    batch_bytes: int = 4 << 20
    dtype: str | None = None
    overwrite: bool = False
    skip_bad_lines: bool = False
    progress: bool = True

    def __post_init__(self):
        if self.input_format not in ("auto", "jsonl", "text"):
            raise MlmError(f"input_format={self.input_format!r}: must be auto, jsonl or text")
        if self.text_unit not in ("file", "line"):
            raise MlmError(f"text_unit={self.text_unit!r}: must be file (one document per file) or line")
        if self.workers < 1:
            raise MlmError(f"workers={self.workers}: must be at least 1")


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


def _read_batches(sources, opts: BuildOptions, out: _Pipe) -> None:
    """Reader thread: batches of (texts, bytes consumed since the last batch)."""
    try:
        for path, stats in sources:
            fmt = input_format(path, opts.input_format)
            texts: list[str] = []
            size, last = 0, 0
            for text, pos in iter_documents(
                path, fmt, opts.json_key, opts.text_unit, opts.skip_bad_lines, stats
            ):
                texts.append(text)
                size += len(text)
                if size >= opts.batch_bytes:
                    if not out.put((texts, pos - last)):
                        return
                    texts, size, last = [], 0, pos
            if not out.put((texts, stats.bytes - last)):
                return
        out.put(_DONE)
    except BaseException as e:  # hand the error to the consumer, which re-raises it
        out.put(e)


def _write_batches(writer: IndexedDatasetWriter, eod: int | None, inp: _Pipe, errors: list) -> None:
    """Writer thread: ids → one array per batch, streamed to the .bin."""
    try:
        while (ids := inp.get()) is not _DONE:
            if eod is not None:
                for d in ids:
                    if d:
                        d.append(eod)
            lengths = np.fromiter(map(len, ids), np.int64, len(ids))
            total = int(lengths.sum())
            tokens = np.fromiter(itertools.chain.from_iterable(ids), writer.dtype, total)
            writer.add_documents(tokens, lengths)
    except BaseException as e:
        errors.append(e)
        inp.stop.set()


def build_dataset(opts: BuildOptions) -> BuildSummary:
    paths = expand_inputs(opts.inputs)
    tok = load_tokenizer(opts.tokenizer, opts.merges, opts.eod_token)
    if opts.append_eod and tok.eod_id is None:
        raise MlmError(f"{tok.path}: the tokenizer has no eod/eos token; name one with --eod-token")
    dtype = np.dtype(opts.dtype) if opts.dtype else optimal_dtype(tok.vocab_size)
    check_dtype_fits(dtype, tok.vocab_size)
    bin_path, idx_path = data_paths(opts.output_prefix)
    finals = [bin_path, idx_path, meta_path(opts.output_prefix)]
    check_writable(finals, opts.overwrite)

    sources = [(p, SourceStats(str(p), p.stat().st_size)) for p in paths]
    summary = BuildSummary(opts.output_prefix, dtype=dtype.name, sources=[s for _, s in sources])
    total_bytes = sum(s.bytes for _, s in sources)
    eod = tok.eod_id if opts.append_eod else None
    t0 = time.perf_counter()
    stop = threading.Event()
    errors: list[BaseException] = []
    with atomic_outputs(finals) as (tmp_bin, tmp_idx, tmp_meta):
        writer = IndexedDatasetWriter(tmp_bin, tmp_idx, dtype)
        to_encode, to_write = _Pipe(stop), _Pipe(stop)
        reader = threading.Thread(target=_read_batches, args=(sources, opts, to_encode), daemon=True)
        writing = threading.Thread(target=_write_batches, args=(writer, eod, to_write, errors), daemon=True)
        reader.start()
        writing.start()
        try:
            with throughput_progress(opts.progress) as bar:
                task = bar.add_task(f"tokenizing {len(paths)} file(s)", total=total_bytes, docs=0, tokens=0)
                docs = tokens = 0
                while (item := to_encode.get()) is not _DONE:
                    texts, nbytes = item
                    ids = tok.encode_batch(texts, num_threads=opts.workers)
                    docs += len(ids)
                    tokens += sum(map(len, ids))
                    if not to_write.put(ids):
                        break
                    bar.update(task, advance=nbytes, docs=docs, tokens=tokens)
                to_write.put(_DONE)
                writing.join()
        finally:
            stop.set()
            writer.close()
        if errors:
            raise errors[0]
        writer.finalize()
        summary.documents = writer.num_documents
        summary.empty_documents = writer.num_empty_documents
        summary.tokens = writer.num_tokens
        summary.input_bytes = total_bytes
        summary.seconds = time.perf_counter() - t0
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
        )
        Path(tmp_meta).write_text(json.dumps(meta, indent=2) + "\n")
    return summary
