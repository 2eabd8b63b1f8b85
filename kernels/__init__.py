"""Triton kernels for mlm's hot elementwise and row-wise ops, each file holding the torch reference,
the `@triton.jit` kernels (forward and backward), their `torch.autograd.Function` and one public
function: `rmsnorm` (RMSNorm, LayerNorm), `swiglu` (SwiGLU, GeLU), `rope` (rotate-half and interleaved
RoPE). `model.kernels` picks them (`mlm.model.layers.resolve_kernels`). Tested against the references
on CPU under the Triton interpreter (TRITON_INTERPRET=1, tests/test_kernels.py); not yet run on a GPU."""
