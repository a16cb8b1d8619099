"""How far a drafter's guesses are trusted: acceptance tables, their priors, and one request's overlay.

The target keeps a draft up to its first rejected token, so a draft of k tokens is worth
E[k] = 1 + sum_{j<=k} prod_{l<=j} a_l emitted tokens, a_l being the probability that position l is
accepted given the ones before it were. The tables here hold those probabilities as moving averages:

- `Acceptance`: the draft model's, one rate per draft position;
- `MatchAcceptance`: a free drafter's (prompt lookup, the suffix cache), per match length and kind of
  first guess, since inside a long copy guesses keep landing;
- `Overlay`: one request's own evidence on top of a shared table, so a request learns fast while the
  shared tables learn slowly across requests.

The tables start from priors fitted on recorded greedy outputs (MATCH_PRIOR, DRAFT_PRIOR;
replay.fit_match_prior and replay.fit_draft_prior refit them). The controller (controller.py)
reads them to choose drafts; replay.py counts recorded guesses the way they count them.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from .costs import EMA

K_MAX = 15  # the draft model's acceptance table, and the fitted priors' longest draft

# The overlay pools prompt lookup's guesses per kind, separately below and from this match length
# (the bucket edge where the fitted MATCH_PRIOR rises past the 0.75 of short matches).
OVERLAY_LONG = 8


def _logit(p):
    """log(p / (1 - p)), p clipped to [0.01, 0.99]: on a float by its math (a NumPy call on one
    value costs ten times as much, and auto prices hundreds a step), on an array by NumPy's."""
    if isinstance(p, float):
        p = min(max(p, 0.01), 0.99)
        return math.log(p / (1.0 - p))
    p = np.clip(p, 0.01, 0.99)
    return np.log(p / (1.0 - p))


class Overlay:
    """One request's own evidence on top of a shared acceptance table. Per group of cells (a kind
    of guess, or the draft model's positions) it counts the guesses checked (n), the right ones (r)
    and what the shared table predicted for them (p, summed), and shifts every cell of the group by
    the same amount in log-odds:

        delta = logit((r + weight * p / n) / (n + weight)) - logit(p / n)

    Pooling a group's cells is what makes it fast: a RAG answer that starts copying its passage shows
    one guess per match length, and a per-cell count would need dozens in each. With weight 8, eight
    right guesses where the table said 0.75 lift it to 0.875 (and a 0.9 cell to 0.955); 24 lift it to
    0.94; a request whose guesses keep failing sinks likewise. Zero evidence: the shared table."""

    def __init__(self, groups: int, weight: float):
        # per group, as floats: a step reads them hundreds of times, one value at a time
        self.n = [0.0] * groups
        self.r = [0.0] * groups
        self.p = [0.0] * groups
        self.weight = weight

    def delta(self, group: int) -> float:
        n = self.n[group]
        if n == 0:
            return 0.0
        mean = self.p[group] / n
        return _logit((self.r[group] + self.weight * mean) / (n + self.weight)) - _logit(mean)

    def blend(self, shared, group: int):
        """This request's estimate of cells of `group` whose shared values are `shared` (a float
        or an array of them)."""
        d = self.delta(group)
        if d == 0.0:
            return shared
        if isinstance(shared, float):
            return 1.0 / (1.0 + math.exp(-(_logit(shared) + d)))
        return 1.0 / (1.0 + np.exp(-(_logit(shared) + d)))

    def observe(self, group: int, right: bool, shared: float) -> None:
        self.n[group] += 1.0
        self.r[group] += float(right)
        self.p[group] += float(shared)


