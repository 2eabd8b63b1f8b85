"""Ask a Hugging Face model folder a question through its chat template, with transformers alone.

    python pipelines/sft/chat.py HF_DIR "What is the capital of Peru?"

Prints the prompt as the template renders it and the greedy reply, up to the template's end of
turn (the tokenizer's eos token).
"""

from __future__ import annotations

import sys

from transformers import AutoModelForCausalLM, AutoTokenizer


def reply(folder: str, question: str, max_new_tokens: int = 32) -> tuple[str, str]:
    """(the rendered prompt, the reply as decoded text, special tokens kept)."""
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    messages = [{"role": "user", "content": question}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(
        **ids,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    return prompt, tok.decode(out[0, ids["input_ids"].shape[1] :])


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit('usage: python pipelines/sft/chat.py HF_DIR "question"')
    prompt, text = reply(sys.argv[1], sys.argv[2])
    print(prompt + text)
