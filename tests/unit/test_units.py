"""The core's one dtype table, size parser and artifact-version refusal (`mlm.units`, `mlm.errors`)."""

from __future__ import annotations

import pytest
import torch

from mlm.errors import MlmError, check_version
from mlm.units import DTYPES, parse_size


def test_dtypes():
    assert DTYPES == {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def test_parse_size():
    assert parse_size("5GB", "--x") == 5 * 10**9 and parse_size(" 500 MB ", "--x") == 5 * 10**8
    assert parse_size("2GiB", "--x") == 2 * 2**30 and parse_size("1.5KiB", "--x") == 1536
    assert parse_size("1e9", "--x") == 10**9 and parse_size("1000", "--x") == parse_size(1000, "--x")
    for bad in ("", "5XB", "-1GB", "0", "2e", "GB"):
        with pytest.raises(MlmError) as e:
            parse_size(bad, "--kv-memory")
        assert str(e.value) == (
            f"--kv-memory {bad!r}: expected a positive size, e.g. 5GB, 500MB, 2GiB, 1e9 or 1000 (bytes)"
        )


def test_check_version():
    check_version("a.json", 1, [1], "format_version")
    with pytest.raises(MlmError) as e:
        check_version("a.json", 3, [1, 2], "format_version")
    assert str(e.value) == "a.json: format_version 3; this mlm reads versions 1, 2"
    with pytest.raises(MlmError, match=r"^plan.toml: plan version None; this mlm reads version 1$"):
        check_version("plan.toml", None, (1,), "plan version")
