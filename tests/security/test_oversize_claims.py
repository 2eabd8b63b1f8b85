"""Sizes and counts that a header merely claims are bounded by what the files hold before anything
is allocated or looped over (issue 36, item 6): safetensors header lengths and offsets, the rank
folders of Megatron's args, the layers of a config, the shapes of a manifest, the context a KV
cache is sized by. Each is one error naming the file and field.

`test_refusals_stay_under_1_gb` runs refusals of every class of the issue (a hostile pickle, names
and links leading out, claimed sizes, a tokenizer outside, a corrupt `.idx`) through the CLI in one
child process and reads its peak resident memory after each: under 1 GB (435 MB measured, most of
it torch)."""

from __future__ import annotations

import argparse
import json
import math
import pickle
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from mlm.checkpoint import checkpoint_config, read_group, read_manifest
from mlm.checkpoint.manager import save_streaming
from mlm.config import MAX_LAYERS, load_config
from mlm.convert.hf.folder import export_hf, import_hf
from mlm.convert.megatron.legacy import LegacyCheckpoint
from mlm.convert.reshard import reshard
from mlm.convert.safetensors_header import read_header
from mlm.errors import MlmError
from mlm.inference.kv_cache import PagedKVCache
from mlm.model.gpt import GPT
from tests.helpers.common import ROOT

SETS = ["preset=tiny-llama", "model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=2"]
SETS += ["model.vocab_size=64", "data.seq_length=16"]


def _checkpoint(root, sets=()):
    config = load_config(None, [*SETS, *sets])
    state = GPT(config.model).state_dict()
    tensors = (("model", k, t, tuple(t.shape)) for k, t in state.items())
    return save_streaming(root, 1, tensors, {"config": config.to_dict()}, ["model"])


def _edit_manifest(it_dir, edit) -> None:
    path = it_dir / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


def _claim_shape(it_dir, key: str, shape: list[int]) -> None:
    """The manifest and the array's zarr.json both claim `shape`; the chunk files stay as they are."""

    def edit(m):
        m["tensors"][key]["shape"] = shape

    _edit_manifest(it_dir, edit)
    meta_path = it_dir / key / "zarr.json"
    meta = json.loads(meta_path.read_text())
    meta["shape"] = shape
    meta_path.write_text(json.dumps(meta))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("claims")
    _checkpoint(root / "ckpt")
    export_hf(root / "ckpt", root / "hf", verify=False)
    return root / "hf"


def _safetensors(path, header: bytes, data: bytes = b"", length: int | None = None) -> None:
    path.write_bytes(struct.pack("<Q", len(header) if length is None else length) + header + data)


@pytest.mark.parametrize(
    ("length", "header", "data", "message"),
    [
        (2**63, b"{}", b"", r"header length 9223372036854775808 is more than the 2 bytes after it"),
        (2**40, b"{}", b"", r"header length 1099511627776 is more than"),
        (None, b"[1]", b"", r"the header is not a JSON object"),
        (None, b"{", b"", r"the header is not JSON"),
        (None, b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 16]}}', b"\0" * 8, r"not a range"),
        (None, b'{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}', b"\0" * 8, r"takes 16"),
        (None, b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}}', b"\0" * 8, r"not a range"),
        (None, b'{"w": {"dtype": "O", "shape": [1], "data_offsets": [0, 8]}}', b"\0" * 8, r"dtype 'O'"),
        (None, b'{"w": {"dtype": "F32", "shape": [1e3], "data_offsets": [0, 8]}}', b"\0" * 8, r"not a list"),
        (
            None,
            b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, '
            b'"b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}',
            b"\0" * 12,
            r"tensors 'a' and 'b' overlap",
        ),
    ],
)
def test_a_safetensors_header_is_checked_against_its_file(tmp_path, length, header, data, message):
    path = tmp_path / "model.safetensors"
    _safetensors(path, header, data, length)
    with pytest.raises(MlmError, match=rf"model\.safetensors: .*{message}"):
        read_header(path)


