"""A Hugging Face index names shard files in its folder, never paths: `../x.safetensors` or an
absolute path would import weights from outside the folder, silently."""

import json

import pytest
import torch
from safetensors.torch import save_file

from mlm.convert.hf.io import weight_files
from mlm.errors import MlmError


@pytest.mark.parametrize(
    "name", ["../outside.safetensors", "{outside}", "sub/../../outside.safetensors", "..", 7]
)
def test_an_index_naming_a_path_is_refused(tmp_path, name):
    outside = tmp_path / "outside.safetensors"
    save_file({"w": torch.ones(2)}, outside)
    hf = tmp_path / "hf"
    hf.mkdir()
    name = str(outside) if name == "{outside}" else name
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": name}}))
    with pytest.raises(
        MlmError, match=r"model\.safetensors\.index\.json: weight_map names .*not a file name in"
    ):
        weight_files(hf)


def test_shard_names_in_the_folder_are_read(tmp_path):
    save_file({"w": torch.ones(2)}, tmp_path / "model-00001-of-00001.safetensors")
    index = {"weight_map": {"w": "model-00001-of-00001.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert weight_files(tmp_path) == [tmp_path / "model-00001-of-00001.safetensors"]


def test_an_index_that_is_not_an_object_is_one_error(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["a"]}))
    with pytest.raises(MlmError, match="not a valid index"):
        weight_files(tmp_path)
