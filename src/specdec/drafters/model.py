"""A small model of the same vocabulary drafts k tokens autoregressively, for every row at once.

The draft model holds a row of its own for each of the engine's rows. It keeps each row's cache in
step with the accepted tokens: after a step the row holds the context plus the accepted draft
tokens it fed itself; the target's correction (or bonus) token, and the last draft token when all
k were accepted, are fed at the start of the next proposal. A proposal is one forward that catches
every drafting row up, then one forward per draft position over the rows still drafting.

With `width` w > 1 the draft is a tree: at each depth the draft model's own token continues the
chain and the next w - 1 candidates of the same distribution hang beside it as leaves (its top
ones when greedy, else further draws without replacement): where the chain's token fails, the
target may keep a sibling. The siblings cost the draft model nothing and the target w - 1 more
tokens a depth in the same forward (tree attention, models' forward_tree_rows).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from ..models.base import RowModel, check_same_vocab
from ..sampling import SamplingParams, draft_token, sample
from .base import Draft


class _Row:
    def __init__(self, params: SamplingParams, rng: np.random.Generator):
        self.model_row: int | None = None  # the draft model's row for this engine row, once made
        self.params, self.rng = params, rng
        self.fed: list[int] = []  # the tokens in the model row's cache, in order
        self.base = 0  # len(context) at the last propose
        self.drafted = 0  # draft length of the last propose


class ModelDrafter:
    def __init__(self, model: RowModel, target: RowModel | None = None, width: int = 1):
        if target is not None:
            check_same_vocab(target, model)
        if width < 1:
            raise ValueError(f"a draft tree's width is at least 1 (a chain), not {width}")
        self.model, self.width = model, width
        self.name, self.kind = f"draft:{model.name}" + (f"x{width}" if width > 1 else ""), "draft"
        self._rows: dict[int, _Row] = {}

    def begin(self, row: int, prompt: Sequence[int], params: SamplingParams, rng: np.random.Generator) -> None:
        self.end([row])
        self._rows[row] = _Row(params, rng)  # its model row is made at its first proposal

    def end(self, rows: Sequence[int]) -> None:
        states = [self._rows.pop(row) for row in rows if row in self._rows]
        made = [state.model_row for state in states if state.model_row is not None]
        if made:
            self.model.drop_rows(made)

    def _make_rows(self, rows) -> None:
        """Model rows for the rows that have none yet, in one call (a batched cache copies itself
        to grow)."""
        new = [self._rows[row] for row in rows if self._rows[row].model_row is None]
        for state, model_row in zip(new, self.model.add_rows(len(new)) if new else []):
            state.model_row = model_row

    def lag(self, row: int, context: Sequence[int]) -> int:
        """Context tokens the draft model has not seen yet (what the row's next proposal feeds first)."""
        return len(context) - len(self._rows[row].fed)

    def propose(self, contexts: Mapping[int, Sequence[int]], ks: Mapping[int, int]) -> dict[int, Draft]:
        model = self.model
        ks = {row: max(0, min(k, model.n_ctx - len(contexts[row]))) for row, k in ks.items()}
        drafts = {row: Draft([]) for row in ks}
        live = {row: self._rows[row] for row, k in ks.items() if k > 0}
        for row in ks:
            self._rows[row].base, self._rows[row].drafted = len(contexts[row]), 0
        if not live:
            return drafts
        self._make_rows(live)
        # 1. catch up: feed every drafting row the context tokens its cache lacks (at least one)
        keep, feed = {}, {}
        for row, state in live.items():
            context = contexts[row]
            if state.fed == list(context[: len(state.fed)]):  # usual: accept() left a prefix
                n = len(state.fed)
            else:
                n = next(i for i, (a, b) in enumerate(zip(state.fed, context)) if a != b)
            n = min(n, len(context) - 1)  # always feed >= 1 token, to get its logits
            keep[state.model_row] = n
            feed[state.model_row] = list(context[n:])
            state.fed = list(context)
        model.rollback_rows(keep)
        logits = model.forward_rows(feed, {r: 1 for r in feed})  # per row [1, vocab]
        # 2. one forward per draft position over the rows still drafting
        tokens = {row: [] for row in live}
        q = {row: [] for row in live}
        parents = {row: [] for row in live}  # a tree's (width > 1)
        chain = {row: -1 for row in live}  # the chain's last node, under which the next depth hangs
        for i in range(max(ks[row] for row in live)):
            feed = {}
            for row, state in live.items():
                if i >= ks[row]:
                    continue
                row_logits = logits[state.model_row][0]
                token, row_q = draft_token(row_logits, state.params, state.rng)
                above, chain[row] = chain[row], len(tokens[row])
                for t in [token, *self._siblings(row_logits, token, row_q, state)]:
                    tokens[row].append(t)
                    parents[row].append(above)
                    if row_q is not None:
                        q[row].append(row_q)
                if i + 1 < ks[row]:  # the last draft token need not be fed: nothing reads it
                    feed[state.model_row] = [token]
                    state.fed.append(token)
            if feed:
                logits = model.forward_rows(feed, {r: 1 for r in feed})
        for row, state in live.items():
            state.drafted = ks[row]  # chain tokens: the depth
            tree = parents[row] if self.width > 1 else None
            drafts[row] = Draft(tokens[row], np.stack(q[row]) if q[row] else None, {}, tree)
        return drafts

    def _siblings(self, logits: np.ndarray, token: int, q: np.ndarray | None, state: _Row) -> list[int]:
        """The width - 1 candidates after `token` at one depth: the next best by the draft's logits
        when greedy (q None), else draws from q without replacement."""
        if self.width == 1:
            return []
        if q is None:
            n = min(self.width, len(logits) - 1)
            best = np.argpartition(-logits, n)[: n + 1]
            best = best[np.lexsort((best, -logits[best]))]  # best first; ties by id
            return [int(t) for t in best if int(t) != token][: self.width - 1]
        rest, out = q.astype(np.float64), []
        rest[token] = 0.0
        for _ in range(self.width - 1):
            mass = rest.sum()
            if mass <= 0:
                break
            t = sample(rest / mass, state.rng)
            out.append(t)
            rest[t] = 0.0
        return out

    def accept(self, n_accepted: Mapping[int, int]) -> None:
        # Keep the context and the accepted draft tokens that were fed; drop the rejected ones.
        keep = {}
        for row, n in n_accepted.items():
            state = self._rows.get(row)
            if state is None or state.model_row is None:
                continue
            k = state.base + min(n, max(state.drafted - 1, 0))
            if k < len(state.fed):
                del state.fed[k:]
                keep[state.model_row] = k
        if keep:
            self.model.rollback_rows(keep)
