"""Hugging Face model folders on disk: config.json, weight files (safetensors, sharded or not, or
`pytorch_model.bin`), safetensors shards with their index, and the tokenizer files beside them.

Weights are read one tensor at a time (`lazy_tensors`) or one file at a time
(`iter_weight_files`); `write_safetensors` writes shards of at most `max_shard_size` bytes under
`model-0000K-of-0000N.safetensors` with `model.safetensors.index.json`, as `save_pretrained` does.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import torch

from mlm.convert.common import refused_name
from mlm.convert.safetensors_header import read_header
from mlm.errors import MlmError
from mlm.fileio import read_json

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"


def read_hf_config(hf_dir: Path) -> dict:
    """config.json of a Hugging Face model folder, with a message naming what is wrong."""
    if not hf_dir.is_dir():
        raise MlmError(f"{hf_dir}: no such directory; pass a Hugging Face model folder (with config.json)")
    path = hf_dir / "config.json"
    if not path.is_file():
        found = ", ".join(sorted(p.name for p in hf_dir.iterdir())[:10]) or "nothing"
        raise MlmError(f"{path}: not found (the folder holds {found}); is {hf_dir} a Hugging Face model?")
    config = read_json(path)
    if not isinstance(config, dict):
        raise MlmError(
            f"{path}: holds a {type(config).__name__}, not a JSON object; is {hf_dir} a Hugging Face model?"
        )
    for key, value in config.items():
        if value is None:
            continue
        if key in _COUNTS and not (type(value) is int and value >= 1):
            raise MlmError(f"{path}: {key} is {str(value)[:40]}; it must be a positive integer")
        if key in _POSITIVE and not (type(value) in (int, float) and value > 0):
            raise MlmError(f"{path}: {key} is {str(value)[:40]}; it must be a positive number")
    return config


_COUNTS = set(
    "num_hidden_layers num_attention_heads num_key_value_heads hidden_size intermediate_size "
    "moe_intermediate_size vocab_size max_position_embeddings head_dim num_experts num_experts_per_tok "
    "n_routed_experts n_layer n_head n_embd n_positions n_inner".split()
)
"""config.json fields that count something: positive integers where present (null: unset)."""
_POSITIVE = {"rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "rope_theta"}
"""config.json fields that must be positive numbers where present."""


def weight_files(hf_dir: Path) -> list[Path]:
    """The weight files to read, in order: the shards an index names, model.safetensors or
    pytorch_model.bin. Missing shards are an error that lists them."""
    for index_name in (SAFETENSORS_INDEX, BIN_INDEX):
        index = hf_dir / index_name
        if index.is_file():
            try:
                values = list(json.loads(index.read_text())["weight_map"].values())
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
                raise MlmError(f"{index}: not a valid index (needs a 'weight_map' object): {e}") from None
            bad = next((n for n in values if not isinstance(n, str) or Path(n).name != n or n == ".."), None)
            if bad is not None:  # a path would read a file outside the folder
                raise MlmError(
                    f"{index}: weight_map names {str(bad)[:120]!r}, not a file name in {hf_dir}; the index is "
                    "damaged or not a Hugging Face one"
                )
            names = list(dict.fromkeys(values))
            missing = [n for n in names if not (hf_dir / n).is_file()]
            if missing:
                raise MlmError(
                    f"{index} names {len(names)} shard file(s); missing from {hf_dir}: {', '.join(missing)}. "
                    "Download them (e.g. `hf download REPO --local-dir DIR`) and run again"
                )
            return [hf_dir / n for n in names]
    for name in (SAFETENSORS, BIN):
        if (hf_dir / name).is_file():
            return [hf_dir / name]
    raise MlmError(
        f"{hf_dir}: no weights found; expected {SAFETENSORS}, {SAFETENSORS_INDEX} with its shards, or {BIN}"
    )


def load_weight_file(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of one weight file, on the CPU (safetensors, or a torch .bin without pickled code)."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        read_header(path)  # checked first: the library's own refusals are tracebacks
        return load_file(str(path), device="cpu")
    try:
        try:  # memory-mapped where the file is in torch's zip format (all files since torch 1.6)
            return torch.load(path, weights_only=True, map_location="cpu", mmap=True)
        except RuntimeError:
            return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        raise MlmError(
            f"{path}: names {refused_name(e)}, which a state dict of tensors does not hold; it is not read "
            "(mlm reads .bin weights with torch.load(weights_only=True)); convert the model to safetensors"
        ) from None
    except Exception as e:  # noqa: BLE001 - torch raises many types for a bad file
        first = str(e).splitlines()[0] if str(e) else ""
        raise MlmError(
            f"{path}: cannot be read as a torch state dict ({type(e).__name__}: {first})"
        ) from None


def iter_weight_files(hf_dir: Path) -> Iterator[tuple[Path, dict[str, torch.Tensor]]]:
    """(file, its tensors), one weight file at a time."""
    for path in weight_files(hf_dir):
        yield path, load_weight_file(path)


def lazy_tensors(
    hf_dir: Path,
) -> tuple[dict[str, tuple[torch.Size, Callable[[], torch.Tensor]]], dict[str, tuple[Path, int, str]]]:
    """Every tensor of the folder's weight files, not read yet: (key → (shape, read), key →
    (file, byte offset of its data, safetensors dtype) for the tensors of safetensors files).
    safetensors headers (`mlm.convert.safetensors_header`) give shapes and places, and each tensor
    is read on its own; a .bin file is memory-mapped (read as pages are touched) where torch's zip
    format allows, else loaded whole."""
    tensors, ranges = {}, {}
    for path in weight_files(hf_dir):
        if path.suffix != ".safetensors":
            tensors.update({k: (t.shape, partial(lambda t: t, t)) for k, t in load_weight_file(path).items()})
            continue
        for k, entry in read_header(path).items():
            tensors[k] = (torch.Size(entry.shape), partial(_read_safetensor, path, k))
            ranges[k] = (path, entry.start, entry.dtype)
    return tensors, ranges


def _read_safetensor(path: Path, key: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor(key)


def plan_shards(state: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """Keys grouped in order into shards of at most `max_bytes` (a bigger tensor gets its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for k, t in state.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(k)
        size += n
    return shards


def write_safetensors(state: dict[str, torch.Tensor], out_dir: Path, max_bytes: int, on_shard=None) -> int:
    """Write `state` as model.safetensors, or as shards + index above `max_bytes`; returns bytes written.

    `on_shard(file_name, n_bytes)` is called after each file."""
    from safetensors.torch import save_file

    shards = plan_shards(state, max_bytes)
    n = len(shards)
    total = 0
    weight_map = {}
    for i, keys in enumerate(shards, 1):
        name = SAFETENSORS if n == 1 else f"model-{i:05d}-of-{n:05d}.safetensors"
        part = {k: state[k].contiguous() for k in keys}
        save_file(part, str(out_dir / name), metadata={"format": "pt"})
        size = sum(t.numel() * t.element_size() for t in part.values())
        total += size
        weight_map.update(dict.fromkeys(keys, name))
        if on_shard is not None:
            on_shard(name, size)
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return total


def generation_config(tokenizer_dir: Path | None) -> dict:
    """generation_config.json: the tokenizer's own if it has one, else bos/eos ids from the tokenizer
    when it names them (fields left out when not known)."""
    if tokenizer_dir is None:
        return {}
    if (tokenizer_dir / "generation_config.json").is_file():
        return json.loads((tokenizer_dir / "generation_config.json").read_text())
    from mlm.tokenizer import load_tokenizer

    try:
        tok = load_tokenizer(tokenizer_dir)
    except MlmError:
        return {}
    ids = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eod_id}
    return {k: v for k, v in ids.items() if v is not None}
