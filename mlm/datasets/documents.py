"""Documents packed in one training sequence (Megatron's `get_ltor_masks_and_position_ids`):
with `reset_position_ids` each document's positions start again at 0 after an end-of-document
token; with `reset_attention_mask` a token attends only within its own document. The
end-of-document token closes its document (it belongs to the one it ends)."""

from __future__ import annotations

from dataclasses import dataclass

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
