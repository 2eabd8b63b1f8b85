"""megatron-core 0.16.1 on CPU: the patches that let its GPTModel, DDP, DistributedOptimizer (Adam),
scheduler, schedules and `dist_checkpointing.save` run without CUDA, each saying why.

They change process-wide state (e.g. `torch.cuda.current_device`), so they run only in a process
that exists to run megatron-core: the `mlm parity --against megatron` worker
(`mlm.train.parity.megatron`) and the reference rank processes of tests/interop/megatron/.
"""

from __future__ import annotations

import queue
import warnings

import torch


def apply_cpu_patches() -> None:
    """Make megatron-core 0.16.1's GPTModel forward and dist_checkpointing.save run without CUDA."""
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    import megatron.core.tensor_parallel.random as mrandom
    import megatron.core.transformer.moe.moe_utils as moe_utils
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fsa

    # P1: the RNG tracker (CudaRNGStatesTracker.add, and fork() around attention dropout in every
    # forward) reads and sets torch.cuda RNG states ("Torch not compiled with CUDA enabled"); keep
    # its logic on the CPU generator.
    def _add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_ or name in self.states_:
            raise Exception(f"rng state {name} / seed {seed} already exists")
        self.seeds_.add(seed)
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    mrandom._get_cuda_rng_state = lambda *_a, **_k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *_a, **_k: torch.set_rng_state(state)
    mrandom.CudaRNGStatesTracker.add = _add

    # P2: buffers all over the forward path (RoPE's inv_freq, the attention-score buffer, the tp
    # all-gathers, the MoE router and experts) are allocated on torch.cuda.current_device():
    # answer "cpu" (torch.cuda.is_available() stays False).
    torch.cuda.current_device = lambda: "cpu"

    # P3: the MoE router tests `te_general_gemm is not None`, a name moe_utils defines only when
    # Transformer Engine imports (NameError otherwise); None selects the torch matmul path.
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None

    # P4: every torch_dist save goes through FileSystemWriterAsync.preload_tensors(non_blocking=True),
    # which ends in torch.cuda.synchronize(); plain blocking copies need no synchronize.
    preload = fsa.FileSystemWriterAsync.preload_tensors
    fsa.FileSystemWriterAsync.preload_tensors = staticmethod(
        lambda write_buckets, non_blocking=True: preload(write_buckets, non_blocking=False)
    )

    # P5: the writer's results queue comes from a spawn-context multiprocessing.Manager, whose server
    # re-imports __main__ and dies under a test runner (EOFError). A synchronous save uses the queue
    # only in this process (the forked per-bucket writers report on their own queue): a queue.Queue.
    if fsa._results_queue is None:
        fsa._results_queue = queue.Queue()

    # P6: the forked writer measures its memory with psutil, not a megatron-core dependency; without
    # it the writer raises and the parent waits forever. Report 0 bytes instead.
    if not fsa.HAVE_PSUTIL:
        fsa._process_memory = lambda: 0


def apply_optimizer_cpu_patches() -> None:
    """Make megatron-core 0.16.1's DistributedOptimizer (Adam) step and save on CPU as well."""
    import megatron.core.optimizer.clip_grads as mclip
    import megatron.core.optimizer.distrib_optimizer as dopt
    import megatron.core.optimizer.optimizer as mopt
    import megatron.core.pipeline_parallel.schedules as schedules
    import megatron.core.utils as mutils

    # P8: MixedPrecisionOptimizer.__init__ (optimizer.py:473-485, 907), the grad-norm code
    # (clip_grads.py:90-115, 174, 207) and local_multi_tensor_l2_norm (utils.py:1207) create tensors
    # with device="cuda" literals: give those modules a `torch` whose factories map "cuda" to "cpu".
    def _cpu(factory):
        return lambda *a, device=None, **k: factory(*a, device="cpu" if device == "cuda" else device, **k)

    class _TorchOnCpu:
        tensor, zeros, empty, ones = (
            staticmethod(_cpu(f)) for f in (torch.tensor, torch.zeros, torch.empty, torch.ones)
        )

        def __getattr__(self, name):
            return getattr(torch, name)

    for module in (mopt, mclip, dopt, mutils, schedules):
        module.torch = _TorchOnCpu()

    # P9: the distributed optimizer sorts parameters by `param.type()` against
    # "torch.cuda.FloatTensor" etc. (distrib_optimizer.py:361-435, 582) and raises TypeError on CPU
    # names: report CPU float tensors under their CUDA names.
    plain_type = torch.Tensor.type

    def _type(self, *a, **k):
        name = plain_type(self, *a, **k)
        if not a and not k and name in ("torch.FloatTensor", "torch.HalfTensor", "torch.BFloat16Tensor"):
            return name.replace("torch.", "torch.cuda.", 1)
        return name

    torch.Tensor.type = _type

    # P10: at pp > 1 a tied embedding's last-stage copy is moved with `weight.data.cuda()` before the
    # all-reduce that gives it the first stage's values (language_module.py:244): it stays on CPU.
    torch.Tensor.cuda = lambda self, *a, **k: self
