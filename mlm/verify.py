"""mlm's logits on a fixed prompt: how a stage that rewrites a checkpoint (convert, export)
checks what it wrote.

    logits = prompt_logits(state, cfg, padded_vocab)   # [1, T, vocab], fp32, CPU
"""

from __future__ import annotations

import torch

from mlm.config import ModelConfig
from mlm.model.gpt import GPT

PROMPT_LENGTH = 16


def prompt(vocab_size: int, max_positions: int) -> torch.Tensor:
    """A fixed [1, T] prompt spread over the vocabulary (T = 16, or fewer positions if the model has them)."""
    n = min(PROMPT_LENGTH, max_positions)
    return torch.tensor([[(7919 * i + 13) % vocab_size for i in range(n)]])


def prompt_logits(state: dict[str, torch.Tensor], cfg: ModelConfig, padded_vocab: int) -> torch.Tensor:
    """Logits of `GPT(cfg)` holding `state` (upcast to fp32) on the fixed prompt, [1, T, vocab]."""
    with torch.device("meta"):
        model = GPT(cfg, padded_vocab)
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=True, assign=True)
    model.set_attention_backend("sdpa", torch.device("cpu"))
    with torch.no_grad():
        return model.eval()(prompt(cfg.vocab_size, cfg.max_position_embeddings))[..., : cfg.vocab_size]
