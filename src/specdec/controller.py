"""Chooses the drafter and the draft length for each step.

For now the policy is fixed: the one drafter, k tokens a step (k = 0 or no drafter is plain
decoding). The engine asks before every step and reports after it, so a cost-aware policy can
replace this one without touching the loop.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .drafters.base import Drafter


@dataclass
class FixedController:
    drafter: Drafter | None
    k: int

    def choose(self, context: Sequence[int], room: int) -> tuple[Drafter | None, int]:
        """(drafter, k) for the next step; `room` is how many more tokens the target's cache holds
        after this step's last token, so k never overflows the context."""
        if self.drafter is None:
            return None, 0
        return self.drafter, max(0, min(self.k, room))

    def observe(self, drafter: Drafter | None, k: int, n_drafted: int, n_accepted: int,
                draft_seconds: float, target_seconds: float) -> None:
        """Told the outcome of every step (a fixed policy ignores it)."""
