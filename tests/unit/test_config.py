"""Run configs read from TOML and `--set`: the errors name the key and show the syntax that works."""

from __future__ import annotations

import functools
import re
import shlex
import tomllib

import pytest

from mlm.config import load_config
from mlm.errors import MlmError


@pytest.mark.parametrize(
    "given,key,value",
    [
        ("data.data_path=runs/tiny/data/stdlib", "data_path", ["runs/tiny/data/stdlib"]),
        ("train.resilience.skip_iterations=5", "skip_iterations", [5]),
    ],
)
def test_a_list_field_given_one_value_shows_the_list_syntax(given, key, value):
    """`--set data.data_path=x` names the list syntax for --set and for TOML, and both forms load."""
    with pytest.raises(MlmError, match="expected a list, e.g. --set ") as e:
        load_config(None, ["preset=tiny-llama", given])
    section = given.split("=")[0].rsplit(".", 1)[0]
    shown = re.search(r"e\.g\. (--set .*?) \(in a TOML file: (.*)\)$", str(e.value))
    assert shown, str(e.value)
    flag, sets = shlex.split(shown.group(1))  # as a shell reads the line
    assert flag == "--set"
    assert (
        functools.reduce(getattr, [*section.split("."), key], load_config(None, ["preset=tiny-llama", sets]))
        == value
    )
    table = tomllib.loads(f"[{section}]\n{shown.group(2)}")
    assert functools.reduce(dict.get, section.split("."), table) == {key: value}
