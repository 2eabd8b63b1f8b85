"""The norm kinds "rmsnorm" (Llama) and "layernorm" (GPT-2): `spec.py`, `module.py`."""
