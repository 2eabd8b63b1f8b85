"""`mlm export trtllm --check DIR`: is DIR a TensorRT-LLM checkpoint of a model mlm reads, laid out
as TensorRT-LLM's converters lay it out? What is checked: docs/trtllm.md ("What is checked before
OUT appears", step 1). No tensor is read, only config.json and the safetensors headers.

    problems = check_trtllm("out/trt")   # [] when it passes
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

from mlm.convert.safetensors_header import read_header
from mlm.convert.trtllm.config import read_trt_config
from mlm.convert.trtllm.names import rank_rules, shard, sources
from mlm.errors import MlmError
from mlm.fileio import read_json
from mlm.model.gpt import GPT

CONFIG = "config.json"
_ST_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}  # safetensors → TensorRT-LLM


def rank_file(rank: int) -> str:
    return f"rank{rank}.safetensors"


def read_config(path: Path) -> dict:
    return read_json(path / CONFIG, missing="not found; is it a TensorRT-LLM checkpoint folder?")


def expected_shapes(config: dict) -> list[dict[str, tuple[tuple[int, ...], str | None]]]:
    """Per rank: TensorRT-LLM name → (shape, the dtype it is stored in whatever config.json's, or
    None for config.json's), for the model config.json describes."""
    cfg, arch, tp, pp = read_trt_config(config)
    with torch.device("meta"):
        state = GPT(cfg).state_dict()
    out = []
    for rank in range(tp * pp):
        shapes = {}
        for name, rule, layer in rank_rules(arch, cfg, tp, pp, rank):
            tensors = [state[k] for k in sources(rule, layer, cfg)]
            shapes[name] = (tuple(shard(rule, tensors, cfg, tp, rank % tp).shape), rule.dtype)
        out.append(shapes)
    return out


def check_trtllm(path: str | os.PathLike) -> list[str]:
    """Every way the folder differs from the layout its config.json implies; [] when none."""
    path = Path(path)
    if not path.is_dir():
        raise MlmError(
            f"{path}: no such folder; pass a TensorRT-LLM checkpoint folder (config.json + rank*.safetensors)"
        )
    config = read_config(path)
    try:
        want = expected_shapes(config)
    except MlmError as e:
        return [str(e)]
    present = {p.name for p in path.glob("rank*.safetensors")}
    names = [rank_file(r) for r in range(len(want))]
    problems = [f"{n} is missing (mapping world_size={len(want)})" for n in names if n not in present]
    problems += [f"{n}: not a rank of mapping world_size={len(want)}" for n in sorted(present - set(names))]
    for where, shapes in zip(names, want, strict=True):
        if where in present:
            problems += _rank_problems(where, read_header(path / where), shapes, config["dtype"])
    if not problems and importlib.util.find_spec("tensorrt_llm") is not None:
        problems += _check_with_tensorrt_llm(path, config)
    return problems


def _rank_problems(where: str, header: dict, shapes: dict, dtype: str) -> list[str]:
    """How the tensors of one rank file (its safetensors `header`) differ from `shapes`."""
    found = {k: (e.shape, _ST_DTYPES.get(e.dtype, e.dtype)) for k, e in header.items()}
    problems = [f"{where}: {k} is missing" for k in shapes if k not in found]
    problems += [f"{where}: {k} is not a tensor of this rank" for k in sorted(found.keys() - shapes.keys())]
    for k, (shape, fixed) in shapes.items():
        if k not in found:
            continue
        got, got_dtype = found[k]
        if got != shape:
            problems.append(f"{where}: {k} has shape {list(got)}, the config needs {list(shape)}")
        if got_dtype != (fixed or dtype):
            need = f"TensorRT-LLM stores it in {fixed}" if fixed else f"config.json dtype is {dtype}"
            problems.append(f"{where}: {k} is {got_dtype}, {need}")
    return problems


def _check_with_tensorrt_llm(path: Path, config: dict) -> list[str]:
    """TensorRT-LLM's own reading of config.json (GPU machines, where it is installed)."""
    from tensorrt_llm.models.modeling_utils import PretrainedConfig

    theirs = PretrainedConfig.from_checkpoint(str(path))
    got = (theirs.architecture, theirs.mapping.world_size, theirs.mapping.tp_size, theirs.mapping.pp_size)
    mapping = config["mapping"]
    want = (config["architecture"], mapping["world_size"], mapping["tp_size"], mapping["pp_size"])
    return [] if got == want else [f"tensorrt_llm reads {got} from config.json, mlm wrote {want}"]


def check_or_raise(path: str | os.PathLike) -> None:
    problems = check_trtllm(path)
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise MlmError(f"{path} is not a valid TensorRT-LLM checkpoint: {'; '.join(problems[:5])}{more}")
