"""Incremental detokenization that emits whole words.

Tokens are decoded together (so multi-token characters come out whole); text is released up to
the last space, at a newline (which also resets the window), or at once after a CJK character.
`flush()` releases the rest. The concatenation of all deltas is the answer's text.
"""

from __future__ import annotations

from typing import Callable


def is_cjk(ch: str) -> bool:
    cp = ord(ch)
    return 0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0x2F800 <= cp <= 0x2FA1F


class WordStreamer:
    def __init__(self, decode: Callable[[list[int]], str]):
        self._decode = decode
        self._window: list[int] = []
        self._printed = 0

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text that is now complete ('' if none)."""
        self._window.append(token_id)
        text = self._decode(self._window)
        if text.endswith("\n"):
            out = text[self._printed :]
            self._window, self._printed = [], 0
            return out
        if text and is_cjk(text[-1]):
            out = text[self._printed :]
        else:
            space = text.rfind(" ", self._printed)
            out = text[self._printed : space + 1] if space >= self._printed else ""
        self._printed += len(out)
        return out

    def flush(self) -> str:
        if not self._window:
            return ""
        out = self._decode(self._window)[self._printed :]
        self._window, self._printed = [], 0
        return out
