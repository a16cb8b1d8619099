"""Chooses the drafter and the draft length of every row, every step.

`FixedController`: one drafter, k tokens a step for every row (k = 0 or no drafter is plain decoding).

`CostAwareController` (`--draft auto`): speculation only pays when the tokens it gains are worth
more than the drafting and the wider target pass cost. Each step it allocates the step's forward
width across the live rows: row i drafts k_i >= 0 tokens so as to maximise expected emitted tokens
per second over the whole batch,

    sum_i E_i[k_i] / (draft_cost(k) + sum_p target_cost(w_p, depth)),
    E_i[k] = 1 + sum_{j<=k} prod_{l<=j} a_il

where w_p are the widths of the passes over the weights the target makes of a forward feeding row i
k_i + 1 tokens (RowModel.passes: one, of their sum, for most backends; llama.cpp's per-row streams
make one per equal split, so uneven drafts cost more than their sum's width; where the rows fed in
two forwards cost less than in one, the step makes two, costs.split_forward, and is priced so)
from measured costs (costs.py: the target's forward for 1..W rows, timed at load at two cache
depths, cached, refined live; `depth` is the step's, its rows' context lengths weighted by the
tokens each feeds) and measured acceptance (a_il = P(position l of row i accepted | the ones
before were), a moving average per drafter; for the free drafters, prompt lookup and the suffix
cache, per match length). The E_i are concave in k (each term is a product of probabilities), so adding draft
tokens in order of their marginal gain gives the most tokens for every total width; the controller
walks that order and keeps the prefix with the best tokens per second. With one row this is
argmax_k E[k] / cost(k + 1). Every row at k = 0, a plain step, is always a candidate, so
speculation steps aside when it cannot pay.

Trees (`tree_widths`, a draft model that drafts chains): the draft model may draft a fishbone of
width w instead (its chain of k tokens and, beside each, its next w - 1 candidates: drafters.model),
one forward of k w + 1 tokens for the target, nothing more for the draft model. Where the chain's
token fails at some depth, a sibling is kept with probability s_w (acceptance.SiblingAcceptance,
learnt from the trees' outcomes), one token more:

    E_w[k] = E[k] + s_w (1 - prod_{l<=k} a_l)

Each row takes the width whose best k promises the most alone; the batch then allocates k as for
chains, each row's forward k w + 1 tokens wide (a tree row beside chains costs the engine a second
forward, and is priced so). On a steep curve (this CPU's: 3 tokens cost 2-2.6x one) width never
pays and every step is today's chain; on a flat one (a GPU's) it is nearly free.

The free drafters' trees (`free_width`, where the target scores trees): prompt lookup's
continuations of the earlier occurrences, up to free_width branches, parting where they differ
(drafters.ngram), and the suffix cache's continuations of earlier requests, up to free_width under
each node (drafters.suffix: where an earlier answer parted from another, both sides). Cut k deep a
tree feeds its nodes that deep, and is worth its first branch's E[k] plus, at each depth d <= k
where it branches, the chance the first d - 1 held and the d-th failed, times s (another branch
holds the target's token there: acceptance.NGRAM_SIBLING_PRIOR, then learnt from that drafter's
trees' outcomes), times the expected tokens of the guesses below it as the drafter's later guesses
in a copy. Each row takes the better of the chain and the tree, as for the draft model's widths.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Callable, Mapping, Protocol, Sequence

import numpy as np

from .acceptance import (
    DRAFT_PRIOR,
    K_MAX,
    NGRAM_SIBLING_PRIOR,
    Acceptance,
    ConfidenceAcceptance,
    MatchAcceptance,
    Overlay,
    SiblingAcceptance,
    agreement,
)

# the acceptance tables and priors moved to acceptance.py; these names stay importable from here
from .acceptance import MATCH_BUCKETS as MATCH_BUCKETS
from .acceptance import MATCH_PRIOR as MATCH_PRIOR
from .acceptance import OVERLAY_LONG as OVERLAY_LONG
from .costs import EMA, CostTable, split_forward, step_depth
from .drafters.base import ChainCut, Draft, Drafter, DraftModel
from .models.base import packed

# What a step maximises over its rows: the batch's tokens per second ("throughput"), each row's own
# (the geometric mean of the rows' tokens per second: "latency", a server that puts its streams'
# pace first), or the batch's tokens per second under latency's bound on a step ("bounded").
OBJECTIVES = ("throughput", "latency", "bounded")
# What `specdec serve` (server.app.build_service) maximises unless asked: the batch's tokens per
# second with no step past LATENCY_STEP plain steps.
# why: throughput first verifies a long copy as one long gap (ITL p99 3.2-8.8x llama-server's);
# latency first drafts nothing at C = 8 on a CPU's curve, 4-6% behind bounded there, level below;
# history: docs/results/provenance.md#server_objective
SERVER_OBJECTIVE = "bounded"
# Objectives "latency" and "bounded" bound a step: its drafts may make it cost at most this many times the
# rows' plain step (on the cost curve), so no stream's gap between tokens grows past that.
# why: the serving bar (issue 34) holds a stream's 99th-percentile gap within 2x a plain server's;
# on this CPU's steep curve that allows drafts of one or two tokens, on a GPU's flat one long ones;
# history: docs/results/provenance.md#latency_step
LATENCY_STEP = 2.0
# Under "bounded", this share of steps may pass the bound: a tail budget, credited a step at a
# time (at most LONG_STEP_CREDIT held), each spent on a step whose long, sure draft saves at least
# LONG_STEP_SAVING plain steps of the batch against drafting within the bound. Gaps past the bound
# stay under 1% of a stream's, so its 99th-percentile gap is still the bound's, while a long copy
# is verified at once, as llama-server's n-gram drafts are.
# why: at C = 1 the bound alone drafted one token at a time through copies llama-server verified
# 40 at a time (served, the suite's prompts); history: docs/results/provenance.md#long_step_share
LONG_STEP_SHARE = 0.005
# Any W steps hold at most LONG_STEP_CREDIT + W x share long ones, within 1% of them wherever
# W >= LONG_STEP_CREDIT / (0.01 - share): 1 000 steps at 5 (a run of 8 streams of 128 tokens).
# why: a cap of 2 spent itself on a copy's first two long steps and drafted the rest of it within
# the bound; history: docs/results/provenance.md#long_step_share
LONG_STEP_CREDIT = 5.0
LONG_STEP_SAVING = 4.0
# A request's own evidence weighs as much as OVERLAY_WEIGHT guesses from the shared table (Overlay):
# after 3 x OVERLAY_WEIGHT guesses of a kind its own rate has 3/4 of the say.
# why: best on code and RAG, the categories where requests differ most;
# history: docs/results/provenance.md#overlay_weight
OVERLAY_WEIGHT = 8.0
# The shared tables learn across requests at this rate per observation, the cost curve's EMA.
# why: the overlay does the fast, per-request learning; history: docs/results/provenance.md#shared_rate
SHARED_RATE = EMA
# A response that has been a verbatim copy of its context nearly since its first token (a match of
# at least WHOLE_COPY_MIN tokens spanning at least WHOLE_COPY_SHARE of the tokens generated) is a
# copy task: a rewrite of given code, an extract from a passage. A cap on reach (the controller's
# `reach`, which only the vLLM proposer sets) does not bound its drafts.
# why: inside such a copy the next 63 guesses are mostly all right, and a capped ramp spends 6-8
# steps getting there; a long match alone is no licence;
# history: docs/results/provenance.md#whole_copy_min, docs/results/provenance.md#whole_copy_share
WHOLE_COPY_MIN = 16
WHOLE_COPY_SHARE = 0.8
# The gap between a request's draft-model probes grows by this factor after each probe (probes at
# steps 32, 96, 224, ... with explore_every = 32); 1.0 is a fixed period.
# why: a request whose probes keep failing should not pay for one every explore_every steps (a
# choice, not a fit); history: docs/results/provenance.md#explore_growth
EXPLORE_GROWTH = 2.0
# A request's first draft-model probe comes after this many steps.
# why: a choice, not a fit: where the draft model pays, its own acceptance, not the probes, decides;
# history: docs/results/provenance.md#explore_every
EXPLORE_EVERY = 32


# The widths of the draft model's trees `auto` chooses from (1: a chain).
# why: the siblings' rates are fitted for these (acceptance.SIBLING_PRIOR); past 4 the dev suite's
# recording adds 5% of the misses a width while the forward grows by k tokens a width
TREE_WIDTHS = (1, 2, 3, 4)
# The most branches of prompt lookup's trees `auto` may draft (its continuations of the earlier
# occurrences, where they part: drafters.ngram), where the target scores trees.
# why: the dev suite's recording on the H100 1.5B curve (`replay_controller.py trees --drafter
# ngram`): the best fixed trees there are 3-4 wide where they pay; the controller cuts their depth;
# history: docs/results/provenance.md#ngram_tree_width
NGRAM_TREE_WIDTH = 4


def whole_copy(match: int, generated: int) -> bool:
    """Whether a match of `match` tokens, `generated` tokens into a response, makes it a whole copy."""
    return match >= WHOLE_COPY_MIN and match >= WHOLE_COPY_SHARE * generated


class Controller(Protocol):
    """What the engine asks every step (engine.Engine.step): the policy over rows. FixedController
    (one drafter, one k), CostAwareController (`auto`) and the server's RoutingController (each
    request its own policy) are the three."""

    def begin(self, row: int, prompt: Sequence[int], policy=None) -> None:
        """A row joins (its prompt prefilled), with its request's policy (Engine.add; None: the
        controller's own)."""

    def end(self, row: int) -> None:
        """A row leaves (finished or cancelled)."""

    def draft(
        self,
        contexts: Mapping[int, Sequence[int]],
        caps: Mapping[int, int],
        leaves: Mapping[int, int] | None = None,
    ) -> dict[int, tuple[Drafter | None, Draft | None]]:
        """(drafter, draft) per live row, (None, None) for a plain step; caps[r] bounds row r's
        draft, leaves[r] its tree's leaves (absent: any; 0: a chain), fixed before drafting
        (Engine._tree_room) and handed to the drafters."""

    def observe(
        self,
        outcomes: Mapping[int, "Outcome"],
        passes: Sequence[int],
        target_seconds: float,
        depth: float | None = None,
    ) -> None:
        """What the step did: each row's outcome, the widths of the forward's passes over the
        weights (RowModel.passes), its seconds and its depth."""

    def speedups(self, row: int, tokens_per_second: float) -> tuple[float | None, float | None]:
        """(predicted, measured) speedup of the row so far, where the policy knows them."""