def cautious_rates(a: np.ndarray | float, rate: float) -> np.ndarray | float:
    """Rates one standard error below `a`, moving averages at `rate`: such an average weighs about
    (2 - r) / r observations, so a rate h is known to about sqrt(h (1 - h) / ((2 - r) / r + 1)).
    why: a draft's worth is a product of rates, so the errors of a long draft's rates compound,
    and a long draft that fails costs most where a wide forward is dear: one error below each
    rate cuts long drafts short on a steep curve and barely on a flat one, as the half-the-match
    cap it replaced did only on the steep one; and the draft the controller picks is the one whose
    estimates are highest, so they err high, which a fixed margin once stood in for;
    history: docs/results/provenance.md#reach, docs/results/provenance.md#margin-replaced-by-the-estimates-error"""
    n = (2.0 - rate) / rate
    if isinstance(a, float):  # one rate: by its math, as _logit
        return min(max(a - math.sqrt(a * (1.0 - a) / (n + 1.0)), 0.0), 1.0)
    return np.clip(a - np.sqrt(a * (1.0 - a) / (n + 1.0)), 0.0, 1.0)


def emitted_tokens(rates: Sequence[float]) -> np.ndarray:
    """[len(rates) + 1] E[emitted tokens | k] for k = 0..len(rates), rates[i] = P(draft position i
    accepted | the ones before were): 1 + [0, cumsum(cumprod(rates))], summed in Python in the
    same order as NumPy's cumprod and cumsum (the same floats, bit for bit) without their calls,
    which cost more than the sums for the few positions of most drafts."""
    out, survive, total = [1.0], 1.0, 0.0
    for h in rates:
        survive *= h
        total += survive
        out.append(1.0 + total)
    return np.array(out)


@dataclass
class Acceptance:
    """a[i] = P(draft position i accepted | positions before it were), as moving averages."""

    prior: float | Sequence[float]
    a: np.ndarray = field(default=None)  # [K_MAX]
    rate: float = EMA  # weight of one observation in the shared table

    def __post_init__(self):
        if self.a is None:
            self.a = np.broadcast_to(np.asarray(self.prior, dtype=float), (K_MAX,)).copy()

    def expected_tokens(self, k_max: int, overlay: Overlay | None = None, cautious: bool = False) -> np.ndarray:
        """[k_max + 1] E[emitted tokens | k] for k = 0..k_max: the accepted prefix plus one
        (this request's estimate when its overlay is given; with `cautious`, each rate one standard
        error below its estimate: what the controller drafts on)."""
        a = self.a[:k_max] if overlay is None else overlay.blend(self.a[:k_max], 0)
        if cautious:
            a = cautious_rates(a, self.rate)
        return emitted_tokens(a.tolist())

    def observe(self, n_drafted: int, n_accepted: int, overlay: Overlay | None = None) -> None:
        # positions 0..n_accepted were examined: the first n_accepted passed, the next one failed
        for i in range(min(n_accepted + 1, n_drafted)):
            if overlay is not None:
                overlay.observe(0, i < n_accepted, self.a[i])
            self.a[i] += self.rate * ((1.0 if i < n_accepted else 0.0) - self.a[i])


# lower edges of the match-length buckets prompt lookup's acceptance is tracked in: every length up
# to 6, then roughly doubling (a choice; the fitted rates change little within a bucket)
MATCH_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64)
# Before any evidence, per bucket and kind of first guess (see MatchAcceptance.evidence), and
# "later" for the guesses after an accepted one: the share of guesses that were right on the outside
# dev suite's recording (`scripts/replay_controller.py loo --fit`), never on benchmarks/prompts.jsonl.
# why: a guess's odds depend on its match length and on whether earlier occurrences agree;
# history: docs/results/provenance.md#match_prior
MATCH_PRIOR = {
    "split": (0.12, 0.26, 0.27, 0.27, 0.43, 0.43, 0.43, 0.77, 0.77, 0.8, 0.91, 0.97, 0.99),
    "single": (0.32, 0.53, 0.62, 0.66, 0.72, 0.72, 0.85, 0.91, 0.95, 0.99, 0.99, 0.99, 0.99),
    "agreed": (0.4, 0.78, 0.78, 0.82, 0.82, 0.82, 0.82, 0.82, 0.82, 0.82, 0.93, 0.95, 0.99),
    "later": (0.53, 0.53, 0.63, 0.65, 0.74, 0.75, 0.83, 0.91, 0.96, 0.99, 0.99, 0.99, 0.99),
}

