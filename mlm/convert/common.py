"""What the conversions share: the logit tolerance of each dtype, and the progress callback.
(The `--dtype` names are `mlm.units.DTYPES`; staging OUT beside its final name is
`mlm.fileio.staged_dir`; the verification prompt and mlm's logits on it are `mlm.verify`.)"""

from __future__ import annotations

from collections.abc import Callable

import torch

# Max |logit difference| allowed, relative to max(1, max |logit|) (both sides computed in fp32 on
# the CPU). Bit-exact conversions differ only by the order of operations: measured 5e-7 relative
# (1.4e-6 at max |logit| 2.8) on tests/test_convert_hf.py's Llama and GPT-2. Casting the weights
# to bf16 / fp16 on export moves the logits by their rounding: measured 9.2e-3 (bf16) and 1.4e-3
# (fp16) relative there; the tolerances leave 5-20× room for deeper models, while a wrong tensor
# (swapped, transposed or misplaced) moves the logits by O(1).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 5e-2, torch.float16: 1e-2}

Progress = Callable[[str, int, int], None]
"""progress(description, done, total): bytes read or written so far; total 0 for a step without a size."""


def noop(desc: str, done: int, total: int) -> None:
    pass
