"""`mlm data ...`: corpus, tokenizer training, dataset build/inspect/merge, index prebuild."""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(
    help="Raw text → tokenizer → Megatron indexed dataset (.bin/.idx + .json).", no_args_is_help=True
)
corpus_app = typer.Typer(help="Make a corpus to train on.", no_args_is_help=True)
tokenizer_app = typer.Typer(help="Train a tokenizer.", no_args_is_help=True)
app.add_typer(corpus_app, name="corpus")
app.add_typer(tokenizer_app, name="tokenizer")

Overwrite = typer.Option(False, "--overwrite", help="Replace outputs that already exist.")
JsonKey = typer.Option("text", "--json-key", help="JSONL field that holds the document text.")
InputFormat = typer.Option("auto", "--input-format", help="auto (from the file name), jsonl or text.")
TextUnit = typer.Option("file", "--text-unit", help="For text inputs: one document per file, or per line.")
NoProgress = typer.Option(False, "--no-progress", help="Hide the progress bar.")


def _print_table(title: str, rows: list[tuple[str, object]], console=None) -> None:
    """A two-column table on `console` (default: stderr, a log line of a command that writes)."""
    from rich.table import Table

    if console is None:
        from mlm.console import console

    console.print(f"[bold]{title}[/]", highlight=False)
    table = Table(show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    for k, v in rows:
        table.add_row(k, f"{v:,}" if isinstance(v, int) else str(v))
    console.print(table)


@corpus_app.command("stdlib")
def corpus_stdlib(
    output: Path = typer.Argument(..., help="JSONL file to write (`text`, `path` per line)."),
    repeat: int = typer.Option(1, help="Write the corpus this many times (for benchmarks)."),
    overwrite: bool = Overwrite,
) -> None:
    """The embedded default corpus: this Python's standard-library sources, one document per file."""
    from mlm.data.corpus import write_stdlib_corpus

    s = write_stdlib_corpus(output, overwrite=overwrite, repeat=repeat)
    _print_table(
        f"wrote {s.path}",
        [("documents", s.documents), ("bytes", s.bytes), ("skipped (not UTF-8)", s.skipped_not_utf8)],
    )


@tokenizer_app.command("train")
def tokenizer_train(
    inputs: list[Path] = typer.Option(..., "--input", "-i", help="JSONL or text files (repeat the option)."),
    output: Path = typer.Option(..., "--output", "-o", help="SentencePiece model to write (NAME.model)."),
    vocab_size: int = typer.Option(8000, help="Vocabulary size, special tokens included."),
    model_type: str = typer.Option("bpe", help="bpe or unigram."),
    byte_fallback: bool = typer.Option(True, help="Spell unknown characters as UTF-8 bytes."),
    special_tokens: list[str] = typer.Option(
        ["<|eod|>"], "--special-token", help="User-defined special tokens."
    ),
    json_key: str = JsonKey,
    input_format: str = InputFormat,
    text_unit: str = TextUnit,
    max_sentences: int = typer.Option(1_000_000, help="Most text chunks SentencePiece samples to train on."),
    threads: int = typer.Option(2, help="Training threads."),
    seed: int = typer.Option(1234, help="Seed of SentencePiece's sampling."),
    overwrite: bool = Overwrite,
    no_progress: bool = NoProgress,
) -> None:
    """Train a SentencePiece BPE/unigram tokenizer (eod = its eos id, 2)."""
    from mlm.data.tokenizer_train import TokenizerTrainOptions, train_tokenizer

    opts = TokenizerTrainOptions(
        [str(i) for i in inputs],
        str(output),
        vocab_size,
        model_type,
        byte_fallback,
        special_tokens,
        json_key,
        input_format,
        text_unit,
        max_sentences,
        threads=threads,
        seed=seed,
        overwrite=overwrite,
        progress=not no_progress,
    )
    r = train_tokenizer(opts)
    _print_table(
        f"wrote {r['output']}",
        [("vocab size", r["vocab_size"]), ("documents", r["documents"]), ("text chunks", r["chunks"])],
    )


@app.command("build")
def build(
    inputs: list[Path] = typer.Option(
        ..., "--input", "-i", help="JSONL (.jsonl, .gz, .zst) or text files, or folders."
    ),
    output_prefix: str = typer.Option(
        ...,
        "--output-prefix",
        "-o",
        help="Writes PREFIX.bin, PREFIX.idx, PREFIX.json (with --chat also PREFIX_loss_mask.bin/.idx).",
    ),
    tokenizer: Path = typer.Option(
        ..., "--tokenizer", "-t", help=".model, tokenizer.json, vocab.json or a folder."
    ),
    merges: Path | None = typer.Option(None, help="GPT-2 merges.txt (default: beside vocab.json)."),
    eod_token: str | None = typer.Option(None, help="Use this token as eod instead of the tokenizer's own."),
    append_eod: bool = typer.Option(
        False, "--append-eod", help="Add the eod token after every non-empty document."
    ),
    json_key: str | None = typer.Option(
        None,
        "--json-key",
        help="JSONL field that holds the document text (default text); with --chat the messages "
        "(default messages, else conversations).",
    ),
    input_format: str = InputFormat,
    text_unit: str = TextUnit,
    chat: bool = typer.Option(
        False,
        "--chat",
        help="Conversations: tokens from the chat template, and a loss mask of the assistant's.",
    ),
    chat_template: Path | None = typer.Option(
        None, "--chat-template", help="With --chat: a Jinja file instead of the tokenizer's template."
    ),
    seq_length: int | None = typer.Option(
        None, "--seq-length", help="With --chat: a conversation of more than N + 1 tokens is a bad line."
    ),
    workers: int = typer.Option(2, help="Tokenizer threads."),
    dtype: str | None = typer.Option(None, help="uint16 or int32 (default: uint16 when vocab < 65500)."),
    skip_bad_lines: bool = typer.Option(
        False, "--skip-bad-lines", help="Skip and count bad lines instead of stopping."
    ),
    overwrite: bool = Overwrite,
    no_progress: bool = NoProgress,
) -> None:
    """Tokenize documents into a Megatron-LM indexed dataset."""
    from mlm.console import human
    from mlm.data.build import BuildOptions, build_dataset
    from mlm.datasets.meta import loss_mask_prefix

    opts = BuildOptions(
        [str(i) for i in inputs],
        output_prefix,
        str(tokenizer),
        str(merges) if merges else None,
        eod_token,
        json_key,
        input_format,
        text_unit,
        append_eod,
        workers,
        dtype=dtype,
        overwrite=overwrite,
        skip_bad_lines=skip_bad_lines,
        progress=not no_progress,
        chat=chat,
        chat_template=str(chat_template) if chat_template else None,
        seq_length=seq_length,
    )
    s = build_dataset(opts)
    if s.assistant_tokens is None:
        counts = [("documents", s.documents), ("empty documents", s.empty_documents), ("tokens", s.tokens)]
        wrote = f"{s.prefix}.bin/.idx/.json"
    else:
        share = f"{s.assistant_tokens:,} ({s.assistant_tokens / max(s.tokens, 1):.1%})"
        counts = [("conversations", s.documents), ("tokens", s.tokens), ("assistant tokens", share)]
        wrote = f"{s.prefix}.bin/.idx/.json, {loss_mask_prefix(s.prefix)}.bin/.idx"
    rows: list[tuple[str, object]] = [
        *counts,
        ("dtype", s.dtype),
        ("input", human(s.input_bytes, "B")),
        ("time", f"{s.seconds:.1f} s"),
        (
            "throughput",
            f"{human(s.tokens / max(s.seconds, 1e-9))} tok/s, {s.input_bytes / max(s.seconds, 1e-9) / 1e6:.1f} MB/s",
        ),
    ]
    rows += [(f"skipped: {reason}", n) for reason, n in sorted(s.skipped.items())]
    _print_table(f"wrote {wrote}", rows)


@app.command("inspect")
def inspect(
    prefix: str = typer.Argument(..., help="Dataset prefix (PREFIX.bin/.idx)."),
    docs: int = typer.Option(3, help="Documents to decode and show."),
    tokenizer: Path | None = typer.Option(
        None, help="Tokenizer to decode with (default: the one in PREFIX.json)."
    ),
) -> None:
    """Counts, document lengths, frequent tokens and the first documents (on stdout)."""
    from rich.panel import Panel

    from mlm.console import LOG_WIDTH, make_console
    from mlm.data.inspect import inspect_dataset

    console = make_console(stderr=False)
    r = inspect_dataset(prefix, docs, str(tokenizer) if tokenizer else None)
    rows: list[tuple[str, object]] = [
        ("documents", r.documents),
        ("empty documents", r.empty_documents),
        ("sequences", r.sequences),
        ("tokens", r.tokens),
        ("dtype", r.dtype),
        ("distinct token ids", r.distinct_tokens),
        ("largest token id", r.max_token_id),
    ]
    rows += [(f"tokens/doc {k}", v) for k, v in r.length_percentiles.items()]
    if r.meta:
        t = r.meta["tokenizer"]
        rows += [
            ("tokenizer", f"{t['kind']} {t['path']}"),
            ("vocab size", t["vocab_size"]),
            ("eod id", t["eod_id"]),
        ]
    _print_table(f"{prefix}", rows, console)
    top = ", ".join(f"{tid} {piece!r} ×{n:,}" for tid, n, piece in r.top_tokens)
    console.print(f"[bold]most frequent tokens:[/] {top}", highlight=False)
    for i, text in enumerate(r.samples):
        # in a file (LOG_WIDTH columns) the panel fits its text instead of filling the width
        panel = Panel(text, title=f"document {i}", title_align="left", expand=console.width < LOG_WIDTH)
        console.print(panel, highlight=False)


@app.command("merge")
def merge(
    inputs: list[str] = typer.Option(
        ..., "--input", "-i", help="Dataset prefixes, in order (repeat the option)."
    ),
    output_prefix: str = typer.Option(..., "--output-prefix", "-o"),
    overwrite: bool = Overwrite,
) -> None:
    """Concatenate datasets into one (Megatron's merge_datasets)."""
    from mlm.data.merge import merge_datasets

    m = merge_datasets(inputs, output_prefix, overwrite)
    _print_table(f"wrote {output_prefix}", [("documents", m["documents"]), ("tokens", m["tokens"])])


@app.command("index")
def index(
    data_path: list[str] = typer.Argument(..., help="A prefix, or weight-prefix pairs: 0.3 A 0.7 B."),
    seq_length: int = typer.Option(..., help="Tokens per sample (the model's sequence length)."),
    train_samples: int = typer.Option(0, help="Training samples (global batch × iterations)."),
    valid_samples: int = typer.Option(0, help="Validation samples."),
    test_samples: int = typer.Option(0, help="Test samples."),
    split: str = typer.Option("969,30,1", help="Shares of documents for train, valid, test."),
    seed: int = typer.Option(1234, help="Shuffle seed (the trainer's data seed)."),
    cache_dir: str | None = typer.Option(
        None, help="Index cache folder (default: cache/ beside the first dataset)."
    ),
    packing: str = typer.Option(
        "first_fit", help="Chat datasets: first_fit or none (the run's data.packing)."
    ),
) -> None:
    """Prebuild the sample and shuffle indices (for chat datasets the packs) offline, so training
    nodes only load them."""
    import time

    from mlm.datasets.builder import build_split_datasets, parse_blend
    from mlm.datasets.gpt import GPTDatasetConfig

    counts = {"train": train_samples, "valid": valid_samples, "test": test_samples}
    if not any(v > 0 for v in counts.values()):
        raise typer.BadParameter("give at least one of --train-samples, --valid-samples, --test-samples")
    t0 = time.perf_counter()
    config = GPTDatasetConfig(seq_length, seed, split, cache_dir)
    built = build_split_datasets(parse_blend(data_path), config, counts, packing=packing)
    rows: list[tuple[str, object]] = [(f"{name} samples", len(ds)) for name, ds in built.items()]
    rows.append(("time", f"{time.perf_counter() - t0:.2f} s"))
    _print_table("indices ready", rows)
