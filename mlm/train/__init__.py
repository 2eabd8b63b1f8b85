"""The training stage: `mlm train` (one process in this version; the mesh slots in later)."""
