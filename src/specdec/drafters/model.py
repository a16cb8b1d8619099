"""A small model of the same vocabulary drafts k tokens autoregressively, for every row at once.

The draft model holds a row of its own for each of the engine's rows. It keeps each row's cache in
step with the accepted tokens: after a step the row holds the context plus the accepted draft
tokens it fed itself; the target's correction (or bonus) token, and the last draft token when all
k were accepted, are fed at the start of the next proposal. A proposal is one forward that catches
every drafting row up, then one forward per draft position over the rows still drafting. After
steps it sat out, a greedy row's catch-up also scores the draft's guesses at the generated tokens
it reads (the last CATCH_UP_SCORED): `auto` learns the draft model's first-position rate from them.

With `width` w > 1 the draft is a tree: at each depth the draft model's own token continues the
chain and the next w - 1 candidates of the same distribution hang beside it as leaves (its top
ones when greedy, else further draws without replacement): where the chain's token fails, the
target may keep a sibling. The siblings cost the draft model nothing and the target w - 1 more
tokens a depth in the same forward (tree attention, models' forward_tree_rows).

With `nodes` n as well, the draft model grows a true tree, EAGLE-2's dynamic tree (Li et al.
2406.16858): the n nodes whose paths the draft finds most probable (the product of its
probabilities from the root: the softmax of its logits when greedy; when sampled, each draw's
expected q given the draws before it, never its own, which would bias the output: shaping_probs),
each node with up to w children of its own distribution, k deep at most. It grows
best first: the most probable candidate not yet in the tree joins it, then its next sibling
becomes a candidate and, once the draft model has read it, its own first child. One forward of
the draft model (a tree forward over its own cache: models' grow_tree_rows, else forward_tree_rows
of the tree so far) reads up to w nodes that joined: a round goes on while the next candidate is
worth what the children of those that joined may be (_Growth.join), so the tree is up to one depth deeper
per draft forward; a branch is continued by the draft itself, where a sibling of the chain (the
fishbone above, and Levels' shaped one, which the early exit drafts) is a leaf. Width goes where
the draft is unsure and depth where it is sure, and a tree of n nodes scores as many tokens as a
chain of n. Whether a candidate joins depends on candidates found before it (never on its own
draw, nor on anything drawn below it), and siblings join in the order they were drawn, so sampled
trees keep the rule of verify_tree exact.
"""

from __future__ import annotations

import heapq
import itertools
import math
from typing import Mapping, Sequence

import numpy as np

from ..errors import SpecdecError
from ..models.base import RowModel, check_same_vocab
from ..sampling import SamplingParams, draft_token, sample
from .base import ChainCut, Declared, Draft, fit_tree, lent_passes, tree_shape

# A catch-up scores the draft's guesses at no more than this many of the last generated tokens it
# feeds (each costs a row of logits: on a CPU the output head is a quarter of a small model's work).
# why: auto's table of the draft model is a moving average that weighs about the last dozen
# observations (acceptance.Acceptance, costs.EMA), so more would cost without telling it more
CATCH_UP_SCORED = 16
# ... and only a catch-up of more than this many tokens: one after steps the draft model sat out.
# why: drafting step after step it reads 1 token (after a rejection) or 2 (after a whole draft, the
# bonus), and its own drafts' outcomes already tell the table what those guesses would; a row of
# logits costs 10-25% more of such a catch-up on this CPU (the 0.5B, 2 threads)
CATCH_UP_MIN = 2


class _Row:
    def __init__(self, params: SamplingParams, rng: np.random.Generator):
        self.model_row: int | None = None  # the draft model's row for this engine row, once made
        self.params, self.rng = params, rng
        self.prompt_len = 0  # context tokens before the first generated one
        self.fed: list[int] = []  # the tokens in the model row's cache, in order
        self.base = 0  # len(context) at the last propose
        self.drafted = 0  # draft length of the last propose


def _kept(state: _Row, context: Sequence[int]) -> int:
    """The row's cached tokens its next proposal keeps: those that agree with the context (usually
    all of them: accept() left a prefix; but the cache may hold a token the context does not, the
    chain's token where the target kept a tree's sibling), less one where they are the whole
    context (a proposal feeds at least one token, to get its logits)."""
    n = len(state.fed)
    if state.fed != list(context[:n]):
        n = next((i for i, (a, b) in enumerate(zip(state.fed, context)) if a != b), min(n, len(context)))
    return min(n, len(context) - 1)