@dataclass
class FixedController:
    """One drafter, k tokens a step for every row; k = 0 or no drafter is plain decoding."""

    drafter: Drafter | None
    k: int

    def begin(self, row: int, prompt: Sequence[int], policy=None) -> None:
        pass

    def end(self, row: int) -> None:
        pass

    def draft(
        self,
        contexts: Mapping[int, Sequence[int]],
        caps: Mapping[int, int],
        leaves: Mapping[int, int] | None = None,
    ) -> dict[int, tuple[Drafter | None, Draft | None]]:
        """(drafter, draft) per row; caps[r] bounds row r's draft (the context's room, the tokens
        the row still wants), leaves[r] its tree's leaves (Controller.draft)."""
        plan = {row: (None, None) for row in contexts}
        ks = {row: min(self.k, caps[row]) for row in contexts}
        ks = {row: k for row, k in ks.items() if k > 0}
        if self.drafter is None or not ks:
            return plan
        asked = {row: contexts[row] for row in ks}
        bounds = {"leaves": leaves} if leaves else {}  # (none: no row's tree is bounded)
        drafts = self.drafter.propose(asked, ks, **bounds)  # at most k tokens each
        plan.update({row: (self.drafter, draft) for row, draft in drafts.items()})
        return plan

    def observe(
        self,
        outcomes: Mapping[int, "Outcome"],
        passes: Sequence[int],
        target_seconds: float,
        depth: float | None = None,
    ) -> None:
        """Told the outcome of every step (a fixed policy ignores it)."""

    def speedups(self, row: int, tokens_per_second: float) -> tuple[float | None, float | None]:
        return None, None


@dataclass(frozen=True)
class Outcome:
    """What one row's step did: the drafter and draft used (None: a plain step), how many draft
    tokens the target kept, and the tokens emitted."""

    drafter: Drafter | None
    draft: Draft | None
    n_accepted: int
    emitted: Sequence[int]


