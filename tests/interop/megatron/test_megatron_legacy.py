"""`mlm convert from-megatron` on Megatron-LM's legacy per-rank checkpoints, and Megatron's
pickled `args` read under mlm's allow-list (mlm/convert/megatron/legacy.py, unpickle.py).

megatron-core 0.16.1 builds the tiny GPTModel of tests/helpers/megatron_ref.py in gloo rank processes at
tp 2 (dense and MoE), pp 2 (real pipeline stages, run by hand) and ep 2 (MoE), and saves each
rank's `state_dict_for_save_checkpoint()` with a Megatron-LM `args` Namespace holding Megatron's
enums, as Megatron-LM's legacy save does (tests/helpers/megatron_legacy_ref.py). mlm imports the save
directory taking the model config from the args alone (no --set of heads), and its `GPT` must
give GPTModel's logits to 1e-5 (fp32, absolute; measured 1.2e-7 to 1.8e-7). A torch_dist checkpoint whose common.pt holds
such args imports the same way. megatron is never imported in this process: the enums are read
through stand-ins. Refusals (a pickle naming a foreign callable, a missing rank file) are checked
without megatron.
"""

from __future__ import annotations

import builtins
import os
import sys

import pytest
import torch

from mlm.checkpoint import read_group
from mlm.config import config_from_dict
from mlm.convert.megatron.importer import import_megatron
from mlm.convert.megatron.unpickle import load_megatron_pickle
from mlm.errors import MlmError
from tests.helpers.common import mlm  # noqa: E402
from tests.helpers.distributed import run_ranks  # noqa: E402
from tests.helpers.megatron_helpers import TOL, megatron, mlm_logits  # noqa: E402, F401 (megatron: the fixture)
from tests.helpers.megatron_ref import VOCAB  # noqa: E402

MOE_SETS = ["model.moe.token_dispatcher=allgather"]  # mlm's dispatcher; the weights do not say it


@pytest.mark.parametrize(
    "moe, tp, pp, ep",
    [(False, 2, 1, 1), (False, 1, 2, 1), (True, 1, 1, 2), (True, 2, 1, 1)],
    ids=["dense-tp2", "dense-pp2", "moe-ep2", "moe-tp2"],
)
@pytest.mark.usefixtures("megatron")
def test_legacy_import_matches_gptmodel(tmp_path, moe, tp, pp, ep):
    from tests.helpers.megatron_legacy_ref import CONSUMED, ITERATION, save_legacy

    save = tmp_path / "megatron"
    logits = [x for x in run_ranks(tp * pp * ep, save_legacy, str(save), moe, tp, pp, ep) if x is not None]
    ranks = sorted(p.name for p in (save / "iter_0000010").iterdir())
    expected = {
        (False, 2, 1, 1): ["mp_rank_00", "mp_rank_01"],
        (False, 1, 2, 1): ["mp_rank_00_000", "mp_rank_00_001"],
        (True, 1, 1, 2): ["mp_rank_00_000", "mp_rank_00_001"],
        (True, 2, 1, 1): ["mp_rank_00", "mp_rank_01"],
    }
    assert ranks == expected[moe, tp, pp, ep]
    if (moe, tp) == (False, 2):  # through the command line
        r = mlm("convert", "from-megatron", save, tmp_path / "out")
        assert r.returncode == 0, r.stderr
        assert "imported Megatron-core GPTModel" in r.stderr and "21 tensors" in r.stderr, r.stderr
    else:
        report = import_megatron(save, tmp_path / "out", MOE_SETS if moe else [])
        assert report.notes == [] and report.tensors == (23 if moe else 21)
    assert "megatron.core" not in sys.modules  # read through the stand-ins
    manifest = read_group(tmp_path / "out")[1]
    cfg = config_from_dict(manifest["config"]).model
    assert (cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels, cfg.vocab_size) == (
        4,
        2,
        16,
        VOCAB,
    )
    assert (cfg.num_layers, cfg.mlp_kind) == (2, "moe" if moe else "dense")
    assert manifest["source"]["iteration"] == ITERATION
    assert manifest["source"]["consumed_train_samples"] == CONSUMED
    diff = (mlm_logits(tmp_path / "out") - logits[0]).abs().max().item()
    assert diff <= TOL, diff


@pytest.mark.usefixtures("megatron")
def test_torch_dist_args_with_megatron_enums(tmp_path):
    """common.pt as Megatron-LM writes it (args holding AttnBackend, ModelType): read, and the
    model config taken from it without --set."""
    from tests.helpers.megatron_legacy_ref import ITERATION, save_torch_dist_with_args

    src = tmp_path / "megatron" / "iter_0000010"
    logits = run_ranks(1, save_torch_dist_with_args, str(src))[0]
    (tmp_path / "megatron" / "latest_checkpointed_iteration.txt").write_text("10")
    args = load_megatron_pickle(src / "common.pt")["args"]
    assert repr(args.attention_backend) == "<AttnBackend 5>"  # AttnBackend.auto, a stand-in
    import_megatron(tmp_path / "megatron", tmp_path / "out")
    assert "megatron.core" not in sys.modules
    manifest = read_group(tmp_path / "out")[1]
    assert manifest["source"]["iteration"] == ITERATION
    assert (mlm_logits(tmp_path / "out") - logits).abs().max().item() <= TOL


