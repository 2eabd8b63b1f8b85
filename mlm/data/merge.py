"""`mlm data merge`: concatenate indexed datasets into one (Megatron's merge_datasets.py)."""

from __future__ import annotations

import json

from mlm.datasets.builder import check_same_tokenizer
from mlm.datasets.indexed import IndexedDataset, IndexedDatasetWriter, data_paths
from mlm.datasets.meta import meta_path, new_meta, read_meta
from mlm.errors import MlmError
from mlm.fileio import atomic_outputs, check_writable


def merge_datasets(inputs: list[str], output_prefix: str, overwrite: bool = False) -> dict:
    if len(inputs) < 2:
        raise MlmError(f"merge needs at least two input prefixes, got {len(inputs)}")
    datasets = [IndexedDataset(p) for p in inputs]
    dtypes = {d.dtype.name for d in datasets}
    if len(dtypes) > 1:
        found = ", ".join(f"{d.path_prefix}={d.dtype.name}" for d in datasets)
        raise MlmError(
            f"cannot merge datasets of different dtypes ({found}); rebuild them with the same --dtype"
        )
    tokenizer = check_same_tokenizer(inputs)
    bin_path, idx_path = data_paths(output_prefix)
    finals = [bin_path, idx_path, meta_path(output_prefix)]
    check_writable(finals, overwrite)
    with atomic_outputs(finals) as (tmp_bin, tmp_idx, tmp_meta):
        writer = IndexedDatasetWriter(tmp_bin, tmp_idx, datasets[0].dtype)
        try:
            for d in datasets:
                writer.add_dataset(d)
        finally:
            writer.close()
        writer.finalize()
        metas = [read_meta(p) for p in inputs]
        meta = new_meta(
            tokenizer=tokenizer,
            dtype=writer.dtype.name,
            append_eod=all(m and m.get("append_eod") for m in metas),
            documents=writer.num_documents,
            empty_documents=writer.num_empty_documents,
            sequences=writer.num_sequences,
            tokens=writer.num_tokens,
            sources=[{"merged_from": p} for p in inputs],
        )
        tmp_meta.write_text(json.dumps(meta, indent=2) + "\n")
    return meta
