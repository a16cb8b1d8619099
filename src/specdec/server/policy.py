"""Each request its own speculation, every row in the same step.

The engine asks ONE controller for every live row's drafter and k. `RoutingController` is that
controller for a server whose requests choose their own policy (a spec.DraftSpec): it splits the
rows by policy and hands each group to what decides for it -- the cost-aware controller for
'auto' rows, prompt lookup or the draft model at the row's own k for fixed rows, nothing for
plain rows -- and puts the plans back together. So one target forward still scores every row,
whatever it asked for: rows choosing different policies batch together, as they must on a CPU
where width is the scarce resource.

Why this and not one engine per policy: engines sharing the target would each run their own
forward, serialising the rows a batch should carry together, and each would believe it has the
whole cache. The router needs nothing of the engine but its controller slot: each request
carries its policy (Engine.add), and the engine hands it over with the row (begin).

What it does not do: the cost-aware controller allocates width among its own rows only; the
fixed-policy rows in the same step widen the forward without it knowing. With a draft model, a
step where 'auto' rows and fixed draft-model rows both draft runs the draft model twice.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from ..build import Drafters
from ..controller import Outcome
from ..drafters.base import Draft, Drafter
from ..spec import WIDTH_PER_CALL, DraftSpec


class RoutingController:
    def __init__(self, auto, drafters: Drafters):
        self.auto = auto  # CostAwareController (over the drafters' ngram, suffix and model)
        # what a request's fixed policy drafts with, by its kind
        self.drafters = {
            "ngram": drafters.ngram,
            "model": drafters.model,
            "suffix": drafters.suffix,
            "head": drafters.head,
        }
        self._rows: dict[int, DraftSpec] = {}  # row -> policy, while the row lives

    def begin(self, row: int, prompt: Sequence[int], policy: DraftSpec | None = None) -> None:
        """A row joins with its request's policy (Engine.add carries it)."""
        if policy is None:
            raise ValueError("the server's router speculates each request by its own policy: add it with one")
        self._rows[row] = policy
        if policy.is_auto:
            self.auto.begin(row, prompt)

    def end(self, row: int) -> None:
        policy = self._rows.pop(row, None)
        if policy is not None and policy.is_auto:
            self.auto.end(row)

    def draft(
        self,
        contexts: Mapping[int, Sequence[int]],
        caps: Mapping[int, int],
        leaves: Mapping[int, int] | None = None,
    ) -> dict[int, tuple[Drafter | None, Draft | None]]:
        plan: dict[int, tuple[Drafter | None, Draft | None]] = {row: (None, None) for row in contexts}
        auto = [row for row in contexts if self._rows[row].is_auto]
        if auto:
            plan.update(self.auto.draft({r: contexts[r] for r in auto}, {r: caps[r] for r in auto}, leaves))
        for kind, drafter in self.drafters.items():
            ks = {row: min(self._rows[row].k, caps[row]) for row in contexts if self._rows[row].kind == kind}
            ks = {row: k for row, k in ks.items() if k > 0}
            if drafter is not None and ks:
                asked = {row: contexts[row] for row in ks}
                bounds = {"leaves": leaves} if leaves else {}  # (none: no row's tree is bounded)
                if kind in WIDTH_PER_CALL:  # each request's own tree width (1: a chain)
                    drafts = drafter.propose(asked, ks, {row: self._rows[row].width for row in ks}, **bounds)
                else:  # a draft model or head drafts the shape the server built it with
                    drafts = drafter.propose(asked, ks, **bounds)
                plan.update({row: (drafter, draft) for row, draft in drafts.items()})
        suffix = self.drafters["suffix"]
        if suffix is not None:
            # The suffix cache remembers every request, whatever its policy: it learns a row's
            # context when asked to draft for it, so the rows nobody asked it about are asked for
            # 0 tokens (free: it only notes the context, added to the cache when the row ends).
            unseen = [row for row in contexts if plan[row][0] is not suffix and not self._rows[row].is_auto]
            if unseen:
                suffix.propose({row: contexts[row] for row in unseen}, {row: 0 for row in unseen})
        return plan

    def observe(
        self, outcomes: Mapping[int, Outcome], passes: Sequence[int], target_seconds: float, depth: float | None = None
    ) -> None:
        # the cost table learns from every forward (its passes are the whole step's); acceptance
        # only from the rows the cost-aware controller drafted for
        self.auto.observe({row: o for row, o in outcomes.items() if self._auto(row)}, passes, target_seconds, depth)

    def _auto(self, row: int) -> bool:
        policy = self._rows.get(row)
        return policy is not None and policy.is_auto

    def speedups(self, row: int, tokens_per_second: float) -> tuple[float | None, float | None]:
        if self._auto(row):
            return self.auto.speedups(row, tokens_per_second)
        return None, None
