"""The conversions behind `mlm convert` (reshard, from-hf, from-megatron, from-torchtitan) and `mlm
export hf` / `mlm export megatron`: reshard checkpoints, Hugging Face import and export,
Megatron-LM import and export, torchtitan import.

`reshard` rewrites a checkpoint for another mesh; `hf_io` reads and writes Hugging Face model
folders; `hf` converts in both directions through the adapters of `mlm.hf`; `megatron_dcp` reads
torch DCP directories (Megatron's torch_dist, torchtitan's steps) without unpickling more than
plain values, `megatron_pickle` Megatron-LM's pickled files under an allow-list, `megatron_legacy`
its per-rank `--ckpt-format torch` layout; `megatron` imports a Megatron-core GPTModel (with its
distributed optimizer's Adam state: `megatron_optim`), `megatron_export` writes one, `torchtitan`
imports a torchtitan Llama 3; `common` holds the report, the import writer and the checks every
conversion ends with. See docs/convert.md.
"""
