"""Incremental detokenization with stop strings.

Text is released only when it is final: a tail that could still become a stop string, or an
incomplete UTF-8 character (decoded as U+FFFD), is held back until the next token decides it.
"""

from __future__ import annotations

from mlm.tokenizer import Tokenizer


class TextStream:
    def __init__(self, tokenizer: Tokenizer | None, stop: tuple[str, ...]):
        self.tokenizer = tokenizer
        self.stop = stop
        self.ids: list[int] = []
        self.sent = 0  # characters of the decoded text released so far
        self.text = ""  # the text released so far

    def add(self, token_id: int) -> tuple[str, bool]:
        """(newly final text, whether a stop string was reached; the text then ends before it)."""
        if self.tokenizer is None:
            return "", False
        self.ids.append(token_id)
        full = self.tokenizer.decode(self.ids)
        hits = [i for i in (full.find(s) for s in self.stop) if i >= 0]
        if hits:
            return self._release(full, min(hits)), True
        hold = max((_overlap(full, s) for s in self.stop), default=0)
        end = len(full) - hold
        while end > self.sent and full[end - 1] == "\ufffd":
            end -= 1
        return self._release(full, end), False

    def flush(self) -> str:
        """The text still held back, at the end of a sequence that stopped for another reason."""
        if self.tokenizer is None or not self.ids:
            return ""
        full = self.tokenizer.decode(self.ids)
        return self._release(full, len(full))

    def _release(self, full: str, end: int) -> str:
        delta = full[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        self.text += delta
        return delta


def _overlap(text: str, stop: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `stop`."""
    for n in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0
