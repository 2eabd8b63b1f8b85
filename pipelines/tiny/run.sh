#!/usr/bin/env bash
# The tiny pipeline, the embedded default that `just demo` runs on a CPU.
#
#   bash pipelines/tiny/run.sh            # writes everything under runs/tiny (OUT=... to change)
#
# stdlib corpus (this Python's own sources) → SentencePiece BPE tokenizer → Megatron indexed
# dataset → inspect → prebuilt sample indices. Nothing is downloaded.
# Expected on 2 cores: about 30 s; ~3.7M tokens in ~730 documents with a 4096-token vocabulary.
set -euo pipefail
OUT=${OUT:-runs/tiny}
mkdir -p "$OUT"

mlm data corpus stdlib "$OUT/corpus.jsonl" --overwrite
mlm data tokenizer train -i "$OUT/corpus.jsonl" -o "$OUT/tokenizer.model" --vocab-size 4096 --overwrite
mlm data build -i "$OUT/corpus.jsonl" -o "$OUT/data/stdlib" -t "$OUT/tokenizer.model" --append-eod --overwrite
mlm data inspect "$OUT/data/stdlib" --docs 1
mlm data index "$OUT/data/stdlib" --seq-length 256 --train-samples 20000 --valid-samples 200 --split 98,2,0
