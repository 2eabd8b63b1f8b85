"""The SFT recipe's inputs, made here so that nothing is downloaded.

    python pipelines/sft/toy.py OUT     # writes OUT/hf-base/ and OUT/conversations.jsonl

- `OUT/conversations.jsonl`: toy conversations in OpenAI's `messages` shape (some in ShareGPT's
  `conversations` shape): questions about capital cities, one or two turns, some with a system
  message. The answers follow one pattern, so a tiny model learns them in 100 steps.
- `OUT/hf-base/`: a Hugging Face model folder standing in for a downloaded one: a byte-level BPE
  tokenizer trained on the conversations with a ChatML chat template (`<|im_start|>` /
  `<|im_end|>`, as SmolLM2 and Qwen use), and a tiny Llama with transformers' random
  initialisation. Point the recipe at a real model folder instead with HF_MODEL=...
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Japan": "Tokyo",
    "Canada": "Ottawa", "Egypt": "Cairo", "Peru": "Lima", "Kenya": "Nairobi", "Norway": "Oslo",
    "Greece": "Athens", "Chile": "Santiago", "Cuba": "Havana", "Ireland": "Dublin", "Poland": "Warsaw",
    "Austria": "Vienna",
}  # fmt: skip
QUESTIONS = ("What is the capital of {}?", "Which city is the capital of {}?", "Name the capital of {}.")
SYSTEM = "You answer in one sentence."
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def conversation(rng: random.Random) -> dict:
    turns = []
    if rng.random() < 0.3:
        turns.append({"role": "system", "content": SYSTEM})
    for country in rng.sample(sorted(CAPITALS), rng.choice((1, 1, 2))):
        turns.append({"role": "user", "content": rng.choice(QUESTIONS).format(country)})
        turns.append({"role": "assistant", "content": f"The capital of {country} is {CAPITALS[country]}."})
    if rng.random() < 0.2:  # ShareGPT's shape
        names = {"system": "system", "user": "human", "assistant": "gpt"}
        return {"conversations": [{"from": names[t["role"]], "value": t["content"]} for t in turns]}
    return {"messages": turns}


def write_tokenizer(folder: Path, texts: list[str]) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=400, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 256,
        "chat_template": CHATML,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return tok.get_vocab_size()


def write_model(folder: Path, vocab: int, eos: int, pad: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    LlamaForCausalLM(config).save_pretrained(folder)


def main(out: Path, count: int = 2000) -> None:
    rng = random.Random(0)
    convs = [conversation(rng) for _ in range(count)]
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "conversations.jsonl", "w") as f:
        for c in convs:
            f.write(json.dumps(c) + "\n")
    hf = out / "hf-base"
    hf.mkdir(exist_ok=True)
    texts = [t.get("content") or t.get("value") for c in convs for t in next(iter(c.values()))]
    vocab = write_tokenizer(hf, texts)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(hf / "tokenizer.json"))
    write_model(hf, vocab, tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>"))
    print(f"wrote {out / 'conversations.jsonl'} ({len(convs)} conversations) and {hf} (vocab {vocab})")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python pipelines/sft/toy.py OUT")
    main(Path(sys.argv[1]))