class ModelDrafter(Declared):
    takes = frozenset({"widths", "cuts"})  # propose's keywords beyond (contexts, ks, leaves): Drafter.takes

    def __init__(self, model: RowModel, target: RowModel | None = None, width: int = 1, nodes: int = 0):
        if target is not None:
            check_same_vocab(target, model)
        shape = tree_shape(width, nodes)
        if nodes and not model.scores_trees:
            raise SpecdecError(
                f"a tree of {nodes} nodes grows on the draft model's own tree forwards, which {model.name} "
                "does not score (llama.cpp's exact build keeps a stream per row): leave out --draft-nodes"
            )
        self.model, self.width, self.nodes = model, width, nodes
        self.name, self.kind = f"draft:{model.name}{shape}", "draft"
        self._rows: dict[int, _Row] = {}

    def begin(self, row: int, prompt: Sequence[int], params: SamplingParams, rng: np.random.Generator) -> None:
        self.end([row])
        self._rows[row] = _Row(params, rng)  # its model row is made at its first proposal
        self._rows[row].prompt_len = len(prompt)

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
        """Context tokens the draft model has not seen yet: what the row's next proposal feeds first
        (at least one)."""
        return len(context) - _kept(self._rows[row], context)

    def passes(self, fed: Mapping[int, int]) -> list[int]:
        return lent_passes(self.model, self._rows, fed)

    def propose(
        self,
        contexts: Mapping[int, Sequence[int]],
        ks: Mapping[int, int],
        widths: Mapping[int, int] | None = None,
        cuts: Mapping[int, ChainCut] | None = None,
        leaves: Mapping[int, int] | None = None,
    ) -> dict[int, Draft]:
        """Each row's draft of ks[row] tokens: a tree of widths[row] (default: the drafter's width;
        `auto` chooses one per row and step). A greedy row with a cut (cuts[row], `auto`'s
        controller.ChainCut; a chain or a fishbone, not a tree of `nodes`) is up to ks[row] deep:
        at each depth the cut, told the draft's confidence in its chain token (`confidence`), takes
        the depth or ends the draft before it, and after a depth it took says whether to feed its
        chain token (and learn the next one's confidence) or end the draft after it; the draft's
        evidence "confidence" holds the taken chain tokens' confidences. leaves[row] (absent: any)
        bounds row r's tree before anything is drawn (drafters.base.fit_tree; 0: a chain)."""
        model = self.model
        cuts = {row: cut for row, cut in (cuts or {}).items() if self._rows[row].params.greedy}
        ks = {row: max(0, min(k, model.n_ctx - len(contexts[row]))) for row, k in ks.items()}
        shapes = {
            row: fit_tree((widths or {}).get(row, self.width), self.nodes, k, (leaves or {}).get(row))
            for row, k in ks.items()
        }
        widths = {row: width for row, (width, _) in shapes.items()}
        drafts = {row: Draft([]) for row in ks}
        live = {row: self._rows[row] for row, k in ks.items() if k > 0}
        for row in ks:
            self._rows[row].base, self._rows[row].drafted = len(contexts[row]), 0
        if not live:
            return drafts
        self._make_rows(live)
        # 1. catch up: feed every drafting row the context tokens its cache lacks (at least one).
        # A greedy row also scores the draft's guesses at the generated tokens among them: each is
        # the first guess a draft from there would have made, kept exactly when it is the target's
        # token (Draft.evidence "caught_up", read by the controller)
        keep, feed, scored = {}, {}, {}
        for row, state in live.items():
            context = contexts[row]
            n = _kept(state, context)
            keep[state.model_row] = n
            feed[state.model_row] = list(context[n:])
            # rows from the one that reads the last prompt token (it guesses the first generated one)
            scored[state.model_row] = (
                min(len(context) - n, len(context) - state.prompt_len + 1, CATCH_UP_SCORED + 1)
                if state.params.greedy and len(context) - n > CATCH_UP_MIN
                else 1
            )
            state.fed = list(context)
        model.rollback_rows(keep)
        logits = model.forward_rows(feed, {r: max(1, n) for r, n in scored.items()})  # per row [scored, vocab]
        caught_up = {}
        for row, state in live.items():
            rows_logits, tokens = logits[state.model_row], feed[state.model_row]
            if len(rows_logits) > 1:  # row j guesses the token after its own: the next fed one
                guesses = np.argmax(rows_logits[:-1], axis=1)  # [scored - 1]
                caught_up[row] = [bool(g == t) for g, t in zip(guesses, tokens[len(tokens) - len(rows_logits) + 1 :])]
            logits[state.model_row] = rows_logits[-1:]  # [1, vocab] what the draft continues from
        grown = {row: state for row, state in live.items() if shapes[row][1]}
        if grown:  # 2. a tree grown best first (the module docstring)
            trees = self._grow(grown, logits, ks, widths, {row: shapes[row][1] for row in grown})
            for row, state in grown.items():
                evidence = {"caught_up": caught_up[row]} if row in caught_up else {}
                drafts[row] = trees[row].draft(state.params.greedy, evidence)
            live = {row: state for row, state in live.items() if row not in grown}
            if not live:
                return drafts
        # 2. one forward per draft position over the rows still drafting; each depth's candidates:
        # the chain's token first, then its siblings, with the draft's probability of each
        levels = {row: Levels(widths[row]) for row in live}
        depth = {row: ks[row] for row in live}
        sure: dict[int, list[float]] = {row: [] for row in cuts if row in live}
        for i in range(max(ks[row] for row in live)):
            feed = {}
            for row, state in live.items():
                if i >= depth[row]:
                    continue
                if row in sure:  # a cut chain: the draft's confidence in this token decides
                    p = confidence(logits[state.model_row][0])
                    if not cuts[row].take(p):
                        depth[row] = i
                        continue
                    sure[row].append(p)
                token = levels[row].add(logits[state.model_row][0], state.params, state.rng)
                if row in sure and i + 1 < depth[row] and not cuts[row].feed():
                    depth[row] = i + 1  # the cut ends it: the chain ends here
                if i + 1 < depth[row]:  # the last draft token need not be fed: nothing reads it
                    feed[state.model_row] = [token]
                    state.fed.append(token)
            if feed:
                logits = model.forward_rows(feed, {r: 1 for r in feed})
        for row, state in live.items():
            state.drafted = depth[row]  # chain tokens: the depth
            evidence = {"caught_up": caught_up[row]} if row in caught_up else {}
            if row in sure:
                evidence["confidence"] = sure[row]
            drafts[row] = levels[row].draft(evidence) if depth[row] else Draft([], evidence=evidence)
        return drafts

    def _grow(self, live, logits, ks, widths, nodes) -> dict[int, "_Growth"]:
        """Each drafting row's tree of `nodes`, grown best first from the draft's logits after the
        row's context (logits[model row] [1, vocab]): each round the next widths[row] nodes that
        may have children join, and one tree forward of the draft model (all rows) reads them.
        The draft model's cache holds the context alone after it (state.fed; the tree is dropped)."""
        model = self.model
        grow = model.grow_tree_rows if model.grows_trees else None
        # a node may take a sequence id of its own (llama.cpp lends a few dozen): rows past what is
        # left grow smaller trees, down to one node (a chain of one)
        room = model.tree_leaves if model.tree_leaves is not None else sum(nodes.values())
        growth = {}
        for row, state in live.items():
            growth[row] = _Growth(ks[row], max(1, min(nodes[row], room)))
            room -= growth[row].nodes
            growth[row].open(-1, 1.0, 0, candidates(logits[state.model_row][0], state.params, state.rng, widths[row]))
        grown: set[int] = set()  # model rows with a tree in flight
        while True:
            picked = {row: g.join(widths[row]) for row, g in growth.items()}
            picked = {row: nodes for row, nodes in picked.items() if nodes}
            if not picked:
                break
            new = {live[row].model_row: growth[row].feed(nodes) for row, nodes in picked.items()}
            if grow is not None:
                out = grow(new)
            else:  # the tree so far again, whole
                if grown:
                    model.keep_path_rows({r: [] for r in grown})
                    grown = set()
                scores = model.forward_tree_rows({live[row].model_row: growth[row].fed_tree() for row in picked})
                out = {r: scores[r][len(scores[r]) - len(tokens) :] for r, (tokens, _) in new.items()}
            grown.update(new)
            for row, nodes in picked.items():
                state, g = live[row], growth[row]
                for node, row_logits in zip(nodes, out[state.model_row]):
                    level = candidates(row_logits, state.params, state.rng, widths[row])
                    g.open(node, g.value[node], g.depth[node] + 1, level)
        if grown:
            model.keep_path_rows({r: [] for r in grown})
        return growth

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


