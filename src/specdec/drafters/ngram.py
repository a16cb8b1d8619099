"""Prompt lookup: continue the longest earlier match of the last n tokens.

Code edits, summaries with quotes and chat that repeats the question all copy long runs of the
context. If the last n tokens occurred before, whatever followed them then is a free guess now.
The drafter has no distribution, so its q is one-hot (Draft.q is None).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..sampling import SamplingParams
from .base import Draft


class NgramDrafter:
    """Tries n = n_max down to n_min; for each n the most recent earlier occurrence wins
    (edits tend to follow the code nearest to them)."""

    def __init__(self, n_max: int = 4, n_min: int = 1):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got n_min={n_min}, n_max={n_max}")
        self.name = "ngram"
        self.n_min, self.n_max = n_min, n_max
        self._tokens: list[int] = []
        # n-gram -> the position just after its most recent occurrence, for every n
        self._last_end: dict[tuple[int, ...], int] = {}
        self.last_match_length = 0   # n of the last proposal's match (0 = none), for statistics

    def begin(self, prompt: Sequence[int], params: SamplingParams, rng: np.random.Generator) -> None:
        self._tokens = []
        self._last_end = {}

    def _index(self, context: Sequence[int]) -> None:
        """Index every n-gram that ends before the last token. Context only grows within a
        generation, so each position is indexed once."""
        tokens = self._tokens
        start = len(tokens)
        if context[:start] != tokens:   # not an extension: a new context, start over
            tokens.clear()
            self._last_end.clear()
            start = 0
        tokens.extend(context[start:])
        # An n-gram ending at `end` (exclusive) is indexed once a token follows it, i.e. end < len.
        for end in range(max(start, 1), len(tokens)):
            for n in range(self.n_min, self.n_max + 1):
                if end - n < 0:
                    break
                self._last_end[tuple(tokens[end - n:end])] = end

    def propose(self, context: Sequence[int], k: int) -> Draft:
        self.last_match_length = 0
        if k <= 0 or not context:
            return Draft([])
        self._index(context)
        tokens = self._tokens
        for n in range(min(self.n_max, len(tokens) - 1), self.n_min - 1, -1):
            end = self._last_end.get(tuple(tokens[-n:]))
            if end is not None:
                self.last_match_length = n
                return Draft(tokens[end:end + k])
        return Draft([])

    def accept(self, n_accepted: int) -> None:
        pass  # nothing to roll back: the index is rebuilt from the context it is given
