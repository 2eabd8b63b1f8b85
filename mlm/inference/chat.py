"""Chat templates: messages → prompt text.

The template is the tokenizer's own (`chat_template` in the tokenizer_config.json beside it, as
Hugging Face models ship it), or a Jinja file given by the user, or `DEFAULT_TEMPLATE`, a plain
"role: content" transcript for models trained without one. Templates run in Jinja's sandbox
with Hugging Face's conventions (trim_blocks, lstrip_blocks, `bos_token`, `eos_token`,
`add_generation_prompt`, `raise_exception`).
"""

from __future__ import annotations

import json
from pathlib import Path

from mlm.errors import MlmError
from mlm.tokenizer import Tokenizer

DEFAULT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", origin: str = "default"):
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
        try:
            self.template = env.from_string(source)
        except TemplateError as e:
            raise MlmError(f"chat template from {origin}: not a valid Jinja template ({e})") from None
        self.bos_token, self.eos_token, self.origin = bos_token, eos_token, origin

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text; raises MlmError when the template refuses the messages."""
        from jinja2 import TemplateError

        try:
            return self.template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except TemplateError as e:
            raise MlmError(f"the chat template refused the messages: {e}") from None


def _token_text(value) -> str:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def load_chat_template(tokenizer: Tokenizer, path: str | None = None) -> ChatTemplate:
    """The template in file `path`, else the tokenizer's own, else DEFAULT_TEMPLATE."""
    config_file = Path(tokenizer.path).parent / "tokenizer_config.json"
    config = {}
    if config_file.is_file():
        try:
            config = json.loads(config_file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise MlmError(f"{config_file}: not valid JSON ({e})") from None
    tokens = {
        "bos_token": _token_text(config.get("bos_token")),
        "eos_token": _token_text(config.get("eos_token")),
    }
    if path is not None:
        try:
            return ChatTemplate(Path(path).read_text(), **tokens, origin=str(path))
        except OSError as e:
            raise MlmError(f"--chat-template {path}: cannot read it ({e.strerror})") from None
    source = config.get("chat_template")
    if isinstance(source, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if isinstance(source, str) and source:
        return ChatTemplate(source, **tokens, origin=str(config_file))
    return ChatTemplate(DEFAULT_TEMPLATE, **tokens)
