"""What the conversions share: dtypes, staging OUT beside its final name, and mlm's own logits on
the verification prompt."""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from mlm.config import ModelConfig
from mlm.errors import MlmError
from mlm.model.gpt import GPT

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Max |logit difference| allowed, relative to max(1, max |logit|) (both sides computed in fp32 on
# the CPU). Bit-exact conversions differ only by the order of operations: measured 5e-7 relative
# (1.4e-6 at max |logit| 2.8) on tests/test_convert_hf.py's Llama and GPT-2. Casting the weights
# to bf16 / fp16 on export moves the logits by their rounding: measured 9.2e-3 (bf16) and 1.4e-3
# (fp16) relative there; the tolerances leave 5-20× room for deeper models, while a wrong tensor
# (swapped, transposed or misplaced) moves the logits by O(1).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 5e-2, torch.float16: 1e-2}
PROMPT_LENGTH = 16


def prompt(vocab_size: int, max_positions: int) -> torch.Tensor:
    """A fixed [1, T] prompt spread over the vocabulary (T = 16, or fewer positions if the model has them)."""
    n = min(PROMPT_LENGTH, max_positions)
    return torch.tensor([[(7919 * i + 13) % vocab_size for i in range(n)]])


def mlm_logits(mlm_state: dict[str, torch.Tensor], cfg: ModelConfig, padded_vocab: int) -> torch.Tensor:
    """Logits of `GPT(cfg)` holding `mlm_state` (upcast to fp32) on the verification prompt, [1, T, vocab]."""
    with torch.device("meta"):
        model = GPT(cfg, padded_vocab)
    model.load_state_dict({k: v.float() for k, v in mlm_state.items()}, strict=True, assign=True)
    model.set_attention_backend("sdpa", torch.device("cpu"))
    with torch.no_grad():
        return model.eval()(prompt(cfg.vocab_size, cfg.max_position_embeddings))[..., : cfg.vocab_size]


def check_new(out: Path) -> None:
    if out.exists():
        raise MlmError(f"{out} already exists; pass a new output path, or remove it first (rm -r {out})")


class Staging:
    """A temporary folder beside OUT, renamed to OUT on success and removed on any failure."""

    def __init__(self, out: Path):
        self.out = out
        self.tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")

    def __enter__(self) -> Path:
        check_new(self.out)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir()
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
                free = shutil.disk_usage(self.out.parent).free
                raise MlmError(
                    f"no space left on the device while writing {self.out} ({exc.strerror}); the "
                    f"partial output was removed ({free / 1e9:.3g} GB free now): free space or choose "
                    "another OUT, then run again"
                ) from exc
            return
        check_new(self.out)
        os.rename(self.tmp, self.out)


Progress = Callable[[str, int, int], None]
"""progress(description, done, total): bytes read or written so far; total 0 for a step without a size."""


def noop(desc: str, done: int, total: int) -> None:
    pass
