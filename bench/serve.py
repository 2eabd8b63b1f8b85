"""Benchmark generation: mlm's engine serving 16 concurrent requests against transformers'
`generate` on the same requests, one at a time and as one left-padded batch; optionally, time to
first token and inter-token latency of 32 streaming HTTP clients against `mlm serve`'s app.

    .venv/bin/python bench/serve.py [--shape tiny|smollm2-135m] [--requests 16] [--new-tokens 48]
                                    [--repeat 1] [--threads N] [--device cpu|cuda] [--dtype fp32|bf16]
                                    [--http-clients 32] [--http-requests 64] [--skip-generate]
                                    [--cuda-graphs]

Shapes (random weights, seed 0; a LlamaForCausalLM, and mlm's GPT with the same weights through
`mlm.convert.hf.load_hf_into`):
- `tiny`: hidden 64, 2 layers, 4 heads / 2 key-value heads, intermediate 192, vocabulary 1000,
  context 512.
- `smollm2-135m`: SmolLM2-135M's shape (its published config.json): hidden 576, 30 layers, 9 heads
  / 3 key-value heads (head 64), intermediate 1536, vocabulary 49,152, tied embeddings, RoPE theta
  100,000, RMSNorm eps 1e-5, context 2048; 134.5M parameters.

The requests are prompts of 8 to 128 tokens, each asking for `--new-tokens` greedy tokens with no
early stop. Three ways, each run once untimed on two short requests (warm-up), then timed
`--repeat` times (the shortest time counts; on a shared machine single runs vary a lot; there,
`--threads 1` also helps: with two threads on two busy cores, every parallel op waits for the
descheduled thread, which costs a batch-1 decode step far more than a batched one):
- mlm: all submitted at once to an `Engine` (continuous batching, paged KV cache) and stepped to the
  end in this thread;
- HF one at a time: `generate(do_sample=False)` per request, batch 1 (as a one-request-at-a-time
  server runs it);
- HF padded batch: one `generate` of all requests, left-padded with `attention_mask` and
  `pad_token_id` (a static-batch server at its best: every request arrives at once).
`--cuda-graphs` (CUDA) adds mlm's engine with `EngineConfig(cuda_graphs=True)` (decode steps replayed
from captured graphs) as a fourth way, and whether it gives the same tokens as without.
Prints output tokens/s of each, the ratios mlm / one-at-a-time (target >= 8 on smollm2-135m) and
mlm / padded batch (target >= 1.5 on smollm2-135m), and how many requests gave the same tokens. HF
can give a padded sequence slightly different logits than the same sequence alone (other matmul
shapes, masked positions), so a near-tie may go the other way there; the line "HF one at a time vs
padded" shows how often that happens.

`--http-clients N` (0: off) serves the same model in this process with `mlm.serve.app.create_app`
on `ServerThread` (uvicorn, loopback, engine `--max-seqs 16` as `mlm serve` defaults) and drives N
concurrent streaming clients from a separate process (httpx, so that the clients do not share the
server's interpreter lock), each sending requests one after another until `--http-requests` are
done: `POST /v1/completions` with the prompt as token ids, `max_tokens` = `--new-tokens`,
`temperature` 0, `stream: true`. The model has no real tokenizer, so the server gets a word-level
one of the model's vocabulary size (token i is the word `t<i>`; no end-of-text token): every token
decodes to text on its own, so every token is one server-sent event and the gaps between a stream's
events are the inter-token latencies (a byte-level BPE would hold back partial characters and merge
events; `logprobs` would measure log-softmax work that a plain client does not ask for). Two
untimed requests warm the server up. Prints time to first token (from sending the request to its
first token event; includes waiting for a place among the engine's 16 sequences) and inter-token
latency, p50 and p99, with requests/s and tokens/s. `--skip-generate` runs only the HTTP part.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlm.convert.hf import config_from_hf, load_hf_into  # noqa: E402
from mlm.inference.engine import Engine, EngineConfig  # noqa: E402
from mlm.inference.host_memory import keep_freed_memory  # noqa: E402
from mlm.inference.sampling import SamplingParams  # noqa: E402
from mlm.model.gpt import GPT  # noqa: E402
from mlm.units import DTYPES  # noqa: E402

SHAPES = {
    "tiny": dict(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    ),
    # HuggingFaceTB/SmolLM2-135M config.json (LlamaForCausalLM)
    "smollm2-135m": dict(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=2048,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        initializer_range=0.041666666666666664,
    ),
}
PAD = 0


def build(shape: str, device: str, dtype: torch.dtype):
    import transformers

    cfg = transformers.LlamaConfig(**SHAPES[shape], attn_implementation="sdpa")
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.generation_config.eos_token_id = None  # every request runs to --new-tokens on all sides
    hf.generation_config.pad_token_id = PAD
    ours = load_hf_into(GPT(config_from_hf(hf.config.to_dict())).eval(), hf)
    return hf.to(device, dtype), ours.to(device, dtype)


def make_prompts(n: int, vocab: int) -> list[list[int]]:
    """`n` prompts of 8 to 128 tokens, lengths spread by a stride of 37 (mod 121)."""
    return [[(31 * i + 7 * j) % vocab for j in range(8 + (i * 37) % 121)] for i in range(n)]


def run_mlm(model, prompts, new_tokens: int, graphs: bool = False) -> tuple[float, list[list[int]]]:
    config = EngineConfig(max_seqs=len(prompts), max_tokens_per_step=2048, cuda_graphs=graphs)
    engine = Engine(model, None, config)
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


@torch.no_grad()
def run_hf_padded(hf, prompts, new_tokens: int, device: str) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    gen = hf.generate(
        ids,
        attention_mask=mask,
        pad_token_id=PAD,
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
    )
    out = gen[:, width:].tolist()
    sync()
    return time.perf_counter() - start, out


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def best(repeat: int, run) -> tuple[float, list[list[int]]]:
    """The shortest time of `repeat` runs, and the tokens (the same in every run: greedy)."""
    runs = [run() for _ in range(repeat)]
    assert all(r[1] == runs[0][1] for r in runs), "greedy tokens changed between repeats"
    return min(t for t, _ in runs), runs[0][1]


def same(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x == y for x, y in zip(a, b, strict=True))


def generate_bench(a, hf, ours, log=print) -> dict:
    """The three ways (and mlm with CUDA graphs under `a.cuda_graphs`): tokens/s, ratios, agreement."""
    prompts = make_prompts(a.requests, hf.config.vocab_size)
    ways = {"mlm": lambda p, n: run_mlm(ours, p, n)}
    if a.cuda_graphs:
        ways["mlm_cuda_graphs"] = lambda p, n: run_mlm(ours, p, n, graphs=True)
    ways["hf_one_at_a_time"] = lambda p, n: run_hf(hf, p, n, a.device)
    ways["hf_padded"] = lambda p, n: run_hf_padded(hf, p, n, a.device)
    for way in ways.values():  # warm-up, each side
        way(prompts[:2], 4)
    seconds, out = {}, {}
    for name, way in ways.items():
        seconds[name], out[name] = best(a.repeat, lambda way=way: way(prompts, a.new_tokens))
    n, r = a.requests * a.new_tokens, a.requests
    lens = [len(p) for p in prompts]
    log(
        f"{a.requests} requests, prompts {min(lens)}-{max(lens)} tokens, {a.new_tokens} new tokens each; "
        f"best of {a.repeat} timed run(s) after a warm-up"
    )
    labels = {
        "mlm": f"mlm engine, {r} concurrent:",
        "mlm_cuda_graphs": "mlm engine, CUDA graphs:",
        "hf_one_at_a_time": "HF generate, one at a time:",
        "hf_padded": "HF generate, padded batch:",
    }
    for name, t in seconds.items():
        log(f"{labels[name]:<29}{n / t:9.1f} tokens/s ({t:.2f} s)")
    result = {"tokens_per_s": {name: n / t for name, t in seconds.items()}, "requests": r}
    target = " (target >= {} on smollm2-135m)"
    for name in [k for k in ("mlm", "mlm_cuda_graphs") if k in seconds]:
        one, pad = seconds["hf_one_at_a_time"] / seconds[name], seconds["hf_padded"] / seconds[name]
        result[f"{name}_vs_hf_one_at_a_time"], result[f"{name}_vs_hf_padded"] = one, pad
        suffix = "" if name == "mlm" else " (CUDA graphs)"
        log(f"ratio mlm / one at a time{suffix}:   {one:.2f}x" + target.format(8))
        log(f"ratio mlm / padded batch{suffix}:    {pad:.2f}x" + target.format(1.5))
    agree = {
        "mlm vs HF one at a time": same(out["mlm"], out["hf_one_at_a_time"]),
        "mlm vs HF padded batch": same(out["mlm"], out["hf_padded"]),
        "HF one at a time vs padded": same(out["hf_one_at_a_time"], out["hf_padded"]),
    }
    if a.cuda_graphs:
        agree["mlm CUDA graphs vs mlm"] = same(out["mlm_cuda_graphs"], out["mlm"])
    for what, k in agree.items():
        log(f"{'same greedy tokens, ' + what + ':':<49}{k}/{r} requests")
    result["same_tokens"] = agree
    return result


# ---------------------------------------------------------------------- HTTP


def word_tokenizer(vocab: int, folder: Path):
    """A word-level tokenizer.json of `vocab` tokens, token i the word `t<i>`; loaded by mlm."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from mlm.tokenizer import load_tokenizer

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    return load_tokenizer(folder / "tokenizer.json")


