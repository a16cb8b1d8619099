"""Tokens -> text: whole UTF-8 characters at a time, cut at the first stop string."""

from __future__ import annotations

import codecs
from typing import Sequence


class Detokenizer:
    """Tokens -> text, whole UTF-8 characters at a time, cut at the first stop string; text that
    could still grow into a stop string is held back until it cannot."""

    def __init__(self, tokenizer, stop: Sequence[str]):
        self._tokenizer, self._stop = tokenizer, stop
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.tokens: list[int] = []
        self.text = ""  # all text so far
        self._sent = 0  # how much of it ready() has handed out
        self.stopped = False

    def add(self, tokens: Sequence[int]) -> bool:
        """Append tokens; True when a stop string ended the text (later tokens are dropped)."""
        for token in tokens:
            self.tokens.append(token)
            self.text += self._decoder.decode(self._tokenizer.token_bytes(token))
            cut = _find_stop(self.text, self._stop, max(0, self._sent - self._hold))
            if cut is not None:
                self.text = self.text[:cut]
                self.stopped = True
                return True
        return False

    def ready(self) -> str:
        """The new text that is final."""
        safe = len(self.text) - self._hold if self._stop and not self.stopped else len(self.text)
        if safe <= self._sent:
            return ""
        piece, self._sent = self.text[self._sent : safe], safe
        return piece

    def finish(self) -> str:
        """The rest, once generation is over."""
        if not self.stopped:
            self.text += self._decoder.decode(b"", final=True)
        piece, self._sent = self.text[self._sent :], len(self.text)
        return piece


def _find_stop(text: str, stops: Sequence[str], start: int) -> int | None:
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(hits) if hits else None
