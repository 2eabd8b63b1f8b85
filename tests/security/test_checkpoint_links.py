"""Checkpoint housekeeping never follows a link out of its folder.

Pruning (`keep_last`) and re-saving an iteration remove a linked `iter_*` itself, never the
checkpoint it names; `latest` must name an `iter_*` folder beside it, and is not followed through
a link that leaves the folder. Canary: the linked checkpoint elsewhere keeps every file.
"""

import pytest
import torch

from mlm.checkpoint import resolve_checkpoint, save_checkpoint
from mlm.checkpoint.manager import ShardedTensor
from mlm.errors import MlmError


def _save(root, iteration, **kw):
    tensors = {"model": [ShardedTensor.full("w", torch.full((2,), float(iteration)))]}
    return save_checkpoint(root, iteration, tensors, {"consumed_samples": iteration}, **kw)


def _files(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_pruning_removes_a_linked_checkpoint_not_its_target(tmp_path):
    elsewhere = _save(tmp_path / "elsewhere", 1)
    before = _files(elsewhere)
    run = tmp_path / "run"
    run.mkdir()
    (run / "iter_0000001").symlink_to(elsewhere)
    for it in (2, 3):
        _save(run, it, keep_last=2)
    assert sorted(p.name for p in run.iterdir()) == ["iter_0000002", "iter_0000003", "latest"]
    assert _files(elsewhere) == before  # the canary: nothing deleted through the link


def test_resaving_a_linked_iteration_replaces_the_link_only(tmp_path):
    elsewhere = _save(tmp_path / "elsewhere", 1)
    before = _files(elsewhere)
    run = tmp_path / "run"
    run.mkdir()
    (run / "iter_0000001").symlink_to(elsewhere)
    _save(run, 1)
    assert not (run / "iter_0000001").is_symlink()
    assert _files(elsewhere) == before


@pytest.mark.parametrize("text", ["../elsewhere/iter_0000001", "/etc", "iter_0000001/../../x", ""])
def test_latest_names_only_an_iter_folder_beside_it(tmp_path, text):
    _save(tmp_path / "elsewhere", 1)
    run = tmp_path / "run"
    _save(run, 1)
    (run / "latest").write_text(text + "\n")
    with pytest.raises(MlmError, match=r"latest names .*not an iter_NNNNNNN folder beside it"):
        resolve_checkpoint(run)


def test_latest_is_not_followed_through_a_link_out_of_its_folder(tmp_path):
    elsewhere = _save(tmp_path / "elsewhere", 5)
    run = tmp_path / "run"
    _save(run, 1)
    (run / "iter_0000005").symlink_to(elsewhere)
    (run / "latest").write_text("iter_0000005\n")
    with pytest.raises(
        MlmError, match=r"a link to .*elsewhere.* outside .*run; .*pass that checkpoint directly"
    ):
        resolve_checkpoint(run)
    assert (
        resolve_checkpoint(run / "iter_0000005") == run / "iter_0000005"
    )  # named directly: the user's choice


def test_an_output_that_is_a_dangling_link_is_refused_and_leaves_nothing(tmp_path):
    from mlm.convert.reshard import reshard

    _save(tmp_path / "src", 1)
    (tmp_path / "out").symlink_to(tmp_path / "nowhere")
    with pytest.raises(MlmError, match=r"out is a link \(to .*nowhere\); pass a new output path"):
        reshard(tmp_path / "src", tmp_path / "out", tp=1, pp=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]  # no OUT.tmp-PID left
