"""The mixer kind "mla": DeepSeek's multi-latent attention (`spec.py`, `module.py`)."""
