#!/usr/bin/env bash
# The tiny pipeline, the embedded default that `just demo` runs on a CPU.
#
#   bash pipelines/tiny/run.sh            # writes everything under runs/tiny (OUT=... to change)
#   ITERS=20 bash pipelines/tiny/run.sh   # a short run (default 300 steps), e.g. for the docs' follow-along test
#
# stdlib corpus (this Python's own sources) → SentencePiece BPE tokenizer → Megatron indexed
# dataset → inspect → prebuilt sample indices → train a 1.8M-parameter Llama for 300 steps
# (checkpoints every 100, a greedy sample after each evaluation). Nothing is downloaded.
# Expected on 2 cores: data ~15 s (3.7M tokens, ~730 documents, 4096-token vocabulary), then
# training ~4-5 min; the training loss falls from ~8.3 to about 4.0 (see pipelines/tiny/README.md).
set -euo pipefail
OUT=${OUT:-runs/tiny}
ITERS=${ITERS:-300}
mkdir -p "$OUT"

mlm data corpus stdlib "$OUT/corpus.jsonl" --overwrite
mlm data tokenizer train -i "$OUT/corpus.jsonl" -o "$OUT/tokenizer.model" --vocab-size 4096 --overwrite
mlm data build -i "$OUT/corpus.jsonl" -o "$OUT/data/stdlib" -t "$OUT/tokenizer.model" --append-eod --overwrite
mlm data inspect "$OUT/data/stdlib" --docs 1
mlm data index "$OUT/data/stdlib" --seq-length 256 --train-samples 4800 --valid-samples 64 --split 98,2,0
mlm train --config pipelines/tiny/train.toml --set run_dir="'$OUT/train'" --set data.data_path="['$OUT/data/stdlib']" \
    --set checkpoint.save="'$OUT/checkpoints'" --set train.train_iters=$ITERS
mlm generate "$OUT/checkpoints" -p "    def __init__(self" --max-tokens 48   # `mlm serve` serves the same checkpoint