async def _clients(url: str, bodies: list[dict], clients: int) -> list[tuple[float, list[float], str]]:
    """Each body streamed by one of `clients` concurrent clients: (send time, token event times,
    how the stream ended)."""
    import httpx

    todo = list(reversed(range(len(bodies))))
    results: list = [None] * len(bodies)
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)

    async def client(http: httpx.AsyncClient) -> None:
        while todo:
            i = todo.pop()
            start, events, end = time.perf_counter(), [], "no [DONE]"
            async with http.stream("POST", f"{url}/v1/completions", json=bodies[i]) as r:
                if r.status_code != 200:
                    end = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                else:
                    async for line in r.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        if line == "data: [DONE]":
                            end = "done"
                            break
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            end = f"error event: {chunk['error']}"
                            break
                        if chunk["choices"] and chunk["choices"][0]["text"]:
                            events.append(time.perf_counter())
            results[i] = (start, events, end)

    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    return results


def drive_clients(url: str, bodies: list[dict], clients: int) -> tuple[float, list]:
    """Run in the client process: (wall seconds, per-request results of `_clients`)."""
    start = time.perf_counter()
    results = asyncio.run(_clients(url, bodies, clients))
    return time.perf_counter() - start, results


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0-100) of a non-empty list."""
    s = sorted(xs)
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)]


def http_bench(a, ours) -> None:
    from mlm.chat import load_chat_template
    from mlm.serve.app import ServerState, create_app
    from mlm.serve.server import ServerThread

    vocab = ours.cfg.vocab_size
    prompts = make_prompts(a.http_requests, vocab)
    bodies = [{"prompt": p, "max_tokens": a.new_tokens, "temperature": 0, "stream": True} for p in prompts]
    with tempfile.TemporaryDirectory() as tmp:
        tok = word_tokenizer(vocab, Path(tmp))
        state = ServerState("bench")
        engine = Engine(ours, tok, EngineConfig(max_seqs=16, max_tokens_per_step=512))
        engine.start()
        state.ready(engine, tok, load_chat_template(tok))
        try:
            with (
                ServerThread(create_app(state)) as server,
                ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool,
            ):
                pool.submit(drive_clients, server.url, bodies[:2], 2).result()  # warm-up
                wall, results = pool.submit(drive_clients, server.url, bodies, a.http_clients).result()
        finally:
            engine.stop()
    bad = [(i, end) for i, (_, _, end) in enumerate(results) if end != "done"]
    short = [i for i, (_, ev, _) in enumerate(results) if len(ev) != a.new_tokens]
    ttft = [ev[0] - start for start, ev, _ in results if ev]
    itl = [b - x for _, ev, _ in results for x, b in zip(ev, ev[1:], strict=False)]
    tokens = sum(len(ev) for _, ev, _ in results)
    if not ttft:
        raise SystemExit(f"no stream gave a token; the first: {bad[:3]}")
    lens = [len(p) for p in prompts]
    print(
        f"HTTP: {len(bodies)} streaming /v1/completions requests (prompts {min(lens)}-{max(lens)} tokens, "
        f"{a.new_tokens} new tokens each) from {a.http_clients} concurrent clients; engine max_seqs 16"
    )
    print(f"  {len(bodies) / wall:.2f} requests/s, {tokens / wall:.1f} tokens/s ({wall:.2f} s)")
    print(
        f"  time to first token: p50 {1000 * percentile(ttft, 50):.0f} ms, p99 {1000 * percentile(ttft, 99):.0f} ms"
    )
    if itl:  # none with --new-tokens 1
        print(
            f"  inter-token latency: p50 {1000 * percentile(itl, 50):.1f} ms, "
            f"p99 {1000 * percentile(itl, 99):.1f} ms"
        )
    print(
        f"  streams not ending in [DONE]: {len(bad)} {bad[:3]}; with a token count other than {a.new_tokens}: {len(short)}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--repeat", type=int, default=1, help="timed runs of each way; the best is printed")
    ap.add_argument("--threads", type=int, help="torch threads; default: torch's own (one per core)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--http-clients", type=int, default=0, help="streaming HTTP clients; 0: no HTTP part")
    ap.add_argument("--http-requests", type=int, default=64, help="requests the HTTP clients send in all")
    ap.add_argument("--skip-generate", action="store_true", help="only the HTTP part")
    ap.add_argument(
        "--cuda-graphs", action="store_true", help="also mlm's engine with CUDA graphs (cuda only)"
    )
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.device == "cpu":  # what mlm serve does on the CPU; the process-wide malloc settings serve every side
        keep_freed_memory()
    hf, ours = build(a.shape, a.device, DTYPES[a.dtype])
    params = sum(p.numel() for p in hf.parameters())
    s = SHAPES[a.shape]
    print(
        f"model: {a.shape} (random Llama, hidden {s['hidden_size']}, {s['num_hidden_layers']} layers, "
        f"{s['num_attention_heads']}/{s['num_key_value_heads']} heads, vocabulary {s['vocab_size']}, "
        f"{params / 1e6:.1f}M parameters), {a.device} {a.dtype}, torch threads {torch.get_num_threads()}"
    )
    if not a.skip_generate:
        generate_bench(a, hf, ours)
    if a.http_clients:
        del hf
        http_bench(a, ours)


if __name__ == "__main__":
    main()