@dataclass
class _RowState:
    steps: int = 0
    # per free drafter (by name): its proposal this step (tokens, match, kind), for learning ...
    shadow: dict[str, tuple[list[int], int, str]] = field(default_factory=dict)
    # ... and a proposal followed over plain steps (tokens, match, next position to score)
    tracker: dict[str, tuple[list[int], int, int]] = field(default_factory=dict)
    promised: float = 0.0  # sum over steps of value / plain value
    # this request's own evidence: per free drafter (by name), and the draft model's
    overlays: dict[str, Overlay] = field(default_factory=dict)
    model_overlay: Overlay | None = None
    prompt_len: int = 0  # tokens before the first generated one
    next_explore: float = 0.0  # the step of the next draft-model probe
    explore_gap: float = 0.0  # steps between the last two probes
    depth: int = 0  # context tokens at the last step


def fed_tokens(k: int, width: int = 1, nodes: np.ndarray | None = None) -> int:
    """Tokens the target's forward feeds a row for a draft k deep: its last token and k x width
    draft tokens (a chain, or the draft model's fishbone of that width), or a tree's nodes[k], its
    nodes k deep or less."""
    return 1 + (int(nodes[k]) if nodes is not None else k * width)


def scores_tree(k: int, fed: int) -> bool:
    """Whether a draft k deep that feeds the target `fed` tokens is a tree (more than its chain's
    k + 1): the engine scores trees in a forward of their own, priced with the tree factor."""
    return k > 0 and fed > k + 1


def _survival(chain: np.ndarray) -> np.ndarray:
    """[1 (k = 0), P(the first k kept) for k >= 1] from a chain's E[k] (E[k] - E[k - 1]; np.diff's
    values without its prepend, which costs more than the rest of a tree's pricing)."""
    survive = np.empty_like(chain)
    survive[0] = 1.0
    np.subtract(chain[1:], chain[:-1], out=survive[1:])
    return survive


@dataclass
class _Option:
    """One row's best drafter this step: E[k] for k = 0..len - 1 and the cost of drafting."""

    kind: str  # a free drafter's name ("ngram", "suffix") / "draft" / "plain"
    expected: np.ndarray  # [k_max + 1]
    proposal: Draft | None = None  # a free drafter's proposal (already made: it is free)
    lag: int = 0  # draft model: context tokens it must catch up on first
    drafter: Drafter | None = None  # the free drafter that made `proposal`
    depth: int = 0  # the row's context tokens: the depth its forward attends over
    width: int = 1  # draft model: a tree of this width (its forward k x width + 1 tokens)
    nodes: np.ndarray | None = None  # a free drafter's tree: nodes[k], its nodes k deep or less

    def fed(self, k: int) -> int:
        """Tokens the target's forward feeds this row for a draft k deep."""
        return fed_tokens(k, self.width, self.nodes)

    def tree(self, k: int) -> bool:
        """Whether a draft k deep is a tree (scores_tree)."""
        return scores_tree(k, self.fed(k))


# A greedy row's chain from the draft model (auto's, where the drafter takes cuts) is cut by the
# draft's confidence in each token (ChainCut) and may run this deep, where the objective lets a
# step be as wide as it pays (throughput); under a step bound no deeper than the step planned.
# why: the replayed confidence stop kept all but 1-3% of what 16 gave at 8 on the H100 7B curve
# (benchmarks/confidence_replay.py); history: docs/results/provenance.md#cut_depth
CUT_DEPTH = 8


def auto_controller(
    target,
    free: Sequence[Drafter],
    model: DraftModel | None,
    costs: tuple | None = None,
    objective: str = "throughput",
    long_step_share: float = 0.0,
) -> "CostAwareController":
    """`auto`'s controller for `target`, the one way it is built (a decoder's engine, the server's
    router). `costs`: (the target's curve, the draft model's or None); None, or None for the draft
    model's where there is one: timed, and cached, at first use (costs.measure_cost_table).
    `objective`: OBJECTIVES. A drafter in the draft model's
    place that drafts chains and takes a width with each call (a draft model of the target's
    vocabulary, an early exit: drafters.model.Levels) may draft trees where the target scores them
    (TREE_WIDTHS)."""
    from .drafters.ngram import NgramDrafter

    trees = model is not None and model.width == 1 and not model.nodes and "widths" in model.takes
    scores_trees = target.scores_trees
    if costs is None or (costs[1] is None and model is not None):
        from .costs import measure_cost_table

        if isinstance(model, DraftModel):
            drafting = measure_cost_table(model.model)
        else:  # a drafter that times itself (a trained head), or none
            drafting = model.cost_curve() if model is not None else None
        costs = (measure_cost_table(target) if costs is None else costs[0], drafting)
    return CostAwareController(
        free,
        model,
        *costs,
        passes=target.passes,
        stops=target.tokenizer.eog_ids,
        objective=objective,
        draft_prior=model.prior if model is not None else None,  # a head's held-out agreement
        tree_widths=TREE_WIDTHS if trees and scores_trees else (1,),
        free_width=NGRAM_TREE_WIDTH if scores_trees and free and isinstance(free[0], NgramDrafter) else 1,
        long_step_share=long_step_share,
    )


