"""The mixer kind "gqa": multi-head attention with grouped key/value heads (`spec.py`, `module.py`)."""
