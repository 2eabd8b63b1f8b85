"""Reading Megatron-LM's pickles (`common.pt`, the legacy `model_optim_rng.pt` and `distrib_optim.pt`)
with `torch.load(weights_only=True)` and megatron-core's own allow-list (megatron/core/safe_globals.py
in 0.16), without importing megatron: `load_megatron_pickle(path, mmap=False)`. Megatron's classes
and numpy's are inert stand-ins registered under their qualified names (no numpy array is built from
a file's bytes; a numpy dtype other than a plain number is refused); any other class is refused,
naming it and the file. What is read from these files: docs/megatron.md ("What is unpickled").
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


def _stand_in(qualified: str) -> tuple[type, str]:
    """A `_MegatronValue` subclass named as Megatron's class, registered under its qualified name."""
    name = qualified.rsplit(".", 1)[1]
    return type(name, (_MegatronValue,), {"__module__": "megatron (not imported)"}), qualified


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
    *map(_stand_in, _MEGATRON),
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
