"""Prompt lookup: continue an earlier occurrence of the last n tokens.

Code edits, summaries with quotes and chat that repeats the question all copy long runs of the
context. If the last n tokens occurred before, whatever followed them then is a free guess now.
The drafter has no distribution, so its q is one-hot (Draft.q is None).

Which occurrence: the one whose match reaches furthest back. A function copied from the prompt
shares its last four tokens with many places ("    return self."), but only the place it is being
copied from shares the last forty. That length (Draft.evidence["match"]) is also what the
cost-aware controller predicts acceptance from: the longer the copy so far, the likelier it goes on.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from ..sampling import SamplingParams
from .base import Draft


class _Index:
    """One row's context and, for every n-gram in it, the positions just after each occurrence."""

    def __init__(self):
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], list[int]] = {}  # n-gram -> positions after it, oldest first


class NgramDrafter:
    """Tries n = n_max down to n_min; for the first n whose n-gram occurred before, the latest
    `candidates` occurrences compete on how far back their match extends (up to `match_cap`
    tokens), the most recent winning ties (edits tend to follow the code nearest to them)."""

    def __init__(self, n_max: int = 4, n_min: int = 1, candidates: int = 32, match_cap: int = 128):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got n_min={n_min}, n_max={n_max}")
        if candidates < 1 or match_cap < n_max:
            raise ValueError(f"need candidates >= 1 and match_cap >= n_max, got {candidates}, {match_cap}")
        self.name = self.kind = "ngram"
        self.n_min, self.n_max = n_min, n_max
        self.candidates, self.match_cap = candidates, match_cap
        self._rows: dict[int, _Index] = {}

    def begin(self, row: int, prompt: Sequence[int], params: SamplingParams, rng: np.random.Generator) -> None:
        self._rows[row] = _Index()

    def end(self, rows: Sequence[int]) -> None:
        for row in rows:
            self._rows.pop(row, None)

    def accept(self, n_accepted: Mapping[int, int]) -> None:
        pass  # nothing to roll back: the index follows the context it is given

    def propose(self, contexts: Mapping[int, Sequence[int]], ks: Mapping[int, int]) -> dict[int, Draft]:
        return {row: self.propose_one(self._rows.setdefault(row, _Index()), contexts[row], ks[row]) for row in ks}

    def _update(self, index: _Index, context: Sequence[int]) -> None:
        """Index every n-gram that ends before the last token. Context only grows within a
        generation, so each position is indexed once."""
        tokens = index.tokens
        start = len(tokens)
        if context[:start] != tokens:  # not an extension: a new context, start over
            tokens.clear()
            index.ends.clear()
            start = 0
        tokens.extend(context[start:])
        # An n-gram ending at `end` (exclusive) is indexed once a token follows it, i.e. end < len.
        for end in range(max(start, 1), len(tokens)):
            for n in range(self.n_min, self.n_max + 1):
                if end - n < 0:
                    break
                index.ends.setdefault(tuple(tokens[end - n : end]), []).append(end)

    def _match_length(self, tokens: list[int], end: int, n: int) -> int:
        """How many tokens before `end` equal the last tokens of the context (at least n)."""
        last = len(tokens)
        m = n
        cap = min(self.match_cap, end)
        while m < cap and tokens[end - 1 - m] == tokens[last - 1 - m]:
            m += 1
        return m

    def propose_one(self, index: _Index, context: Sequence[int], k: int) -> Draft:
        if k <= 0 or not context:
            return Draft([])
        self._update(index, context)
        tokens = index.tokens
        for n in range(min(self.n_max, len(tokens) - 1), self.n_min - 1, -1):
            ends = index.ends.get(tuple(tokens[-n:]))
            if ends:
                best_end, best_m = ends[-1], -1
                considered = ends[-self.candidates :]
                for end in reversed(considered):  # most recent first
                    m = self._match_length(tokens, end, n)
                    if m > best_m:
                        best_end, best_m = end, m
                guess = tokens[best_end]
                votes = (sum(tokens[end] == guess for end in considered), len(considered))
                return Draft(tokens[best_end : best_end + k], evidence={"match": best_m, "votes": votes})
        return Draft([])