def test_a_relabelled_header_is_refused_before_import(tmp_path, hf_dir):
    hf = tmp_path / "hf"
    hf.mkdir()
    for f in hf_dir.iterdir():
        (hf / f.name).write_bytes(f.read_bytes())
    data = bytearray((hf / "model.safetensors").read_bytes())
    struct.pack_into("<Q", data, 0, 2**40)
    (hf / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(MlmError, match=r"model\.safetensors: header length 1099511627776"):
        import_hf(hf, tmp_path / "out", verify=False)
    assert not (tmp_path / "out").exists()


def test_megatron_args_claiming_ten_billion_rank_folders(tmp_path):
    rank = tmp_path / "iter_0000001" / "mp_rank_00_000"
    rank.mkdir(parents=True)
    args = argparse.Namespace(tensor_model_parallel_size=10**5, pipeline_model_parallel_size=10**5)
    torch.save({"args": args, "iteration": 1, "model": {}}, rank / "model_optim_rng.pt")
    with pytest.raises(
        MlmError, match=r"tp 100000 · pp 100000 · ep 1, so 10000000000 rank folders, but it holds 1"
    ):
        LegacyCheckpoint(tmp_path / "iter_0000001")


def test_a_config_of_ten_million_layers_is_refused_before_its_layers_are_walked():
    with pytest.raises(MlmError, match=rf"model\.num_layers=10000000 .*more than {MAX_LAYERS} layers"):
        load_config(None, [*SETS[:1], "model.num_layers=10000000"])


def test_hf_config_layers_beyond_the_tensors_present(tmp_path, hf_dir):
    hf = tmp_path / "hf"
    hf.mkdir()
    for f in hf_dir.iterdir():
        (hf / f.name).write_bytes(f.read_bytes())
    config = json.loads((hf / "config.json").read_text())
    config["num_hidden_layers"] = 1000
    (hf / "config.json").write_text(json.dumps(config))
    with pytest.raises(MlmError, match=r"the config says 1000 layers, but the weights hold 21 tensors"):
        import_hf(hf, tmp_path / "out", verify=False)


@pytest.mark.parametrize("layers", [1000, 10**7])
def test_a_manifest_config_deeper_than_its_tensors(tmp_path, layers):
    it_dir = _checkpoint(tmp_path / "src")
    _edit_manifest(it_dir, lambda m: m["config"]["model"].update(num_layers=layers))
    message = (
        "says 1000 layers, but the weights hold 21 tensors" if layers == 1000 else "more than 4096 layers"
    )
    with pytest.raises(MlmError, match=message):
        checkpoint_config(read_manifest(it_dir), it_dir)
    with pytest.raises(MlmError, match=message):
        reshard(tmp_path / "src", tmp_path / "out", tp=1, pp=1)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("rows", [10**12, 2**62 - 1, 129])
def test_a_manifest_shape_beyond_its_chunk_files(tmp_path, rows):
    it_dir = _checkpoint(tmp_path / "src")
    _claim_shape(it_dir, "model/embed.weight", [rows, 32])
    count = math.ceil(rows / 128)
    with pytest.raises(
        MlmError, match=rf"holds 1 chunk files; shape \[{rows}, 32\] in chunks of \[128, 32\] needs {count}"
    ):
        read_group(tmp_path / "src")
    with pytest.raises(MlmError, match="chunk files"):
        reshard(tmp_path / "src", tmp_path / "out", tp=1, pp=1)


@pytest.mark.parametrize("shape", [[2**62], [-1], ["8"], [1.5]])
def test_a_manifest_shape_that_is_not_sizes(tmp_path, shape):
    it_dir = _checkpoint(tmp_path / "src")
    _edit_manifest(it_dir, lambda m: m["tensors"]["model/final_norm.weight"].update(shape=shape))
    with pytest.raises(MlmError, match=r"tensor model/final_norm\.weight: .* does not give a shape"):
        read_manifest(it_dir)


def test_a_manifest_shape_other_than_its_array(tmp_path):
    it_dir = _checkpoint(tmp_path / "src")
    _edit_manifest(it_dir, lambda m: m["tensors"]["model/final_norm.weight"].update(shape=[10**12]))
    with pytest.raises(
        MlmError,
        match=r"final_norm\.weight/zarr\.json says .*'shape': \[32\].*, the manifest .*1000000000000",
    ):
        read_group(tmp_path / "src")


def test_a_chunk_file_linked_out_of_the_checkpoint(tmp_path):
    it_dir = _checkpoint(tmp_path / "src")
    chunk = it_dir / "model" / "final_norm.weight" / "c" / "0"
    (tmp_path / "outside").write_bytes(chunk.read_bytes())
    chunk.unlink()
    chunk.symlink_to(tmp_path / "outside")
    with pytest.raises(MlmError, match=r"chunk file .*final_norm\.weight/c/0 is a link"):
        read_group(tmp_path / "src")


def test_a_kv_cache_larger_than_free_memory_is_refused_before_allocation():
    cfg = load_config(None, [*SETS, "model.max_position_embeddings=1000000000000"]).model
    with pytest.raises(
        MlmError, match=r"the KV cache of 62500000000 blocks .*max_position_embeddings=1000000000000"
    ):
        PagedKVCache(cfg, 10**12 // 16, 16, torch.float32, torch.device("cpu"))


# ---- every refusal, through the CLI, under 1 GB ---------------------------------------------------

CHILD = r"""
import contextlib, io, json, resource, sys
from cli.main import main
results = []
for argv in json.loads(sys.argv[1]):
    out = io.StringIO()
    sys.argv = ["mlm", *argv]
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            main()
        except SystemExit as e:
            code = e.code
    # this process's own peak (VmHWM): ru_maxrss also counts the parent's, which a child started
    # by vfork + exec inherits (a pytest process grown past 1 GB would fail every case)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with contextlib.suppress(OSError):
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                peak = int(line.split()[1]) * 1024
    results.append({"code": code, "output": out.getvalue(), "peak": peak})
print(json.dumps(results))
"""


class _Dtype:
    def __reduce__(self):  # numpy.dtype('O')
        return (np.dtype, ("O",))


class _ObjectArray:
    def __reduce__(self):  # numpy.ndarray((2,), dtype('O'), 16 bytes of the file): pointers
        return (np.ndarray, ((2,), _Dtype(), b"A" * 16))


def _megatron_legacy(root, **args):
    rank = root / "iter_0000001" / "mp_rank_00"
    rank.mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text("1")
    torch.save({"args": argparse.Namespace(**args), "iteration": 1, "model": {}}, rank / "model_optim_rng.pt")
    return root


def test_refusals_stay_under_1_gb(tmp_path, hf_dir, hf_tokenizer_json):
    from mlm.datasets.indexed import IndexedDatasetWriter, data_paths

    def copy_hf(name, edit_config=None, header_length=None):
        hf = tmp_path / name
        hf.mkdir()
        for f in hf_dir.iterdir():
            (hf / f.name).write_bytes(f.read_bytes())
        if edit_config:
            config = json.loads((hf / "config.json").read_text())
            config.update(edit_config)
            (hf / "config.json").write_text(json.dumps(config))
        if header_length:
            data = bytearray((hf / "model.safetensors").read_bytes())
            struct.pack_into("<Q", data, 0, header_length)
            (hf / "model.safetensors").write_bytes(bytes(data))
        return hf

    deep = _checkpoint(tmp_path / "deep")
    _edit_manifest(deep, lambda m: m["config"]["model"].update(num_layers=10**7))
    wide = _checkpoint(tmp_path / "wide")
    _claim_shape(wide, "model/embed.weight", [2**62 - 1, 32])
    long_context = _checkpoint(tmp_path / "long")
    _edit_manifest(long_context, lambda m: m["config"]["model"].update(max_position_embeddings=10**12))
    linked = _checkpoint(tmp_path / "linked")
    (linked / "model" / "L").symlink_to(linked / "model")
    _edit_manifest(
        linked, lambda m: m["tensors"].update({"model/L/../../../x": m["tensors"]["model/embed.weight"]})
    )
    prefix = tmp_path / "data"
    bin_path, idx_path = data_paths(prefix)
    w = IndexedDatasetWriter(bin_path, idx_path, np.uint16)
    w.add_documents(np.arange(10, dtype=np.uint16), np.array([3, 3, 4]))
    w.finalize()
    idx = bytearray(idx_path.read_bytes())
    struct.pack_into("<i", idx, struct.calcsize("<9sQBQQ") + 4, 2**31 - 1)  # a middle length
    idx_path.write_bytes(bytes(idx))
    dcp_dir = tmp_path / "dcp"
    dcp.save({"w": torch.arange(4.0)}, checkpoint_id=dcp_dir, no_dist=True)
    meta = pickle.loads((dcp_dir / ".metadata").read_bytes())
    for info in meta.storage_data.values():
        info.relative_path = "../outside.distcp"
    (dcp_dir / ".metadata").write_bytes(pickle.dumps(meta))
    hf_index = copy_hf("hf_index")
    (hf_index / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "../x.safetensors"}})
    )
    elsewhere = _checkpoint(tmp_path / "elsewhere")
    (tmp_path / "elsewhere" / "latest").write_text(f"../deep/{elsewhere.name}\n")
    secret = tmp_path / "credentials.json"
    secret.write_text('{"key": "canary"}')
    outside_tokenizer = _checkpoint(tmp_path / "outside_tokenizer", [f"data.tokenizer={secret}"])
    out = tmp_path / "out"
    cases = [
        (
            ["convert", "from-hf", copy_hf("hf_header", header_length=2**40), out],
            "header length 1099511627776",
        ),
        (
            ["convert", "from-hf", copy_hf("hf_deep", {"num_hidden_layers": 10**7}), out],
            "more than 4096 layers",
        ),
        (["convert", "reshard", tmp_path / "deep", out, "--tp", "1"], "more than 4096 layers"),
        (["convert", "reshard", tmp_path / "wide", out, "--tp", "1"], "needs 36028797018963968"),
        (["export", "hf", tmp_path / "wide", out], "needs 36028797018963968"),
        (["convert", "reshard", tmp_path / "linked", out, "--tp", "1"], "is not GROUP/KEY"),
        (
            ["generate", tmp_path / "long", "-p", "hi", "--tokenizer", hf_tokenizer_json, "--device", "cpu"],
            "max_position_embeddings=1000000000000",
        ),
        (
            [
                "convert",
                "from-megatron",
                _megatron_legacy(
                    tmp_path / "mp", tensor_model_parallel_size=10**5, pipeline_model_parallel_size=10**5
                ),
                out,
            ],
            "10000000000 rank folders",
        ),
        (
            [
                "convert",
                "from-megatron",
                _megatron_legacy(tmp_path / "obj", num_layers=1, hostile=_ObjectArray()),
                out,
            ],
            "numpy dtype 'O'",
        ),
        (["data", "inspect", prefix], "sequence 1 has length 2147483647"),
        (["convert", "from-megatron", dcp_dir, out], "names the data file '../outside.distcp'"),
        (["convert", "from-hf", hf_index, out], "weight_map names '../x.safetensors'"),
        (["convert", "reshard", tmp_path / "elsewhere", out, "--tp", "1"], "latest"),
        (["export", "hf", outside_tokenizer.parent, out], "pass --tokenizer PATH"),
    ]
    argvs = [[str(a) for a in argv] for argv, _ in cases]
    r = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(argvs)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads(r.stdout.splitlines()[-1])
    for (argv, fragment), result in zip(cases, results, strict=True):
        lines = [line for line in result["output"].splitlines() if line.strip()]
        assert result["code"] == 2 and fragment in result["output"], (argv, result["output"][-2000:])
        assert lines[-1].startswith("error:") and "Traceback" not in result["output"], result["output"][
            -2000:
        ]
        assert result["peak"] < 2**30, (argv, result["peak"])
    assert not out.exists()


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("num_attention_heads", 0, "num_attention_heads is 0; it must be a positive integer"),
        ("num_hidden_layers", 1.5, "num_hidden_layers is 1.5; it must be a positive integer"),
        ("hidden_size", True, "hidden_size is True; it must be a positive integer"),
        ("rms_norm_eps", "x", "rms_norm_eps is x; it must be a positive number"),
    ],
)
def test_hf_config_counts_are_checked_by_name(tmp_path, hf_dir, field, value, message):
    from mlm.convert.hf.io import read_hf_config

    (tmp_path / "config.json").write_text(
        json.dumps({**json.loads((hf_dir / "config.json").read_text()), field: value})
    )
    with pytest.raises(MlmError, match=rf"config\.json: {message}"):
        read_hf_config(tmp_path)
