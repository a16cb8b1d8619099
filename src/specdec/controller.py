"""Chooses the drafter and the draft length for each step.

`FixedController`: one drafter, k tokens a step (k = 0 or no drafter is plain decoding).

`CostAwareController` (`--draft auto`): speculation only pays when the tokens it gains are worth
more than the drafting and the wider target pass cost. Each step it picks the drafter and k that
maximise expected emitted tokens per second,

    E[tokens | k] / (draft_cost(k) + target_cost(k + 1)),      E[tokens | k] = 1 + sum_i prod_{j<=i} a_j

from measured costs (the target's forward for 1..16 rows, timed at load, cached per model file,
backend and threads, refined live) and measured acceptance (a_j = P(position j accepted | the ones
before were), an exponential moving average per drafter; for prompt lookup, per match length).
k = 0, a plain step, is always a candidate, so speculation steps aside when it cannot pay.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from .drafters.base import Draft, Drafter

K_MAX = 15          # largest draft: k + 1 = 16 rows, the widest forward we time
EMA = 0.15          # weight of a new observation in the moving averages
# A speculative step must promise 10% more tokens per second than a plain step: the estimates it
# wins on are picked for being the highest, so they err high (and step costs vary by about that).
MARGIN = 0.1
# Prompt lookup drafts at most REACH x its match length: a copy that has held for m tokens is
# trusted for m / 2 more. A failed 16-row draft costs six plain steps here, and the long drafts that
# failed were the ones from short matches; replayed on the suite this cap removed every prompt that
# fell below 0.97x without lowering the medians (scripts/replay_controller.py).
REACH = 0.5


@dataclass
class FixedController:
    drafter: Drafter | None
    k: int

    def begin(self, prompt: Sequence[int]) -> None:
        pass

    def choose(self, context: Sequence[int], room: int) -> tuple[Drafter | None, int]:
        """(drafter, k) for the next step; `room` is how many more tokens the target's cache holds
        after this step's last token, so k never overflows the context."""
        if self.drafter is None:
            return None, 0
        return self.drafter, max(0, min(self.k, room))

    def draft(self, context: Sequence[int], room: int) -> tuple[Drafter | None, Draft | None]:
        drafter, k = self.choose(context, room)
        if drafter is None or k == 0:
            return None, None
        return drafter, drafter.propose(context, k)   # a Drafter returns at most k tokens

    def observe(self, drafter: Drafter | None, draft: Draft | None, n_accepted: int, emitted: Sequence[int],
                draft_seconds: float, target_seconds: float) -> None:
        """Told the outcome of every step (a fixed policy ignores it)."""


# -- costs --------------------------------------------------------------------------------------

def _cache_file(model, tag: str) -> Path | None:
    from .catalog import specdec_home

    path = getattr(model, "path", None)
    if path is None:
        return None
    st = os.stat(path)
    key = f"{os.path.abspath(path)} {st.st_size} {st.st_mtime_ns} {type(model).__name__} " \
          f"{getattr(model, 'n_threads', '')} {tag}"
    return specdec_home() / "costs" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def measure_forward_costs(model, n_max: int = K_MAX + 1, repeats: int = 7, use_cache: bool = True) -> list[float]:
    """Seconds of one forward of n = 1..n_max rows at a realistic cache depth, the fastest of
    `repeats` (another process stealing a core only ever adds time, so the minimum is the cost).
    Cached per model file, backend and threads in $SPECDEC_HOME/costs/."""
    cache = _cache_file(model, f"forward-{n_max}") if use_cache else None
    if cache is not None and cache.is_file():
        costs = json.loads(cache.read_text())
        if len(costs) == n_max:
            return costs
    context = [int(t) % model.vocab_size for t in range(1000, 1128)]  # [128] arbitrary tokens
    model.reset()
    model.forward(context, n_rows=0)
    base = model.n_past
    model.forward(context[:n_max], n_rows=n_max)        # warm-up: touch every weight page
    model.rollback(base)
    # Widths take turns, round after round, so that a slow spell of the machine (another process,
    # clock changes) lands on every width alike instead of skewing the ratios between them.
    times = [[] for _ in range(n_max)]
    for _ in range(repeats):
        for n in range(1, n_max + 1):
            t = time.perf_counter()
            model.forward(context[:n], n_rows=n)
            times[n - 1].append(time.perf_counter() - t)
            model.rollback(base)
    costs = [min(t) for t in times]
    model.reset()
    costs = list(np.maximum.accumulate(costs))          # wider is never cheaper: smooth out noise
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(costs))
    return costs