class _Growth:
    """One row's tree grown best first (ModelDrafter._grow): its nodes (token, parent, the q it was
    drawn from, path probability, depth), the candidates that may join next (a heap by path
    probability, ties to the one found first), and which nodes the draft model has read."""

    def __init__(self, k: int, nodes: int):
        self.k, self.nodes = k, nodes
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.q: list[np.ndarray | None] = []
        self.value: list[float] = []  # each node's place: the product of the places from the root
        self.depth: list[int] = []  # 0: under the row's last token
        self.fed: dict[int, int] = {}  # node -> its index in the draft model's tree
        self._heap: list[tuple] = []
        self._order = itertools.count()
        self._first, self._levels = 0.0, 0  # the first candidates' probabilities, summed, and their count

    def open(self, parent: int, above: float, depth: int, level: tuple) -> None:
        """Node `parent`'s children (level: candidates' tokens, their shaping probabilities, q), at
        `depth`, under a path of probability `above`: the first becomes a candidate."""
        if depth < self.k:
            self._push(parent, above, depth, level, 0)
            self._first += level[1][0]
            self._levels += 1

    def _push(self, parent: int, above: float, depth: int, level: tuple, j: int) -> None:
        heapq.heappush(self._heap, (-above * level[1][j], next(self._order), parent, above, depth, level, j))

    def join(self, most: int) -> list[int]:
        """A round: the best candidates join the tree, best first, while the next is worth what
        the children of one that joined this round may be (their path probability times the
        draft's mean first-candidate probability so far: those children are not known until the
        draft model reads their parent), until `most` joined that may have children (above depth
        k - 1) or the tree has its nodes. Returns those that may, unless the tree is full (nothing
        below could join). Which candidate joins reads only what was drafted before it."""
        picked: list[int] = []
        bound = 0.0  # what the best child of a node that joined this round may be worth
        while self._heap and len(self.tokens) < self.nodes and len(picked) < most:
            if picked and -self._heap[0][0] < bound:
                break
            negative, _, parent, above, depth, level, j = heapq.heappop(self._heap)
            node = len(self.tokens)
            self.tokens.append(level[0][j])
            self.parents.append(parent)
            self.q.append(level[2])
            # its children's places build on its own, not on its drawn q: a drawn token is kept with
            # min(1, p / q), which its q alone does not tell (measured: docs/results/bench-tree-grown.md)
            self.value.append(-negative)
            self.depth.append(depth)
            if j + 1 < len(level[0]):  # the sibling drawn next
                self._push(parent, above, depth, level, j + 1)
            if depth + 1 < self.k:
                picked.append(node)
                bound = max(bound, self.value[node] * self._first / self._levels)
        return picked if len(self.tokens) < self.nodes else []

    def feed(self, nodes: list[int]) -> tuple[list[int], list[int]]:
        """These nodes, for the draft model to read: (tokens, parents in its tree, numbered on from
        the nodes it read before). Their parents were read before them."""
        first = len(self.fed)
        for i, node in enumerate(nodes):
            self.fed[node] = first + i
        return [self.tokens[n] for n in nodes], [self.fed.get(self.parents[n], -1) for n in nodes]

    def fed_tree(self) -> tuple[list[int], list[int]]:
        """Every node the draft model has read, as its tree (tokens, parents), in the order read."""
        nodes = sorted(self.fed, key=self.fed.get)
        return [self.tokens[n] for n in nodes], [self.fed.get(self.parents[n], -1) for n in nodes]

    def draft(self, greedy: bool, evidence: dict) -> Draft:
        """The Draft: the tree, or its chain where a greedy tree has no sibling (a tree's forward
        costs more than a chain's of as many tokens)."""
        q = np.stack(self.q) if self.tokens and not greedy else None
        chain = all(parent == i - 1 for i, parent in enumerate(self.parents))
        return Draft(list(self.tokens), q, evidence, None if greedy and chain else list(self.parents))


