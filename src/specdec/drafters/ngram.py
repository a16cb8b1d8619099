"""Prompt lookup: continue an earlier occurrence of the last n tokens.

Code edits, summaries with quotes and chat that repeats the question all copy long runs of the
context. If the last n tokens occurred before, whatever followed them then is a free guess now.
The drafter has no distribution, so its q is one-hot (Draft.q is None).

Which occurrence: the one whose match reaches furthest back. A function copied from the prompt
shares its last four tokens with many places ("    return self."), but only the place it is being
copied from shares the last forty. That length (Draft.evidence["match"]) is also what the
cost-aware controller predicts acceptance from: the longer the copy so far, the likelier it goes on.

With `width` w > 1 the draft is a tree of up to w continuations: the occurrences considered, best
match first, each add the part of their continuation that no earlier one drafted, branching where
they part, until w branches stand (every occurrence that continues the same way adds nothing).
Where a phrase was copied twice and then edited differently, both continuations are tried in one
forward. The first branch is the chain width 1 drafts. Its nodes are fixed candidates (no q): a
sampled row verifies them by the rule for fixed candidates (sampling.verify_tree), greedy ones by
the target's argmax; a tree that never branches goes as the chain.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from ..sampling import SamplingParams
from .base import Declared, Draft, tree_shape


class _Index:
    """One row's context and, for every n-gram in it, the positions just after each occurrence."""

    def __init__(self):
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], list[int]] = {}  # n-gram -> positions after it, oldest first


class NgramDrafter(Declared):
    """Tries n = n_max down to n_min; for the first n whose n-gram occurred before, the latest
    `candidates` occurrences compete on how far back their match extends (up to `match_cap`
    tokens), the most recent winning ties (edits tend to follow the code nearest to them)."""

    takes = frozenset({"widths"})  # propose's keywords beyond (contexts, ks, leaves): Drafter.takes

    def __init__(self, n_max: int = 4, n_min: int = 1, candidates: int = 32, match_cap: int = 128, width: int = 1):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got n_min={n_min}, n_max={n_max}")
        if candidates < 1 or match_cap < n_max:
            raise ValueError(f"need candidates >= 1 and match_cap >= n_max, got {candidates}, {match_cap}")
        tree_shape(width, 0)
        self.name = self.kind = "ngram"
        self.width = width
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

    def propose(
        self,
        contexts: Mapping[int, Sequence[int]],
        ks: Mapping[int, int],
        widths: Mapping[int, int] | None = None,
        leaves: Mapping[int, int] | None = None,
    ) -> dict[int, Draft]:
        """Up to ks[r] tokens deep for every row asked; widths[r] (else the drafter's width): the
        most branches of row r's tree (1: a chain). `leaves` is not read: a tree of fixed candidates
        may be cut to its first branch after drafting (Engine._fitted)."""
        widths = widths or {}
        return {
            row: self.propose_one(self._rows.setdefault(row, _Index()), contexts[row], ks[row], widths.get(row))
            for row in ks
        }

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

    def propose_one(self, index: _Index, context: Sequence[int], k: int, width: int | None = None) -> Draft:
        width = self.width if width is None else width
        if k <= 0 or not context:
            return Draft([])
        self._update(index, context)
        tokens = index.tokens
        for n in range(min(self.n_max, len(tokens) - 1), self.n_min - 1, -1):
            ends = index.ends.get(tuple(tokens[-n:]))
            if ends:
                considered = ends[-self.candidates :]
                lengths = {end: self._match_length(tokens, end, n) for end in reversed(considered)}
                ranked = sorted(lengths, key=lambda end: -lengths[end])  # best match, then most recent, first
                best_end = ranked[0]
                guess = tokens[best_end]
                votes = (sum(tokens[end] == guess for end in considered), len(considered))
                evidence = {"match": lengths[best_end], "votes": votes}
                if width > 1:
                    return self._tree([tokens[end : end + k] for end in ranked], evidence, width)
                return Draft(tokens[best_end : best_end + k], evidence=evidence)
        return Draft([])

    def _tree(self, continuations: list[list[int]], evidence: dict, width: int) -> Draft:
        """A tree of the continuations, in order, until `width` branches stand: each adds the nodes
        past the point where it parts from the tree so far; as a chain if it never branches."""
        tokens: list[int] = []
        parents: list[int] = []
        children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
        branches = 0
        for continuation in continuations:
            node, new = -1, False
            for token in continuation:
                child = children.get((node, token))
                if child is None:
                    if not new and branches >= width:
                        break  # a new branch, and the tree has its width
                    child = children[(node, token)] = len(tokens)
                    tokens.append(token)
                    parents.append(node)
                    branches += not new
                    new = True
                node = child
        if branches <= 1:
            return Draft(tokens, evidence=evidence)
        return Draft(tokens, evidence=evidence, parents=parents)
