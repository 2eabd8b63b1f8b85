"""The mixer kind "gdn": Gated DeltaNet, Qwen3-Next's linear attention (`spec.py`, `module.py`; the
delta rule in `kernels.delta_rule`)."""
