#!/usr/bin/env bash
# Supervised fine-tuning of an imported Hugging Face model on conversations, exported back.
#
#   just sft   (or bash pipelines/sft/run.sh with the venv's bin on PATH)   # everything under runs/sft (OUT=... to change)
#   HF_MODEL=path/to/hf-folder bash pipelines/sft/run.sh   # a real model (its own chat template)
#
# toy conversations + a tiny random Llama with a ChatML tokenizer (pipelines/sft/toy.py, unless
# HF_MODEL names a folder) → mlm convert from-hf → mlm data build --chat (tokens + loss mask, the
# tokenizer's chat template) → mlm train from the imported weights, 100 steps, loss over the
# assistant's tokens, conversations packed first-fit → mlm export hf → transformers answers a
# question in the chat format (pipelines/sft/chat.py). Needs the dev extra (transformers).
# Expected on 2 cores: about 40 seconds; the loss falls from ~6.0 to below 0.01.
set -euo pipefail
OUT=${OUT:-runs/sft}
HERE=$(dirname "$0")
mkdir -p "$OUT"

python "$HERE/toy.py" "$OUT"
HF_MODEL=${HF_MODEL:-$OUT/hf-base}
rm -rf "$OUT/base" "$OUT/hf-sft"
mlm convert from-hf "$HF_MODEL" "$OUT/base" --no-progress
mlm data build --chat -i "$OUT/conversations.jsonl" -t "$OUT/base/tokenizer" -o "$OUT/data/chat" \
    --seq-length 128 --overwrite --no-progress
mlm train --config "$OUT/base/config.toml" --load "$OUT/base" \
    --set run_dir="'$OUT/train'" --set data.data_path="['$OUT/data/chat']" --set data.seq_length=128 \
    --set data.split="'98,2,0'" --set train.train_iters=100 --set train.global_batch_size=16 \
    --set train.micro_batch_size=8 --set train.eval_interval=50 --set train.eval_iters=2 \
    --set optimizer.lr=3e-3 --set optimizer.min_lr=3e-4 --set optimizer.warmup_iters=10 \
    --set optimizer.weight_decay=0.0 --set logging.log_interval=10 --set logging.tensorboard=false \
    --set checkpoint.save="'$OUT/sft'" --set checkpoint.save_interval=0
mlm export hf "$OUT/sft" "$OUT/hf-sft" --tokenizer "$OUT/base/tokenizer" --no-progress
python "$HERE/chat.py" "$OUT/hf-sft" "What is the capital of Peru?"