class CostTable:
    """target_cost(n) for n rows: the load-time measurement times a ratio learned live, per width
    where that width was seen, else the ratio over all widths (the machine got faster or slower)."""

    def __init__(self, costs: Sequence[float]):
        self.base = list(costs)                         # [n_max] seconds for 1..n_max rows, measured
        self.ratio: dict[int, float] = {}               # width -> live seconds / measured seconds
        self.overall = 1.0

    def __call__(self, n: int) -> float:
        base = self.base[n - 1] if n <= len(self.base) else self.base[-1] * n / len(self.base)
        return base * self.ratio.get(n, self.overall)

    def observe(self, n: int, seconds: float) -> None:
        if not (1 <= n <= len(self.base)) or seconds <= 0:
            return
        r = seconds / self.base[n - 1]
        self.overall += EMA * (r - self.overall)
        self.ratio[n] = self.ratio.get(n, self.overall) + EMA * (r - self.ratio.get(n, self.overall))


# -- acceptance ---------------------------------------------------------------------------------

@dataclass
class Acceptance:
    """a[i] = P(draft position i accepted | positions before it were), as moving averages."""
    prior: float
    a: np.ndarray = field(default=None)  # [K_MAX]

    def __post_init__(self):
        if self.a is None:
            self.a = np.full(K_MAX, self.prior)

    def expected_tokens(self, k_max: int) -> np.ndarray:
        """[k_max + 1] E[emitted tokens | k] for k = 0..k_max: the accepted prefix plus one."""
        survive = np.cumprod(self.a[:k_max])            # [k_max] P(first i+1 positions accepted)
        return 1.0 + np.concatenate([[0.0], np.cumsum(survive)])

    def observe(self, n_drafted: int, n_accepted: int) -> None:
        # positions 0..n_accepted were examined: the first n_accepted passed, the next one failed
        for i in range(min(n_accepted + 1, n_drafted)):
            self.a[i] += EMA * ((1.0 if i < n_accepted else 0.0) - self.a[i])


# lower edges of the match-length buckets prompt lookup's acceptance is tracked in
MATCH_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64)
# Before any evidence, per bucket and kind of first guess (see MatchAcceptance.evidence): measured
# on the greedy outputs of the 1.5B target for the 40 prompts of benchmarks/prompts.jsonl, rounded
# down a little. A guess from a 1-token match the earlier occurrences disagree on was right 16% of
# the time, one they all agreed on 49%; after 12 matched tokens a guess is right over 90% of the time.
MATCH_PRIOR = {
    "split":  (0.15, 0.2, 0.25, 0.2, 0.2, 0.3, 0.5, 0.6, 0.7, 0.7, 0.8, 0.8, 0.8),
    "single": (0.3, 0.5, 0.62, 0.65, 0.68, 0.78, 0.84, 0.92, 0.92, 0.94, 0.94, 0.94, 0.96),
    "agreed": (0.45, 0.68, 0.8, 0.8, 0.85, 0.82, 0.92, 0.94, 0.94, 0.94, 0.94, 0.96, 0.96),
    "later":  (0.4, 0.45, 0.6, 0.62, 0.65, 0.75, 0.84, 0.9, 0.92, 0.94, 0.94, 0.94, 0.96),
}


