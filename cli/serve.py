"""`mlm serve CKPT`: an OpenAI-compatible HTTP API over a checkpoint; `mlm generate CKPT --prompt
TEXT`: one-off generation from the shell. Both run tensor-parallel under torchrun:
`torchrun --nproc-per-node 2 -m cli.main serve CKPT`. See docs/serve-engine.md."""

from __future__ import annotations

import typer

_DTYPE = typer.Option("fp32", "--dtype", help="fp32, bf16 or fp16 (weights and KV cache).")
_DEVICE = typer.Option("auto", "--device", help="auto (cuda if there is one), cpu, cuda, cuda:1, ...")
_TOKENIZER = typer.Option(
    None, "--tokenizer", help="Tokenizer file or folder; default: the one the checkpoint names."
)
_TP = typer.Option(
    None,
    "--tp",
    help="Tensor-parallel ranks, one process each; default: WORLD_SIZE under torchrun "
    "(torchrun --nproc-per-node 2 -m cli.main serve CKPT), else 1. Rank 0 serves HTTP (or prints).",
)


def _kv_blocks(
    kv_blocks: int | None, kv_memory: str | None, dtype: str, ckpt: str, tp: int | None, cuda_graphs: bool
) -> int | None:
    """The cache's blocks: --kv-blocks, or what --kv-memory holds (less the scratch block of
    --cuda-graphs)."""
    from mlm.errors import MlmError

    if kv_memory is None:
        return kv_blocks
    if kv_blocks is not None:
        raise MlmError("give --kv-blocks or --kv-memory, not both")
    from mlm.inference.kv_cache import blocks_for_memory
    from mlm.inference.loader import model_config
    from mlm.parallel.launch import detect
    from mlm.units import DTYPES, parse_size

    cfg, dt = model_config(ckpt), DTYPES.get(dtype, DTYPES["fp32"])
    n = blocks_for_memory(cfg, 16, dt, parse_size(kv_memory, "--kv-memory"), tp or detect().world_size)
    if cuda_graphs and n < 2:
        raise MlmError(
            f"--kv-memory {kv_memory} holds one block, which --cuda-graphs keeps as scratch: give more"
        )
    return n - int(cuda_graphs)


def serve(
    ckpt: str = typer.Argument(..., help="Checkpoint DIR or DIR/iter_N (from mlm train or mlm convert)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind; 0.0.0.0 serves other machines."),
    port: int = typer.Option(8000, "--port", help="TCP port."),
    api_key: str | None = typer.Option(
        None,
        "--api-key",
        envvar="MLM_API_KEY",
        help="Require `Authorization: Bearer KEY` on /v1, /api and the tokenizer endpoints.",
    ),
    name: str | None = typer.Option(
        None, "--model-name", help="Model id clients ask for; default: DIR's name."
    ),
    max_seqs: int = typer.Option(16, "--max-seqs", help="Sequences in one batch."),
    max_tokens_per_step: int = typer.Option(
        512, "--max-tokens-per-step", help="Tokens one engine step runs."
    ),
    max_waiting: int = typer.Option(256, "--max-waiting", help="Requests that may wait; more get HTTP 429."),
    kv_blocks: int | None = typer.Option(
        None, "--kv-blocks", help="KV-cache blocks of 16 tokens; default: max-seqs full contexts."
    ),
    kv_memory: str | None = typer.Option(
        None, "--kv-memory", help="KV-cache size per rank instead, e.g. 2GiB or 500MB."
    ),
    prefix_caching: bool = typer.Option(
        True,
        "--prefix-caching/--no-prefix-caching",
        help="Share the KV-cache blocks of common prompt prefixes between requests.",
    ),
    max_tokens: int | None = typer.Option(
        None, "--max-tokens-limit", help="Largest max_tokens a request may ask; default: the context."
    ),
    max_body: int = typer.Option(1 << 20, "--max-body-bytes", help="Largest request body (HTTP 413 beyond)."),
    max_connections: int = typer.Option(
        1000,
        "--max-connections",
        help="Open connections; one more closes the one waiting longest for its request (HTTP 503).",
    ),
    read_timeout: float = typer.Option(
        10.0, "--read-timeout", help="Seconds for a whole request to arrive (HTTP 408 beyond)."
    ),
    max_header_bytes: int = typer.Option(
        16384, "--max-header-bytes", help="Largest request line and headers (HTTP 431 beyond)."
    ),
    dtype: str = _DTYPE,
    device: str = _DEVICE,
    tokenizer: str | None = _TOKENIZER,
    chat_template: str | None = typer.Option(
        None,
        "--chat-template",
        help="Jinja chat template file; default: the tokenizer's own, else role: text.",
    ),
    tp: int | None = _TP,
    cuda_graphs: bool = typer.Option(
        False,
        "--cuda-graphs",
        help="Replay decode steps as CUDA graphs (CUDA, tp 1; never run on a GPU yet).",
    ),
    packed_weights: bool = typer.Option(
        True,
        "--packed-weights/--no-packed-weights",
        help="CPU fp32: full decode batches multiply by MKL-packed weights (one more copy in memory).",
    ),
) -> None:
    """Serve a checkpoint over HTTP: OpenAI /v1/completions, /v1/chat/completions, Megatron PUT /api.
    Under torchrun, tensor-parallel over the processes; only rank 0 binds the port."""
    from mlm.inference.engine import EngineConfig
    from mlm.serve.app import Limits
    from mlm.serve.connections import ConnectionLimits
    from mlm.serve.server import serve as run

    engine_config = EngineConfig(
        max_seqs=max_seqs,
        max_tokens_per_step=max_tokens_per_step,
        num_blocks=_kv_blocks(kv_blocks, kv_memory, dtype, ckpt, tp, cuda_graphs),
        max_waiting=max_waiting,
        prefix_caching=prefix_caching,
        cuda_graphs=cuda_graphs,
        packed_weights=packed_weights,
    )
    limits = Limits(max_body_bytes=max_body, max_tokens=max_tokens)
    connection_limits = ConnectionLimits(max_connections, read_timeout, max_header_bytes)
    run(
        ckpt,
        host,
        port,
        engine_config,
        api_key=api_key,
        limits=limits,
        connection_limits=connection_limits,
        name=name,
        dtype=dtype,
        device=device,
        tokenizer=tokenizer,
        chat_template=chat_template,
        tp=tp,
    )


