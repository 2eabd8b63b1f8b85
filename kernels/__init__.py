"""Kernels for mlm's hot ops, each file holding the torch reference, the fused implementation, its
`torch.autograd.Function` and one public function. Triton: `rmsnorm` (RMSNorm, LayerNorm), `swiglu`
(SwiGLU, GeLU), `rope` (rotate-half and interleaved RoPE), `ssd` (Mamba-2's chunked scan), `delta_rule` (the gated
delta rule); `model.kernels` picks them
(`mlm.model.ops.resolve_kernels`), tested against the references on CPU under the Triton
interpreter (TRITON_INTERPRET=1, tests/unit/test_kernels.py); not yet run on a GPU. `lean`: the torch
path of the norms and SwiGLU (no triton needed), autograd Functions that save what the Triton
ones save and in fp32 compute exactly as torch. The chunked linear + cross-entropy lives with the
vocabulary-parallel losses (`mlm.parallel.cross_entropy`), its chunk size in the torch-free
`mlm.parallel.loss_chunks` that the planner reads. Nothing here is imported by `mlm plan`."""