# The draft model's P(position i accepted | the ones before were), before any evidence. Another
# draft model starts from these, and its overlay and the shared table move to its own rates.
# why: the default pair's own agreement, per draft position (the 0.5B drafting for the 1.5B);
# history: docs/results/provenance.md#draft_prior
DRAFT_PRIOR = (0.84, 0.86, 0.89, 0.9, 0.92, 0.93, 0.94, 0.95, 0.95, 0.96, 0.96, 0.96, 0.97, 0.97, 0.97)

# The draft model's siblings, before any evidence: for a tree of width w = 2, 3, 4, P(the target's
# token is one of the draft's next w - 1 candidates | the draft's own token was not).
# why: the default pair's ranks on the dev suite's recording (784 misses; replay.fit_sibling_prior);
# our suite's recordings read 0.54-0.55 / 0.73-0.75 / 0.82-0.84
SIBLING_PRIOR = (0.46, 0.64, 0.74)

# Prompt lookup's trees, before any evidence: P(the target's token is on another branch | the first
# branch's token was not, where the tree branches), for trees of controller.NGRAM_TREE_WIDTH.
# why: the dev suite's recording (replay.fit_ngram_sibling_prior: 245 of 885; 0.09 QA to 0.43 RAG,
# and our suite's 0.18); history:
# docs/results/provenance.md#ngram_sibling_prior
NGRAM_SIBLING_PRIOR = 0.28


# The draft model's greedy guess, by its confidence in it (drafters.model.confidence): P(the target
# keeps it | the confidence lies in [edge i - 1, edge i)), for the buckets these edges make.
# why: the dev suite's recording (replay.fit_confidence_prior: 698, 723, 442, 764 and 2 280 guesses
# a bucket; our suites' recordings agree within 0.06); history: docs/results/provenance.md#confidence_prior
CONFIDENCE_EDGES = (0.5, 0.75, 0.9, 0.99)
CONFIDENCE_PRIOR = (0.389, 0.655, 0.836, 0.958, 0.997)


@dataclass
class ConfidenceAcceptance:
    """c[b] = P(the draft's greedy guess is the target's | its confidence in bucket b), as moving
    averages from CONFIDENCE_PRIOR: what a chain cut by confidence (controller.ChainCut) reads."""

    prior: Sequence[float] = CONFIDENCE_PRIOR
    rate: float = EMA
    c: np.ndarray = field(default=None)

    def __post_init__(self):
        if self.c is None:
            self.c = np.asarray(self.prior, dtype=float).copy()

    @staticmethod
    def bucket(p: float) -> int:
        return bisect.bisect_right(CONFIDENCE_EDGES, p)

    def rate_of(self, p: float) -> float:
        return float(self.c[self.bucket(p)])

    def observe(self, confidences: Sequence[float], kept: int) -> None:
        """A chain's guesses (their confidences, in order), of which the target kept the first
        `kept`: each kept one, and the one it rejected; what followed was never judged."""
        for i, p in enumerate(confidences[: kept + 1]):
            b = self.bucket(p)
            self.c[b] += self.rate * (float(i < kept) - self.c[b])


@dataclass
class SiblingAcceptance:
    """s[w - 2] = P(a tree of width w keeps a sibling | the chain's token failed there), as moving
    averages. Candidates nest (a width's are the next width's first ones), so one outcome informs
    several widths: a sibling kept at width w would be at every wider one, and none kept at w none
    at any narrower one."""

    prior: Sequence[float] = SIBLING_PRIOR
    rate: float = EMA
    s: np.ndarray = field(default=None)

    def __post_init__(self):
        if self.s is None:
            self.s = np.asarray(self.prior, dtype=float).copy()

    @property
    def widths(self) -> range:
        return range(2, len(self.s) + 2)

    def rate_at(self, width: int) -> float:
        return float(self.s[width - 2]) if width > 1 else 0.0

    def observe(self, width: int, kept: bool) -> None:
        told = [w for w in self.widths if (w >= width if kept else w <= width)]
        for w in told:
            self.s[w - 2] += self.rate * (float(kept) - self.s[w - 2])


