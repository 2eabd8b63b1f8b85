"""The MLP kind "moe": router, experts and shared experts (`spec.py`; `module.py` with `router.py`
and `experts.py`)."""
