"""Chat templates against transformers' `apply_chat_template`: the rendered token ids of three
template styles (ChatML as SmolLM2 ships it, Llama 3's headers, and ChatML with `{% generation %}`
marks) equal transformers' on the same tokenizer.json, and the assistant mask equals its
`assistant_masks` where the template marks them. Where it does not, mlm marks each assistant turn
as the text it adds after the generation prompt."""

from __future__ import annotations

import pytest

from mlm.chat import ChatTemplate, assistant_mask, chat_tokens, load_chat_template
from mlm.errors import MlmError
from mlm.tokenizer import copy_tokenizer_files, load_tokenizer
from tests.helpers.common import CHATML_MARKED, chat_tokenizer, write_chat_config

CHATML = (  # SmolLM2-Instruct's shape: a default system turn, ChatML turns
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA3 = (  # Llama 3's headers: BOS, role headers, trimmed content, <|eot_id|>
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "It is 4."}],
    [
        {
            "role": "system",
            "content": "Answer briefly.",
            "name": None,
        },  # a None value: dropped, as transformers
        {"role": "user", "content": "Café or thé?"},
        {"role": "assistant", "content": "  Thé, s'il vous plaît 🍵  "},
        {"role": "user", "content": "And then?"},
        {"role": "assistant", "content": "def f(x):\n    return x"},
    ],
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory, sample_texts):
    """A byte-level BPE tokenizer.json with the templates' special tokens."""
    return chat_tokenizer(tmp_path_factory.mktemp("chat"), sample_texts)


@pytest.mark.parametrize("name,template", [("chatml", CHATML), ("llama3", LLAMA3), ("marked", CHATML_MARKED)])
def test_token_ids_and_masks_equal_transformers(tokenizer_dir, name, template):
    from transformers import PreTrainedTokenizerFast

    write_chat_config(tokenizer_dir, template)
    hf = PreTrainedTokenizerFast.from_pretrained(str(tokenizer_dir))
    tok = load_tokenizer(str(tokenizer_dir / "tokenizer.json"))
    chat = load_chat_template(tok)
    assert chat.marks_generation is (name == "marked")
    for messages in CONVERSATIONS:
        theirs = hf.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids, mask = chat_tokens(chat, tok, messages)
        assert ids == theirs["input_ids"]
        assert chat.render(messages, add_generation_prompt=True) == hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        marked = tok.decode([i for i, m in zip(ids, mask, strict=True) if m])
        turns = [m["content"] for m in messages if m["role"] == "assistant"]
        if name == "marked":  # transformers' mask, bit for bit
            assert mask == theirs["assistant_masks"] and marked == "".join(t + "<|im_end|>" for t in turns)
        elif name == "chatml":  # each turn as it follows the generation prompt: content, end, newline
            assert marked == "".join(t + "<|im_end|>\n" for t in turns)
        else:  # llama3 trims the content
            assert marked == "".join(t.strip() + "<|eot_id|>" for t in turns)


def test_masks_overlap_tokens_as_transformers():
    # a token is the assistant's when its characters overlap a span, even partly
    offsets = [(0, 3), (3, 5), (5, 9), (9, 10), (10, 14)]
    assert assistant_mask(offsets, [(4, 9)]) == [0, 1, 1, 0, 0]
    assert assistant_mask(offsets, [(0, 1), (9, 11)]) == [1, 0, 0, 1, 1]
    assert assistant_mask(offsets, []) == [0] * 5


def test_a_template_that_rewrites_earlier_turns_is_refused():
    # drops every assistant turn but the last (as templates that hide past reasoning do)
    template = ChatTemplate(
        "{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}{{ m['role'] }}: {{ m['content'] }}\n"
        "{% endif %}{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}",
        origin="test.jinja",
    )
    messages = CONVERSATIONS[1]
    with pytest.raises(MlmError, match=r"renders message 2 \(assistant\) so that the conversation before it"):
        template.assistant_spans(messages)
    with pytest.raises(MlmError, match="the chat template from test.jinja refused the messages: no system"):
        ChatTemplate("{{ raise_exception('no system') }}", origin="test.jinja").render(messages)


def test_chat_template_jinja_beside_the_tokenizer_wins_and_travels_with_it(tokenizer_dir, tmp_path):
    """transformers saves the template as chat_template.jinja; a copy of the tokenizer (an import,
    a checkpoint's tokenizer/) keeps it."""
    write_chat_config(tokenizer_dir, CHATML)
    (tokenizer_dir / "chat_template.jinja").write_text(LLAMA3)
    try:
        assert "chat_template.jinja" in copy_tokenizer_files(tokenizer_dir, tmp_path / "copy")
    finally:
        (tokenizer_dir / "chat_template.jinja").unlink()
    chat = load_chat_template(load_tokenizer(str(tmp_path / "copy" / "tokenizer.json")))
    assert chat.render(CONVERSATIONS[0]).startswith("<|begin_of_text|><|start_header_id|>user")


def test_sentencepiece_offsets_cover_the_text(sp_model):
    tok = load_tokenizer(str(sp_model))
    text = "def f(x): café → 🍵"
    ids, offsets = tok.encode_offsets(text)
    assert ids == tok.encode_plain(text) and len(offsets) == len(ids)
    assert offsets[0][0] == 0 and offsets[-1][1] == len(text)
    assert all(a[1] <= b[0] for a, b in zip(offsets, offsets[1:], strict=False))  # in order, no overlap
