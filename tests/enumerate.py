"""Exact distributions through the real code: every random decision enumerated, with its probability.

Every random decision in specdec's decode path is one of three draws from `specdec.sampling`: a
categorical draw (`sample`), a Bernoulli (`accept`, true with min(1, num / den)), or several
Bernoullis at once (`accepts`). `exact(run)` replaces them with an oracle and calls `run()` once
for every combination of outcomes that has a probability above zero, depth first (each call
replays the choices of the branch it explores, then takes the first outcome of every new
decision and leaves the others for later calls). It returns {run's result: probability}, the
probabilities multiplied along each branch. So a test checks the whole engine (the drafter's
draws, its shape, the controller's and the engine's choices, the rule the engine dispatches to)
against the target's own distribution with no sampling error: a bias of 1e-9 is visible where a
sampled harness of 4 000 rows sees only ~0.06.

`run` must rebuild whatever holds state between calls (a decoder, a suffix cache): each call is
one branch, from the same start.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Hashable

import numpy as np
import pytest

import specdec.drafters.cross_vocab
import specdec.drafters.model
import specdec.sampling


class _Oracle:
    def __init__(self, script: list[int]):
        self.script, self.taken, self.prob = script, [], 1.0
        self.open: list[tuple[int, list[int]]] = []  # (decision index, its other outcomes)

    def choose(self, probs: list[float]) -> int:
        """The outcome of one decision among outcomes of these probabilities (summing to 1)."""
        live = [i for i, p in enumerate(probs) if p > 0.0]
        at = len(self.taken)
        if at < len(self.script):
            i = self.script[at]
        else:
            i = live[0]
            self.open.append((at, live[1:]))
        self.taken.append(i)
        self.prob *= probs[i]
        return i


def exact(run: Callable[[], Hashable], limit: int = 200_000) -> dict[Hashable, float]:
    """{run()'s result: its exact probability} over every branch of the random decisions."""
    out: dict[Hashable, float] = defaultdict(float)
    stack: list[list[int]] = [[]]
    runs = 0
    with pytest.MonkeyPatch.context() as patch:
        oracle = None

        def sample(probs, rng):
            probs = np.asarray(probs, dtype=np.float64)
            return oracle.choose(list(probs / probs.sum()))

        def accept(rng, num, den):
            yes = min(1.0, max(0.0, float(num) / float(den)))
            return oracle.choose([1.0 - yes, yes]) == 1

        def accepts(rng, probs):
            return np.array([oracle.choose([1.0 - p, p]) == 1 for p in np.clip(np.asarray(probs, float), 0, 1)])

        for module in (specdec.sampling, specdec.drafters.model, specdec.drafters.cross_vocab):
            patch.setattr(module, "sample", sample)
        patch.setattr(specdec.sampling, "accept", accept)
        patch.setattr(specdec.sampling, "accepts", accepts)
        while stack:
            script = stack.pop()
            oracle = _Oracle(script)
            result = run()
            out[result] += oracle.prob
            for at, others in oracle.open:
                stack += [oracle.taken[:at] + [i] for i in others]
            runs += 1
            assert runs <= limit, f"more than {limit} branches: make the case smaller"
    return dict(out)


def total_variation(a: dict, b: dict) -> float:
    return 0.5 * sum(abs(a.get(o, 0.0) - b.get(o, 0.0)) for o in set(a) | set(b))
