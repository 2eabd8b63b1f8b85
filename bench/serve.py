"""Benchmark generation: mlm's engine serving 16 concurrent requests against the same requests run
one at a time through transformers' `generate`, on the same tiny model, in one process.

    .venv/bin/python bench/serve.py [--requests 16] [--new-tokens 64] [--device cpu|cuda]
                                    [--dtype fp32|bf16] [--hidden 64] [--layers 2]

A random LlamaForCausalLM (GQA, vocabulary 1000, context 512) gets mlm's GPT with the same
weights (`mlm.hf.load_hf_into`). The requests are prompts of 8 to 128 tokens, each asking for
`--new-tokens` greedy tokens with no early stop. mlm: all submitted at once to an `Engine`
(continuous batching, paged KV cache, one forward per step) and stepped to the end. HF:
`generate(do_sample=False)` per request, its own KV cache, batch 1 (as a one-request-at-a-time
server runs it). Each side runs once untimed (warm-up), then is timed; prints output tokens/s
of each, the ratio mlm / HF (target >= 4 on a CPU with the tiny model), and how many requests
gave the same tokens on both sides.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlm.hf import config_from_hf, load_hf_into  # noqa: E402
from mlm.inference.engine import Engine, EngineConfig  # noqa: E402
from mlm.inference.sampling import SamplingParams  # noqa: E402
from mlm.model.gpt import GPT  # noqa: E402
from mlm.units import DTYPES  # noqa: E402


def build(hidden: int, layers: int, device: str, dtype: torch.dtype):
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=1000,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.generation_config.eos_token_id = None  # every request runs to --new-tokens on both sides
    hf.generation_config.pad_token_id = 0
    ours = load_hf_into(GPT(config_from_hf(hf.config.to_dict())).eval(), hf)
    return hf.to(device, dtype), ours.to(device, dtype)


def run_mlm(model, prompts, new_tokens: int) -> tuple[float, list[list[int]]]:
    engine = Engine(model, None, EngineConfig(max_seqs=len(prompts), max_tokens_per_step=2048))
    start = time.perf_counter()
    results = engine.generate(prompts, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    sync()
    return time.perf_counter() - start, [r.token_ids for r in results]


@torch.no_grad()
def run_hf(hf, prompts, new_tokens: int, device: str) -> tuple[float, list[list[int]]]:
    out = []
    start = time.perf_counter()
    for p in prompts:
        ids = torch.tensor([p], device=device)
        gen = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
        )
        out.append(gen[0, len(p) :].tolist())
    sync()
    return time.perf_counter() - start, out


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    a = ap.parse_args()
    hf, ours = build(a.hidden, a.layers, a.device, DTYPES[a.dtype])
    prompts = [[(31 * i + 7 * j) % 1000 for j in range(8 + (i * 37) % 121)] for i in range(a.requests)]
    run_mlm(ours, prompts[:2], 4)  # warm-up
    run_hf(hf, prompts[:2], 4, a.device)
    t_mlm, out_mlm = run_mlm(ours, prompts, a.new_tokens)
    t_hf, out_hf = run_hf(hf, prompts, a.new_tokens, a.device)
    n = a.requests * a.new_tokens
    same = sum(x == y for x, y in zip(out_mlm, out_hf, strict=True))
    print(
        f"model: Llama hidden {a.hidden}, {a.layers} layers, {a.device} {a.dtype}, torch threads "
        f"{torch.get_num_threads()}; {a.requests} requests, prompts 8-128 tokens, {a.new_tokens} new tokens each"
    )
    print(f"mlm engine, {a.requests} concurrent: {n / t_mlm:9.1f} tokens/s ({t_mlm:.2f} s)")
    print(f"HF generate, one at a time:  {n / t_hf:9.1f} tokens/s ({t_hf:.2f} s)")
    print(f"ratio mlm / HF: {t_hf / t_mlm:.2f}x (target >= 4 on CPU)")
    print(f"same greedy tokens: {same}/{a.requests} requests")


if __name__ == "__main__":
    main()
