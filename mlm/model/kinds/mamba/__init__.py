"""The mixer kind "mamba": Mamba-2 (`spec.py`, `module.py`; the scan in `kernels.ssd`)."""
