"""What the conversions share: the logit tolerance of each dtype, the progress callback, the
report, and the writing and checking of an imported mlm checkpoint. (`--dtype` names are
`mlm.units.DTYPES`; the verification prompt and mlm's logits on it are `mlm.verify`.)"""

from __future__ import annotations

import dataclasses
import math
import pickle
import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mlm.checkpoint import read_group
from mlm.checkpoint.manager import TOKENIZER_DIR, save_streaming
from mlm.checkpoint.store import dtype_name
from mlm.config import Config, ModelConfig, to_toml
from mlm.errors import MlmError
from mlm.fileio import staged_dir
from mlm.model.gpt import GPT
from mlm.tokenizer import VOCABULARY_FILES, copy_tokenizer_files
from mlm.verify import prompt_logits

# Max |logit difference| allowed, relative to max(1, max |logit|) (both sides computed in fp32 on
# the CPU). Bit-exact conversions differ only by the order of operations: measured 5e-7 relative
# (1.4e-6 at max |logit| 2.8) on the Llama and GPT-2 of tests/interop/hf/. Casting the weights
# to bf16 / fp16 on export moves the logits by their rounding: measured 9.2e-3 (bf16) and 1.4e-3
# (fp16) relative there; the tolerances leave 5-20× room for deeper models, while a wrong tensor
# (swapped, transposed or misplaced) moves the logits by O(1).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 5e-2, torch.float16: 1e-2}

Progress = Callable[[str, int, int], None]
"""progress(description, done, total): bytes read or written so far; total 0 for a step without a size."""


def noop(desc: str, done: int, total: int) -> None:
    pass


@dataclass
class Report:
    """What a conversion did, for the summary line."""

    direction: str
    """'import' (→ mlm) or 'export' (mlm →)."""
    src: Path
    out: Path
    architecture: str
    """What the other side is, e.g. LlamaForCausalLM, Megatron-core GPTModel."""
    tensors: int = 0
    bytes: int = 0
    seconds: float = 0.0
    dtype: str = ""
    tokenizer_files: list[str] = field(default_factory=list)
    verified: bool = False
    """OUT was checked before it was kept (--verify): logits, or for a Megatron export every tensor."""
    max_abs_diff: float | None = None
    """Max |mlm logit − transformers logit| on the verification prompt; None when not compared."""
    max_abs_logit: float | None = None
    tolerance: float | None = None
    """The absolute tolerance the difference was checked against."""
    notes: list[str] = field(default_factory=list)
    """What the conversion changed or assumed that the user should know (e.g. MTP layers the weights lack)."""
    started: float = field(default_factory=time.perf_counter, repr=False)

    def finish(self) -> Report:
        """The report, its `seconds` counted from its creation."""
        self.seconds = time.perf_counter() - self.started
        return self

    def count(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """One more tensor written."""
        self.tensors += 1
        self.bytes += math.prod(shape) * dtype.itemsize
        self.dtype = ",".join(sorted({*filter(None, self.dtype.split(",")), dtype_name(dtype)}))


def refused_name(e: pickle.UnpicklingError) -> str:
    """What torch's weights-only unpickler refused, from its message: the global or function it
    names ("an object" where it names none), never its advice to load without the check."""
    text = str(e)
    named = re.search(r"GLOBAL (\S+)", text) or re.search(r"unrecognized function (.+)", text)
    return named.group(1) if named else "an object"


def model_shapes(cfg: ModelConfig, padded_vocab: int | None) -> dict[str, torch.Size]:
    """mlm's tensor shapes for `cfg` (the vocabulary padded to `padded_vocab` rows), built on the
    meta device: nothing is allocated."""
    with torch.device("meta"):
        return {k: v.shape for k, v in GPT(cfg, padded_vocab).state_dict().items()}


def write_import(
    out: Path,
    report: Report,
    iteration: int,
    items: Iterable[tuple[str, str, torch.Tensor | tuple]],
    extra: dict,
    groups: list[str],
    config: Config,
    progress: Progress,
    total: int,
    *,
    check: Callable[[Path, Config, Report, Progress], None] | None = None,
    tokenizer: Path | None = None,
) -> Report:
    """Write `items` as iteration `iteration` of the mlm checkpoint OUT, one at a time
    (`save_streaming`), with its config.toml and the tokenizer files of folder `tokenizer` (in
    OUT/tokenizer/, named by the config); built beside OUT and renamed into place once
    `check(tmp, config, report, progress)` (the verification) has passed. An item is (group, key, tensor), or (group, key,
    (shape, dtype, write)) for an array `write(path)` copies as stored. Counted in `report`,
    returned finished."""

    def tensors() -> Iterator[tuple]:
        for group, key, t in items:
            shape, dtype = (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else t[:2]
            yield (group, key, t, shape) if isinstance(t, torch.Tensor) else (group, key, t[2])
            report.count(shape, dtype)
            progress(f"{group}/{key}", report.bytes, total)

    with staged_dir(out) as tmp:
        names = copy_tokenizer_files(tokenizer, tmp / TOKENIZER_DIR) if tokenizer is not None else []
        report.tokenizer_files = names
        if set(names) & set(VOCABULARY_FILES):  # not for a generation_config.json alone
            data = dataclasses.replace(config.data, tokenizer=str((out / TOKENIZER_DIR).resolve()))
            config = dataclasses.replace(config, data=data)
        if tokenizer is not None:  # the record says the source had none
            extra = {**extra, "tokenizer": {"path": TOKENIZER_DIR, "files": names} if names else None}
        save_streaming(tmp, iteration, tensors(), {**extra, "config": config.to_dict()}, groups)
        (tmp / "config.toml").write_text(to_toml(config))
        if check is not None:
            check(tmp, config, report, progress)
    return report.finish()


def check_finite_logits(tmp: Path, config: Config, report: Report, progress: Progress) -> None:
    """Read back what was written (chunk checksums) and check mlm's logits on it are finite: the
    verification of an import whose source mlm cannot run."""
    progress("verifying", 0, 0)
    stored = read_group(tmp)[0]
    logits = prompt_logits(stored, config.model, stored["embed.weight"].shape[0])
    if not torch.isfinite(logits).all():
        raise MlmError(f"verification failed: mlm's logits on {report.src}'s weights are not finite")
    report.max_abs_logit = logits.abs().max().item()
    report.verified = True


OPTIONS = {"norm_zero_centered": False, "attention_output_gate": False, "rotary_percent": 1.0}
"""Qwen3-Next's model options and their defaults: only its adapter writes other values."""


def attention_options(cfg: ModelConfig) -> list[str]:
    """Each of `OPTIONS` that `cfg` sets, as "model.x=v (needs default)": an architecture without
    them would compute other logits from the same weights."""
    return [
        f"model.{k}={getattr(cfg, k)!r} (needs {v!r})" for k, v in OPTIONS.items() if getattr(cfg, k) != v
    ]