class _Call:
    """Pickles as a call of `fn(arg)`."""

    def __init__(self, fn, arg):
        self.fn, self.arg = fn, arg

    def __reduce__(self):
        return (self.fn, (self.arg,))


@pytest.mark.parametrize("fn, name", [(os.system, "posix.system"), (builtins.eval, "eval")])
def test_foreign_callables_are_refused(tmp_path, fn, name):
    marker = tmp_path / "ran"
    code = f"touch {marker}" if fn is os.system else f"open({str(marker)!r}, 'w')"
    path = tmp_path / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt"
    path.parent.mkdir(parents=True)
    torch.save({"args": _Call(fn, code), "model": {}}, path)
    with pytest.raises(MlmError, match=rf"model_optim_rng\.pt: names {name}, which is outside the classes"):
        import_megatron(tmp_path / "iter_0000001", tmp_path / "out")
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_missing_rank_file_is_named(tmp_path):
    """A tp 2 set with mp_rank_01 absent: named, nothing written."""
    import argparse

    folder = tmp_path / "iter_0000010" / "mp_rank_00"
    folder.mkdir(parents=True)
    args = argparse.Namespace(
        tensor_model_parallel_size=2, pipeline_model_parallel_size=1, num_attention_heads=4
    )
    model = {"embedding.word_embeddings.weight": torch.zeros(4, 4)}
    torch.save({"args": args, "iteration": 10, "model": model}, folder / "model_optim_rng.pt")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("10")
    with pytest.raises(MlmError, match=r"tp 2 · pp 1 · ep 1, so it should hold mp_rank_00, mp_rank_01; "
                       r"mp_rank_01/model_optim_rng\.pt missing"):  # fmt: skip
        import_megatron(tmp_path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _write_stages(root, chunks_by_stage: list[list[int]], **args) -> None:
    """A legacy pp folder whose layer <n> of each chunk holds an input_layernorm filled with the
    global layer number the chunk order gives it (chunks_by_stage[p][v]: chunk v's layer count;
    `args` over the sizes)."""
    import argparse

    pp, vpp = len(chunks_by_stage), len(chunks_by_stage[0])
    number = 0
    chunks: dict[tuple[int, int], dict] = {}
    for v in range(vpp):
        for p in range(pp):
            chunks[p, v] = {}
            for n in range(chunks_by_stage[p][v]):
                chunks[p, v][f"decoder.layers.{n}.input_layernorm.weight"] = torch.full((4,), float(number))
                number += 1
    sizes = dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=pp, num_layers=number) | args
    for p in range(pp):
        state = {"args": argparse.Namespace(**sizes), "iteration": 3}
        state.update({"model": chunks[p, 0]} if vpp == 1 else {f"model{v}": chunks[p, v] for v in range(vpp)})
        folder = root / f"mp_rank_00_{p:03d}"
        folder.mkdir(parents=True)
        torch.save(state, folder / "model_optim_rng.pt")


@pytest.mark.parametrize(
    "chunks",
    [[[2, 1], [1, 2]], [[1], [3]], [[0, 2], [1, 1], [2, 0]]],
    ids=["vpp2", "uneven", "vpp2-pp3-uneven"],
)
def test_pipeline_chunks_number_layers_in_pipeline_order(tmp_path, chunks):
    """Virtual pipeline chunks and uneven stages: global layer = the layers of every chunk before it
    (chunk 0 of every stage, then chunk 1, …) + the local number (no megatron needed)."""
    from mlm.convert.megatron.legacy import LegacyCheckpoint

    _write_stages(tmp_path, chunks)
    ckpt = LegacyCheckpoint(tmp_path)
    total = sum(map(sum, chunks))
    assert sorted(ckpt.tensors) == sorted(f"decoder.layers.{n}.input_layernorm.weight" for n in range(total))
    for n in range(total):
        assert ckpt.read(f"decoder.layers.{n}.input_layernorm.weight").tolist() == [float(n)] * 4


def test_layer_count_checked_against_args(tmp_path):
    from mlm.convert.megatron.legacy import LegacyCheckpoint

    _write_stages(tmp_path, [[1], [1]], num_layers=4)
    with pytest.raises(
        MlmError, match="the pipeline chunks hold 2 layers but the Megatron args say num_layers=4"
    ):
        LegacyCheckpoint(tmp_path)
