"""The row-indexed Drafter protocol and the Draft it returns.

Like llama.cpp's common/speculative.h (begin / draft / accept, with a sequence id on every call),
a drafter keeps opaque state per row behind a few verbs, and every verb names its rows, so one
drafter serves a whole batch: a draft model drafts every row in one forward per draft position;
free drafters (prompt lookup) simply loop over the rows.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np

from ..sampling import SamplingParams

# The longest draft a step may ask for (-k). k + 1 rows go through the target in one forward; past
# a few dozen tokens a draft is never accepted whole, and the width only costs.
MAX_DRAFT_TOKENS = 32
MAX_DRAFT_WIDTH = 8  # candidates per draft position of a tree (drafters.model)


def tree_shape(width: int, nodes: int) -> str:
    """A tree drafter's shape checked (width >= 1 candidates a depth; a node budget >= 0, and one
    only with a width of 2 or more) -> its name's suffix: "", "xW" or "xW/N"."""
    if width < 1 or nodes < 0 or (nodes and width < 2):
        raise ValueError(f"a draft tree is width >= 1, and nodes >= 1 only with width >= 2; got {width}, {nodes}")
    return (f"x{width}" if width > 1 else "") + (f"/{nodes}" if nodes else "")


def fit_tree(width: int, nodes: int, k: int, most: int | None) -> tuple[int, int]:
    """A tree drafter's shape (width, nodes) for a draft k deep of at most `most` leaves (None:
    any; under 2: a chain, (1, 0)), chosen before anything is drawn. The engine reserves each
    row's leaves before drafting (Engine.step): a sampled tree cut, or swapped for its first
    branch, because of what was drawn would mix two verification rules by the draws, and that
    mixture is not exact (README, "Trees of drafts"). A tree of n nodes has at most n leaves; a fishbone
    k deep at most k (width - 1) + 1, so its width narrows to fit."""
    if most is None or width <= 1:
        return width, nodes
    if most < 2:
        return 1, 0
    if nodes:
        return width, min(nodes, most)
    width = min(width, (most - 1) // max(1, k) + 1)
    return width, 0


@dataclass(frozen=True)
class Draft:
    tokens: list[int]  # the k proposed tokens (may be fewer than asked, or none)
    q: np.ndarray | None = None  # [len(tokens), vocab] draft probabilities; None = one-hot
    # what the controller may read to predict acceptance: prompt lookup's "match" (tokens its
    # match spans) and "votes" ((occurrences continuing with the first guess, occurrences))
    evidence: dict = field(default_factory=dict)
    # a tree instead of a chain: node i hangs under parents[i] (-1: the row's last token), parents
    # before children; None is a chain. A tree's q is None where its nodes were chosen (the top
    # candidates), else q[i] is the distribution node i was drawn from: siblings, in node order,
    # drawn from their parent's one distribution without replacement (sampling.verify_tree).
    parents: list[int] | None = None

    def first_branch(self) -> "Draft":
        """A tree's first branch (from the root, each node's first child) as a chain draft; a chain
        as it is. For a target that scores no trees, or a step that must be a chain."""
        if self.parents is None:
            return self
        chain = self.first_branch_nodes()
        # a first child was drawn first, from its parent's distribution: a chain draft of q
        q = self.q[chain] if self.q is not None and chain else None
        return Draft([self.tokens[i] for i in chain], q, self.evidence)

    def first_branch_nodes(self) -> list[int]:
        """The nodes of the first branch (from the root, each node's first child), in order."""
        if self.parents is None:
            return list(range(len(self.tokens)))
        chain, node = [], -1
        for i, parent in enumerate(self.parents):  # parents come before their children, so the
            if parent == node:  # first node under the last one found is its first child
                chain.append(i)
                node = i
        return chain

    def leaves(self) -> int:
        """The draft's branches: its nodes no node hangs under (a chain's: 1)."""
        if self.parents is None:
            return 1 if self.tokens else 0
        return len(self.parents) - len(set(self.parents) - {-1})

    def siblings_of(self, node: int) -> list[int]:
        """The other nodes under `node`'s parent (none in a chain)."""
        if self.parents is None:
            return []
        above = self.parents[node]
        return [i for i, parent in enumerate(self.parents) if parent == above and i != node]

    def depths(self) -> list[int]:
        """Each node's depth: 1 under the root, its parent's + 1 below (a chain's: 1..k)."""
        if self.parents is None:
            return list(range(1, len(self.tokens) + 1))
        depths: list[int] = []
        for parent in self.parents:  # parents come before their children
            depths.append(1 if parent < 0 else depths[parent] + 1)
        return depths

    def to_depth(self, k: int) -> "Draft":
        """The draft's nodes k deep or less (a chain's first k tokens); a tree left with one branch
        is that chain."""
        if self.parents is None:
            return self._first(min(k, len(self.tokens)))
        kept = [i for i, d in enumerate(self.depths()) if d <= k]
        index = {-1: -1, **{old: new for new, old in enumerate(kept)}}
        parents = [index[self.parents[i]] for i in kept]
        tokens = [self.tokens[i] for i in kept]
        q = self.q[kept] if self.q is not None else None
        if len(set(parents)) == len(parents):  # every node an only child: a chain
            return Draft(tokens, q, self.evidence)
        return Draft(tokens, q, self.evidence, parents)

    def upto(self, stops: frozenset[int] | set[int], vocab_size: int | None = None) -> "Draft":
        """The draft up to and including its first token in `stops` (end of generation): once the
        target keeps that token the response is over, so the tokens after it could only widen
        the forward. Prompt lookup copying a passage runs into the prompt's own end-of-turn token
        and on into the chat template (seen: a 63-token draft whose last 26 tokens lay past it).
        With `vocab_size`, the draft also ends before its first token outside [0, vocab_size):
        one bad draft (a damaged cache file's ids) must never fail the target's forward, which
        every row of the batch shares. A tree keeps such a node's siblings: a node outside the
        vocabulary goes with everything below it, a stop keeps nothing below it."""
        if self.parents is not None:
            return self._prune_tree(stops, vocab_size)
        for i, token in enumerate(self.tokens):
            if vocab_size is not None and not 0 <= token < vocab_size:
                return self._first(i)
            if token in stops:
                return self._first(i + 1)
        return self

    def _prune_tree(self, stops, vocab_size) -> "Draft":
        if self.q is not None and vocab_size is not None and any(not 0 <= t < vocab_size for t in self.tokens):
            # a sampled node's later siblings were drawn without it: dropping it alone would leave
            # their q rows wrong, so the tree's first branch (each node drawn first) goes instead
            return self.first_branch().upto(stops, vocab_size)
        index: dict[int, int] = {-1: -1}  # old node -> new node; absent: dropped
        tokens, parents, kept = [], [], []
        ended = set()  # nodes that are stops: nothing below them
        for i, (token, parent) in enumerate(zip(self.tokens, self.parents)):
            if parent not in index or parent in ended or (vocab_size is not None and not 0 <= token < vocab_size):
                continue
            index[i] = len(tokens)
            kept.append(i)
            tokens.append(token)
            parents.append(index[parent])
            if token in stops:
                ended.add(i)
        if len(tokens) == len(self.tokens):
            return self
        return Draft(tokens, self.q[kept] if self.q is not None else None, self.evidence, parents)

    def _first(self, n: int) -> "Draft":
        if n == len(self.tokens):
            return self
        return Draft(self.tokens[:n], self.q[:n] if self.q is not None else None, self.evidence)


class ChainCut:
    """One greedy row's draft-model chain (or fishbone tree: the chain's depths, each with its
    siblings), cut by the draft's confidence in each chain token as it comes (ModelDrafter.propose
    and the replay's RecordedDrafter call it): a depth is taken while the draft's expected tokens
    over its seconds grow with it, the chain token's chance that of its confidence
    (acceptance.ConfidenceAcceptance) and, where it fails, a sibling's the tree's sibling rate s;
    and a taken token is fed, to learn the next one's confidence, while a depth as sure as it
    would pay for that forward:

        value(E, taken, fed) = E / (look + fed x feed + target(taken))
        E(taken) = 1 + sum over depths d <= taken of S_d + S_(d-1) (1 - a_d) s,  S_d = a_1 ... a_d

    look: the draft model's catch-up forward (paid: it told the first token's confidence); feed:
    one more one-token forward of it; target(t): the target's forward verifying t depths."""

    def __init__(
        self,
        rate_of: Callable[[float], float],
        look: float,
        feed: float,
        target: Callable[[int], float],
        sibling: float = 0.0,
    ):
        self.rate_of, self.look, self.feed_seconds, self.target = rate_of, look, feed, target
        self.sibling = sibling
        self.taken, self.fed, self.expected, self.survive, self.last = 0, 0, 1.0, 1.0, 0.0

    def _value(self, expected: float, taken: int, fed: int) -> float:
        return expected / (self.look + fed * self.feed_seconds + self.target(taken))

    def _deeper(self, rate: float) -> float:
        """The expected tokens with one more depth whose chain token holds with `rate`."""
        return self.expected + self.survive * rate + self.survive * (1.0 - rate) * self.sibling

    def take(self, p: float) -> bool:
        """Whether the chain takes its next token, of confidence p (else it ends before it)."""
        rate = self.rate_of(p)
        deeper = self._deeper(rate)
        if self._value(deeper, self.taken + 1, self.fed) <= self._value(self.expected, self.taken, self.fed):
            return False
        self.expected, self.taken, self.survive, self.last = deeper, self.taken + 1, self.survive * rate, rate
        return True

    def feed(self) -> bool:
        """Whether to feed the token just taken (and learn the next one's confidence): a next depth
        as sure as this one would pay for the forward. Else the chain ends after it."""
        more = self._deeper(self.last)
        if self._value(more, self.taken + 1, self.fed + 1) <= self._value(self.expected, self.taken, self.fed):
            return False
        self.fed += 1
        return True


@runtime_checkable
class Drafter(Protocol):
    name: str  # what it is, for people: "ngram", "draft:qwen2.5-coder-0.5b", "early-exit:2"
    kind: str  # what its steps are counted as (GenerationStats.decisions): "ngram", "draft", ...
    # the keywords its propose takes beyond (contexts, ks, leaves), declared so that a controller
    # reads them instead of probing the signature: "widths" (a tree's width per row and call)
    # and "cuts" (controller.ChainCut per greedy row: the draft's confidence ends the chain)
    takes: frozenset[str]
    # its shape: candidates per position (> 1: trees) and a tree's nodes kept (0: all), and a
    # held-out agreement auto starts from (None: its own prior); Declared holds the defaults
    width: int
    nodes: int
    prior: float | Sequence[float] | None

    def cost_curve(self) -> dict[int, float] | None:
        """Seconds of one draft position over w rows, where it times itself (None: it does not)."""
        ...

    def begin(self, row: int, prompt: Sequence[int], params: SamplingParams, rng: np.random.Generator) -> None:
        """A row starts generating. `params` and `rng` are the ones the engine verifies the row
        with, so that q is processed exactly like p."""
        ...

    def propose(
        self, contexts: Mapping[int, Sequence[int]], ks: Mapping[int, int], leaves: Mapping[int, int] | None = None
    ) -> dict[int, Draft]:
        """Up to ks[r] tokens that follow contexts[r] (prompt + everything emitted so far), for
        every row asked. A drafter of trees keeps row r's within leaves[r] leaves (absent: any;
        0: a chain), its shape chosen before it draws (fit_tree); a chain drafter ignores it."""
        ...

    def accept(self, n_accepted: Mapping[int, int]) -> None:
        """After a step: how many of each row's last draft the target kept."""
        ...

    def end(self, rows: Sequence[int]) -> None:
        """These rows are done (or cancelled): free what they hold."""
        ...


class Declared:
    """What a drafter declares (Drafter), with the defaults of a chain drafter that takes no
    keywords, has no prior of its own and does not time itself; a drafter sets what differs."""

    takes: frozenset[str] = frozenset()
    width = 1  # candidates per draft position (> 1: trees)
    nodes = 0  # a tree's nodes kept (0: all of its k x width)
    prior = None  # P(position i kept | the ones before were), a head's held-out agreement (None: auto's prior)

    def cost_curve(self) -> dict[int, float] | None:
        """auto's price of one draft position over w rows, where the drafter times itself (a head,
        an early exit); None: auto times its model (DraftModel) or it costs nothing."""
        return None


@runtime_checkable
class DraftModel(Drafter, Protocol):
    """A drafter that runs a model of its own (drafters.model, drafters.cross_vocab): the engine
    holds no more rows than that model does, and the cost-aware controller prices its forwards."""

    model: object  # a models.base.RowModel

    def lag(self, row: int, context: Sequence[int]) -> int:
        """The context tokens its model must catch up on before drafting for this row."""
        ...

    def passes(self, fed: Mapping[int, int]) -> list[int]:
        """The widths of the passes over its weights its model makes of a forward feeding fed[row]
        tokens to these engine rows (RowModel.passes over the model rows it lends them)."""
        ...


def lent_passes(model, rows: Mapping, fed: Mapping[int, int]) -> list[int]:
    """DraftModel.passes for a drafter that lends row rows[row].model_row of `model` (a RowModel)
    to engine row `row`: the model's passes over those rows (llama.cpp's streams split a forward
    wherever seq ids leave a gap). A row lent none yet is priced at the next seq id past the lent
    ones: its first proposal makes it (the model lends its lowest free ids, which this does not see)."""
    lent = {row: state.model_row for row, state in rows.items() if state.model_row is not None}
    fresh = itertools.count(max(lent.values(), default=-1) + 1)
    return model.passes({lent[row] if row in lent else next(fresh): n for row, n in fed.items()})