def generate(
    ckpt: str = typer.Argument(..., help="Checkpoint DIR or DIR/iter_N."),
    prompts: list[str] = typer.Option(..., "--prompt", "-p", help="Prompt text (repeat for a batch)."),
    max_tokens: int = typer.Option(64, "--max-tokens", help="Most new tokens per prompt."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 is greedy."),
    top_k: int = typer.Option(0, "--top-k", help="Sample among the k most likely tokens (0: all)."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass."),
    seed: int | None = typer.Option(None, "--seed", help="Seed of the draws."),
    stop: list[str] = typer.Option([], "--stop", help="Stop at this text (repeatable)."),
    chat: bool = typer.Option(
        False, "--chat", help="Wrap each prompt as a user message in the chat template."
    ),
    dtype: str = _DTYPE,
    device: str = _DEVICE,
    tokenizer: str | None = _TOKENIZER,
    tp: int | None = _TP,
) -> None:
    """Generate from the shell: prints each prompt's continuation (the prompts run as one batch).
    Under torchrun, tensor-parallel over the processes; rank 0 prints."""
    import time

    from mlm.chat import load_chat_template
    from mlm.console import console
    from mlm.inference.engine import Engine, EngineConfig, build_runner
    from mlm.inference.host_memory import keep_freed_memory
    from mlm.inference.loader import load_checkpoint_tokenizer, load_model, model_config
    from mlm.inference.lockstep import serving_mesh
    from mlm.inference.sampling import SamplingParams
    from mlm.parallel.launch import pick_device

    dev = pick_device(device, "--device")
    if dev.type == "cpu":
        keep_freed_memory()
    cfg = model_config(ckpt)
    mesh = serving_mesh(cfg, tp, dev)
    config = EngineConfig(
        max_seqs=max(1, len(prompts)), max_tokens_per_step=max(512, cfg.max_position_embeddings)
    )
    model, manifest, it_dir = load_model(ckpt, dtype, dev, mesh)
    if mesh.rank != 0:
        build_runner(model, config, mesh).follow()
        return
    tok = load_checkpoint_tokenizer(manifest, it_dir, tokenizer)
    if chat:
        template = load_chat_template(tok)
        ids = [tok.encode_plain(template.render([{"role": "user", "content": p}])) for p in prompts]
    else:
        ids = [tok.encode(p) for p in prompts]
    params = SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, stop=tuple(stop)
    )
    engine = Engine(model, tok, config, mesh)
    start = time.perf_counter()
    try:
        results = engine.generate(ids, params)
    finally:
        engine.stop()  # under tp: the other ranks return
    seconds = time.perf_counter() - start
    for prompt, r in zip(prompts, results, strict=True):
        print(f"{prompt}{r.text}" if not chat else r.text, flush=True)
    n = sum(r.completion_tokens for r in results)
    console.print(
        f"[dim]{n} tokens in {seconds:.2f} s ({n / seconds:.1f} tokens/s), "
        f"finish: {', '.join(str(r.finish_reason) for r in results)}[/]",
        highlight=False,
    )
