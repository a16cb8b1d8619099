"""A small model of the same vocabulary drafts k tokens autoregressively.

It keeps its own KV cache in step with the accepted tokens: after a step it holds the context
plus the accepted draft tokens it fed itself; the target's correction (or bonus) token, and the
last draft token when all k were accepted, are fed at the start of the next proposal, in one batch.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..models.base import CausalLM, check_same_vocab
from ..sampling import SamplingParams, draft_token
from .base import Draft


class ModelDrafter:
    def __init__(self, model: CausalLM, target: CausalLM | None = None):
        if target is not None:
            check_same_vocab(target, model)
        self.model = model
        self.name = f"draft:{model.name}"
        self._params = SamplingParams()
        self._rng = np.random.default_rng()
        self._fed: list[int] = []      # the tokens in the model's cache, in order
        self._base = 0                 # len(context) at the last propose
        self._draft_len = 0

    def begin(self, prompt: Sequence[int], params: SamplingParams, rng: np.random.Generator) -> None:
        self._params, self._rng = params, rng
        self.model.reset()
        self._fed = []

    def lag(self, context: Sequence[int]) -> int:
        """Context tokens the draft model has not seen yet (what the next proposal feeds first)."""
        return len(context) - len(self._fed)

    def _catch_up(self, context: Sequence[int]) -> np.ndarray:
        """Feed the context tokens the cache lacks (at least one) and return the last row's logits."""
        fed = self._fed
        if fed == list(context[:len(fed)]):   # the usual case: accept() left a prefix of context
            keep = len(fed)
        else:
            keep = next(i for i, (a, b) in enumerate(zip(fed, context)) if a != b)
        keep = min(keep, len(context) - 1)     # always feed >= 1 token, to get its logits
        self.model.rollback(keep)
        new = list(context[keep:])
        logits = self.model.forward(new, n_rows=1)[0]   # [vocab]
        self._fed = list(context)
        return logits

    def propose(self, context: Sequence[int], k: int) -> Draft:
        self._base, self._draft_len = len(context), 0
        if k <= 0:
            return Draft([])
        k = min(k, self.model.n_ctx - len(context))
        if k <= 0:
            return Draft([])
        logits = self._catch_up(context)
        tokens, rows = [], []
        for i in range(k):
            token, q = draft_token(logits, self._params, self._rng)
            tokens.append(token)
            if q is not None:
                rows.append(q)
            if i + 1 < k:   # the last draft token need not be fed: nothing would read its logits
                logits = self.model.forward([token], n_rows=1)[0]
                self._fed.append(token)
        self._draft_len = len(tokens)
        return Draft(tokens, np.stack(rows) if rows else None)

    def accept(self, n_accepted: int) -> None:
        # Keep the context and the accepted draft tokens that were fed; drop the rejected ones.
        keep = self._base + min(n_accepted, max(self._draft_len - 1, 0))
        if keep < len(self._fed):
            self.model.rollback(keep)
            del self._fed[keep:]