class MatchAcceptance:
    """Prompt lookup's acceptance as a function of its match length: h[b] = P(the next guess is
    right | the match so far spans m tokens, m in bucket b), a moving average per bucket.

    A draft from a match of m tokens is one guess at length m, and, if that one is accepted, a
    guess at m + 1, and so on: P(first i guesses accepted) = h(m) h(m + 1) ... h(m + i - 1). So a
    long copy earns a long draft and the first guess after an edit, from a short match, does not.
    The first guess has its own tables by the evidence behind it: earlier occurrences of the
    matched n-gram that disagree on what comes next make it a coin toss even after a long match."""

    def __init__(self):
        self.tables = {kind: np.array(prior, dtype=float) for kind, prior in MATCH_PRIOR.items()}

    @staticmethod
    def evidence(votes: tuple[int, int]) -> str:
        """(occurrences continuing with the guess, occurrences) -> the kind of first guess."""
        agree, total = votes
        return "split" if agree < total else "single" if total <= 1 else "agreed"

    @staticmethod
    def bucket(m: int) -> int:
        return max(0, bisect.bisect_right(MATCH_BUCKETS, m) - 1)

    def _table(self, i: int, kind: str) -> np.ndarray:
        return self.tables[kind] if i == 0 else self.tables["later"]

    def expected_tokens(self, m: int, k_max: int, kind: str = "single") -> np.ndarray:
        """[k_max + 1] E[emitted tokens | k] for k = 0..k_max, the match spanning m tokens now."""
        a = np.array([self._table(i, kind)[self.bucket(m + i)] for i in range(k_max)])
        return 1.0 + np.concatenate([[0.0], np.cumsum(np.cumprod(a))])

    def observe(self, m: int, checked: int, matched: int, kind: str = "single") -> None:
        """`checked` guesses of a proposal from a match of m tokens were compared with what the
        target emitted; the first `matched` were right."""
        for i in range(checked):
            h, b = self._table(i, kind), self.bucket(m + i)
            h[b] += EMA * ((1.0 if i < matched else 0.0) - h[b])


def _agreement(proposal: Sequence[int], emitted: Sequence[int]) -> tuple[int, int]:
    """(positions checked, positions that matched) of a draft against the tokens the target emitted."""
    n = min(len(proposal), len(emitted))
    matched = 0
    while matched < n and proposal[matched] == emitted[matched]:
        matched += 1
    return (min(matched + 1, n), matched)