class MatchAcceptance:
    """Prompt lookup's acceptance as a function of its match length: h[b] = P(the next guess is
    right | the match so far spans m tokens, m in bucket b), a moving average per bucket.

    A draft from a match of m tokens is one guess at length m, and, if that one is accepted, a
    guess at m + 1, and so on: P(first i guesses accepted) = h(m) h(m + 1) ... h(m + i - 1). So a
    long copy earns a long draft and the first guess after an edit, from a short match, does not.
    The first guess has its own tables by the evidence behind it: earlier occurrences of the
    matched n-gram that disagree on what comes next make it a coin toss even after a long match."""

    KINDS = ("split", "single", "agreed", "later")

    def __init__(self, prior: Mapping[str, Sequence[float]] | None = None, rate: float = EMA):
        prior = MATCH_PRIOR if prior is None else prior
        self.tables = {kind: np.array(prior[kind], dtype=float) for kind in self.KINDS}
        self.rate = rate

    def overlay(self, weight: float) -> Overlay:
        """A request's own evidence, two groups per kind: matches shorter than OVERLAY_LONG tokens
        and the rest (a request whose 1-token matches keep failing may still copy long runs)."""
        return Overlay(2 * len(self.KINDS), weight)

    def _group(self, kind: str, b: int) -> int:
        return 2 * self.KINDS.index(kind) + (MATCH_BUCKETS[b] >= OVERLAY_LONG)

    @staticmethod
    def evidence(votes: tuple[int, int]) -> str:
        """(occurrences continuing with the guess, occurrences) -> the kind of first guess."""
        agree, total = votes
        return "split" if agree < total else "single" if total <= 1 else "agreed"

    @staticmethod
    def bucket(m: int) -> int:
        return max(0, bisect.bisect_right(MATCH_BUCKETS, m) - 1)

    def _kind(self, i: int, kind: str) -> str:
        return kind if i == 0 else "later"

    def _estimate(self, kind: str, b: int, overlay: Overlay | None) -> float:
        shared = float(self.tables[kind][b])
        return shared if overlay is None else overlay.blend(shared, self._group(kind, b))

    def expected_tokens(
        self, m: int, k_max: int, kind: str = "single", overlay: Overlay | None = None, cautious: bool = False
    ) -> np.ndarray:
        """[k_max + 1] E[emitted tokens | k] for k = 0..k_max, the match spanning m tokens now
        (this request's estimate when its overlay is given; with `cautious`, each rate one standard
        error below its estimate: what the controller drafts on)."""
        # position i is a guess of kind `kind` (i = 0, else "later") at match length m + i; the
        # positions between two bucket edges share a cell, priced once (a few cells for 64 guesses)
        a: list[float] = []
        i = 0
        while i < k_max:
            b = self.bucket(m + i)
            end = k_max if b + 1 == len(MATCH_BUCKETS) else min(k_max, MATCH_BUCKETS[b + 1] - m)
            if i == 0:
                end = 1
            h = self._estimate(self._kind(i, kind), b, overlay)
            a += [cautious_rates(h, self.rate) if cautious else h] * (end - i)
            i = end
        return emitted_tokens(a)

    def observe(self, m: int, checked: int, matched: int, kind: str = "single", overlay: Overlay | None = None) -> None:
        """`checked` guesses of a proposal from a match of m tokens were compared with what the
        target emitted; the first `matched` were right."""
        for i in range(checked):
            name, b = self._kind(i, kind), self.bucket(m + i)
            h = self.tables[name]
            if overlay is not None:
                overlay.observe(self._group(name, b), i < matched, h[b])
            h[b] += self.rate * ((1.0 if i < matched else 0.0) - h[b])


def agreement(proposal: Sequence[int], emitted: Sequence[int]) -> tuple[int, int]:
    """(positions checked, positions that matched) of a draft against the tokens the target emitted."""
    n = min(len(proposal), len(emitted))
    matched = 0
    while matched < n and proposal[matched] == emitted[matched]:
        matched += 1
    return (min(matched + 1, n), matched)