def candidates(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator, width: int, shaped: bool = True):
    """One position's candidates from the draft's logits there [vocab]: its own token (the argmax,
    or a draw from q) and width - 1 siblings (siblings); (tokens, shaping_probs of each, or none
    unless `shaped`, q: None when greedy)."""
    token, q = draft_token(logits, params, rng)
    tokens = [token, *siblings(logits, token, q, width - 1, rng)]
    return tokens, shaping_probs(logits, q, tokens) if shaped else [], q


class Levels:
    """One row's draft, depth by depth (the module docstring): each depth's candidates (the chain's
    token first, then its width - 1 siblings from the same distribution), the draft's probability of
    each (a tree shaped by `nodes` only: shaping_probs) and the q they were drawn from (sampled rows).
    A chain at width 1. Any drafter that drafts a chain position by position shapes trees with it
    (a draft model, the early exit)."""

    def __init__(self, width: int = 1, nodes: int = 0):
        tree_shape(width, nodes)
        self.width, self.nodes = width, nodes
        self.levels: list[tuple[list[int], list[float], np.ndarray | None]] = []

    def add(self, logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
        """The next depth's candidates from the draft's logits there [vocab]; its chain token (the
        one a further depth is drafted after)."""
        tokens, probs, q = candidates(logits, params, rng, self.width, shaped=bool(self.nodes))
        self.extend(tokens, probs, q)
        return tokens[0]

    def extend(self, candidates: list[int], probs: list[float], q: np.ndarray | None = None) -> None:
        """The next depth: its candidates (the chain's token first), the probability the tree is
        shaped by for each (shaping_probs; none unless `nodes`) and the q they were drawn from
        (None: greedy). `add` drafts them; the replay gives a recording's (replay.shaped_run)."""
        self.levels.append((candidates, probs, q))

    def settled(self) -> bool:
        """Whether a tree of `nodes` nodes is settled: that many candidates found so far are at least
        as probable as the chain's last node, which bounds every node below it, so no deeper node
        could be chosen (never, for a chain or a fishbone)."""
        if not self.nodes:
            return False
        path, values = 1.0, []
        for _, probs, _ in self.levels:
            values += [path * p for p in probs]
            path *= probs[0]
        return sum(v >= path for v in values) >= self.nodes

    def shape(self) -> list[int]:
        """How many of each depth's candidates the draft keeps (its chain's node first): all of
        them, or those of the `nodes` most probable paths (0 from the first depth it leaves out)."""
        return self._choose() if self.nodes else [len(c) for c, _, _ in self.levels]

    def draft(self, evidence: dict | None = None) -> Draft:
        """The Draft: the chain (width 1), every candidate (the fishbone), or the `nodes` most
        probable paths. A greedy tree of `nodes` that keeps no sibling is its chain, verified as one
        (a tree's forward costs more than a chain's of as many tokens)."""
        chosen = self.shape()
        tokens, parents, q = [], [], []
        above = -1  # the chain's node of the depth before, under which a depth's candidates hang
        for (candidates, _, row_q), n in zip(self.levels, chosen):
            if n == 0:
                break
            for t in candidates[:n]:
                tokens.append(t)
                parents.append(above)
                if row_q is not None:
                    q.append(row_q)
            above = len(tokens) - n
        greedy_chain = self.nodes and not q and max(chosen, default=0) <= 1
        tree = self.width > 1 and not greedy_chain
        return Draft(tokens, np.stack(q) if q else None, evidence or {}, parents if tree else None)

    def _choose(self) -> list[int]:
        """How many of each depth's candidates the tree keeps: best first by path probability,
        among the candidates whose chain node above and earlier siblings are already kept."""
        levels = self.levels
        above = [1.0]  # the path probability of each depth's parent (the chain's node before it)
        for _, probs, _ in levels[:-1]:
            above.append(above[-1] * probs[0])
        chosen = [0] * len(levels)
        heap = [(-levels[0][1][0], 0, 0)]  # (-path probability, depth, candidate)
        while heap and sum(chosen) < self.nodes:
            _, d, j = heapq.heappop(heap)
            chosen[d] = j + 1
            candidates, probs, _ = levels[d]
            if j == 0 and d + 1 < len(levels):  # the chain's node: the next depth opens below it
                heapq.heappush(heap, (-above[d + 1] * levels[d + 1][1][0], d + 1, 0))
            if j + 1 < len(candidates):  # the sibling drawn next
                heapq.heappush(heap, (-above[d] * probs[j + 1], d, j + 1))
        return chosen


# The draft's confidence in its greedy token is that token's softmax share among the draft's
# CONFIDENCE_TOP_K best candidates, as llama.cpp's draft sampler reads it (common/speculative.cpp:
# top_k 10, then p_min compares the first's share).
# why: one measure for the recordings, the replay of llama.cpp's rule (its p_min, the confidence
# rule users know) and auto's own cut (controller.ChainCut), whose rates are fitted on recordings;
# history: docs/results/provenance.md#confidence_top_k
CONFIDENCE_TOP_K = 10


def confidence(logits: np.ndarray) -> float:
    """The greedy token's softmax share among the CONFIDENCE_TOP_K best logits [vocab]. Candidates
    more than 20 below the best add under 1e-8 each and are left out: the share is exact to 1e-7
    without partitioning the whole vocabulary (152k logits: 0.45 ms; this 0.03 ms for a peaked
    distribution, 0.19 for logits of spread 3)."""
    logits = np.asarray(logits)
    top = float(logits.max())
    near = logits[logits > top - 20.0]
    if len(near) > CONFIDENCE_TOP_K:
        near = np.partition(near, len(near) - CONFIDENCE_TOP_K)[-CONFIDENCE_TOP_K:]
    return float(1.0 / np.exp(near.astype(np.float64) - top).sum())


def siblings(
    logits: np.ndarray | None, token: int, q: np.ndarray | None, n: int, rng: np.random.Generator | None
) -> list[int]:
    """Up to n more candidates for the position where `token` was drafted from `logits` [vocab]:
    the next best by the logits when greedy (q None; ties by id), else further draws from q with
    `rng`, without replacement, in the order drawn (sampling.verify_tree's rule for siblings)."""
    if n <= 0:
        return []
    if q is None:  # an argmax a sibling (the first maximum: ties by id), not a sort of the vocabulary
        n = min(n, len(logits) - 1)
        rest = np.array(logits, dtype=np.result_type(logits, np.float32))
        rest[token] = -np.inf
        out: list[int] = []
        while len(out) < n:
            t = int(np.argmax(rest))
            if rest[t] == -np.inf:  # only impossible tokens are left: the lowest ids
                taken = {token, *out}
                out += [int(i) for i in np.flatnonzero(rest == -np.inf) if int(i) not in taken][: n - len(out)]
                break
            out.append(t)
            rest[t] = -np.inf
        return out
    rest, out = q.astype(np.float64), []
    rest[token] = 0.0
    for _ in range(n):
        mass = rest.sum()
        if mass <= 0:
            break
        t = sample(rest / mass, rng)
        out.append(t)
        rest[t] = 0.0
    return out


def shaping_probs(logits: np.ndarray | None, q: np.ndarray | None, tokens: list[int]) -> list[float]:
    """The probability a tree is shaped by, for each of one position's candidates (`tokens`, in
    the order drafted). Greedy (q None): the softmax of the logits at it; the candidates are fixed,
    so any shape keeps greedy exact. Sampled: the expected q of that draw given the draws before it,
    sum_x q'(x) q(x) with q' = q without them renormalised, never its own q: a candidate kept or not
    by its own drawn value leaves the rejection rule no longer exact (drawn [0.5, 0.3, 0.2] against
    p = [0.1, 0.6, 0.3], a second candidate kept only where q > 0.25 emits token 1 with 0.66, not
    0.6). What came before it (earlier draws, its ancestors, other branches) may shape the tree."""
    if q is None:  # (the log-normaliser alone: a whole float64 log-softmax cost 1.4 ms a 152k vocabulary)
        top = float(np.max(logits))
        log_norm = top + math.log(float(np.sum(np.exp(logits - top, dtype=np.float64))))
        return [math.exp(float(logits[t]) - log_norm) for t in tokens]
    q = q.astype(np.float64)
    square, drawn, drawn_square, out = float(np.dot(q, q)), 0.0, 0.0, []
    for t in tokens:
        rest = 1.0 - drawn
        out.append((square - drawn_square) / rest if rest > 1e-12 else 0.0)
        drawn += q[t]
        drawn_square += q[t] ** 2
    return out
