"""The Drafter protocol and the Draft it returns."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

import numpy as np

from ..sampling import SamplingParams


@dataclass(frozen=True)
class Draft:
    tokens: list[int]                 # the k proposed tokens (may be fewer than asked, or none)
    q: np.ndarray | None = None       # [len(tokens), vocab] draft probabilities; None = one-hot


@runtime_checkable
class Drafter(Protocol):
    name: str

    def begin(self, prompt: Sequence[int], params: SamplingParams, rng: np.random.Generator) -> None:
        """A new generation starts: forget the last one. `params` and `rng` are the ones the
        engine verifies with, so that q is processed exactly like p."""
        ...

    def propose(self, context: Sequence[int], k: int) -> Draft:
        """Up to k tokens that follow `context` (prompt + everything emitted so far)."""
        ...

    def accept(self, n_accepted: int) -> None:
        """Told after every step how many of the last draft's tokens the target kept."""
        ...


# The longest draft a step may ask for (-k). k + 1 rows go through the target in one forward; past
# a few dozen tokens a draft is never accepted whole, and the width only costs.
MAX_DRAFT_TOKENS = 32
