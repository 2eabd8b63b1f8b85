"""TensorRT-LLM checkpoint → mlm: the inverse of the export, for checking exports and for users who
have TensorRT-LLM checkpoints (Llama-family or GPT-2, unquantized).

    cfg, state = read_trtllm("out/trt")          # global mlm tensors, in memory
    import_trtllm("out/trt", "ckpt/from-trt")   # → ckpt/from-trt/{latest, iter_0000000/, config.toml}

The folder is checked first (`check`); KV heads repeated over tp ranks and tensors every
tp rank holds whole must agree between ranks, and with tied embeddings `lm_head` must equal the
embedding. The vocabulary rows are padded with zeros to mlm's `make_vocab_size_divisible_by`.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import load_file

from mlm.checkpoint import read_group
from mlm.config import Config, DataConfig, ModelConfig
from mlm.convert.common import Progress, Report, noop, write_import
from mlm.convert.trtllm.check import check_or_raise, rank_file, read_config
from mlm.convert.trtllm.config import read_trt_config
from mlm.convert.trtllm.names import gather, rank_rules, sources
from mlm.errors import MlmError
from mlm.fileio import check_new_dir
from mlm.model.gpt import VOCAB_ROWS


def read_trtllm(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(mlm model, global mlm state dict) of a TensorRT-LLM checkpoint folder, in its stored dtype."""
    path = Path(path)
    check_or_raise(path)
    cfg, arch, tp, pp = read_trt_config(read_config(path))
    state: dict[str, torch.Tensor] = {}
    for pp_rank in range(pp):
        files = [load_file(path / rank_file(pp_rank * tp + r)) for r in range(tp)]
        for name, rule, layer in rank_rules(arch, cfg, tp, pp, pp_rank * tp):
            keys = sources(rule, layer, cfg)
            parts = gather(name, rule, [f[name] for f in files], cfg, tp)
            for key, t in zip(keys, parts, strict=True):
                if key in state:  # lm_head of tied embeddings: must be the embedding
                    if not torch.equal(state[key], t):
                        raise MlmError(
                            f"{path}: config.json ties the embeddings (tie_word_embeddings=true) but lm_head.weight "
                            "differs from transformer.vocab_embedding.weight; set it to false for this checkpoint"
                        )
                    continue
                state[key] = t
    V = cfg.padded_vocab_size()
    for key in VOCAB_ROWS:
        if key in state:
            t = state[key]
            state[key] = torch.cat([t, t.new_zeros(V - t.shape[0], *t.shape[1:])])
    return cfg, state


def import_trtllm(path: str | os.PathLike, out: str | os.PathLike, progress: Progress = noop) -> Report:
    """TensorRT-LLM checkpoint folder → mlm checkpoint folder `out` (iteration 0, group "model"),
    written beside `out` and renamed into place once read back bit for bit."""
    path, out = Path(path), Path(out)
    check_new_dir(out)
    report = Report("import", path, out, "")
    cfg, state = read_trtllm(path)
    report.architecture = read_config(path)["architecture"]
    config = Config(
        model=cfg, data=DataConfig(seq_length=min(DataConfig().seq_length, cfg.max_position_embeddings))
    )

    def read_back(tmp: Path, *_) -> None:
        stored = read_group(tmp)[0]
        bad = [k for k, t in state.items() if not torch.equal(stored[k], t)]
        if bad or stored.keys() != state.keys():
            raise MlmError(f"verification failed: {out} does not read back as written ({bad}); this is a bug")
        report.verified = True

    extra = {"source": {"trtllm_dir": str(path.resolve()), "architecture": report.architecture}}
    items = (("model", k, t) for k, t in state.items())
    total = sum(t.numel() * t.element_size() for t in state.values())
    return write_import(out, report, 0, items, extra, ["model"], config, progress, total, check=read_back)
