"""The MLP kind "dense": SwiGLU or GeLU (`spec.py`, `module.py`)."""
