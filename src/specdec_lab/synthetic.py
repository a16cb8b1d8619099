"""A drafter of known acceptance, for timing the engine without a real draft model.

Given the target's own greedy continuation of each prompt (recorded beforehand, e.g. by a plain
run), it proposes, position by position, the target's next token with probability `a` and a wrong
token otherwise. Under greedy verification every draft position is then accepted with probability
`a` given the ones before it were: E[accepted of k] = a + a^2 + ... + a^k, whatever the model.
It costs nothing to run, so a timed step is the engine's and the target's alone.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from specdec.drafters.base import Declared, Draft
from specdec.sampling import SamplingParams


class SyntheticDrafter(Declared):
    takes = frozenset()  # propose's keywords beyond (contexts, ks, leaves): Drafter.takes

    def __init__(
        self, continuations: Mapping[tuple[int, ...], Sequence[int]], acceptance: float, vocab_size: int, seed: int = 0
    ):
        """continuations: prompt tokens -> the target's greedy tokens after them."""
        if not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"acceptance must be in [0, 1], got {acceptance}")
        self.name, self.kind = f"synthetic:{acceptance:g}", "synthetic"
        self.acceptance = acceptance
        self.vocab_size = vocab_size
        self._continuations = {tuple(p): list(c) for p, c in continuations.items()}
        self._rng = np.random.default_rng(seed)
        self._rows: dict[int, tuple[int, list[int]]] = {}  # row -> (prompt length, continuation)

    def begin(self, row: int, prompt: Sequence[int], params: SamplingParams, rng: np.random.Generator) -> None:
        self._rows[row] = (len(prompt), self._continuations.get(tuple(prompt), []))

    def propose(
        self, contexts: Mapping[int, Sequence[int]], ks: Mapping[int, int], leaves: Mapping[int, int] | None = None
    ) -> dict[int, Draft]:
        drafts = {}
        for row, k in ks.items():
            start, truth = self._rows[row]
            pos = len(contexts[row]) - start  # tokens generated so far
            tokens = []
            for i in range(k):
                right = truth[pos + i] if pos + i < len(truth) else None
                if right is not None and self._rng.random() < self.acceptance:
                    tokens.append(right)
                else:  # any other token: the target rejects it
                    tokens.append(((right if right is not None else 0) + 1) % self.vocab_size)
            drafts[row] = Draft(tokens)
        return drafts

    def accept(self, n_accepted: Mapping[int, int]) -> None:
        pass

    def end(self, rows: Sequence[int]) -> None:
        for row in rows:
            self._rows.pop(row, None)
