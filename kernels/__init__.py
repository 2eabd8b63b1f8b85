"""Fused kernels for mlm: Triton kernels and chunked torch implementations, each beside its torch reference."""
