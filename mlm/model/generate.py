"""Greedy decoding without a cache: for samples printed during training (the serving engine
with a KV cache is `mlm serve`'s)."""

from __future__ import annotations

import torch

from mlm.model.gpt import GPT


@torch.no_grad()
def greedy(
    model: GPT, prompt_ids: list[int], max_new_tokens: int, stop_id: int | None = None, logits_fn=None
) -> list[int]:
    """The prompt's continuation (new ids only), stopping early at `stop_id`. `logits_fn(ids)`
    replaces `model(ids)` where the logits need gathering (tensor parallelism)."""
    logits_fn = logits_fn or model
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    vocab = model.cfg.vocab_size
    out: list[int] = []
    for _ in range(max_new_tokens):
        window = ids[:, -model.cfg.max_position_embeddings :]
        nxt = int(logits_fn(window)[0, -1, :vocab].argmax())
        if nxt == stop_id:
            break
        out.append(nxt)
        ids = torch.cat([ids, ids.new_tensor([[nxt]])], dim=1)
    model.train(was_training)
    return out
