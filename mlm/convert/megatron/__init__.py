"""Megatron-LM ⇄ mlm: `mlm convert from-megatron` (`importer`) and `mlm export megatron` (`exporter`).

`names` maps GPTModel's tensor names both ways; `args` translates Megatron-LM's saved `args` both
ways; `dcp` reads torch_dist (and torchtitan's) DCP folders without unpickling more than plain
values; `unpickle` is the allow-list for Megatron-LM's pickles; `legacy` reads the per-rank
`--ckpt-format torch` layout; `optim` decodes the distributed optimizer's Adam state. See
docs/megatron.md and docs/formats.md.
"""
