"""Train/valid/test datasets from a blend of indexed datasets (Megatron's `--data-path`): text
(GPTDataset) or conversations (SFTDataset).

A blend is `[(weight, prefix), ...]`; one prefix alone needs no weight. Each split is a
GPTDataset of one prefix, or a BlendedDataset over one GPTDataset per prefix, each asked for
exactly the samples the blend takes from it.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

from mlm.config import Config
from mlm.datasets.blended import BlendedDataset, samples_per_dataset
from mlm.datasets.gpt import SPLIT_NAMES, GPTDataset, GPTDatasetConfig
from mlm.datasets.indexed import IndexedDataset
from mlm.datasets.meta import read_meta
from mlm.datasets.sft import SFTDataset
from mlm.errors import MlmError


def parse_blend(items: list[str]) -> list[tuple[float, str]]:
    """["0.3", "a", "0.7", "b"] or ["a"] → [(0.3, "a"), (0.7, "b")]."""
    if len(items) == 1:
        return [(1.0, items[0])]
    if len(items) % 2:
        raise MlmError(f"data paths {items}: give one prefix, or weight-prefix pairs such as '0.3 a 0.7 b'")
    blend = []
    for w, p in zip(items[::2], items[1::2], strict=True):
        try:
            blend.append((float(w), p))
        except ValueError:
            raise MlmError(
                f"data paths: {w!r} should be a weight before prefix {p!r} (e.g. '0.3 {p}')"
            ) from None
    return blend


def check_same_tokenizer(prefixes: list[str]) -> dict | None:
    """The tokenizer the datasets share (from their PREFIX.json), or None when none records one."""
    seen: dict | None = None
    first = None
    for p in prefixes:
        meta = read_meta(p)
        if meta is None:
            continue
        tok = meta["tokenizer"]
        if seen is None:
            seen, first = tok, p
        elif tok["sha256"] != seen["sha256"]:
            raise MlmError(
                f"{p} was tokenized with {tok['path']} (sha256 {tok['sha256'][:12]}) but {first} with "
                f"{seen['path']} (sha256 {seen['sha256'][:12]}); rebuild one so that all share a tokenizer"
            )
    return seen


def is_chat(prefixes: list[str]) -> bool:
    """Whether the datasets are conversations with loss masks (`mlm data build --chat`); all or
    none must be."""
    chat = [p for p in prefixes if ((read_meta(p) or {}).get("chat"))]
    if chat and len(chat) != len(prefixes):
        plain = next(p for p in prefixes if p not in chat)
        raise MlmError(
            f"{chat[0]} holds conversations (mlm data build --chat) but {plain} plain text; a run trains "
            "on one kind: blend chat datasets only, or plain ones only"
        )
    return bool(chat)


def build_split_datasets(
    blend: list[tuple[float, str]],
    config: GPTDatasetConfig,
    num_samples: dict[str, int],
    build: bool = True,
    packing: str = "first_fit",
) -> dict:
    """{split: dataset} for each split with a positive sample count in `num_samples`: GPTDatasets
    of text, or SFTDatasets (`packing`) of conversations."""
    prefixes = [p for _, p in blend]
    check_same_tokenizer(prefixes)
    indexed = [IndexedDataset(p) for p in prefixes]
    dataset = partial(SFTDataset, packing=packing) if is_chat(prefixes) else GPTDataset
    cache_dir = config.cache_dir or str(Path(prefixes[0]).parent / "cache")
    config = GPTDatasetConfig(config.seq_length, config.seed, config.split, cache_dir)
    out = {}
    for split in SPLIT_NAMES:
        n = num_samples.get(split, 0)
        if n <= 0:
            continue
        if len(blend) == 1:
            out[split] = dataset(indexed[0], split, n, config, build=build)
            continue
        weights = [w for w, _ in blend]
        counts = samples_per_dataset(weights, n)
        parts = [
            dataset(ds, split, max(c, 1), config, build=build) for ds, c in zip(indexed, counts, strict=True)
        ]
        description = {"split": split, "datasets": [d.description for d in parts]}
        out[split] = BlendedDataset(parts, weights, n, cache_dir, description, build=build)
    return out


def run_datasets(cfg: Config, total_iters: int, build: bool = True) -> dict:
    """{"train": ..., "valid": ...} of a run of `total_iters` steps, as `mlm train` reads them: the
    train split sized for every step's global batch, the valid split for `train.eval_iters` global
    batches where the run evaluates (`build` False: load the index cache another process built)."""
    t = cfg.train
    counts = {"train": total_iters * t.global_batch_size}
    counts["valid"] = t.eval_iters * t.global_batch_size if t.eval_interval else 0
    gcfg = GPTDatasetConfig(cfg.data.seq_length, t.seed, cfg.data.split, cfg.data.cache_dir or None)
    blend = parse_blend(cfg.data.data_path)
    return build_split_datasets(blend, gcfg, counts, build=build, packing=cfg.data.packing)