class CostAwareController:
    """Picks, every step, prompt lookup with its best k, the draft model with its best k, or a
    plain step, whichever promises the most tokens per second (see the module docstring)."""

    def __init__(self, ngram: Drafter | None, model_drafter: Drafter | None,
                 target_costs: Sequence[float], draft_costs: Sequence[float] | None = None,
                 explore_every: int = 32):
        self.target_cost = CostTable(target_costs)
        self.ngram, self.model = ngram, model_drafter
        # the draft model's forward costs for 1..16 rows: catching up on m tokens it has not seen
        # costs a forward of m rows, then each further draft token one row
        self.draft_cost = CostTable(draft_costs) if draft_costs else None
        # prompt lookup's acceptance by match length: inside a long copy its guesses keep landing
        self.ngram_accept = MatchAcceptance()
        self.model_accept = Acceptance(prior=0.7)
        self.explore_every = explore_every
        self.margin = MARGIN
        self._steps = 0
        self._shadow: tuple[list[int], int, str] | None = None   # free n-gram proposal, for learning
        self._tracker: tuple[list[int], int, int] | None = None  # a proposal followed over plain steps
        self.decisions: dict[str, int] = {}           # "plain" / "ngram:k" / "draft:k" -> steps
        self._promised = (0.0, 0)                      # this generation: sum of value / plain value, steps

    def begin(self, prompt: Sequence[int]) -> None:
        self._shadow = self._tracker = None
        self._promised = (0.0, 0)

    def speedups(self, tokens_per_second: float) -> tuple[float, float]:
        """(predicted, measured) speedup over plain decoding for the generation so far: the mean
        of each step's promise, and the tokens/s achieved over what plain steps would give."""
        total, steps = self._promised
        predicted = total / steps if steps else 1.0
        return predicted, tokens_per_second * self.target_cost(1)

    # -- the decision -------------------------------------------------------------------------

    def _best_k(self, expected: np.ndarray, draft_cost) -> tuple[int, float]:
        """argmax over k of expected[k] / (draft_cost(k) + target_cost(k + 1))."""
        values = [expected[k] / (draft_cost(k) + self.target_cost(k + 1)) for k in range(len(expected))]
        k = int(np.argmax(values))
        return k, values[k]

    def draft(self, context: Sequence[int], room: int) -> tuple[Drafter | None, Draft | None]:
        self._steps += 1
        k_cap = max(0, min(K_MAX, room))
        plain_value = 1.0 / self.target_cost(1)
        best = ("plain", 0, plain_value, None)
        bar = plain_value * (1.0 + self.margin)        # what a speculative step must promise
        # Prompt lookup is free to consult: look first, then decide how much of it to use.
        if self.ngram is not None and k_cap:
            proposal = self.ngram.propose(context, k_cap)
            match = max(1, getattr(self.ngram, "last_match_length", 1))
            kind = MatchAcceptance.evidence(getattr(self.ngram, "last_votes", (1, 1)))
            self._shadow = (list(proposal.tokens), match, kind) if proposal.tokens else None
            if proposal.tokens:
                reach = min(len(proposal.tokens), max(1, int(REACH * match)))
                expected = self.ngram_accept.expected_tokens(match, reach, kind)
                k, value = self._best_k(expected, lambda k: 0.0)
                if value > max(best[2], bar):
                    best = ("ngram", k, value, proposal)
        if self.model is not None and k_cap and self.draft_cost is not None:
            lag = max(1, self.model.lag(context)) if hasattr(self.model, "lag") else 1
            cost = lambda k: self.draft_cost(lag) + (k - 1) * self.draft_cost(1) if k else 0.0  # noqa: E731
            k_model = min(k_cap, 8)
            k, value = self._best_k(self.model_accept.expected_tokens(k_model), cost)
            if value > max(best[2], bar) and k:
                best = ("draft", k, value, None)
            elif self._steps % self.explore_every == 0:
                # Explore only if a perfect draft would win by a margin: otherwise no acceptance
                # estimate, however stale, could make the draft model worth its cost.
                k_opt, optimistic = self._best_k(np.arange(1.0, k_model + 2), cost)
                if k_opt and optimistic > 1.1 * best[2]:
                    best = ("draft", 1, value, None)
        kind, k, value, proposal = best
        self._promised = (self._promised[0] + value / plain_value, self._promised[1] + 1)
        key = "plain" if kind == "plain" or k == 0 else f"{kind}:{k}"
        self.decisions[key] = self.decisions.get(key, 0) + 1
        if kind == "ngram" and k:
            return self.ngram, Draft(proposal.tokens[:k])
        if kind == "draft":
            return self.model, self.model.propose(context, k)
        return None, None

    # -- learning -----------------------------------------------------------------------------

    def observe(self, drafter: Drafter | None, draft: Draft | None, n_accepted: int, emitted: Sequence[int],
                draft_seconds: float, target_seconds: float) -> None:
        n_drafted = len(draft.tokens) if draft is not None else 0
        self.target_cost.observe(n_drafted + 1, target_seconds)
        if drafter is self.model and drafter is not None and n_drafted:
            self.model_accept.observe(n_drafted, n_accepted)
        if n_drafted:
            self._tracker = None          # the draft's own outcome covers the positions after it
        elif self._tracker is not None:
            self._follow(emitted)
        if self._shadow is not None:
            # Prompt lookup costs nothing to check after the fact: score its proposal against what
            # the target emitted, whether or not it was used, so its estimate never goes stale.
            tokens, match, kind = self._shadow
            checked, matched = _agreement(tokens, emitted)
            self.ngram_accept.observe(match, checked, matched, kind)
            if not n_drafted and self._tracker is None and matched == checked == 1 and len(tokens) > 1:
                # A plain step only reveals the first guess. Follow the rest of the proposal over
                # the next steps, or guesses past the first would only ever be scored while
                # drafting, and an estimate lowered by bad luck could never recover.
                self._tracker = (tokens, match, 1)
        self._shadow = None

    def _follow(self, emitted: Sequence[int]) -> None:
        tokens, match, i = self._tracker
        self._tracker = None
        for token in emitted:
            if i >= len(tokens):
                return
            right = tokens[i] == token
            self.ngram_accept.observe(match + i, 1, int(right), kind="later")
            i += 1
            if not right:
                return
        if i < len(tokens):
            self._tracker = (tokens, match, i)
