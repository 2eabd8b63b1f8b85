"""What the inference and serving tests share: small model settings (`LLAMA`, `GPT2`, `MOE`) saved
as mlm checkpoints (`model_checkpoint`), an engine driven through a fixed schedule of arrivals
(`ENGINE`, `drive_engine`), and a tiny random Llama saved by transformers with its tokenizer and a
chat template, imported as an mlm checkpoint (`tiny_llama_checkpoint`)."""

from __future__ import annotations

import json

import torch

from mlm.checkpoint import ShardedTensor, save_checkpoint
from mlm.config import Config, DataConfig, ModelConfig, MoEConfig
from mlm.convert.hf.folder import import_hf
from mlm.inference.engine import Completion, Engine, EngineConfig
from mlm.inference.sampling import SamplingParams
from mlm.model.gpt import build_model
from tests.helpers.hf_models import llama as hf_llama

LLAMA = dict(  # GQA: 4 heads, 2 query groups (one per rank); vocab 100 pads to 104 / 112
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=96,
    vocab_size=100,
    make_vocab_size_divisible_by=8,
    max_position_embeddings=64,
    init_std=0.2,  # logits spread out: no near-ties for greedy to break differently
)
GPT2 = dict(
    LLAMA,
    num_query_groups=None,
    ffn_hidden_size=None,
    normalization="layernorm",
    position_embedding="learned",
    activation="gelu_tanh",
    add_bias=True,
    tie_embeddings=True,
)
MOE = dict(
    LLAMA,
    num_layers=3,
    mlp_kind="moe",
    first_k_dense=1,
    moe=MoEConfig(
        num_experts=4,
        ffn_hidden_size=48,
        router_topk=2,
        shared_expert_ffn_hidden_size=32,
        shared_expert_gate=True,
        capacity_factor=1.0,  # a training setting: serving is dropless
    ),
)
# 3 sequences and 16 tokens a step: requests queue, join and leave mid-run; the 30-token prompt is
# prefilled over two steps (a chunk that samples nothing)
ENGINE = EngineConfig(max_seqs=3, max_tokens_per_step=16, block_size=4)
LENGTHS, ARRIVALS = (5, 30, 1, 12), (0, 1, 3, 4)  # prompt tokens, step of arrival
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


def model_checkpoint(root, model_kw: dict):
    cfg = ModelConfig(**model_kw)
    model = build_model(cfg, seed=3)
    tensors = [ShardedTensor.full(name, p.data) for name, p in model.named_parameters()]
    config = Config(model=cfg, data=DataConfig(seq_length=cfg.max_position_embeddings))
    return str(save_checkpoint(root, 0, {"model": tensors}, {"config": config.to_dict()}))


def drive_engine(engine: Engine) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Submit each prompt at its arrival step, step until all are done: (tokens, every step's logits)."""
    vocab = engine.model.cfg.vocab_size
    prompts = [[(37 * i + 11 * j + 5) % vocab for j in range(n)] for i, n in enumerate(LENGTHS)]
    results = [Completion() for _ in prompts]
    logits: list[torch.Tensor] = []
    forward = engine.runner.forward
    engine.runner.forward = lambda chunks: logits.append(forward(chunks)) or logits[-1]
    step = 0
    while step <= max(ARRIVALS) or engine.has_work():
        for p, at, r in zip(prompts, ARRIVALS, results, strict=True):
            if at == step:
                engine.submit(p, GREEDY, r.add)
        engine.step()
        step += 1
    assert all(r.finish_reason == "length" for r in results)
    return [r.token_ids for r in results], logits


CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def tiny_llama_checkpoint(root, tokenizer_json) -> tuple:
    """A tiny random Llama (GQA; vocabulary = the tokenizer's) saved by transformers with its
    tokenizer and a chat template, imported as an mlm checkpoint. (HF model, checkpoint dir)."""
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(tokenizer_json)).get_vocab_size()
    hf = hf_llama(tie=False, seed=3, vocab_size=vocab, rms_norm_eps=1e-6, rope_scaling=None)
    hf_dir = root / "hf"
    hf.save_pretrained(hf_dir)
    (hf_dir / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
    config = {"eos_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE}
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(config))
    import_hf(hf_dir, root / "tiny-llama")
    return hf, root / "tiny-llama"
