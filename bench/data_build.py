"""Benchmark `mlm data build` against raw SentencePiece batch encoding, same model and threads.

    python bench/data_build.py [--repeat 9] [--workers 2] [--vocab-size 8000]

Builds the stdlib corpus `repeat` times over (≥ 100 MB with the default), trains a tokenizer on
one copy, then measures in this one process:
  raw: SentencePiece `encode(batch, num_threads=workers)` over the pre-parsed documents, in
       batches of the size mlm uses (parsing and writing excluded: the ideal to hide behind);
  mlm: `build_dataset` end to end (read + parse JSONL, encode, write .bin/.idx/.json).
and prints tokens/s of each and the ratio mlm / raw (target ≥ 0.9). It also times CLI
start-up (`mlm --help`, `mlm data --help`) and checks that torch is not imported.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mlm.data.build import BuildOptions, build_dataset  # noqa: E402
from mlm.data.corpus import write_stdlib_corpus  # noqa: E402
from mlm.data.tokenizer_train import TokenizerTrainOptions, train_tokenizer  # noqa: E402


def raw_encode(corpus: Path, model: Path, workers: int, batch_bytes: int) -> tuple[int, float]:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(model))
    texts = [json.loads(line)["text"] for line in open(corpus, encoding="utf-8")]
    batches, cur, size = [], [], 0
    for t in texts:
        cur.append(t)
        size += len(t)
        if size >= batch_bytes:
            batches.append(cur)
            cur, size = [], 0
    batches.append(cur)
    tokens, t0 = 0, time.perf_counter()
    for b in batches:
        tokens += sum(map(len, sp.encode(b, out_type=int, num_threads=workers)))
    return tokens, time.perf_counter() - t0


def startup(args: list[str], runs: int = 5) -> float:
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "cli.main", *args], cwd=ROOT, capture_output=True, check=True)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--vocab-size", type=int, default=8000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        one = write_stdlib_corpus(d / "one.jsonl")
        corpus = write_stdlib_corpus(d / "corpus.jsonl", repeat=args.repeat)
        train_tokenizer(
            TokenizerTrainOptions([one.path], str(d / "tok.model"), args.vocab_size, progress=False)
        )
        opts = BuildOptions(
            [corpus.path],
            str(d / "ds"),
            str(d / "tok.model"),
            append_eod=True,
            workers=args.workers,
            progress=False,
        )
        raw_tokens, raw_s = raw_encode(Path(corpus.path), d / "tok.model", args.workers, opts.batch_bytes)
        summary = build_dataset(opts)
        raw_tps, mlm_tps = raw_tokens / raw_s, summary.tokens / summary.seconds
        print(
            f"corpus: {corpus.bytes / 1e6:.1f} MB, {corpus.documents} documents, vocab {args.vocab_size}, "
            f"workers {args.workers}"
        )
        print(
            f"raw SentencePiece encode: {raw_tokens:,} tokens in {raw_s:.2f} s = {raw_tps / 1e6:.3f} M tok/s"
        )
        print(
            f"mlm data build:           {summary.tokens:,} tokens in {summary.seconds:.2f} s = "
            f"{mlm_tps / 1e6:.3f} M tok/s ({summary.input_bytes / summary.seconds / 1e6:.1f} MB/s)"
        )
        print(f"ratio mlm / raw: {mlm_tps / raw_tps:.3f}  (target >= 0.9)")
    help_s, data_s = startup(["--help"]), startup(["data", "--help"])
    probe = (
        "import sys; from cli.main import app\ntry: app(['data', '--help'])\nexcept SystemExit: pass\n"
        "print('torch' in sys.modules, file=sys.stderr)"
    )
    torch_loaded = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True
    ).stderr
    print(
        f"start-up (best of 5): mlm --help {help_s:.3f} s, mlm data --help {data_s:.3f} s (target < 0.5 s); "
        f"torch imported: {torch_loaded.strip()}"
    )


if __name__ == "__main__":
    main()
