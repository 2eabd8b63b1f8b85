"""Benchmark one engine step with each of the CPU serving speed-ups off and on, in one process.

    .venv/bin/python bench/serve_step.py [--shape smollm2-135m|tiny] [--steps 15] [--threads N]

On a random model of `bench/serve.py`'s shapes (mlm's GPT, fp32, CPU), with `bench/serve.py`'s 16
prompts of 8 to 126 tokens:
- **host memory** (`mlm.inference.host_memory.keep_freed_memory`, which `mlm serve` calls on the
  CPU): the prefill step of the 16 prompts (1,059 tokens in one step), with glibc's default
  thresholds and then after the call. The call is process-wide and cannot be undone, so "off" runs
  first; everything after it runs with it on.
- **packed weights** (`EngineConfig.packed_weights`, `mlm.inference.packed_weights`): a decode
  step of the 16 sequences, engines built with packing off and on.
- **decode groups** (`mlm.inference.paged_attention.width_groups`): a decode step of 16 sequences
  of very different lengths (one prompt of 1,900 tokens, 15 of 100), all in one group
  (`GROUP_BYTES` set out of reach) and as the engine splits them.
Each figure is the median of `--steps` steps (prefill: of `--steps` fresh engines), after the
step(s) that warm up; "off" and "on" alternate between repeats so that a drift of the machine
shows in both. Prints milliseconds and the ratio off / on.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve import SHAPES, make_prompts  # noqa: E402

from mlm.convert.hf import config_from_hf  # noqa: E402
from mlm.inference import paged_attention  # noqa: E402
from mlm.inference.engine import Engine, EngineConfig  # noqa: E402
from mlm.inference.host_memory import keep_freed_memory  # noqa: E402
from mlm.inference.sampling import SamplingParams  # noqa: E402
from mlm.model.gpt import GPT  # noqa: E402


def model_of(shape: str) -> GPT:
    import transformers

    torch.manual_seed(0)
    return GPT(config_from_hf(transformers.LlamaConfig(**SHAPES[shape]).to_dict())).eval()


def engine_with(model: GPT, prompts: list[list[int]], new_tokens: int, **config) -> Engine:
    engine = Engine(model, None, EngineConfig(max_seqs=len(prompts), max_tokens_per_step=4096, **config))
    for p in prompts:
        engine.submit(p, SamplingParams(max_tokens=new_tokens, ignore_eos=True), lambda out: None)
    return engine


def timed_step(engine: Engine) -> float:
    start = time.perf_counter()
    engine.step()
    return time.perf_counter() - start


def prefill_ms(model: GPT, prompts, steps: int) -> float:
    return 1e3 * statistics.median(timed_step(engine_with(model, prompts, 2)) for _ in range(steps))


def decode_ms(model: GPT, prompts, steps: int, **config) -> float:
    engine = engine_with(model, prompts, steps + 3, **config)
    engine.step()  # the prefill
    engine.step()  # a first decode step
    return 1e3 * statistics.median(timed_step(engine) for _ in range(steps))


def compare(name: str, off, on, repeat: int = 2) -> None:
    offs, ons = [], []
    for _ in range(repeat):
        offs.append(off())
        ons.append(on())
    a, b = min(offs), min(ons)
    print(f"{name:<34} off {a:8.1f} ms   on {b:8.1f} ms   off / on {a / b:5.2f}x", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--threads", type=int, help="torch threads; default: torch's own (one per core)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    model = model_of(a.shape)
    vocab = model.cfg.vocab_size
    prompts = make_prompts(16, vocab)
    print(f"model: {a.shape}, cpu fp32, torch threads {torch.get_num_threads()}; median of {a.steps} steps")
    prefill_ms(model, prompts, 2)  # warm-up
    off = prefill_ms(model, prompts, a.steps)
    kept = keep_freed_memory()
    on = prefill_ms(model, prompts, a.steps)
    label = "host memory: prefill, 1,059 tokens"
    if kept:
        print(f"{label:<34} off {off:8.1f} ms   on {on:8.1f} ms   off / on {off / on:5.2f}x")
    else:
        print(f"{label}: not glibc's malloc here; nothing to compare")
    compare(
        "packed weights: decode, 16 seqs",
        lambda: decode_ms(model, prompts, a.steps, packed_weights=False),
        lambda: decode_ms(model, prompts, a.steps),
    )
    skewed = [[(31 * i + 7 * j) % vocab for j in range(1900 if i == 0 else 100)] for i in range(16)]
    if model.cfg.max_position_embeddings < 1900 + a.steps + 3:
        print("decode groups: the model's context is too short for the 1,900-token prompt; skipped")
        return
    grouped = paged_attention.GROUP_BYTES

    def one_group() -> float:
        paged_attention.GROUP_BYTES = float("inf")
        try:
            return decode_ms(model, skewed, a.steps)
        finally:
            paged_attention.GROUP_BYTES = grouped

    compare("decode groups: 1 x 1,900 + 15 x 100", one_group, lambda: decode_ms(model, skewed, a.steps))


if __name__ == "__main__":
    main()
