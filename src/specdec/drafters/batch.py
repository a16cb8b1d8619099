"""Drafters for a batch of rows, each row drafting for its own context.

The batched engine talks to these through one small protocol (begin / propose / accept /
keep_rows, all indexed by the batch's live rows):

- PerRowDrafters: one ordinary Drafter per row (prompt lookup: it is free, nothing to batch);
- BatchModelDrafter: a draft model with a batched cache (models/transformers.py) drafts every
  row at once, one batched forward per draft position, each row with its own k and random stream.
  Its bookkeeping per row is ModelDrafter's: the cache holds the context and the draft tokens fed,
  and rejected ones are rolled back in accept().
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from ..models.base import CausalLM, check_same_vocab
from ..sampling import SamplingParams, draft_token
from .base import Draft, Drafter


class PerRowDrafters:
    def __init__(self, make: Callable[[], Drafter]):
        self._make = make
        self.name = make().name
        self._rows: list[Drafter] = []

    def begin(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
              rngs: Sequence[np.random.Generator]) -> None:
        self._rows = [self._make() for _ in prompts]
        for drafter, prompt, rng in zip(self._rows, prompts, rngs):
            drafter.begin(prompt, params, rng)

    def propose(self, contexts: Sequence[Sequence[int]], ks: Sequence[int]) -> list[Draft]:
        return [d.propose(c, k) for d, c, k in zip(self._rows, contexts, ks)]

    def accept(self, n_accepted: Sequence[int]) -> None:
        for drafter, n in zip(self._rows, n_accepted):
            drafter.accept(n)

    def keep_rows(self, rows: Sequence[int]) -> None:
        self._rows = [self._rows[r] for r in rows]


class BatchModelDrafter:
    def __init__(self, model: CausalLM, target: CausalLM | None = None):
        if not hasattr(model, "forward_rows"):
            raise TypeError(f"{model.name} has no batched cache (only the torch backend has one)")
        if target is not None:
            check_same_vocab(target, model)
        self.model = model
        self.name = f"draft:{model.name}"
        self._params = SamplingParams()
        self._rngs: list[np.random.Generator] = []
        self._fed: list[list[int]] = []    # per row: the tokens in its cache, in order
        self._base: list[int] = []         # per row: len(context) at the last propose
        self._drafted: list[int] = []      # per row: draft length of the last propose

    def begin(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
              rngs: Sequence[np.random.Generator]) -> None:
        self._params, self._rngs = params, list(rngs)
        self.model.start(len(prompts))
        self._fed = [[] for _ in prompts]
        self._base = [0] * len(prompts)
        self._drafted = [0] * len(prompts)

    def propose(self, contexts: Sequence[Sequence[int]], ks: Sequence[int]) -> list[Draft]:
        B = len(contexts)
        ks = [max(0, min(k, self.model.n_ctx - len(c))) for k, c in zip(ks, contexts)]
        self._base = [len(c) for c in contexts]
        self._drafted = [0] * B
        if max(ks, default=0) == 0:
            return [Draft([]) for _ in range(B)]
        # catch up: feed every drafting row the context tokens its cache lacks (at least one)
        keep, feed = [None] * B, [[] for _ in range(B)]
        for r, (context, k) in enumerate(zip(contexts, ks)):
            if k == 0:
                continue
            fed = self._fed[r]
            n = len(fed) if fed == list(context[:len(fed)]) else next(
                i for i, (a, b) in enumerate(zip(fed, context)) if a != b)
            keep[r] = min(n, len(context) - 1)
            feed[r] = list(context[keep[r]:])
            self._fed[r] = list(context)
        self.model.rollback_rows(keep)
        logits = self.model.forward_rows(feed, [1 if f else 0 for f in feed])   # per row [1, vocab]
        tokens: list[list[int]] = [[] for _ in range(B)]
        q: list[list[np.ndarray]] = [[] for _ in range(B)]
        for i in range(max(ks)):
            feed = [[] for _ in range(B)]
            for r in range(B):
                if i < ks[r]:
                    token, row_q = draft_token(logits[r][0], self._params, self._rngs[r])
                    tokens[r].append(token)
                    if row_q is not None:
                        q[r].append(row_q)
                    if i + 1 < ks[r]:   # the last draft token need not be fed: nothing reads it
                        feed[r] = [token]
                        self._fed[r].append(token)
            if any(feed):
                logits = self.model.forward_rows(feed, [1 if f else 0 for f in feed])
        self._drafted = [len(t) for t in tokens]
        return [Draft(t, np.stack(rows) if rows else None) for t, rows in zip(tokens, q)]

    def accept(self, n_accepted: Sequence[int]) -> None:
        keep: list[int | None] = []
        for r, n in enumerate(n_accepted):
            k = self._base[r] + min(n, max(self._drafted[r] - 1, 0))
            if k < len(self._fed[r]):
                del self._fed[r][k:]
                keep.append(k)
            else:
                keep.append(None)
        if any(k is not None for k in keep):
            self.model.rollback_rows(keep)

    def keep_rows(self, rows: Sequence[int]) -> None:
        self.model.keep_rows(rows)
        for name in ("_fed", "_base", "_drafted", "_rngs"):
            values = getattr(self, name)
            setattr(self, name, [values[r] for r in rows])
