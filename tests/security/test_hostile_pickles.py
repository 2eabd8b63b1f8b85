"""Hostile pickles in Megatron-LM files: numpy values are never built from a file's bytes.

A pickle may call `numpy.ndarray(shape, numpy.dtype('O'), buffer)`: an object array whose
pointers are bytes of the file, a crash (or worse) when anything touches it. mlm's allow-list
keeps numpy values inert and refuses every dtype that is not a plain number, so `mlm convert
from-megatron` gives one `error:` line and exit 2. The CLI runs in a child process: a crash
would show as a signal, not take the test run down.
"""

import argparse

import numpy as np
import pytest
import torch

from mlm.convert.megatron.unpickle import load_megatron_pickle
from mlm.errors import MlmError
from tests.helpers.common import assert_error, mlm


class _Dtype:
    def __init__(self, name):
        self.name = name

    def __reduce__(self):  # numpy.dtype(name), with no state to BUILD
        return (np.dtype, (self.name,))


class _Array:
    def __init__(self, dtype):
        self.dtype = dtype

    def __reduce__(self):  # numpy.ndarray(shape, dtype, buffer)
        return (np.ndarray, ((2,), _Dtype(self.dtype), b"A" * 16))


def _legacy_checkpoint(root, value):
    """A legacy (--ckpt-format torch) Megatron-LM save whose args hold `value`."""
    rank = root / "iter_0000001" / "mp_rank_00"
    rank.mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text("1")
    args = argparse.Namespace(num_layers=1, tensor_model_parallel_size=1, hostile=value)
    torch.save({"args": args, "iteration": 1, "model": {}}, rank / "model_optim_rng.pt")
    return root


def test_an_object_array_built_from_file_bytes_is_one_error_line_and_exit_2(tmp_path):
    src = _legacy_checkpoint(tmp_path / "megatron", _Array("O"))
    r = mlm("convert", "from-megatron", src, tmp_path / "out", "--set", "model.num_attention_heads=2")
    assert r.returncode >= 0, f"killed by signal {-r.returncode}"
    assert_error(r, "model_optim_rng.pt", "numpy dtype 'O'", "refused")
    assert "weights_only" not in r.stderr  # never torch's advice to load without the allow-list
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("dtype", ["O", "V8", "U2", "M8", "S4"])
def test_a_numpy_array_of_a_non_numeric_dtype_is_refused(tmp_path, dtype):
    path = tmp_path / "model_optim_rng.pt"
    torch.save({"args": argparse.Namespace(hostile=_Array(dtype))}, path)
    with pytest.raises(MlmError, match=rf"model_optim_rng\.pt: numpy dtype '{dtype}': only plain numeric"):
        load_megatron_pickle(path)


def test_numeric_numpy_values_load_inert(tmp_path):
    """Megatron-LM's rng_state holds numpy's RNG state (a uint32 array): it loads, as an inert value."""
    path = tmp_path / "model_optim_rng.pt"
    torch.save(
        {"rng_state": [{"np_rng_state": np.random.get_state()}], "args": argparse.Namespace(a=1)}, path
    )
    state = load_megatron_pickle(path)
    assert vars(state["args"]) == {"a": 1}
    assert not isinstance(state["rng_state"][0]["np_rng_state"][1], np.ndarray)


def test_an_object_array_with_its_state_is_refused(tmp_path):
    """numpy's own pickling of an object array: dtype('O') then the array's state."""
    path = tmp_path / "common.pt"
    torch.save({"args": argparse.Namespace(x=np.array([1, "a"], dtype=object))}, path)
    with pytest.raises(MlmError, match=r"common\.pt: numpy dtype 'O8'"):
        load_megatron_pickle(path)


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model_optim_rng.pt"])
def test_a_refused_global_is_one_line_naming_it(tmp_path, name):
    """A Hugging Face .bin or a Megatron-LM file naming a callable: refused by name, nothing called,
    and never torch's advice to load without the check."""
    import os

    from mlm.convert.hf.io import load_weight_file

    path = tmp_path / name
    torch.save({"w": torch.ones(2), "x": os.system}, path)
    read = load_weight_file if name.endswith(".bin") else load_megatron_pickle
    with pytest.raises(MlmError, match=rf"{name}: names posix\.system, which") as err:
        read(path)
    assert "weights_only set to False" not in str(err.value)
