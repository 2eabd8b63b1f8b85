"""The convert stage: Hugging Face import and export of mlm checkpoints (`mlm convert`).

`hf_io` reads and writes Hugging Face model folders; `hf` converts in both directions through the
adapters of `mlm.hf` and verifies the logits against transformers. See docs/convert.md.
"""
