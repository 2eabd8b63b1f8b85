"""Reading Megatron-LM's pickled files (`common.pt` of torch_dist, the legacy `model_optim_rng.pt`)
with `torch.load(weights_only=True)` and an explicit allow-list, without importing megatron.

    state = load_megatron_pickle(path)            # MlmError naming any class outside the list
    state = load_megatron_pickle(path, mmap=True)  # tensors stay in the file until used

Megatron-LM saves an `argparse.Namespace` of its arguments (`args`) beside the tensors; it holds
Megatron's own enums (e.g. `attention_backend=AttnBackend.auto`, `model_type=ModelType…`), torch
dtypes, paths and, in `rng_state`, numpy arrays (numpy's RNG state). The allow-list is the one megatron-core registers
for itself (megatron/core/safe_globals.py in 0.16): `argparse.Namespace`, `types.SimpleNamespace`,
`pathlib` paths, `io.BytesIO`, `signal.Signals`, numpy's arrays and dtypes, and Megatron's classes
`_MEGATRON` names. Megatron's classes are stand-ins registered under Megatron's qualified names
(`_MegatronValue`: it keeps the arguments it was built with and its pickled state), so megatron
need not be installed and is never imported. numpy's names (`ndarray`, `dtype` and the array
reconstruction, under both the numpy 1 `numpy.core` and the numpy 2 `numpy._core` spellings) are
inert stand-ins too: no numpy array is ever built from a file's bytes (an object array built that
way holds pointers the file chose), and a dtype other than a plain number is refused. Anything
else is refused with an MlmError naming the class and the file; nothing outside the list is called.

What mlm reads from these files: the `args` fields that `mlm.convert.megatron.args`
reads or refuses (docs/megatron.md lists them all), `args.consumed_train_samples` and `iteration`
(recorded in the manifest), and in the
legacy layout the parallel sizes, `num_layers`, `num_experts`, `expert_tensor_parallel_size` and
`untie_embeddings_and_output_weights` (`mlm.convert.megatron.legacy`) and the `model` /
`model0`, `model1`, … state dicts, the param groups of the `optimizer` entry and the flat buffers of
`distrib_optim.pt` (`mlm.convert.megatron.optim`). The stand-ins' values are never read.
"""

from __future__ import annotations

import argparse
import io
import pathlib
import pickle
import re
import signal
import types
import zipfile
from pathlib import Path
from typing import Any

import torch

from mlm.convert.common import refused_name
from mlm.errors import MlmError

_MEGATRON = (
    "megatron.core.enums.ModelType",
    "megatron.core.transformer.enums.ModelType",
    "megatron.core.transformer.enums.AttnBackend",
    "megatron.core.transformer.enums.CudaGraphScope",
    "megatron.core.optimizer.optimizer_config.OptimizerConfig",
    "megatron.core.rerun_state_machine.RerunDiagnostic",
    "megatron.core.rerun_state_machine.RerunMode",
    "megatron.core.rerun_state_machine.RerunState",
)
"""Megatron's classes in its own torch.load allow-list (megatron/core/safe_globals.py), by the
names a pickle carries: the defining module (ModelType is defined in two)."""


class _MegatronValue:
    """A Megatron enum member or config object as read without megatron: `args` holds the
    arguments it was built with (an enum's value), its pickled state lands in `__dict__`."""

    args: tuple = ()  # a config object is built without __init__ (its state comes after)

    def __init__(self, *args: Any):
        self.args = args

    def __repr__(self) -> str:
        return f"<{type(self).__qualname__} {', '.join(map(repr, self.args))}>"


def _stand_ins() -> list[tuple[type, str]]:
    out = []
    for qualified in _MEGATRON:
        name = qualified.rsplit(".", 1)[1]
        out.append((type(name, (_MegatronValue,), {"__module__": "megatron (not imported)"}), qualified))
    return out


_NUMERIC = re.compile(r"[<>|=]?(b1|[iu][1248]|f[248]|c(8|16))")
"""numpy dtype names of plain numbers (bool, integers, floats, complex): the only ones a file may name."""


class _NumpyArray:
    """A numpy array in a Megatron-LM pickle (the numpy RNG state inside `rng_state`), kept inert:
    its arguments and state are recorded and no array is ever built, so no byte of the file
    becomes an object pointer. mlm reads none of them."""

    def __init__(self, *args: Any):
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state


class _NumpyDtype(_NumpyArray):
    """A numpy dtype named in a pickle, inert like `_NumpyArray`: only plain numeric names pass."""

    def __init__(self, name: Any = None, *args: Any):
        if not isinstance(name, str) or not _NUMERIC.fullmatch(name):
            raise MlmError(
                f"numpy dtype {name!r}: only plain numeric dtypes (bool, integers, floats) are read from a "
                "Megatron-LM file; object and other dtypes are refused"
            )
        super().__init__(name, *args)


_NUMPY = [
    (_NumpyArray, "numpy.ndarray"),
    (_NumpyDtype, "numpy.dtype"),
    # numpy 1 writes numpy.core.multiarray._reconstruct, numpy 2 numpy._core.…: both inert here
    *((_NumpyArray, f"{m}.multiarray._reconstruct") for m in ("numpy.core", "numpy._core")),
]
_ALLOWED = [
    argparse.Namespace,
    types.SimpleNamespace,
    pathlib.PosixPath,
    pathlib.PurePosixPath,
    io.BytesIO,
    signal.Signals,
    *_NUMPY,
    *_stand_ins(),
]


def load_megatron_pickle(path: Path, *, mmap: bool = False) -> Any:
    """torch.load of a Megatron-LM file under the allow-list above, on the CPU. `mmap`: tensors are
    views of the memory-mapped file (read from disk when used), for the large per-rank files; a
    file in torch's pre-1.6 format is read whole."""
    mmap = mmap and zipfile.is_zipfile(path)  # torch.save's format before torch 1.6 maps nothing
    try:
        with torch.serialization.safe_globals(_ALLOWED):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except MlmError as e:  # a refused value (a numpy dtype that is not a plain number)
        raise MlmError(f"{path}: {e}") from None
    except (RuntimeError, EOFError) as e:  # torch's zip reader on a truncated or foreign file
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise MlmError(f"{path}: not a readable torch.save file ({first}); copy it again") from None
    except pickle.UnpicklingError as e:
        raise MlmError(
            f"{path}: names {refused_name(e)}, which is outside the classes mlm unpickles from a Megatron-LM file "
            "(argparse/SimpleNamespace, paths, numpy arrays, Megatron's enums and OptimizerConfig); "
            "it is not read. Re-save the checkpoint without that object in it"
        ) from None
