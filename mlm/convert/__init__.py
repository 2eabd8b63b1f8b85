"""Checkpoint interop, one package: `mlm convert` (reshard, from-hf, from-megatron, from-torchtitan,
from-trtllm) and `mlm export` (hf, megatron, trtllm).

- `reshard`: an mlm checkpoint rewritten for another mesh or dtype.
- `common`: the report, the import writer and the checks every conversion ends with.
- `keymap`: the key-template engine (Hugging Face's names ⇄ mlm's: indexed, split, transposed,
  stacked, copied keys).
- `layouts`: the tensor layouts foreign formats fuse or cut (per-group q/k/v, [gate; up], RoPE's
  pair order, tensor-parallel pieces), each beside its inverse.
- One folder per foreign format: `hf/` (one adapter per architecture, `folder` reads and writes a
  model folder), `megatron/` (names, args both ways, torch_dist and legacy readers, the pickle
  allow-list, the distributed optimizer, import, export), `torchtitan/`, `trtllm/`.

No module here imports another stage (train, serve, plan). See docs/convert.md.
"""
