"""The multi-token prediction depth (DeepSeek-V3's MTP module): `module.py` (the depth and its
targets), `spec.py` (its own parameters and FLOPs; its layer is a layer of the model's kinds)."""
