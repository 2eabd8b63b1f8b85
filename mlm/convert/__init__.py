"""The convert stage (`mlm convert`): reshard checkpoints, Hugging Face import and export.

`reshard` rewrites a checkpoint for another mesh; `hf_io` reads and writes Hugging Face model
folders; `hf` converts in both directions through the adapters of `mlm.hf`; `common` holds the
staging of OUT and the logit checks every conversion ends with. See docs/convert.md.
"""
