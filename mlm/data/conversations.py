"""Conversations for `mlm data build --chat`: one JSONL line → the messages a chat template takes,
then → token ids and the assistant's mask.

Two shapes are read, told apart by the first message's keys (`role` or `from`):

- OpenAI: `{"messages": [{"role": "user", "content": "..."}, ...]}`; a message's other keys
  (`name`, `tool_calls`, ...) reach the template unchanged.
- ShareGPT: `{"conversations": [{"from": "human", "value": "..."}, ...]}`; `from` becomes a role
  through `SHAREGPT_ROLES`, `value` the content.

The field is `--json-key`, by default `messages` where a line has it, else `conversations`. Every
bad conversation is a `BadInput` naming its file and line, with the reason the
`--skip-bad-lines` summary counts it under: those found on reading here, and those found when
the template renders it (`conversation_tokens`), which runs later, in the build's main thread.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlm.chat import ChatTemplate, chat_tokens
from mlm.data.readers import BadInput, json_object, key_names
from mlm.errors import MlmError
from mlm.tokenizer import Tokenizer

ROLES = ("system", "user", "assistant", "tool")
"""The roles of an OpenAI-shaped message."""

SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "gpt": "assistant",
    "tool": "tool",
    "observation": "tool",
    "function_response": "tool",
}
"""ShareGPT's `from` → role. Others (`function_call` among them) are refused, not guessed."""

AUTO_KEYS = ("messages", "conversations")
"""The fields read without --json-key, in order of preference."""

SKIP = "or pass --skip-bad-lines to skip such lines"


@dataclass(frozen=True)
class Conversation:
    """One line's messages in the OpenAI shape, and where the line is (`file:line`)."""

    messages: list[dict]
    where: str

    @property
    def chars(self) -> int:
        return sum(len(m.get("content") or "") for m in self.messages)


def parse_conversation(line: bytes, where: str, key: str | None) -> Conversation | None:
    """The conversation on one JSONL line (None for a blank line) from field `key` (None: one of
    `AUTO_KEYS`); BadInput naming `where` when the line holds none."""
    if not line.strip():
        return None
    obj = json_object(line, where, '{"messages": [{"role": "user", "content": "..."}, ...]}')
    if key is None:
        key = next((k for k in AUTO_KEYS if k in obj), None)
        if key is None:
            raise BadInput(
                where,
                "missing key",
                f"no key 'messages' or 'conversations' (keys: {key_names(obj)})",
                f"Name the field with --json-key, {SKIP}",
            )
    elif key not in obj:
        raise BadInput(
            where,
            "missing key",
            f"no key {key!r} (keys: {key_names(obj)})",
            f"Choose the key with --json-key, {SKIP}",
        )
    value = obj[key]
    if not isinstance(value, list) or not value:
        what = "an empty list" if isinstance(value, list) else f"a {type(value).__name__}"
        raise BadInput(
            where,
            "not a message list",
            f"{key!r} is {what}, not a non-empty list of messages",
            f"Choose the field with --json-key, {SKIP}",
        )
    sharegpt = isinstance(value[0], dict) and "from" in value[0] and "role" not in value[0]
    messages = [_message(m, i, sharegpt, where) for i, m in enumerate(value)]
    if not any(m["role"] == "assistant" for m in messages):
        roles = ", ".join(dict.fromkeys(m["role"] for m in messages))
        raise BadInput(
            where,
            "no assistant message",
            f"no assistant message (roles: {roles}), so nothing to train on",
            f"Only the assistant's tokens are targets: add its answer, {SKIP}",
        )
    return Conversation(messages, where)


def _message(m, i: int, sharegpt: bool, where: str) -> dict:
    """Message `i` in the OpenAI shape, checked."""
    example = '{"from": "human", "value": "..."}' if sharegpt else '{"role": "user", "content": "..."}'
    if not isinstance(m, dict):
        raise BadInput(
            where,
            "bad message",
            f"message {i} is a {type(m).__name__}, not an object",
            f"Each message must be an object such as {example}, {SKIP}",
        )
    name = "from" if sharegpt else "role"
    if name not in m:
        raise BadInput(
            where,
            "bad message",
            f"message {i} has no {name!r} (keys: {key_names(m)})",
            f"Each message must be an object such as {example}, {SKIP}",
        )
    if sharegpt:
        role = SHAREGPT_ROLES.get(m["from"]) if isinstance(m["from"], str) else None
        if role is None:
            raise BadInput(
                where,
                "unknown role",
                f"message {i} is from {m['from']!r}, not one of {', '.join(SHAREGPT_ROLES)}",
                f"Map it to one of these in the data, {SKIP}",
            )
        rest = {k: v for k, v in m.items() if k not in ("from", "value")}
        m = {"role": role, "content": m.get("value"), **rest}
    elif m["role"] not in ROLES:
        raise BadInput(
            where,
            "unknown role",
            f"message {i} has role {m['role']!r}, not one of {', '.join(ROLES)}",
            f"Map it to one of these in the data, {SKIP}",
        )
    content = m.get("content")
    calls_tools = m["role"] == "assistant" and bool(m.get("tool_calls"))
    if content is not None and not isinstance(content, str):
        raise BadInput(
            where,
            "bad message",
            f"message {i} ({m['role']}) has content of type {type(content).__name__}, not a string",
            f"Give the content as text, {SKIP}",
        )
    if not (content and content.strip()) and not calls_tools:
        raise BadInput(
            where,
            "empty content",
            f"message {i} ({m['role']}) has {'no' if content is None else 'empty'} content",
            f"Only an assistant message with tool_calls may have none: drop the message or the line, {SKIP}",
        )
    return m


def conversation_tokens(
    conversation: Conversation, template: ChatTemplate, tokenizer: Tokenizer, seq_length: int | None
) -> tuple[list[int], list[int]]:
    """(token ids, assistant mask) of a conversation (`mlm.chat.chat_tokens`); BadInput naming its
    line when the template refuses it or marks none of its tokens, or when it holds more than
    `seq_length` + 1 tokens (one training sample)."""
    where = conversation.where
    try:
        ids, mask = chat_tokens(template, tokenizer, conversation.messages)
    except MlmError as e:
        raise BadInput(
            where,
            "template refused",
            str(e),
            f"Fix the conversation or the template (--chat-template), {SKIP}",
        ) from None
    if not any(mask):
        raise BadInput(
            where,
            "no assistant tokens",
            f"the chat template from {template.origin} marks none of its {len(ids)} tokens as the assistant's",
            f"Mark the assistant's text with {{% generation %}} in the template (--chat-template), {SKIP}",
        )
    if seq_length is not None and len(ids) > seq_length + 1:
        raise BadInput(
            where,
            "too long",
            f"{len(ids)} tokens, longer than --seq-length + 1 = {seq_length + 1}",
            f"Raise --seq-length, {SKIP}",
        )
    return ids, mask
