"""Megatron-LM ⇄ mlm: `mlm convert from-megatron` (`importer`) and `mlm export megatron` (`exporter`),
over the name table (`names`), the saved args (`args`), the torch_dist (`dcp`) and legacy (`legacy`)
readers, the pickle allow-list (`unpickle`) and the optimizer state (`optim`). See docs/megatron.md."""
