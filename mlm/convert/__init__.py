"""The convert stage (`mlm convert`): reshard checkpoints, Hugging Face import and export,
Megatron-core import.

`reshard` rewrites a checkpoint for another mesh; `hf_io` reads and writes Hugging Face model
folders; `hf` converts in both directions through the adapters of `mlm.hf`; `megatron_dcp` reads
Megatron's torch_dist checkpoints and `megatron` imports them; `common` holds the
staging of OUT and the logit checks every conversion ends with. See docs/convert.md.
"""
