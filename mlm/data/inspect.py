"""`mlm data inspect`: counts, length and token-id summaries, and the first documents decoded."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from mlm.datasets.indexed import IndexedDataset
from mlm.datasets.meta import read_meta
from mlm.tokenizer import load_tokenizer


@dataclass
class Inspection:
    prefix: str
    dtype: str
    documents: int
    empty_documents: int
    sequences: int
    tokens: int
    length_percentiles: dict[str, int]
    top_tokens: list[tuple[int, int, str]]  # (id, count, piece)
    distinct_tokens: int
    max_token_id: int
    meta: dict | None
    samples: list[str] = field(default_factory=list)


def inspect_dataset(
    prefix: str, num_docs: int = 3, tokenizer: str | None = None, max_chars: int = 400
) -> Inspection:
    ds = IndexedDataset(prefix)
    meta = read_meta(prefix)
    lengths = np.asarray(ds.sequence_lengths)
    doc_seq_counts = np.diff(np.asarray(ds.document_indices))
    qs = (0, 50, 90, 99, 100)
    pct = {}
    if len(lengths):
        pct = dict(
            zip(
                ("min", "p50", "p90", "p99", "max"), (int(x) for x in np.percentile(lengths, qs)), strict=True
            )
        )
    # Token-id histogram over (at most) the first 50M tokens: enough for a summary, bounded in time.
    tokens = np.asarray(ds._bin[:50_000_000])
    counts = np.bincount(tokens.astype(np.int64)) if len(tokens) else np.zeros(0, np.int64)
    top = np.argsort(counts)[::-1][:10]
    tok_path = tokenizer or (meta["tokenizer"]["path"] if meta else None)
    tok = load_tokenizer(tok_path) if tok_path else None
    pieces = [tok.decode([int(t)]) if tok else "" for t in top]
    samples = []
    for d in range(min(num_docs, ds.num_documents)):
        ids = ds.document(d)
        text = tok.decode(ids.tolist()) if tok else " ".join(map(str, ids[:64].tolist()))
        samples.append(text[:max_chars])
    return Inspection(
        prefix=prefix,
        dtype=ds.dtype.name,
        documents=ds.num_documents,
        empty_documents=int((doc_seq_counts == 0).sum()),
        sequences=len(ds),
        tokens=ds.num_tokens,
        length_percentiles=pct,
        top_tokens=[(int(t), int(counts[t]), p) for t, p in zip(top, pieces, strict=True) if counts[t] > 0],
        distinct_tokens=int((counts > 0).sum()),
        max_token_id=int(len(counts) - 1),
        meta=meta,
        samples=samples,
    )
