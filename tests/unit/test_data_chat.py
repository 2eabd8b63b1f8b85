"""`mlm data build --chat`: conversations (OpenAI and ShareGPT lines) → token ids and a loss mask
equal to transformers' `apply_chat_template(tokenize=True, return_assistant_tokens_mask=True)`;
every bad line named by file and line, or counted by reason with --skip-bad-lines."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from mlm.data.build import BuildOptions, build_dataset
from mlm.datasets.indexed import IndexedDataset
from mlm.datasets.meta import loss_mask_prefix, read_meta
from mlm.errors import MlmError
from tests.helpers.common import CHATML_MARKED, assert_error, chat_tokenizer, cli, write_chat_config

SYSTEM = {"role": "system", "content": "Answer briefly."}
USER = {"role": "user", "content": "Café or thé?"}
ANSWER = {"role": "assistant", "content": "  Thé, s'il vous plaît 🍵  "}
GOOD = {
    "messages": [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "It is 4."}]
}

STRICT = (  # refuses a system turn; marks the assistant's text unless the turn only calls tools
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system turn, please') }}{% endif %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
    "{% if m['role'] == 'assistant' and not m.get('tool_calls') %}"
    "{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ m.get('content', '') + '<|im_end|>' }}{% endif %}{{ '\\n' }}{% endfor %}"
)
TOOL_CALL = {
    "role": "assistant",
    "content": "",
    "tool_calls": [{"type": "function", "function": {"name": "f"}}],
}

BAD_LINES = [  # (line 2 of the input, the summary's reason, what the message says)
    ('{"messages": [', "bad JSON", "not valid JSON"),
    ("[1, 2]", "not an object", "a JSON list, not an object"),
    ({"text": "hi"}, "missing key", "no key 'messages' or 'conversations' (keys: text)"),
    ({"messages": []}, "not a message list", "'messages' is an empty list, not a non-empty list of messages"),
    ({"messages": "hi"}, "not a message list", "'messages' is a str, not a non-empty list of messages"),
    ({"messages": [USER, "hi"]}, "bad message", "message 1 is a str, not an object"),
    ({"messages": [{"content": "hi"}, ANSWER]}, "bad message", "message 0 has no 'role' (keys: content)"),
    (
        {"messages": [USER, {"role": "assistant", "content": [{"type": "text", "text": "hi"}]}]},
        "bad message",
        "message 1 (assistant) has content of type list, not a string",
    ),
    (
        {"messages": [USER, {"role": "bot", "content": "x"}]},
        "unknown role",
        "message 1 has role 'bot', not one of system, user, assistant, tool",
    ),
    (
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "function_call", "value": "{}"}]},
        "unknown role",
        "message 1 is from 'function_call', not one of system, human, gpt, tool, observation, function_response",
    ),
    (
        {"messages": [{"role": "user", "content": " \n"}, ANSWER]},
        "empty content",
        "message 0 (user) has empty content",
    ),
    ({"messages": [USER, {"role": "assistant"}]}, "empty content", "message 1 (assistant) has no content"),
    (
        {"messages": [USER, {"role": "user", "content": "?"}]},
        "no assistant message",
        "no assistant message (roles: user)",
    ),
    (
        {"messages": [SYSTEM, USER, ANSWER]},
        "template refused",
        "refused the messages: no system turn, please. Fix the conversation or the template (--chat-template)",
    ),
    (
        {"messages": [USER, TOOL_CALL, {"role": "tool", "content": "42"}]},
        "no assistant tokens",
        "marks none of its 35 tokens as the assistant's",
    ),
    (
        {"messages": [USER, {"role": "assistant", "content": "la " * 40}]},
        "too long",
        "106 tokens, longer than --seq-length + 1 = 33. Raise --seq-length",
    ),
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory, sample_texts):
    folder = chat_tokenizer(tmp_path_factory.mktemp("chat"), sample_texts)
    write_chat_config(folder, CHATML_MARKED)
    (folder / "strict.jinja").write_text(STRICT)
    return folder


def write_lines(path, lines):
    path.write_text(
        "".join((x if isinstance(x, str) else json.dumps(x, ensure_ascii=False)) + "\n" for x in lines)
    )
    return path


def build(tmp_path, tokenizer_dir, lines, **kw):
    opts = BuildOptions(
        [str(write_lines(tmp_path / "in.jsonl", lines))],
        str(tmp_path / "out"),
        str(tokenizer_dir),
        progress=False,
        chat=True,
        **kw,
    )
    return build_dataset(opts)


def outputs(tmp_path):
    return sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("out"))


def test_tokens_and_loss_mask_equal_transformers(tmp_path, tokenizer_dir):
    from transformers import AutoTokenizer

    conversations = [
        [USER, ANSWER],
        [SYSTEM, USER, ANSWER, {"role": "user", "content": "And then?", "name": "ana"}, ANSWER],
        [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "def f(x):\n    return 4"}],
    ]
    sharegpt = {"from": "human", "value": "2 + 2?"}, {"from": "gpt", "value": "def f(x):\n    return 4"}
    lines = [
        {"messages": conversations[0]},
        {"messages": conversations[1], "id": 7},
        {"conversations": sharegpt},
    ]
    s = build(tmp_path, tokenizer_dir, lines)
    hf = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    theirs = [
        hf.apply_chat_template(m, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        for m in conversations
    ]
    tokens, mask = IndexedDataset(tmp_path / "out"), IndexedDataset(loss_mask_prefix(tmp_path / "out"))
    assert tokens.num_documents == mask.num_documents == 3 and mask.dtype == np.uint8
    np.testing.assert_array_equal(tokens.sequence_lengths, mask.sequence_lengths)
    np.testing.assert_array_equal(tokens.document_indices, mask.document_indices)
    for d, t in enumerate(theirs):
        assert tokens.document(d).tolist() == t["input_ids"], f"conversation {d}"
        assert mask.document(d).tolist() == t["assistant_masks"], f"conversation {d}"
    assistant = sum(sum(t["assistant_masks"]) for t in theirs)
    assert s.documents == 3 and s.tokens == tokens.num_tokens and s.assistant_tokens == assistant
    meta = read_meta(tmp_path / "out")
    assert meta["chat"] == {
        "loss_mask": "out_loss_mask",
        "template": str(tokenizer_dir / "tokenizer_config.json"),
        "template_sha256": hashlib.sha256(CHATML_MARKED.encode()).hexdigest(),
        "marks_generation": True,
        "assistant_tokens": assistant,
    }
    assert meta["dtype"] == "uint16" and meta["append_eod"] is False and meta["documents"] == 3

    # an explicit --json-key names the field; the shape comes from the messages' keys
    write_lines(tmp_path / "in.jsonl", [{"dialog": sharegpt}])
    opts = BuildOptions(
        [str(tmp_path / "in.jsonl")], str(tmp_path / "key"), str(tokenizer_dir), json_key="dialog", chat=True
    )
    build_dataset(opts)
    assert IndexedDataset(tmp_path / "key").document(0).tolist() == theirs[2]["input_ids"]


@pytest.mark.parametrize("line,reason,message", BAD_LINES, ids=[r for _, r, _ in BAD_LINES])
def test_a_bad_line_stops_the_build_and_names_it(tmp_path, tokenizer_dir, line, reason, message):
    kw = {"chat_template": str(tokenizer_dir / "strict.jinja"), "seq_length": 32}
    with pytest.raises(MlmError) as e:
        build(tmp_path, tokenizer_dir, [GOOD, line, GOOD], **kw)
    assert str(e.value).startswith(f"{tmp_path / 'in.jsonl'}:2: "), e.value
    assert message in str(e.value) and "--skip-bad-lines" in str(e.value), e.value
    assert outputs(tmp_path) == []
    s = build(tmp_path, tokenizer_dir, [GOOD, line, GOOD], skip_bad_lines=True, **kw)
    assert s.skipped == {reason: 1} and s.documents == 2
    assert read_meta(tmp_path / "out")["sources"][0] == {
        "path": str(tmp_path / "in.jsonl"),
        "bytes": (tmp_path / "in.jsonl").stat().st_size,
        "documents": 2,
        "skipped": {reason: 1},
    }
    assert outputs(tmp_path) == ["out.bin", "out.idx", "out.json", "out_loss_mask.bin", "out_loss_mask.idx"]


def test_an_assistant_turn_that_only_calls_tools_may_have_no_content(tmp_path, tokenizer_dir):
    conversation = [USER, {**TOOL_CALL, "content": None}, {"role": "tool", "content": "42"}, ANSWER]
    s = build(
        tmp_path,
        tokenizer_dir,
        [{"messages": conversation}],
        chat_template=str(tokenizer_dir / "strict.jinja"),
    )
    assert s.documents == 1 and 0 < s.assistant_tokens < s.tokens


@pytest.mark.parametrize(
    "options,message",
    [
        ({"chat": True, "append_eod": True}, "--append-eod with --chat"),
        ({"chat": True, "input_format": "text"}, "--input-format text with --chat"),
        ({"seq_length": 512}, "--seq-length 512: only used with --chat"),
        ({"chat_template": "t.jinja"}, "--chat-template t.jinja: only used with --chat"),
    ],
)
def test_options_that_do_not_go_together(options, message):
    with pytest.raises(MlmError, match=message):
        BuildOptions(["in.jsonl"], "out", "tok", **options)


def test_the_cli_builds_and_refuses(tmp_path, tokenizer_dir, monkeypatch, capsys):
    long = {"messages": [USER, {"role": "assistant", "content": "la " * 40}]}
    write_lines(tmp_path / "in.jsonl", [GOOD, long, {"conversations": [{"from": "gpt", "value": "hi"}]}])
    args = [
        "data",
        "build",
        "--chat",
        "-i",
        tmp_path / "in.jsonl",
        "-t",
        tokenizer_dir,
        "-o",
        tmp_path / "out",
    ]
    r = cli(monkeypatch, capsys, *args, "--no-progress", "--seq-length", "32")
    assert_error(r, "in.jsonl:2: 106 tokens, longer than --seq-length + 1 = 33")
    assert outputs(tmp_path) == []
    r = cli(monkeypatch, capsys, *args, "--no-progress", "--seq-length", "32", "--skip-bad-lines")
    assert r.returncode == 0, r.stderr
    err = " ".join(r.stderr.split())
    for row in ("conversations │ 2", "assistant tokens │ 10 (23.8%)", "skipped: too long │ 1"):
        assert row in err, err
    (tmp_path / "out.bin").unlink()  # the loss mask alone is an output that exists too
    assert_error(cli(monkeypatch, capsys, *args), "output already exists", "out_loss_mask.bin", "--overwrite")
    assert_error(cli(monkeypatch, capsys, *args, "--append-eod", "--overwrite"), "--append-eod with --chat")
    (tmp_path / "in.txt").write_text("hello\n")
    args[4] = tmp_path / "in.txt"
    assert_error(
        cli(monkeypatch, capsys, *args, "--overwrite"), "in.txt: --chat reads JSONL", "--input-format jsonl"
    )
