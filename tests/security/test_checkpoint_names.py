"""Names in an mlm checkpoint's manifest never reach outside the checkpoint or OUT.

A manifest comes with the checkpoint, from elsewhere: a tensor named `model/L/../../../../X`
would make `mlm convert reshard` read, and write, `X` outside both folders. Names must be
GROUP/KEY of plain file names, and an array that is a link out of the checkpoint is refused.
Canary: nothing appears beside the checkpoint or OUT.
"""

import json
import shutil

import pytest
import torch

from mlm.checkpoint import read_group
from mlm.checkpoint.manager import save_streaming
from mlm.config import load_config
from mlm.convert.reshard import reshard
from mlm.errors import MlmError
from mlm.model.gpt import GPT

SETS = ["preset=tiny-llama", "model.num_layers=1", "model.hidden_size=32", "model.num_attention_heads=2"]


def _checkpoint(root):
    config = load_config(None, [*SETS, "model.vocab_size=64", "data.seq_length=16"])
    state = GPT(config.model).state_dict()
    tensors = (("model", k, t, tuple(t.shape)) for k, t in state.items())
    return save_streaming(root, 1, tensors, {"config": config.to_dict()}, ["model"])


def _listing(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize(
    "name", ["model/L/../../../../X", "model/../x", "/abs/x", "model", "model/a/b", "../model/x"]
)
def test_a_manifest_name_that_is_not_group_slash_key_is_refused(tmp_path, name):
    it_dir = _checkpoint(tmp_path / "src")
    (it_dir / "model" / "L").symlink_to(it_dir / "model")
    manifest = json.loads((it_dir / "manifest.json").read_text())
    manifest["tensors"][name] = manifest["tensors"]["model/embed.weight"]
    (it_dir / "manifest.json").write_text(json.dumps(manifest))
    before = _listing(tmp_path)
    with pytest.raises(MlmError, match=r"manifest\.json: tensor name .* is not GROUP/KEY"):
        reshard(tmp_path / "src", tmp_path / "out", tp=1, pp=1)
    assert _listing(tmp_path) == before  # no OUT, nothing outside it


def test_an_array_linked_out_of_the_checkpoint_is_refused(tmp_path):
    it_dir = _checkpoint(tmp_path / "src")
    other = _checkpoint(tmp_path / "other")
    shutil.rmtree(it_dir / "model" / "final_norm.weight")
    (it_dir / "model" / "final_norm.weight").symlink_to(other / "model" / "final_norm.weight")
    with pytest.raises(
        MlmError, match=r"tensor model/final_norm\.weight is a link to .*other.*outside the checkpoint"
    ):
        read_group(tmp_path / "src")
    with pytest.raises(MlmError, match="outside the checkpoint"):
        reshard(tmp_path / "src", tmp_path / "out", tp=1, pp=1)
    assert not (tmp_path / "out").exists()
    assert torch.equal(read_group(tmp_path / "other")[0]["final_norm.weight"], torch.ones(32))
