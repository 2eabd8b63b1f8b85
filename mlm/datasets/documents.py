"""Documents packed in one training sequence (Megatron's `get_ltor_masks_and_position_ids`):
with `reset_position_ids` each document's positions start again at 0 after an end-of-document
token; with `reset_attention_mask` a token attends only within its own document. The
end-of-document token closes its document (it belongs to the one it ends). `PackedBatch` is the same for packed
conversations, whose boundaries and loss mask come from the dataset."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch


@dataclass(frozen=True)
class DocumentLayout:
    eod_id: int
    reset_position_ids: bool
    reset_attention_mask: bool

    def __call__(self, inputs_BT: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(document index of every token or None, position of every token or None)."""
        B, T = inputs_BT.shape
        begins = torch.zeros_like(inputs_BT, dtype=torch.bool)
        begins[:, 0] = True
        begins[:, 1:] = inputs_BT[:, :-1] == self.eod_id
        documents = torch.cumsum(begins, 1) - 1 if self.reset_attention_mask else None
        positions = None
        if self.reset_position_ids:
            t = torch.arange(T, device=inputs_BT.device).expand(B, T)
            start = torch.cummax(torch.where(begins, t, torch.zeros_like(t)), dim=1).values
            positions = t - start
        return documents, positions


class PackedBatch(NamedTuple):
    """Micro-batch of packed conversations (`mlm.datasets.sft`), [B, T] each: what the model reads,
    what it predicts, which predictions the loss counts, and the document layout."""

    inputs: torch.Tensor
    labels: torch.Tensor
    weights: torch.Tensor
    """float32: 1 where the label is a target of its own conversation, else 0."""
    documents: torch.Tensor
    positions: torch.Tensor

    @staticmethod
    def of(samples: list, device: torch.device) -> PackedBatch:
        """From `PackedSample`s of T + 1 tokens: input t predicts token t + 1 where both belong to
        the same conversation and the mask marks t + 1 as a target; positions restart at 0 with
        each conversation."""
        tokens = torch.from_numpy(np.stack([s.tokens for s in samples])).to(device)
        targets = torch.from_numpy(np.stack([s.targets for s in samples])).to(device)
        docs = torch.from_numpy(np.stack([s.documents for s in samples])).to(device)
        same = docs[:, 1:] == docs[:, :-1]
        weights = (same & (targets[:, 1:] > 0)).float()
        documents = docs[:, :-1]
        B, T = documents.shape
        t = torch.arange(T, device=device).expand(B, T)
        begins = torch.ones_like(documents, dtype=torch.bool)
        begins[:, 1:] = ~same[:, :-1]
        start = torch.cummax(torch.where(begins, t, torch.zeros_like(t)), dim=1).values
        return PackedBatch(tokens[:, :-1], tokens[:, 1:], weights, documents, t - start)

    @property
    def targets(self) -> torch.Tensor:
        """How many predictions the loss counts (int64)."""
        return (self.weights > 0).sum()
