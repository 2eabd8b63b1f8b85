"""A torch DCP `.metadata` names its data files; a name that is a path (`../outside.distcp`, an
absolute path) would read tensors from outside the checkpoint folder, silently: it is refused."""

import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from mlm.convert.megatron.dcp import MegatronCheckpoint
from mlm.errors import MlmError


def _checkpoint(path):
    dcp.save({"w": torch.arange(4.0)}, checkpoint_id=path, no_dist=True)
    return path


@pytest.mark.parametrize("name", ["../outside.distcp", "{abs}", "a/../../outside.distcp", ".."])
def test_a_data_file_named_by_a_path_is_refused(tmp_path, name):
    outside = _checkpoint(tmp_path / "other")
    ckpt = _checkpoint(tmp_path / "ckpt")
    meta = pickle.loads((ckpt / ".metadata").read_bytes())
    target = str(next(outside.glob("*.distcp"))) if name == "{abs}" else name
    for info in meta.storage_data.values():
        info.relative_path = target
    (ckpt / ".metadata").write_bytes(pickle.dumps(meta))
    with pytest.raises(MlmError, match=r"\.metadata: names the data file .*not a file name in"):
        MegatronCheckpoint(ckpt)


def test_a_checkpoint_as_torch_writes_it_reads(tmp_path):
    ckpt = MegatronCheckpoint(_checkpoint(tmp_path / "ckpt"))
    assert torch.equal(ckpt.read("w"), torch.arange(4.0))


class _Call:
    def __reduce__(self):  # os.system("true"), were it ever called
        import os

        return (os.system, ("true",))


def test_a_metadata_naming_a_callable_is_refused_naming_the_file(tmp_path):
    ckpt = _checkpoint(tmp_path / "ckpt")
    meta = pickle.loads((ckpt / ".metadata").read_bytes())
    meta.planner_data = _Call()
    (ckpt / ".metadata").write_bytes(pickle.dumps(meta))
    with pytest.raises(
        MlmError, match=rf"^{ckpt}/\.metadata: names posix\.system, which a torch DCP metadata"
    ):
        MegatronCheckpoint(ckpt)


def test_a_bytes_entry_naming_a_callable_is_refused_not_called_damaged(tmp_path):
    dcp.save({"w": torch.arange(4.0), "extra": _Call()}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    ckpt = MegatronCheckpoint(tmp_path / "ckpt")
    with pytest.raises(
        MlmError, match=r"extra not read: it names posix\.system, a class outside plain values"
    ) as e:
        ckpt.values(["extra"])
    assert "damaged" not in str(e.value) and "weights_only" not in str(e.value)


def test_a_data_file_that_links_out_of_the_checkpoint_is_refused(tmp_path):
    ckpt = _checkpoint(tmp_path / "ckpt")
    (data,) = ckpt.glob("*.distcp")
    (tmp_path / "outside.distcp").write_bytes(data.read_bytes())
    data.unlink()
    data.symlink_to(tmp_path / "outside.distcp")
    with pytest.raises(MlmError, match=r"\.distcp: a link to .*outside\.distcp, outside the checkpoint"):
        MegatronCheckpoint(ckpt)
