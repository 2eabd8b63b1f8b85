"""Parallelism on torch.distributed, applied to the plain model from outside: the mesh and every
process group (`mesh`), where each parameter lives (`placement`), tensor and sequence parallel
layers applied from the modules' plans (`tensor`, `parallelize`), pipeline stages and schedules
(`pipeline`, `schedules`), data parallelism and the distributed optimizer (`data_parallel`,
`dist_optim`), activation recompute (`recompute`)."""

from mlm.parallel.mesh import Mesh

__all__ = ["Mesh"]