class CostAwareController:
    """Picks, every step and for every row, one of the free drafters (prompt lookup, the suffix
    cache), the draft model or a plain step, and the k of each, to promise the most tokens per
    second over the batch (module docstring).

    `free` is one free drafter or several: each proposes every step (it costs nothing), is scored
    with its own MatchAcceptance table, and the row takes whichever promises most."""

    def __init__(
        self,
        free: Drafter | Sequence[Drafter] | None,
        model_drafter: DraftModel | None,  # or a drafter with lag() and its own cost curve (a head)
        target_costs,
        draft_costs=None,
        explore_every: int = EXPLORE_EVERY,
        passes: Callable[[Mapping[int, int]], list[int]] = packed,
        match_prior: Mapping[str, Sequence[float]] | None = None,
        draft_prior: float | Sequence[float] | None = None,
        overlay_weight: float | None = None,
        shared_rate: float | None = None,
        explore_growth: float | None = None,
        stops: frozenset[int] = frozenset(),
        objective: str = "throughput",
        reach: float | None = None,  # a cap: free drafts at most reach x their match (None: none)
        tree_widths: Sequence[int] = (1,),  # the draft model's tree widths to choose from (1: chains)
        free_width: int = 1,  # the free drafters' trees: at most this many branches (1: chains)
        long_step_share: float = 0.0,  # "bounded": the share of steps that may pass the bound (LONG_STEP_SHARE)
    ):
        if objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
        if not 0.0 <= long_step_share < 1.0:
            raise ValueError(f"long_step_share must be in [0, 1), got {long_step_share}")
        self.objective = objective  # what a step maximises over the batch (_allocate)
        self.long_step_share = long_step_share if objective == "bounded" else 0.0
        self._credit = 0.0  # steps past the bound that may be taken now (long_step_share a step)
        # row -> the most tokens a step could promise it if the bound did not cut its asks (inf
        # where that cannot be told: a cut tree, a row the bound left no draft), from the last
        # _options (_long_step; its dearer parts only priced where there is a tail budget)
        self._ceiling: dict[int, float] = {}
        self._unbounded = False  # pricing a step past the bound (_step_bound)
        self.long_steps = 0  # steps taken past the bound
        # a CostTable (with a deep curve, costs.measure_cost_table), or a curve at one depth
        self.target_cost = CostTable.of(target_costs)
        # A free drafter (prompt lookup, the suffix cache) may draft as far as the widest forward the cost
        # curve has timed (costs.WIDE): inside a verbatim copy its guesses keep landing, and on this CPU a
        # forward's cost per token keeps falling past 16 tokens.
        self.k_free = max(K_MAX, self.target_cost.widths[-1] - 1)
        # How far past its match a free draft is trusted is the acceptance tables' estimate (the
        # survival of a copy by match length and position, each rate one standard error below its
        # estimate: MatchAcceptance.cautious), priced on the curve: a flat curve drafts long, a steep
        # one short. `reach` adds a cap for callers that measured one (vllm.py).
        # history: docs/results/provenance.md#reach
        self.reach = reach
        self.stops = stops  # end-of-generation tokens: a free proposal is valued up to its first
        if free is None:
            free = []
        self.free: list[Drafter] = [free] if isinstance(free, Drafter) else list(free)
        if len({d.name for d in self.free}) < len(self.free):
            raise ValueError(f"free drafters need distinct names, got {[d.name for d in self.free]}")
        self.ngram = self.free[0] if self.free else None  # the first free drafter (prompt lookup)
        self.model = model_drafter
        # the draft model's forward costs: catching up on m tokens costs a forward of m rows,
        # then each further draft position one forward over the rows still drafting, each forward
        # by its passes (_draft_forward_seconds)
        self.draft_cost = CostTable.of(draft_costs) if draft_costs else None
        self.passes = passes  # the target's: a forward's passes over the weights, by row (RowModel.passes)
        self._tables(match_prior, draft_prior, shared_rate, free_width, tree_widths)
        self.overlay_weight = OVERLAY_WEIGHT if overlay_weight is None else overlay_weight
        self.explore_every = explore_every
        self.explore_growth = EXPLORE_GROWTH if explore_growth is None else explore_growth
        self._rows: dict[int, _RowState] = {}
        self.decisions: dict[str, int] = {}  # "plain" / "ngram:k" / "draft:k" -> row steps
        self._alone: dict[tuple[int, float | None, bool], float] = {}  # _alone_seconds's, this step's
        self._drafts: dict[tuple[int, float | None], float] = {}  # _draft_seconds's, this step's

    def _tables(self, match_prior, draft_prior, shared_rate, free_width: int, tree_widths: Sequence[int]) -> None:
        """The acceptance tables, each learning at the shared rate: the free drafters' by match
        length, the draft model's, its trees' siblings and its confidence cuts."""
        # each free drafter's acceptance by match length: inside a long copy its guesses keep landing.
        # The shared tables start from priors fitted on the outside suite and learn slowly across
        # requests; each request learns fast in its own overlay (Overlay)
        rate = SHARED_RATE if shared_rate is None else shared_rate
        self.match_accept = {d.name: MatchAcceptance(match_prior, rate=rate) for d in self.free}
        self.ngram_accept = (
            self.match_accept[self.ngram.name] if self.ngram else MatchAcceptance(match_prior, rate=rate)
        )
        self.model_accept = Acceptance(prior=DRAFT_PRIOR if draft_prior is None else draft_prior, rate=rate)
        self.sibling_accept = SiblingAcceptance(rate=rate)
        # the free drafters' trees: P(the target's token is on another branch | the first branch's
        # token failed where the tree branches), one rate per drafter for every width up to
        # free_width; the suffix cache's starts from prompt lookup's prior (none fitted of its own)
        self.free_width = free_width if self.ngram is not None else 1
        self.free_siblings = {d.name: SiblingAcceptance(prior=(NGRAM_SIBLING_PRIOR,), rate=rate) for d in self.free}
        self._tree_free = {d.name for d in self.free if "widths" in d.takes}
        self.tree_widths = sorted({1, *(w for w in tree_widths if w in self.sibling_accept.widths)})
        # the draft model's greedy chains, cut by its confidence where it takes cuts (ChainCut)
        self.confidence_accept = ConfidenceAcceptance(rate=rate)
        self._cuts = self.model is not None and "cuts" in self.model.takes

    def begin(self, row: int, prompt: Sequence[int], policy=None) -> None:
        self._rows[row] = _RowState(
            next_explore=self.explore_every,
            prompt_len=len(prompt),
            overlays={name: table.overlay(self.overlay_weight) for name, table in self.match_accept.items()},
            model_overlay=Overlay(1, self.overlay_weight),
        )

    def end(self, row: int) -> None:
        self._rows.pop(row, None)

    def speedups(self, row: int, tokens_per_second: float) -> tuple[float, float]:
        """(predicted, measured) speedup over plain decoding for the row's generation so far: the
        mean of each step's promise, and the tokens/s achieved over what plain steps would give."""
        state = self._rows.get(row)
        predicted = state.promised / state.steps if state and state.steps else 1.0
        return predicted, tokens_per_second * self.target_cost(1, state.depth if state else None)

    # -- the decision -------------------------------------------------------------------------

    def _value(
        self, expected: np.ndarray, draft_cost: Callable[[int], float], depth: int, width: int = 1, nodes=None
    ) -> tuple[int, float]:
        """One row alone at `depth`: argmax over k of expected[k] / (draft_cost(k) + target_cost(k
        width + 1)), or of a tree with nodes[k] nodes k deep or less."""
        best_k, best = 0, -np.inf
        for k, e in enumerate(expected.tolist()):  # the first k of the most value, as np.argmax
            fed = fed_tokens(k, width, nodes)
            value = e / (draft_cost(k) + self._alone_seconds(fed, depth, scores_tree(k, fed)))
            if value > best:
                best_k, best = k, value
        return best_k, best

    def _forward_seconds(self, fed: Mapping[int, int], depth: float | None, tree: bool = False) -> float:
        """The target's forward feeding fed[row] tokens to each row: each of its passes on the
        curve; a forward that scores trees, times the tree factor the table learned. One row's
        is _alone_seconds's (a one-row step prices the same few widths a dozen times: the
        bound's bisection, each option's k, the allocation)."""
        if len(fed) == 1:
            (n,) = fed.values()
            return self._alone_seconds(n, depth, tree)
        return self._priced(fed, depth, tree)

    def _priced(self, fed: Mapping[int, int], depth: float | None, tree: bool) -> float:
        if tree:  # a tree is scored in one forward (Engine.step)
            return sum(self.target_cost(w, depth) for w in self.passes(fed)) * self.target_cost.tree
        return split_forward(fed, self.passes, self.target_cost, depth)[1]  # the forwards Engine.step makes

    def _alone_seconds(self, n: int, depth: float | None, tree: bool = False) -> float:
        """The target's forward feeding one row n tokens (_forward_seconds; `tree`: they score a
        tree), each width and depth priced once a step: a step's options ask for the same few
        dozens of times per row, and the curve only changes between steps (observe, or a caller's
        new table): _options and observe forget them."""
        key = (n, depth, tree)
        seconds = self._alone.get(key)
        if seconds is None:
            seconds = self._alone[key] = self._priced({0: n}, depth, tree)
        return seconds

    def _draft_seconds(self, w: int, depth: float | None) -> float:
        """The draft model's forward of w rows: its curve, times the drift the target's live timing
        shows over all widths (the machine got slower or faster for both: a draft curve that stayed
        as named while the target's learned a busy machine would make the draft model look cheaper
        than it is; a CI run once drafted with it where it did not pay): the machine's factor alone.
        Not the target's drift at w: its shape there is the target's own kernels at that width,
        and at a width the target met once (a catch-up's) it is one forward's; when the drift was
        a ratio per width, a draft model priced by that moment's ratio at a quarter under its cost
        drafted where it could not pay."""
        key = (w, depth)
        if key not in self._drafts:  # priced once a step, as _alone_seconds
            self._drafts[key] = self.draft_cost(w, depth) * self.target_cost.overall
        return self._drafts[key]

    def _draft_forward_seconds(self, fed: Mapping[int, int], depth: float | None) -> float:
        """The draft model's forward feeding fed[row] tokens to each row: each of its passes over
        the rows it lends them (DraftModel.passes; one pass of their sum for a drafter without rows
        of its own, a head) on its curve."""
        # a draft model's own model says how a forward splits; a head's forward is one pass
        passes = self.model.passes if isinstance(self.model, DraftModel) else packed
        return sum(self._draft_seconds(w, depth) for w in passes(fed))

    def _model_cost(self, lag: int, depth: int) -> Callable[[int], float]:
        catch_up, one = self._draft_seconds(lag, depth), self._draft_seconds(1, depth)
        return lambda k: catch_up + (k - 1) * one if k else 0.0

    def _options(self, contexts: Mapping[int, Sequence[int]], caps: Mapping[int, int]) -> dict[int, _Option]:
        """Each row's better drafter, judged as if the row were alone (as the one-row controller
        decides), and the shadow proposal prompt lookup is scored by afterwards."""
        self._alone.clear()
        self._drafts.clear()
        options = {row: _Option("plain", np.ones(1), depth=len(contexts[row])) for row in contexts}
        reach = self._bounded_reach(contexts)
        ask = {row: min(self.k_free, caps[row], reach) for row in contexts}
        # what a step could promise each row if the bound did not cut its asks: a row the bound
        # leaves no draft could draft anything past it
        self._ceiling = {row: np.inf if ask[row] == 0 < min(self.k_free, caps[row]) else 1.0 for row in contexts}
        ask = {row: k for row, k in ask.items() if k > 0}
        asked = {r: contexts[r] for r in ask}
        proposals = {d.name: self._propose_free(d, asked, ask) if ask else {} for d in self.free}
        for row, k_cap in ask.items():
            state = self._rows[row]
            depth = len(contexts[row])
            best_value = 1.0 / self._alone_seconds(1, depth)
            state.shadow = {}
            for drafter in self.free:  # in order: an earlier one wins a tie
                proposal = proposals[drafter.name].get(row)
                if proposal is None or not proposal.tokens:
                    continue
                proposal = proposal.upto(self.stops)
                chain = proposal.first_branch()
                match = max(1, proposal.evidence.get("match", 1))
                kind = MatchAcceptance.evidence(proposal.evidence.get("votes", (1, 1)))
                state.shadow[drafter.name] = (list(chain.tokens), match, kind)
                reach = len(chain.tokens)
                longest = min(self.k_free, caps[row]) if reach >= k_cap else reach  # were it asked for more
                if self.reach is not None and not whole_copy(match, len(contexts[row]) - state.prompt_len):
                    reach = min(reach, max(1, int(self.reach * match)))  # a cap, except in a whole copy
                    longest = min(longest, max(1, int(self.reach * match)))
                expected = self.match_accept[drafter.name].expected_tokens(
                    match, reach, kind, state.overlays[drafter.name], cautious=True
                )
                if self.long_step_share and longest > reach:  # the bound cut it: what the longest could promise
                    most = np.inf  # a tree's, untold
                    if proposal.parents is None:
                        table, overlay = self.match_accept[drafter.name], state.overlays[drafter.name]
                        most = table.expected_tokens(match, longest, kind, overlay, cautious=True)[-1]
                    self._ceiling[row] = max(self._ceiling[row], most)
                shapes = [(expected, None)]
                if proposal.parents is not None:
                    overlay = state.overlays[drafter.name]
                    shapes.append(self._free_tree(drafter.name, proposal, expected, match, overlay))
                for expected, nodes in shapes:
                    self._ceiling[row] = max(self._ceiling[row], expected[-1])
                    k, value = self._value(expected, lambda k: 0.0, depth, nodes=nodes)
                    if k and value > best_value:
                        best_value = value
                        options[row] = _Option(
                            drafter.name,
                            expected,
                            proposal if nodes is not None else chain,
                            drafter=drafter,
                            depth=depth,
                            nodes=nodes,
                        )
            if self.model is not None and self.draft_cost is not None:
                lag = max(1, self.model.lag(row, contexts[row]))
                chain = self.model_accept.expected_tokens(min(k_cap, 8), state.model_overlay, cautious=True)
                shapes = {width: self.tree_expected(chain, width) for width in self.tree_widths}
                if self.long_step_share:  # what the whole chain could promise, were the bound to cut it
                    uncut = min(self.k_free, caps[row], 8)
                    full = shapes
                    if uncut > min(k_cap, 8):
                        longest = self.model_accept.expected_tokens(uncut, state.model_overlay, cautious=True)
                        full = {width: self.tree_expected(longest, width) for width in self.tree_widths}
                    self._ceiling[row] = max(self._ceiling[row], max(e[-1] for e in full.values()))
                for width, expected in shapes.items():
                    k, value = self._value(expected, self._model_cost(lag, depth), depth, width)
                    if k and value > best_value:
                        best_value = value
                        options[row] = _Option("draft", expected, lag=lag, depth=depth, width=width)
        return options

    def _bounded_reach(self, contexts: Mapping[int, Sequence[int]]) -> int:
        """The most draft tokens one row may add to a plain step of every row before the step
        passes the bound (objectives "latency" and "bounded": LATENCY_STEP plain steps), priced as
        _allocate prices a step, for the shallowest row (the cheapest to widen), on the target's
        curve alone (a draft model's forwards only add to it). No row's draft past it could be
        taken, so none is asked for or priced: under the bound each row's drafter is chosen by
        what the step can afford (a sure first guess, not a long copy it may not verify), and the
        controller does not price dozens of draft lengths a step for nothing."""
        plain = {row: 1 for row in contexts}
        depths = {row: len(context) for row, context in contexts.items()}
        cap = self._step_bound(lambda: self._forward_seconds(plain, step_depth(plain, depths)))
        if cap == np.inf:
            return self.k_free
        shallowest = min(depths, key=depths.get)

        def fits(k: int) -> bool:
            fed = {**plain, shallowest: k + 1}
            return self._forward_seconds(fed, step_depth(fed, depths)) <= cap

        # a forward's cost only grows with its width: the last k that fits, by bisection (a
        # flat curve's bound, at the widest draft, in one pricing)
        if fits(self.k_free):
            return self.k_free
        lo, hi = 0, self.k_free  # fits(lo) (a plain step, LATENCY_STEP >= 1), not fits(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo

    def _step_bound(self, plain_seconds: Callable[[], float]) -> float:
        """The most seconds a step may take: LATENCY_STEP times the rows' plain step (priced only
        when asked), or none under throughput first."""
        return np.inf if self.objective == "throughput" or self._unbounded else LATENCY_STEP * plain_seconds()

    def _long_step(self, contexts, caps, ks, value: float, plain: float):
        """A step past the bound in place of (options, ks, value), where the tail budget has credit
        for one and its draft saves LONG_STEP_SAVING plain steps of the batch: its expected tokens
        at the bounded step's pace would take that much longer than the long step does. Else
        None."""
        self._credit = min(LONG_STEP_CREDIT, self._credit + self.long_step_share)
        if self._credit < 1.0:
            return None
        # a long step of E tokens saves at most E / rows - 1 plain steps (the bounded pace is at
        # least a plain step's, and the long step costs at least one): where the asks the bound
        # left uncut cannot promise that much, it is not priced (it would cost a second pass)
        if sum(self._ceiling.get(row, np.inf) for row in contexts) < (1 + LONG_STEP_SAVING) * len(contexts):
            return None
        shadows = {row: self._rows[row].shadow for row in contexts}  # what the bounded step scores
        self._unbounded = True
        try:
            long_options = self._options(contexts, caps)
            long_ks, long_value, _ = self._allocate(long_options)
            seconds = self._step_cost(long_ks, long_options)
        finally:
            self._unbounded = False
        plain_seconds = len(ks) / plain
        if long_value * seconds / value - seconds < LONG_STEP_SAVING * plain_seconds:
            for row, shadow in shadows.items():
                self._rows[row].shadow = shadow
            return None
        self._credit -= 1.0
        self.long_steps += 1
        return long_options, long_ks, long_value

    def _propose_free(self, drafter: Drafter, contexts, ks) -> dict[int, Draft]:
        """A free drafter's proposals: trees of up to free_width branches where it drafts trees (its
        `propose` takes widths: prompt lookup, the suffix cache), else chains."""
        if self.free_width > 1 and drafter.name in self._tree_free:
            return drafter.propose(contexts, ks, {row: self.free_width for row in ks})
        return drafter.propose(contexts, ks)

    def _free_tree(
        self, name: str, tree: Draft, chain: np.ndarray, match: int, overlay: Overlay
    ) -> tuple[np.ndarray, np.ndarray]:
        """(E[k], nodes[k]) for k = 0..the first branch's length of free drafter `name`'s `tree` cut
        k deep, from its first branch's E[k] (`chain`): where the first branch's token at depth d
        fails and the tree branches there, another branch's token is the target's with the
        siblings' rate s, and the guesses below it hold as a copy's later guesses do:

            E_tree[k] = E[k] + sum over branching depths d <= k of
                        P(first d - 1 kept) (1 - a_d) s E_later(match + d, k - d)

        with a_d the first branch's rate at d and E_later the expected tokens of a chain of the
        k - d guesses that the other branch holds below its first (one branch's: the longest)."""
        depths = tree.depths()
        n = len(chain) - 1  # the first branch's length, or less where a cap on reach cut its E
        nodes = np.cumsum(np.bincount(depths, minlength=n + 1)[: n + 1]).astype(float)
        survive = _survival(chain)
        # the depth of every node that hangs off the first branch somewhere other than its first child,
        # and how deep the branch below it goes
        on_first = set(tree.first_branch_nodes())
        below: dict[int, int] = {}  # branching depth -> the deepest node of its other branches
        branch_root = {}
        for i, (p, d) in enumerate(zip(tree.parents, depths)):
            if i in on_first:
                continue
            root = i if (p == -1 or p in on_first) else branch_root[p]
            branch_root[i] = root
            below[depths[root]] = max(below.get(depths[root], 0), d)
        s = self.free_siblings[name].rate_at(2)
        table = self.match_accept[name]
        expected = chain.copy()
        for d, deepest in below.items():
            fail = survive[d - 1] - survive[d]  # reached depth d, and the first branch failed there
            later = table.expected_tokens(match + d, deepest - d, "later", overlay, cautious=True)
            for k in range(d, n + 1):
                expected[k] += fail * s * later[min(k, deepest) - d]
        return expected, nodes

    def tree_expected(self, chain: np.ndarray, width: int) -> np.ndarray:
        """E_w[k] for k = 0..len - 1 from the chain's E[k]: where the chain's token fails within the
        k, a sibling is kept with the table's rate for the width (module docstring)."""
        if width == 1:
            return chain
        survive = _survival(chain)
        return chain + self.sibling_accept.rate_at(width) * (1.0 - survive)

    def _step_cost(self, ks: Mapping[int, int], options: Mapping[int, _Option]) -> float:
        """Seconds of a step: the target's forward over every row's k + 1 tokens (a tree row's k
        width + 1, in a forward of its own where chains share the step, as the engine runs it), plus
        the draft model's catch-up forward and one forward per draft position over the rows still
        drafting, each forward by its passes, all at the step's depth (costs.step_depth)."""
        fed = {r: options[r].fed(ks[r]) for r in ks}
        depth = step_depth(fed, {r: o.depth for r, o in options.items()})
        trees = {r: n for r, n in fed.items() if options[r].tree(ks[r])}
        chains = {r: n for r, n in fed.items() if r not in trees}
        seconds = sum(self._forward_seconds(group, depth, group is trees) for group in (chains, trees) if group)
        drafting = {r: ks[r] for r, o in options.items() if o.kind == "draft" and ks[r]}
        if drafting:
            seconds += self._draft_forward_seconds({r: options[r].lag for r in drafting}, depth)
            seconds += sum(
                self._draft_forward_seconds({r: 1 for r, k in drafting.items() if k >= j}, depth)
                for j in range(2, max(drafting.values()) + 1)
            )
        return seconds

    def _allocate(self, options: Mapping[int, _Option]) -> tuple[dict[int, int], float, float]:
        """k per row, the promised speed, and that of a plain step for every row. The speed is the
        batch's tokens per second (objective "throughput"), or the geometric mean of the rows' own
        tokens per second (objective "latency": a long draft for one row slows every other row's
        stream, and the mean of logs counts that where a sum of tokens does not). Under "latency"
        and "bounded" (the batch's tokens per second) no step may cost more than LATENCY_STEP plain
        steps."""
        latency = self.objective == "latency"
        # a row's gain from its next draft token: in expected tokens, or in their log
        gain = (lambda e, k: np.log(e[k + 1] / e[k])) if latency else (lambda e, k: e[k + 1] - e[k])
        ks = {row: 0 for row in options}
        n = len(ks)

        def speed(total: float, seconds: float) -> float:  # total: the rows' expected tokens (their logs)
            return float(np.exp(total / n)) / seconds if latency else total / seconds

        total = 0.0 if latency else float(n)
        seconds = self._step_cost(ks, options)
        plain = speed(total, seconds)
        best = (dict(ks), plain)
        cap = self._step_bound(lambda: seconds)
        # every row's next draft token, by marginal gain (E and log E are concave: a row's gains only shrink)
        heap = [(-gain(o.expected, 0), row) for row, o in options.items() if len(o.expected) > 1]
        heapq.heapify(heap)
        while heap:
            g, row = heapq.heappop(heap)
            ks[row] += 1
            seconds = self._step_cost(ks, options)
            if seconds > cap:  # a longer draft only widens the step further
                ks[row] -= 1
                break
            total -= g
            value = speed(total, seconds)
            if value > best[1]:
                best = (dict(ks), value)
            e, k = options[row].expected, ks[row]
            if k + 1 < len(e):
                heapq.heappush(heap, (-gain(e, k), row))
        # a speculative step need only promise more than a plain one: the drafters' rates it is
        # priced on are already taken one standard error low (acceptance.cautious_rates), which is
        # the error a fixed margin stood in for (docs/results/provenance.md#margin-replaced-by-the-estimates-error)
        if best[1] <= plain:
            return {row: 0 for row in options}, plain, plain
        return best[0], best[1], plain

    def draft(
        self,
        contexts: Mapping[int, Sequence[int]],
        caps: Mapping[int, int],
        leaves: Mapping[int, int] | None = None,
    ) -> dict[int, tuple[Drafter | None, Draft | None]]:
        options = self._options(contexts, caps)
        ks, value, plain = self._allocate(options)
        if self.long_step_share:
            long = self._long_step(contexts, caps, ks, value, plain)
            if long is not None:
                options, ks, value = long
        probes: set[int] = set()
        for row in contexts:
            state = self._rows[row]
            state.steps += 1
            state.depth = len(contexts[row])
            state.promised += value / plain
            # Explore the draft model now and then, but only where a perfect draft would win by a
            # margin: otherwise no acceptance estimate, however stale, could make it worth its cost.
            if (
                self.model is not None
                and self.draft_cost is not None
                and caps[row] > 0
                and options[row].kind != "draft"
                and state.steps >= state.next_explore
            ):
                # each probe of a request waits longer than the last (explore_growth): a probe costs
                # a catch-up forward of the draft model and a wider target step, and a request whose
                # probes keep failing should not pay that every explore_every steps
                state.explore_gap = (state.explore_gap or self.explore_every) * self.explore_growth
                state.next_explore = state.steps + state.explore_gap
                lag = max(1, self.model.lag(row, contexts[row]))
                k_model = min(caps[row], K_MAX, 8)
                k_opt, optimistic = self._value(
                    np.arange(1.0, k_model + 2), self._model_cost(lag, state.depth), state.depth
                )
                current = options[row].expected[ks[row]] / self._forward_seconds({row: ks[row] + 1}, state.depth)
                if k_opt and optimistic > 1.1 * current:
                    options[row] = _Option("draft", np.ones(2), lag=lag, depth=state.depth)
                    ks[row] = 1
                    probes.add(row)  # one token, uncut: what the probe is for
        plan: dict[int, tuple[Drafter | None, Draft | None]] = {}
        model_ks, widths = {}, {}
        for row, k in ks.items():
            kind = options[row].kind if k else "plain"
            key = "plain" if kind == "plain" else f"{kind}:{k}"
            if kind == "draft" and options[row].width > 1:
                key += f"x{options[row].width}"
                widths[row] = options[row].width
            if options[row].drafter is not None and kind != "plain":  # a free drafter's
                draft = options[row].proposal.to_depth(k)
                if draft.parents is not None:  # a tree: its depth x its branches (its leaves)
                    key += f"x{draft.leaves()}"
                plan[row] = (options[row].drafter, Draft(draft.tokens, parents=draft.parents))
            elif kind == "draft":
                model_ks[row] = k
            else:
                plan[row] = (None, None)
            self.decisions[key] = self.decisions.get(key, 0) + 1
        if model_ks:
            asked = {row: contexts[row] for row in model_ks}
            cuts = self._chain_cuts(model_ks, widths, probes, options) if self._cuts else {}
            for row in cuts:  # a cut chain may run deeper than planned where a step may (CUT_DEPTH)
                if self.objective == "throughput":
                    model_ks[row] = max(model_ks[row], min(caps[row], CUT_DEPTH))
            kwargs = {"cuts": cuts} if cuts else {}
            if leaves:  # (none: no row's tree is bounded)
                kwargs["leaves"] = leaves
            drafts = (
                self.model.propose(asked, model_ks, widths, **kwargs)
                if widths or cuts
                else self.model.propose(asked, model_ks, **kwargs)
            )
            plan.update({row: (self.model, drafts[row]) for row in model_ks})
        return plan

    def _chain_cuts(self, model_ks, widths, probes, options) -> dict[int, ChainCut]:
        """A ChainCut for each row the draft model drafts for (its chain, or its fishbone's, but for
        a probe), priced at the row's depth as _options prices it alone."""
        cuts = {}
        for row in model_ks:
            if row in probes:
                continue
            depth, width = options[row].depth, widths.get(row, 1)

            def verify(t: int, depth=depth, width=width) -> float:  # the target's forward of t depths
                return self._alone_seconds(t * width + 1, depth, scores_tree(t, t * width + 1))

            cuts[row] = ChainCut(
                self.confidence_accept.rate_of,
                self._draft_seconds(max(1, options[row].lag), depth),
                self._draft_seconds(1, depth),
                verify,
                self.sibling_accept.rate_at(width),
            )
        return cuts

    # -- learning -----------------------------------------------------------------------------

    def observe(
        self, outcomes: Mapping[int, Outcome], passes: Sequence[int], target_seconds: float, depth: float | None = None
    ) -> None:
        tree = any(
            out.draft is not None and out.draft.parents is not None and out.draft.tokens for out in outcomes.values()
        )
        self.target_cost.observe(passes, target_seconds, depth, tree)
        self._alone.clear()  # priced on the curve before this forward taught it
        self._drafts.clear()
        for row, out in outcomes.items():
            state = self._rows.get(row)
            if state is not None:
                self._observe_row(state, out)

    def _observe_row(self, state: _RowState, out: Outcome) -> None:
        n_drafted = len(out.draft.tokens) if out.draft is not None else 0
        if out.drafter is self.model and out.drafter is not None:
            # The draft model's guesses at the tokens it caught up on (the steps it sat out): each
            # is the first guess a draft from there would have made, scored for the price of their
            # logits; else its estimate would learn only while it drafts, and one lowered by a few
            # misses would keep it out (a probe then scores one guess, not the dozens it skipped).
            for right in out.draft.evidence.get("caught_up", ()):
                self.model_accept.observe(1, int(right), state.model_overlay)
            kept = out.n_accepted  # the chain's tokens the target kept
            if out.draft.parents is not None and n_drafted:  # a tree: its chain, and a sibling where it failed
                chain = out.draft.first_branch().tokens
                kept = agreement(chain, out.emitted)[1]
                self.model_accept.observe(len(chain), kept, state.model_overlay)
                if kept < len(chain):
                    self.sibling_accept.observe(n_drafted // len(chain), out.n_accepted > kept)
            elif n_drafted:
                self.model_accept.observe(n_drafted, out.n_accepted, state.model_overlay)
            if "confidence" in out.draft.evidence:  # a cut chain: its guesses' rates by confidence
                self.confidence_accept.observe(out.draft.evidence["confidence"], kept)
        elif out.draft is not None and out.draft.parents is not None and n_drafted:  # a free drafter's tree
            self._observe_free_tree(out)
        if n_drafted:
            state.tracker = {}  # the draft's own outcome covers the positions after it
        else:
            for name in list(state.tracker):
                self._follow(state, name, out.emitted)
        for name, (tokens, match, kind) in state.shadow.items():
            # A free drafter costs nothing to check after the fact: score its proposal against
            # what the target emitted, whether or not it was used, so its estimate never goes stale.
            checked, matched = agreement(tokens, out.emitted)
            self.match_accept[name].observe(match, checked, matched, kind, state.overlays[name])
            if not n_drafted and name not in state.tracker and matched == checked == 1 and len(tokens) > 1:
                # A plain step only reveals the first guess. Follow the rest of the proposal over
                # the next steps, or guesses past the first would only ever be scored while
                # drafting, and an estimate lowered by bad luck could never recover.
                state.tracker[name] = (tokens, match, 1)
        state.shadow = {}

    def _observe_free_tree(self, out: Outcome) -> None:
        """Where a free drafter's tree's first branch failed at a depth where the tree branches,
        whether the target kept another branch's token there (that drafter's siblings' rate)."""
        tree = out.draft
        chain = tree.first_branch_nodes()
        kept = agreement([tree.tokens[i] for i in chain], out.emitted)[1]
        if kept < len(chain) and tree.siblings_of(chain[kept]):
            self.free_siblings[out.drafter.name].observe(2, out.n_accepted > kept)

    def _follow(self, state: _RowState, name: str, emitted: Sequence[int]) -> None:
        tokens, match, i = state.tracker.pop(name)
        for token in emitted:
            if i >= len(tokens):
                return
            right = tokens[i] == token
            self.match_accept[name].observe(match + i, 1, int(right), kind="later", overlay=state.overlays[name])
            i += 1
            if not right:
                return
        if i < len(tokens):
            state.tracker[name] = (tokens, match, i)
