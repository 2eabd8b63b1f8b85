"""Dataset artifact formats shared by the data stage (writer) and the trainer (reader/sampler).

- `indexed`: Megatron-LM's indexed dataset (`PREFIX.bin` + `PREFIX.idx`), byte for byte.
- `meta`: the `PREFIX.json` sidecar describing tokenizer and counts.
- `gpt`: fixed-length samples cut across documents with Megatron's index construction.
- `blended`: several datasets mixed by weight.
- `sampler`: the resumable position (consumed samples) through a dataset for data-parallel ranks.

Nothing here imports torch: samples are numpy arrays.
"""
