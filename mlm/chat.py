"""Chat templates: messages → text, and → token ids with the assistant tokens marked.

The template is a Jinja file given by the user, or the tokenizer's own (`chat_template.jinja`
beside it, else `chat_template` in its tokenizer_config.json, as Hugging Face models ship them),
or `DEFAULT_TEMPLATE`, a plain "role: content" transcript for models trained without one.
Templates run in Jinja's sandbox with transformers' conventions: trim_blocks, lstrip_blocks, the
tokenizer's special tokens (`bos_token`, `eos_token`, ...), `add_generation_prompt`,
`raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text.

`{% generation %} ... {% endgeneration %}` marks what the assistant says; `chat_tokens` turns the marks
into a per-token mask as transformers' `apply_chat_template(return_assistant_tokens_mask=True)`
does: a token is the assistant's when its characters overlap a marked span. A template without
the marks gets them from the messages (`assistant_spans`): each assistant turn is the text the
message adds to the conversation before it with the generation prompt.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from mlm.errors import MlmError
from mlm.tokenizer import Tokenizer

DEFAULT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")
"""The tokenizer_config.json entries a template sees by name."""


def _generation_extension():
    """The Jinja extension of `{% generation %}`: while a render tracks them (`tracking`), each
    block records (start, end) of its text in the output rendered so far."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def __init__(self, environment):
            super().__init__(environment)
            self.tracking: tuple[list[str], list[tuple[int, int]]] | None = None

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller) -> str:
            text = caller()
            if self.tracking is not None:
                blocks, spans = self.tracking
                start = sum(map(len, blocks))  # the text the render has yielded so far
                spans.append((start, start + len(text)))
            return text

    return Generation


class ChatTemplate:
    def __init__(self, source: str, origin: str = "default", **special_tokens: str):
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=["jinja2.ext.loopcontrols", _generation_extension()],
        )
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: (
            json.dumps(
                x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
            )
        )
        try:
            self.template = env.from_string(source)
        except TemplateError as e:
            raise MlmError(f"chat template from {origin}: not a valid Jinja template ({e})") from None
        self._generation = next(e for e in env.extensions.values() if "generation" in e.tags)
        lexed = [(kind, value) for _, kind, value in env.lex(source) if kind != "whitespace"]
        self.marks_generation = any(
            a[0] == "block_begin" and b == ("name", "generation")
            for a, b in zip(lexed, lexed[1:], strict=False)
        )
        """Whether the template marks the assistant's text with {% generation %}."""
        self.special_tokens = {k: special_tokens.get(k, "") for k in SPECIAL_TOKENS}
        self.source, self.origin = source, origin

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text; raises MlmError when the template refuses the messages."""
        return self.render_marked(messages, add_generation_prompt)[0]

    def render_marked(self, messages: list[dict], add_generation_prompt: bool = False) -> tuple[str, list]:
        """(the text, the (start, end) character spans its `{% generation %}` blocks marked)."""
        from jinja2 import TemplateError

        blocks: list[str] = []
        spans: list[tuple[int, int]] = []
        self._generation.tracking = (blocks, spans)
        try:
            for block in self.template.generate(
                messages=[{k: v for k, v in m.items() if v is not None} for m in messages],
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            ):
                blocks.append(block)
        except TemplateError as e:
            raise MlmError(f"the chat template from {self.origin} refused the messages: {e}") from None
        finally:
            self._generation.tracking = None
        return "".join(blocks), spans

    def assistant_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """(the conversation's text, the character spans of the assistant's turns): the template's
        `{% generation %}` marks where it has them, else each assistant message's text as the
        conversation up to it renders it after the generation prompt. MlmError where a turn does not
        extend the text before it (a template that rewrites earlier turns, such as one that drops
        past reasoning)."""
        text, spans = self.render_marked(messages)
        if self.marks_generation:
            return text, spans
        spans = []
        for i, m in enumerate(messages):
            if m.get("role") != "assistant":
                continue
            before = self.render_marked(messages[:i], add_generation_prompt=True)[0] if i else ""
            upto = self.render_marked(messages[: i + 1])[0]
            if not (upto.startswith(before) and text.startswith(upto)):
                raise MlmError(
                    f"the chat template from {self.origin} renders message {i} (assistant) so that the "
                    "conversation before it is not a prefix of the whole: its tokens cannot be marked; "
                    "mark them in the template with {% generation %} ... {% endgeneration %}"
                )
            spans.append((len(before), len(upto)))
        return text, spans


def assistant_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for each token (character `offsets`, in order) overlapping one of `spans` (in order), as
    transformers' `apply_chat_template` marks `assistant_masks`."""
    mask, s = [0] * len(offsets), 0
    for i, (start, end) in enumerate(offsets):
        while s < len(spans) and start >= spans[s][1]:
            s += 1
        if s == len(spans):
            break
        if end > spans[s][0]:
            mask[i] = 1
    return mask


def chat_tokens(
    template: ChatTemplate, tokenizer: Tokenizer, messages: list[dict]
) -> tuple[list[int], list[int]]:
    """(token ids, assistant mask) of a conversation: the rendered text tokenized without the
    tokenizer's added special tokens (the template writes them), as transformers'
    `apply_chat_template(tokenize=True, return_assistant_tokens_mask=True)`."""
    text, spans = template.assistant_spans(messages)
    ids, offsets = tokenizer.encode_offsets(text)
    return ids, assistant_mask(offsets, spans)


def _token_text(value) -> str:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def load_chat_template(tokenizer: Tokenizer, path: str | None = None) -> ChatTemplate:
    """The template in file `path`, else the tokenizer's own (chat_template.jinja, then
    tokenizer_config.json's chat_template), else DEFAULT_TEMPLATE."""
    folder = Path(tokenizer.path).parent
    config_file = folder / "tokenizer_config.json"
    config = {}
    if config_file.is_file():
        try:
            config = json.loads(config_file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise MlmError(f"{config_file}: not valid JSON ({e})") from None
    tokens = {k: _token_text(config.get(k)) for k in SPECIAL_TOKENS}
    if path is not None:
        try:
            return ChatTemplate(Path(path).read_text(), origin=str(path), **tokens)
        except OSError as e:
            raise MlmError(f"--chat-template {path}: cannot read it ({e.strerror})") from None
    if (folder / "chat_template.jinja").is_file():
        jinja = folder / "chat_template.jinja"
        return ChatTemplate(jinja.read_text(), origin=str(jinja), **tokens)
    source = config.get("chat_template")
    if isinstance(source, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if isinstance(source, str) and source:
        return ChatTemplate(source, origin=str(config_file), **tokens)
    return ChatTemplate(DEFAULT_TEMPLATE, **tokens)
