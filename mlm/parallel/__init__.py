"""Parallelism on torch.distributed: the mesh, and the layers and reducers that use it."""

from mlm.parallel.mesh import Mesh

__all__ = ["Mesh"]
