"""Replays drafting policies offline against recorded greedy outputs.

Under greedy decoding a draft token is accepted exactly when it equals the target's own next token,
so once the target's plain output for a prompt is known, any prompt-lookup policy can be replayed
without the model: what it would have drafted, what the target would have kept, and what the step
would have cost on a measured cost curve (seconds of a forward of 1..W tokens; the longest draft
replayed is W - 1 tokens, as `auto` drafts up to the widest forward it timed). That makes policy
changes measurable in seconds instead of a 40-minute benchmark, and gives two ceilings:

- `oracle_speedup`: a policy that knows in advance how many of prompt lookup's guesses will be
  accepted and drafts exactly those (the best any controller could do with this drafter);
- `copy_ceiling`: the same, drafting from whichever earlier occurrence of the last token continues
  furthest into the real output (the best any prompt-lookup drafter could do).

A recording may also hold a draft model's greedy agreement with the target at every position
(`draft_agrees`, scripts/replay_controller.py record): under greedy decoding an accepted draft
token is the target's own token, so the draft's next guess sees the true context, and the draft
of k tokens from position i keeps the run of agreements starting at i, up to k. `RecordedDrafter`
replays such a draft model for the controllers (fixed draft:K and `auto`), and `draft_ceiling` is
a clairvoyant controller over it. The draft model's costs come from its own curve: a catch-up
forward of the tokens it has not seen, then one forward per further draft token. With the rank of
the target's token among the draft's candidates at every position as well (`draft_ranks`), the
draft model's greedy fishbone trees (draft:KxW) replay exactly too (`tree_run`, `fixed_tree`).

Costs are a curve at one depth (a list of seconds for 1..W tokens) or a `CostTable` with a deep
curve (costs.cost_table): then every step is priced at its own depth, the prompt plus what was
generated before it, as the engine prices it for the controller. Python's own time per step (well
under 1% here) and noise are left out.
"""

from __future__ import annotations

import copy
from typing import Callable, Mapping, Sequence

from specdec.acceptance import K_MAX, MATCH_BUCKETS, MatchAcceptance, agreement
from specdec.controller import Outcome
from specdec.costs import CostTable
from specdec.drafters.base import Declared, Draft
from specdec.drafters.model import CATCH_UP_MIN, CATCH_UP_SCORED, Levels, confidence, shaping_probs
from specdec.drafters.ngram import NgramDrafter


def curve_at(costs, depth: int) -> list[float]:
    """Seconds of a forward of 1..W tokens at `depth`: a list is a curve at one depth, the same at
    every depth; a CostTable is read at `depth` as the controller reads it."""
    table = CostTable.of(costs)
    return [table.at_depth(w, depth) for w in range(1, table.widths[-1] + 1)]


def _curves(costs, prompt_len: int, n: int) -> list[list[float]]:
    """curve_at for each of n output positions: position i is decoded at depth prompt_len + i."""
    return [curve_at(costs, prompt_len + i) for i in range(n)]


def _plain_time(curves: Sequence[Sequence[float]]) -> float:
    """Seconds of plain decoding: one one-token forward per position."""
    return sum(c[0] for c in curves)


def _best_time(lengths: Sequence[int], curves: Sequence[Sequence[float]]) -> float:
    """Least total seconds to emit len(lengths) tokens when at position i a draft of up to
    lengths[i] tokens would be accepted whole and a step of k tokens costs curves[i][k]."""
    return _best_time_of([(lengths, curves)], len(lengths))


def _tree_accepted(draft: Draft, output: Sequence[int], pos: int) -> int:
    """How many of a tree draft's nodes the target keeps at `pos`: greedy, down into the child
    that holds the output's token, while there is one."""
    node, kept = -1, 0
    while pos + kept < len(output):
        token = output[pos + kept]
        node = next((i for i, p in enumerate(draft.parents) if p == node and draft.tokens[i] == token), None)
        if node is None:
            break
        kept += 1
    return kept


def _accepted(proposal: Sequence[int], output: Sequence[int], pos: int) -> int:
    """How many of `proposal`'s tokens the target keeps at `pos`: the prefix `output` agrees with."""
    return agreement(proposal, output[pos : pos + len(proposal)])[1]


def oracle_speedup(
    prompt: Sequence[int], output: Sequence[int], costs: Sequence[float], drafter: NgramDrafter | None = None
) -> float:
    """Speedup over plain decoding of a clairvoyant controller over `drafter`'s proposals."""
    curves = _curves(costs, len(prompt), len(output))
    lengths = _lookup_lengths(prompt, output, len(curves[0]) - 1, drafter or NgramDrafter())
    return _plain_time(curves) / _best_time(lengths, curves)


def _lookup_lengths(prompt: Sequence[int], output: Sequence[int], k_max: int, drafter: NgramDrafter) -> list[int]:
    """At every position of the recorded output, how many tokens of `drafter`'s k_max-token
    proposal from the true context the target would keep."""
    context, lengths = list(prompt), []
    for pos in range(len(output)):
        lengths.append(_accepted(drafter.propose({0: context}, {0: k_max})[0].tokens, output, pos))
        context.append(output[pos])
    return lengths


def copy_ceiling(prompt: Sequence[int], output: Sequence[int], costs: Sequence[float]) -> float:
    """Speedup of a clairvoyant controller that copies from the best earlier occurrence of the
    last token each step (no drafter that guesses from the context can do better)."""
    seq = list(prompt) + list(output)
    curves = _curves(costs, len(prompt), len(output))
    start, k_max = len(prompt), len(curves[0]) - 1
    lengths = []
    for pos in range(len(output)):
        end = start + pos  # the context is seq[:end]
        last = seq[end - 1]
        best = 0
        for j in range(1, end):
            if seq[j - 1] == last:
                best = max(best, _accepted(seq[j : min(end, j + k_max)], output, pos))
                if best >= k_max:
                    break
        lengths.append(best)
    return _plain_time(curves) / _best_time(lengths, curves)


class ReplayPolicy:
    """A peer's policy as a replay controller: nothing to set up per row; what it learns, if
    anything, it learns in observe."""

    def begin(self, row, prompt, policy=None):
        pass

    def end(self, row):
        pass

    def observe(self, outcomes, passes, target_seconds, depth=None):
        pass


class LongMatchController(ReplayPolicy):
    """llama.cpp's ngram-mod, replayed through our lookup: it drafts k tokens only when the last
    `n_match` tokens (24 by default there) occurred before, i.e. only inside a verbatim copy, and
    never otherwise. No acceptance model, no margin: it bets that a 24-token copy goes on."""

    def __init__(self, drafter: NgramDrafter, k: int, n_match: int = 24):
        self.drafter, self.k, self.n_match = drafter, k, n_match

    def draft(self, contexts, caps, leaves=None):
        plan = {}
        for row, context in contexts.items():
            k = min(self.k, caps[row])
            draft = self.drafter.propose({row: context}, {row: k})[row] if k else Draft([])
            long = draft.tokens and draft.evidence.get("match", 0) >= self.n_match
            plan[row] = (self.drafter, draft) if long else (None, None)
        return plan


class AdaptiveKController(ReplayPolicy):
    """vLLM's adaptive K, replayed: from the per-position acceptance averages a_i of its drafter's
    steps so far (a_i: the share of drafts that reached position i and had it kept), each step
    drafts the K in 1..k_max that maximises (1 + a_1 + ... + a_K) / (K c + 1), c the drafter's cost
    per token in target steps. It reads no cost curve: a target step is priced the same at any
    width. Before any evidence a_i = 1 (it starts at k_max)."""

    def __init__(self, drafter, k_max: int, c: float):
        self.drafter, self.k_max, self.c = drafter, k_max, c
        self.drafted = [0] * k_max  # [position] drafts that reached it
        self.kept = [0] * k_max  # [position] of those, kept

    def choose(self) -> int:
        best, best_k, expected, rate = -1.0, 1, 1.0, 1.0
        for k in range(1, self.k_max + 1):
            rate = self.kept[k - 1] / self.drafted[k - 1] if self.drafted[k - 1] else rate
            expected += rate
            value = expected / (k * self.c + 1)
            if value > best:
                best, best_k = value, k
        return best_k

    def draft(self, contexts, caps, leaves=None):
        plan = {}
        for row, context in contexts.items():
            k = min(self.choose(), caps[row])
            draft = self.drafter.propose({row: context}, {row: k})[row] if k else Draft([])
            plan[row] = (self.drafter, draft) if draft.tokens else (None, None)
        return plan

    def observe(self, outcomes, passes, target_seconds, depth=None):
        for outcome in outcomes.values():
            if outcome.draft is None:
                continue
            for i in range(len(outcome.draft.tokens)):
                self.drafted[i] += 1
                self.kept[i] += i < outcome.n_accepted


class ConfidenceController(ReplayPolicy):
    """llama.cpp's draft model policy (draft-simple), replayed: every step the draft model catches
    up on the context and drafts greedily while its own token's probability is at least p_min, at
    most n_max (`--spec-draft-p-min 0.75 --spec-draft-n-max 16`: its defaults through 2025; the
    build here defaults to p_min 0 and 3 tokens, which is fixed draft:3, among the fixed methods);
    a step whose first guess falls short drafts nothing, the draft model's catch-up forward paid
    all the same. Its forwards are counted as llama.cpp runs them: the catch-up, then one per
    drafted token, except after the n_max-th. The recorded
    confidences are teacher-forced: exact up to the draft's first miss (until then its context is
    the target's), the target's context's beyond it, where only where it stops (the wasted tokens'
    cost) depends on them."""

    def __init__(self, recorded: "RecordedDrafter", p_min: float = 0.75, n_max: int = 16):
        self.recorded, self.p_min, self.n_max = recorded, p_min, n_max

    def draft(self, contexts, caps, leaves=None):
        plan = {}
        for row, context in contexts.items():
            state = self.recorded._rows[row]
            pos, probs = len(context) - state["start"], state["p"]
            cap = min(self.n_max, caps[row], len(probs) - pos)
            k = 0
            while k < cap and probs[pos + k] >= self.p_min:
                k += 1
            catch_up = max(1, len(context) - state["fed"])
            draft = self.recorded.propose({row: context}, {row: k})[row]
            if k == 0:  # it looked and stopped: the catch-up forward, and all of the context fed
                state["fed"] = state["base"] = len(context)
            # a stop below p_min read one more forward's logits than n_max's stop does
            self.recorded.last_cost_rows = (catch_up, k + 1 if k < self.n_max else k)
            plan[row] = (self.recorded, draft)
        return plan


# Every fixed method the verdict tries ("best fixed method"), and the peers' policies.
FIXED_NGRAM_K = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48)
FIXED_DRAFT_K = tuple(range(1, 9))
# prompt lookup's fixed trees: its continuations of 2-4 earlier occurrences (ngram:KxW, drafters.ngram)
NGRAM_WIDTHS = (2, 3, 4)


def recorded_draft(records: Sequence[Mapping], draft_costs) -> tuple[bool, bool]:
    """(whether the draft model replays: its curve is given and every record holds its agreement,
    whether its trees do too: every record also holds its ranks)."""
    with_draft = draft_costs is not None and all("draft_agrees" in r for r in records)
    return with_draft, with_draft and all("draft_ranks" in r for r in records)


def peer_policies(recorded: "RecordedDrafter | None", costs, draft_costs, confidences: bool = False) -> dict:
    """The policies of the tools people use instead, as replay controllers (fresh ones):
    llama.cpp's ngram-simple (a 12-token match, up to 48 drafted) and ngram-mod (only inside a
    24-token match, 8 drafted), vLLM's adaptive K over prompt lookup (k_max 8, its drafts costing
    nothing) and over the draft model (k_max 8, c its one-token forward over the target's), and
    where the recording holds the draft's confidences llama.cpp's draft model policy with a
    confidence stop (p_min 0.75, up to 16: ConfidenceController)."""
    peers = {
        "llama.cpp ngram-simple (12, 48)": LongMatchController(NgramDrafter(match_cap=64), 48, n_match=12),
        "llama.cpp ngram-mod (24, 8)": LongMatchController(NgramDrafter(match_cap=64), 8, n_match=24),
        "vLLM adaptive K, ngram (8)": AdaptiveKController(NgramDrafter(), 8, 0.0),
    }
    if recorded is not None and draft_costs is not None:
        c = curve_at(draft_costs, 128)[0] / curve_at(costs, 128)[0]
        peers["vLLM adaptive K, draft (8)"] = AdaptiveKController(recorded, 8, c)
        if confidences:
            peers["llama.cpp draft (p 0.75, 16)"] = ConfidenceController(recorded)
    return peers


def paired_ratio(ours: Sequence[float], theirs: Sequence[float]) -> float:
    """One method against another on the same prompts: the median over the prompts of the first's
    speedup over the second's on each (two medians taken apart can fall on different prompts)."""
    import statistics

    return statistics.median(a / b for a, b in zip(ours, theirs, strict=True))


def policy_runs(
    records: Sequence[Mapping], costs, draft_costs=None, stops: frozenset[int] = frozenset(), tree_cost: float = 1.0
) -> dict[str, dict[str, list[float]]]:
    """category -> method -> its speedup on each of the category's prompts (in the recording's
    order), for every fixed method (ngram:K and prompt lookup's trees ngram:KxW of 2-4 branches,
    draft:K when the draft model is recorded, and its trees draft:KxW of auto's widths when its
    ranks are: fixed_tree) and every peer policy (peer_policies, named "peer ...": each one
    controller per category, learning across its prompts as auto does)."""
    from specdec.controller import TREE_WIDTHS, FixedController

    with_draft, trees = recorded_draft(records, draft_costs)
    out = {}
    for category in dict.fromkeys(r["category"] for r in records):
        test = [r for r in records if r["category"] == category]
        recorded = RecordedDrafter.of(test) if with_draft else None
        policies = {f"ngram:{k}": FixedController(NgramDrafter(), k) for k in FIXED_NGRAM_K}
        policies.update(
            {f"ngram:{k}x{w}": FixedController(NgramDrafter(width=w), k) for k in FIXED_NGRAM_K for w in NGRAM_WIDTHS}
        )
        if with_draft:
            policies.update({f"draft:{k}": FixedController(recorded, k) for k in FIXED_DRAFT_K})
        confident = with_draft and all("draft_p" in r for r in test)
        peers = peer_policies(recorded, costs, draft_costs, confident)
        policies.update({f"peer {name}": c for name, c in peers.items()})
        out[category] = {
            name: [
                replay_speedup(r["prompt"], r["output"], costs, controller, recorded, draft_costs, stops, tree_cost)[0]
                for r in test
            ]
            for name, controller in policies.items()
        }
        for k in FIXED_DRAFT_K if trees else ():
            for width in TREE_WIDTHS[1:]:
                out[category][f"draft:{k}x{width}"] = [
                    fixed_tree(r, costs, draft_costs, k, width, tree_cost)[0] for r in test
                ]
    return out


def verdict(
    records: Sequence[Mapping], costs, draft_costs=None, stops: frozenset[int] = frozenset(), tree_cost: float = 1.0
) -> dict[str, dict]:
    """The bars of `auto` per category, deterministic: leave-one-category-out auto against the
    clairvoyant, the best fixed method and the best peer policy (the best by its median speedup
    over the category's prompts), each compared prompt by prompt: the median over the prompts of
    auto's speedup over the other's on the same prompt (>= 0.9 for the clairvoyant, >= 0.97 for
    the other two). category -> {"auto", "clairvoyant", "ratio", "best fixed": (name, speedup),
    "best peer": (name, speedup), "vs fixed", "vs peer": auto over them, paired; "holds": {bar: bool}}.
    why paired: two medians taken over a category's prompts can fall on different prompts; on the
    dev suite's code on the H100 7B curve auto is ahead of fixed ngram:48x2 on 5 of 8 prompts (its
    median of per-prompt ratios 1.02) while its median speedup is 0.86 of ngram:48x2's."""
    import statistics

    loo = leave_one_category_out(records, costs, draft_costs, stops, tree_cost)
    runs = policy_runs(records, costs, draft_costs, stops, tree_cost)
    out = {}
    for category, r in loo.items():
        medians = {name: statistics.median(v) for name, v in runs[category].items()}
        fixed = max(((n, v) for n, v in medians.items() if not n.startswith("peer ")), key=lambda x: x[1])
        peer = max(((n, v) for n, v in medians.items() if n.startswith("peer ")), key=lambda x: x[1])
        vs_fixed, vs_peer = (paired_ratio(r["speedups"], runs[category][name]) for name in (fixed[0], peer[0]))
        out[category] = {
            **r,
            "best fixed": fixed,
            "best peer": (peer[0][5:], peer[1]),
            "vs fixed": vs_fixed,
            "vs peer": vs_peer,
            "holds": {
                "0.9 clairvoyant": r["ratio"] >= 0.9,
                "best fixed - 3%": vs_fixed >= 0.97,
                "best peer - 3%": vs_peer >= 0.97,
            },
        }
    return out


# A rank string holds one character a position: the rank of the target's token among the draft
# model's candidates there, 0-8, and "9" for the tenth or lower.
# why: a tree of this module's fishbones has at most 9 candidates a depth; a digit keeps the
# recording one short string a prompt, like the agreement string it extends
RANK_CAP = 9


def draft_ranks(logits, output: Sequence[int]) -> str:
    """The rank of each output token among the draft's logits at its position (logits [n, vocab],
    row i the draft's guess at output[i], teacher-forced): 0 is its greedy guess. Ties go by id,
    as argmax and a tree's greedy siblings (drafters.model.siblings) break them."""
    import numpy as np

    out = []
    for row, token in zip(np.asarray(logits), output):
        above = int(np.count_nonzero(row > row[token])) + int(np.count_nonzero(row[:token] == row[token]))
        out.append(str(min(above, RANK_CAP)))
    return "".join(out)


def draft_confidences(logits) -> list[float]:
    """The draft model's confidence in its greedy token at each position (logits [n, vocab],
    teacher-forced; drafters.model.confidence: its share of the draft's 10 best candidates, as
    llama.cpp's draft sampler reads it), floored to 3 decimals (so p >= 0.75 reads as the unrounded
    p does, within the softmax's own rounding): what a confidence rule stops on (llama.cpp's p_min,
    ConfidenceController; auto's chains, controller.ChainCut)."""
    import numpy as np

    return [float(np.floor(confidence(row) * 1000 + 1e-6) / 1000) for row in np.asarray(logits)]


# A recording's "draft_top" holds, at each position, the draft model's probabilities of its
# TOP_WIDTH best candidates (its whole softmax, best first; ties by id), teacher-forced as its ranks.
# why: what a greedy tree shaped by path probability (drafters.model.Levels: the shaped fishbone
# priced as draft:KxW/N) keeps depends on them; 4 is the widest tree auto drafts (controller.TREE_WIDTHS)
TOP_WIDTH = 4


def draft_tops(logits, width: int = TOP_WIDTH) -> list[list[float]]:
    """The draft's probabilities of its `width` best candidates at each position (logits [n, vocab],
    teacher-forced), best first, to 4 significant digits: the greedy shaping probability of each
    candidate of a tree's depth (drafters.model.shaping_probs)."""
    import numpy as np

    out = []
    for row in np.asarray(logits):
        best = np.argpartition(-row, width)[:width] if len(row) > width else np.arange(len(row))
        best = sorted((int(i) for i in best), key=lambda i: (-row[i], i))  # ties by id, as the siblings
        out.append([float(f"{p:.4g}") for p in shaping_probs(row, None, best)])
    return out


def reconcile_ranks(ranks: str, agrees: str) -> tuple[str, int]:
    """(ranks, positions changed): ranks taken on another machine than the agreement string they
    extend, made to agree with it. Where the two machines' kernels part at a rounding tie between
    the draft's two best candidates, one machine's rank 0 is the other's rank 1: such a position
    takes the recorded agreement's side (rank 0 where it agreed, else 1)."""
    out, changed = list(ranks), 0
    for i, (rank, agreed) in enumerate(zip(ranks, agrees)):
        if (rank == "0") != (agreed == "1"):
            out[i] = "0" if agreed == "1" else "1"
            changed += 1
    return "".join(out), changed


def tree_run(ranks: str, pos: int, k: int, width: int) -> int:
    """Draft tokens the target keeps of a greedy fishbone tree from position `pos` (draft:KxW: the
    draft model's chain of k tokens, and beside the chain's node at each depth its next width - 1
    candidates as leaves): the run of greedy guesses the target keeps, then one more where the
    target's token at the first miss is one of that depth's other candidates. Exact: while the
    chain holds, its context is the target's, where the ranks were taken. Width 1 is the chain."""
    if not 1 <= width <= RANK_CAP:
        raise ValueError(f"a recorded rank tells widths 1..{RANK_CAP}, not {width}")
    n = 0
    while n < k and pos + n < len(ranks) and ranks[pos + n] == "0":
        n += 1
    if n < k and pos + n < len(ranks) and int(ranks[pos + n]) < width:
        n += 1
    return n


# Where a shaped tree's draft ran past its first miss, the probabilities it shapes by there are
# the draft's on its own (wrong) path, which a teacher-forced recording does not hold: "recorded"
# takes the recorded ones (the draft's on the target's path, an estimate), "sure" every chain token
# certain there (its deeper nodes crowd out the siblings at and above the miss: fewest kept),
# "unsure" every candidate impossible there (no node past the miss competes: most kept).
PAST_MISS = ("recorded", "sure", "unsure")


def shaped_run(
    ranks: str, tops: Sequence[Sequence[float]], pos: int, k: int, width: int, nodes: int, past_miss: str = "recorded"
) -> tuple[int, int, bool, int]:
    """(draft tokens the target keeps, nodes fed, whether it is a tree, depths drafted) of a greedy
    tree of the `nodes` most probable paths among the draft model's k deep x width candidates from
    position `pos` (priced as draft:KxW/N), built as drafters.model.Levels builds it (the early
    exit's tree, and the draft model's until 2026-11-30: it now grows its branches on, which a
    recording does not hold): depth by depth until it is settled or k deep, then the most probable
    paths, siblings as leaves under the chain's node;
    kept as tree_run keeps a fishbone's (the chain while it holds, then the target's token where it
    is one of that depth's kept siblings). Exact up to the draft's first miss; past it `past_miss`
    (PAST_MISS) stands in for what the recording does not hold."""
    if past_miss not in PAST_MISS:
        raise ValueError(f"past_miss must be one of {', '.join(PAST_MISS)}, got {past_miss!r}")
    miss = tree_run(ranks, pos, k, 1)  # the chain's run: its first miss's depth (or k)
    levels = Levels(width, nodes)
    for d in range(k):
        at = pos + d
        probs = list(tops[at][:width]) if at < len(tops) else []
        probs += [0.0] * (width - len(probs))
        if d > miss and past_miss != "recorded":
            probs = [1.0] + [0.0] * (width - 1) if past_miss == "sure" else [0.0] * width
        levels.extend(list(range(width)), probs)
        if levels.settled():
            break
    chosen = levels.shape()
    depth = next((d for d, n in enumerate(chosen) if n == 0), len(chosen))  # the tree's depth
    kept = min(miss, depth)  # the chain's tokens, while they hold
    if kept == miss < depth and pos + kept < len(ranks) and 0 < int(ranks[pos + kept]) < chosen[kept]:
        kept += 1  # the target's token is a kept sibling at the first miss
    return kept, sum(chosen[:depth]), max(chosen[:depth], default=0) > 1, len(levels.levels)


def draft_run(agrees: str, pos: int, k: int) -> int:
    """Draft tokens the target keeps of a k-token greedy draft from position `pos`: the run of
    agreements ('1') that starts there, at most k."""
    n = 0
    while n < k and pos + n < len(agrees) and agrees[pos + n] == "1":
        n += 1
    return n


class RecordedDrafter(Declared):
    """A draft model replayed from recordings (prompt -> (the target's output, the draft's
    agreement string[, its ranks])): it proposes what the real one would have under greedy
    decoding, the target's tokens for the run of agreements and then a token the target rejects,
    and keeps the draft model's cache bookkeeping (ModelDrafter's) so that `lag` and the costs are
    the real ones. With ranks it drafts fishbone trees as ModelDrafter does (`widths`): at the
    first miss the target's token stands among the siblings where its rank puts it."""

    takes = frozenset({"widths", "cuts"})  # propose's keywords beyond (contexts, ks, leaves): Drafter.takes

    def __init__(self, recordings: Mapping[tuple[int, ...], tuple], vocab_size: int = 1 << 20):
        self.name = "draft:recorded"
        self.vocab_size = vocab_size
        self._recordings = {tuple(p): r for p, r in recordings.items()}
        self._rows: dict[int, dict] = {}
        self.last_cost_rows: tuple[int, int] = (0, 0)  # (catch-up tokens, draft tokens) of the last proposal

    @classmethod
    def of(cls, records: Sequence[Mapping]) -> "RecordedDrafter":
        """From recording lines: their outputs, agreement and (where held) ranks and confidences."""
        return cls(
            {
                tuple(r["prompt"]): (r["output"], r["draft_agrees"], r.get("draft_ranks"), r.get("draft_p"))
                for r in records
            }
        )

    def begin(self, row: int, prompt: Sequence[int], params=None, rng=None) -> None:
        output, agrees, *rest = self._recordings[tuple(prompt)]
        self._rows[row] = {
            "start": len(prompt),
            "output": output,
            "agrees": agrees,
            "ranks": rest[0] if rest else None,
            "p": rest[1] if len(rest) > 1 else None,
            "fed": 0,
            "base": 0,
            "drafted": 0,
            "chain_run": 0,  # the last draft's chain tokens the target kept
        }

    def end(self, rows: Sequence[int]) -> None:
        for row in rows:
            self._rows.pop(row, None)

    def lag(self, row: int, context: Sequence[int]) -> int:
        return len(context) - self._rows[row]["fed"]

    def propose(
        self,
        contexts: Mapping[int, Sequence[int]],
        ks: Mapping[int, int],
        widths: Mapping[int, int] | None = None,
        cuts: Mapping[int, object] | None = None,
        leaves: Mapping[int, int] | None = None,
    ) -> dict[int, Draft]:
        drafts = {}
        for row, k in ks.items():
            state, context = self._rows[row], contexts[row]
            pos = len(context) - state["start"]
            cut = (cuts or {}).get(row) if state["p"] is not None else None
            sure = self._cut(cut, state["p"], pos, k) if cut is not None else None
            asked, k = k, (len(sure) if sure is not None else k)
            n = draft_run(state["agrees"], pos, k)
            tokens = list(state["output"][pos : pos + n])
            if n < k:  # the first guess the target rejects; what follows it is never looked at
                right = state["output"][pos + n] if pos + n < len(state["output"]) else 0
                tokens += [(right + 1) % self.vocab_size] * (k - n)
            width = (widths or {}).get(row, 1)
            tree = self._fishbone(state, pos, tokens, n, width) if width > 1 and k else None
            # its guesses at the generated tokens it catches up on (ModelDrafter's "caught_up")
            first = max(0, state["fed"] + 1 - state["start"], pos - CATCH_UP_SCORED)
            sat_out = asked and len(context) - state["fed"] > CATCH_UP_MIN
            caught_up = [a == "1" for a in state["agrees"][first:pos]] if sat_out else []
            lag = max(1, len(context) - state["fed"])
            if sure is not None:  # the catch-up told the first confidence; each fed token the next
                fed, self.last_cost_rows = cut.fed, (lag, cut.fed + 1)
            else:  # the catch-up, then each draft token but the last
                fed, self.last_cost_rows = max(k - 1, 0), (lag if k else 0, k)
            state["base"], state["drafted"] = len(context), k
            state["fed"] = len(context) + fed if k or sure is not None else state["fed"]
            state["chain_run"] = n
            evidence = {"caught_up": caught_up} if caught_up else {}
            if sure is not None:
                evidence["confidence"] = sure
            drafts[row] = (
                Draft(tree[0], evidence=evidence, parents=tree[1]) if tree else Draft(tokens, evidence=evidence)
            )
        return drafts

    @staticmethod
    def _cut(cut, probs: Sequence[float], pos: int, k: int) -> list[float]:
        """The confidences of the tokens a chain cut by `cut` (controller.ChainCut) takes from `pos`,
        at most k, asked as ModelDrafter.propose asks it: take each, and feed it while another may
        follow. Recorded teacher-forced: exact up to the draft's first miss (its context is the
        target's until then), the target's context's beyond it, where only the wasted tokens'
        number depends on them."""
        sure: list[float] = []
        while len(sure) < k and pos + len(sure) < len(probs):
            p = probs[pos + len(sure)]
            if not cut.take(p):
                break
            sure.append(p)
            if len(sure) < k and not cut.feed():
                break
        return sure

    def _fishbone(self, state, pos: int, chain: list[int], n: int, width: int) -> tuple[list[int], list[int]]:
        """(tokens, parents) of ModelDrafter's greedy fishbone: each depth's chain token and then
        its width - 1 siblings under the chain's node above; at the first miss (depth n) the
        target's token is the sibling its rank names, if under `width`; every other sibling is a
        token the target rejects."""
        output, ranks = state["output"], state["ranks"]
        if ranks is None:
            raise ValueError("a recorded tree needs the draft's ranks (replay_controller.py ranks)")
        tokens, parents, above = [], [], -1
        for d, token in enumerate(chain):
            right = output[pos + d] if pos + d < len(output) else 0
            rank = int(ranks[pos + d]) if d == n and pos + d < len(ranks) else 0
            wrong = [(right + 2 + j) % self.vocab_size for j in range(width - 1)]
            if 0 < rank < width:
                wrong[rank - 1] = right
            tokens += [token, *wrong]
            parents += [above] * width
            above = len(tokens) - width
        return tokens, parents

    def accept(self, n_accepted: Mapping[int, int]) -> None:
        for row, n in n_accepted.items():  # as ModelDrafter.accept: keep the accepted draft tokens fed
            state = self._rows[row]
            chain = min(n, state["chain_run"])  # a kept sibling: the chain's token there was fed, not it
            state["fed"] = min(state["fed"], state["base"] + min(chain, max(state["drafted"] - 1, 0)))


def draft_seconds(draft_costs: Sequence[float], catch_up: int, k: int) -> float:
    """Seconds the draft model spends on a k-token proposal: a forward of the catch-up tokens,
    then one of one token for each draft token after the first (draft_costs: its curve at the
    step's depth)."""
    if k == 0:
        return 0.0
    return _cost(draft_costs, catch_up) + (k - 1) * draft_costs[0]


def _cost(costs: Sequence[float], width: int) -> float:
    """Seconds of a forward of `width` tokens on a 1..len curve (past its end, as the controller
    extrapolates: CostTable.measured)."""
    return costs[width - 1] if width <= len(costs) else CostTable(costs).measured(width)


def _draft_steps(curves: Sequence[Sequence[float]], draft_costs, prompt_len: int) -> list[list[float]]:
    """Per position, the seconds of a step of k draft-model tokens: the target's forward of k + 1
    tokens and the draft model's forwards (one token to catch up on, then one per further token)."""
    return tree_steps(curves, draft_costs, prompt_len, len(curves[0]) - 1 if curves else 0, 1)


def tree_steps(curves, draft_costs, prompt_len: int, depth: int, width: int, tree_cost: float = 1.0):
    """Per position, the seconds of a step of a k-deep fishbone of `width` (k = 0..depth): the
    target's forward of k x width + 1 tokens (times `tree_cost`, what a tree costs over a chain of
    as many tokens: benchmarks/tree_costs.py) and the draft model's chain of k (its siblings are
    read from the chain's own logits). Width 1 is the chain's step."""
    steps = []
    for i, costs in enumerate(curves):
        draft = curve_at(draft_costs, prompt_len + i)
        factor = tree_cost if width > 1 else 1.0
        steps.append(
            [
                _cost(costs, k * width + 1) * (factor if k else 1.0) + draft_seconds(draft, 1, k)
                for k in range(depth + 1)
            ]
        )
    return steps


def fixed_tree(
    record: Mapping,
    costs,
    draft_costs,
    k: int,
    width: int,
    tree_cost: float = 1.0,
    nodes: int = 0,
    past_miss: str = "recorded",
) -> tuple[float, float]:
    """(speedup over plain, tokens per target step) of the draft model's fishbone draft:KxW at every
    step on one recorded prompt (record["draft_ranks"]); width 1 is the chain draft:K; with `nodes`,
    the shaped fishbone of its most probable paths, priced as draft:KxW/N (record["draft_top"]:
    shaped_run; the draft model's own KxW/N grows its tree, which a recording cannot replay). Its first
    step pays the draft model's read of the prompt, as a fixed chain replayed step by step does."""
    prompt, output, ranks = record["prompt"], record["output"], record["draft_ranks"]
    curves = _curves(costs, len(prompt), len(output))
    if nodes:
        shaped = [shaped_run(ranks, record["draft_top"], pos, k, width, nodes, past_miss) for pos in range(len(output))]
        runs = [run for run, _, _, _ in shaped]
        steps = []  # a step of the tree from each position: only its k-th entry is read (fixed_speedup)
        for i, (costs_at, (_, fed, tree, depth)) in enumerate(zip(curves, shaped)):
            seconds = _cost(costs_at, fed + 1) * (tree_cost if tree else 1.0)
            seconds += draft_seconds(curve_at(draft_costs, len(prompt) + i), 1, depth)
            steps.append([0.0] * k + [seconds])
    else:
        runs = [tree_run(ranks, pos, k, width) for pos in range(len(output))]
        steps = tree_steps(curves, draft_costs, len(prompt), k, width, tree_cost)
    if k and steps:  # its first draft reads the whole prompt first (as ModelDrafter and the recorded one do)
        first = curve_at(draft_costs, len(prompt))
        steps[0] = [s + (_cost(first, len(prompt)) - first[0] if j else 0.0) for j, s in enumerate(steps[0])]
    return fixed_speedup(runs, steps, curves, k)


def draft_ceiling(prompt: Sequence[int], output: Sequence[int], agrees: str, costs, draft_costs) -> float:
    """Speedup of a clairvoyant controller over the draft model: at every position it drafts
    exactly as many tokens as will be accepted (or none), paying the draft model's forwards."""
    curves = _curves(costs, len(prompt), len(output))
    lengths = [draft_run(agrees, pos, len(curves[0]) - 1) for pos in range(len(output))]
    return _plain_time(curves) / _best_time(lengths, _draft_steps(curves, draft_costs, len(prompt)))


def head_steps(curves: Sequence[Sequence[float]], head_step: float, keep: float = 0.0) -> list[list[float]]:
    """Per position, the seconds of a step of k trained-head tokens: the target's forward of k + 1
    tokens, k steps of the head (it reads the target's state: nothing to catch up on) and `keep`
    of a one-token forward, what keeping the target's hidden states adds to every step."""
    return [[costs[k] + k * head_step + keep * costs[0] for k in range(len(costs))] for costs in curves]


def fixed_speedup(lengths: Sequence[int], steps: Sequence[Sequence[float]], curves, k: int) -> tuple[float, float]:
    """(speedup over plain, tokens per target step) of drafting k tokens at every step, where a
    step at position i keeps min(lengths[i], k) of them and costs steps[i][k]. A position whose
    length is None drafts nothing (a head right after the prefill has no state to draft from)."""
    pos, seconds, n_steps = 0, 0.0, 0
    while pos < len(lengths):
        width = 0 if lengths[pos] is None else min(k, len(steps[pos]) - 1)
        seconds += steps[pos][width]
        pos += min(lengths[pos] or 0, width) + 1
        n_steps += 1
    return _plain_time(curves) / seconds, len(lengths) / n_steps


def head_ceiling(runs: Sequence[int | None], steps: Sequence[Sequence[float]], curves) -> float:
    """Speedup of a clairvoyant controller over a trained head (runs[i]: how many of the head's
    guesses from position i the target keeps; None: it cannot draft there; steps: head_steps):
    at every position it drafts exactly what will be kept, paying the head's steps."""
    return _plain_time(curves) / _best_time([run or 0 for run in runs], steps)


def head_replay(
    record: Mapping, runs: Sequence[int | None], costs, draft_costs, head_step: float, keep: float = 0.0
) -> dict:
    """One recorded prompt with a trained head's runs on one device's curves (head_step: seconds
    of a head step there; keep: see head_steps): the share of positions where the head's first guess is kept, tokens per
    target step and speedup of fixed head:1..3, the head's clairvoyant ceiling, and the recorded
    draft model's draft:4 and ceiling."""
    prompt, output = record["prompt"], record["output"]
    curves = _curves(costs, len(prompt), len(output))
    steps = head_steps(curves, head_step, keep)
    fixed = [fixed_speedup(runs, steps, curves, k) for k in (1, 2, 3)]
    lengths = [draft_run(record["draft_agrees"], pos, len(curves[0]) - 1) for pos in range(len(output))]
    return {
        "first": sum(run > 0 for run in runs if run is not None) / max(1, sum(run is not None for run in runs)),
        "tokens_per_step": [t for _, t in fixed],
        "head": [s for s, _ in fixed],
        "head_ceiling": head_ceiling(runs, steps, curves),
        "draft4": fixed_speedup(lengths, _draft_steps(curves, draft_costs, len(prompt)), curves, 4)[0],
        "draft_ceiling": draft_ceiling(prompt, output, record["draft_agrees"], costs, draft_costs),
    }


def replay_speedup(
    prompt: Sequence[int],
    output: Sequence[int],
    costs,
    controller,
    recorded: RecordedDrafter | None = None,
    draft_costs=None,
    stops: frozenset[int] = frozenset(),
    tree_cost: float = 1.0,
) -> tuple[float, dict[str, int]]:
    """Speedup over plain decoding of `controller` (a FixedController or CostAwareController over
    prompt lookup and/or `recorded`, the draft model, whose forwards cost `draft_costs`), and its
    decisions, replayed step by step on the recorded output. As in the engine, a draft ends at
    its first token in `stops` (the target's end-of-generation tokens). A tree's forward costs the
    curve's for its nodes times `tree_cost` (benchmarks/tree_costs.py)."""
    controller.begin(0, prompt)
    if recorded is not None:
        recorded.begin(0, prompt)
    context = list(prompt)
    curves = _curves(costs, len(prompt), len(output))
    pos, seconds, decisions = 0, 0.0, {}
    while pos < len(output):
        [(drafter, draft)] = controller.draft({0: context}, {0: len(curves[pos]) - 1}).values()
        draft = draft.upto(stops) if draft is not None else None
        tokens = draft.tokens if draft is not None else []
        n = (
            _tree_accepted(draft, output, pos)
            if draft is not None and draft.parents
            else _accepted(tokens, output, pos)
        )
        emitted = output[pos : pos + n + 1]
        cost = _cost(curves[pos], len(tokens) + 1) * (tree_cost if draft is not None and draft.parents else 1.0)
        seconds += cost
        kind = drafter.name if drafter is not None else "ngram"  # a free drafter's name (prompt lookup's: ngram)
        if drafter is not None and drafter is recorded:
            kind = "draft"
            seconds += draft_seconds(curve_at(draft_costs, len(context)), *recorded.last_cost_rows)
            recorded.accept({0: n})
        controller.observe({0: Outcome(drafter, draft, n, emitted)}, [len(tokens) + 1], cost, len(context))
        key = f"{kind}:{len(tokens)}" if tokens else "plain"
        if kind == "draft" and draft.parents:  # the draft model's fishbone: its depth x its width
            width = draft.parents.count(-1)
            key = f"{kind}:{len(tokens) // width}x{width}"
        elif draft is not None and draft.parents:  # a free drafter's tree: its first branch x its branches
            key = f"{kind}:{len(draft.first_branch().tokens)}x{draft.leaves()}"
        decisions[key] = decisions.get(key, 0) + 1
        context += emitted
        pos += len(emitted)
    controller.end(0)
    if recorded is not None:
        recorded.end([0])
    return _plain_time(curves) / seconds, decisions


# -- fitting the controller's priors, and checking that they transfer ------------------------------


def match_statistics(records: Sequence[Mapping]) -> dict[str, tuple[list[int], list[int]]]:
    """Prompt lookup's guesses on recorded greedy outputs, counted as the controller's tables count
    them: kind ("split" / "single" / "agreed" for a first guess, by its votes; "later" for the guesses
    after an accepted one) -> (right, checked) per match-length bucket (MATCH_BUCKETS). At every
    position the drafter proposes from the true context; the guesses are checked against the
    target's tokens until the first wrong one (what a draft of K_MAX tokens would have shown)."""
    counts = {kind: ([0] * len(MATCH_BUCKETS), [0] * len(MATCH_BUCKETS)) for kind in MatchAcceptance.KINDS}
    for r in records:
        drafter, context, output = NgramDrafter(), list(r["prompt"]), r["output"]
        for pos in range(len(output)):
            draft = drafter.propose({0: context}, {0: K_MAX})[0]
            if draft.tokens:
                match = max(1, draft.evidence.get("match", 1))
                kind = MatchAcceptance.evidence(draft.evidence.get("votes", (1, 1)))
                for i, token in enumerate(draft.tokens[: len(output) - pos]):
                    right, checked = counts[kind if i == 0 else "later"]
                    b = MatchAcceptance.bucket(match + i)
                    checked[b] += 1
                    right[b] += token == output[pos + i]
                    if token != output[pos + i]:
                        break
            context.append(output[pos])
    return counts


def draft_statistics(records: Sequence[Mapping]) -> tuple[list[int], list[int]]:
    """The draft model's (right, checked) per draft position: position i of a draft from any
    output position p is checked when positions p .. p + i - 1 agreed (the recorded agreement)."""
    right, checked = [0] * K_MAX, [0] * K_MAX
    for r in records:
        agrees = r["draft_agrees"]
        for p in range(len(agrees)):
            for i in range(min(K_MAX, len(agrees) - p)):
                checked[i] += 1
                right[i] += agrees[p + i] == "1"
                if agrees[p + i] != "1":
                    break
    return right, checked


def _monotone(rates: Sequence[float], weights: Sequence[float]) -> list[float]:
    """The non-decreasing sequence closest to `rates` in weighted least squares (pool adjacent
    violators): a longer match is never less trusted than a shorter one."""
    blocks: list[list[float]] = []  # [value, weight, count]
    for r, w in zip(rates, weights):
        blocks.append([r, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, w2, n2 = blocks.pop()
            v1, w1, n1 = blocks.pop()
            w = w1 + w2
            blocks.append([(v1 * w1 + v2 * w2) / w if w else (v1 + v2) / 2, w, n1 + n2])
    return [v for v, _, n in blocks for _ in range(n)]


def fit_rate(right: int, checked: int, pseudo: float = 2.0, prior: float = 0.5) -> float:
    """A rate with `pseudo` guesses' worth of `prior` added: an empty cell says `prior`, a full one
    says its own rate."""
    return (right + pseudo * prior) / (checked + pseudo)


def fit_match_prior(records: Sequence[Mapping]) -> dict[str, tuple[float, ...]]:
    """MATCH_PRIOR fitted on recordings: each kind's rate per bucket (fit_rate), made non-decreasing
    in the match length over the buckets that were seen; a bucket never seen takes the rate of the
    nearest shorter one (the first seen one, for the shortest); two decimal places."""
    fitted = {}
    for kind, (right, checked) in match_statistics(records).items():
        seen = [b for b, c in enumerate(checked) if c]
        if not seen:
            fitted[kind] = tuple(MATCH_PRIOR_FALLBACK for _ in checked)
            continue
        rates = _monotone([fit_rate(right[b], checked[b]) for b in seen], [checked[b] + 2.0 for b in seen])
        by_bucket = dict(zip(seen, rates))
        values, last = [], rates[0]
        for b in range(len(checked)):
            last = by_bucket.get(b, last)
            values.append(round(last, 2))
        fitted[kind] = tuple(values)
    return fitted


MATCH_PRIOR_FALLBACK = 0.5  # a kind of guess the recordings never showed: a coin toss


def fit_draft_prior(records: Sequence[Mapping]) -> tuple[float, ...]:
    """The draft model's per-position acceptance fitted on recordings (fit_rate, two places)."""
    right, checked = draft_statistics(records)
    return tuple(round(fit_rate(r, c, prior=0.7), 2) for r, c in zip(right, checked))


def fit_sibling_prior(records: Sequence[Mapping], widths: Sequence[int] = (2, 3, 4)) -> tuple[float, ...]:
    """acceptance.SIBLING_PRIOR fitted on recordings with ranks: per width w, the share of the
    draft's misses where the target's token was among its next w - 1 candidates."""
    ranks = [int(c) for r in records for c in r["draft_ranks"] if c != "0"]
    return tuple(round(sum(rank < w for rank in ranks) / max(1, len(ranks)), 2) for w in widths)


def fit_confidence_prior(records: Sequence[Mapping], digits: int | None = 3) -> tuple[float, ...]:
    """acceptance.CONFIDENCE_PRIOR fitted on recordings with the draft's confidences: per bucket of
    acceptance.CONFIDENCE_EDGES, the share of the draft's greedy guesses the target kept (rounded
    to `digits`, as the prior is written; None: unrounded)."""
    from specdec.acceptance import ConfidenceAcceptance

    buckets = len(ConfidenceAcceptance().c)
    right, checked = [0] * buckets, [0] * buckets
    for r in records:
        for p, agreed in zip(r["draft_p"], r["draft_agrees"]):
            b = ConfidenceAcceptance.bucket(p)
            checked[b] += 1
            right[b] += agreed == "1"
    rates = (fit_rate(a, n) for a, n in zip(right, checked))
    return tuple(rate if digits is None else round(rate, digits) for rate in rates)


def sibling_statistics(
    records: Sequence[Mapping], drafter_of: Callable[[Mapping], object], k: int = K_MAX, width: int | None = None
) -> tuple[int, int]:
    """(right, checked): at every position of the recorded answers, the tree that
    `drafter_of(record)` proposes k deep (`width` branches where given, else its own shape); where
    its first branch fails at a depth where the tree branches, whether another branch there holds
    the recorded token. Each record's row ends with its answer, whole (a suffix cache shared by
    the records learns it, as a server's does)."""
    right = checked = 0
    widths = {0: width} if width else None
    for r in records:
        drafter, context, output = drafter_of(r), list(r["prompt"]), r["output"]
        for pos in range(len(output)):
            tree = drafter.propose({0: context}, {0: k}, widths)[0]
            context.append(output[pos])  # the drafter is shown this list, which grows in place
            if tree.parents is None:
                continue
            chain = tree.first_branch_nodes()
            kept = agreement([tree.tokens[i] for i in chain], output[pos:])[1]
            if kept == len(chain) or pos + kept >= len(output):
                continue
            others = {tree.tokens[i] for i in tree.siblings_of(chain[kept])}
            if others:
                checked += 1
                right += output[pos + kept] in others
        drafter.end([0])
    return right, checked


def ngram_sibling_statistics(records: Sequence[Mapping], width: int) -> tuple[int, int]:
    """sibling_statistics of prompt lookup's trees of up to `width` branches, a fresh one a record."""
    return sibling_statistics(records, lambda r: NgramDrafter(width=width))


def fit_ngram_sibling_prior(records: Sequence[Mapping], width: int) -> float:
    """acceptance.NGRAM_SIBLING_PRIOR fitted on these records (ngram_sibling_statistics)."""
    return round(fit_rate(*ngram_sibling_statistics(records, width)), 2)


def _best_time_of(options: Sequence[tuple[Sequence[int], Sequence[Sequence[float]]]], n: int) -> float:
    """Least total seconds to emit n tokens when at position i a drafter d would have up to
    lengths_d[i] tokens accepted, a step of k of its tokens costing steps_d[i][k] (dynamic
    programming from the end)."""
    best = [0.0] * (n + 1)
    for pos in range(n - 1, -1, -1):
        best[pos] = min(
            steps[pos][k] + best[min(n, pos + k + 1)]
            for lengths, steps in options
            for k in range(min(lengths[pos], len(steps[pos]) - 1) + 1)
        )
    return best[0]


def clairvoyant_speedup(
    prompt: Sequence[int],
    output: Sequence[int],
    costs,
    agrees: str | None = None,
    draft_costs=None,
    ranks: str | None = None,
    tree_cost: float = 1.0,
) -> float:
    """A clairvoyant controller over both drafters `auto` has: at every position prompt lookup's
    proposal or the draft model's (when recorded; with its ranks, also its trees of auto's widths,
    controller.TREE_WIDTHS), drafting exactly what will be accepted."""
    from specdec.controller import TREE_WIDTHS

    curves = _curves(costs, len(prompt), len(output))
    k_max = len(curves[0]) - 1
    options = [(_lookup_lengths(prompt, output, k_max, NgramDrafter()), curves)]
    if agrees is not None and draft_costs is not None:
        options.append(
            (
                [draft_run(agrees, pos, k_max) for pos in range(len(output))],
                _draft_steps(curves, draft_costs, len(prompt)),
            )
        )
        for width in TREE_WIDTHS[1:] if ranks is not None else ():  # a depth-k tree keeps min(k, its run)
            options.append(
                (
                    [tree_run(ranks, pos, k_max, width) for pos in range(len(output))],
                    tree_steps(curves, draft_costs, len(prompt), k_max, width, tree_cost),
                )
            )
    return _plain_time(curves) / _best_time_of(options, len(output))


def leave_one_category_out(
    records: Sequence[Mapping],
    costs: Sequence[float],
    draft_costs: Sequence[float] | None = None,
    stops: frozenset[int] = frozenset(),
    tree_cost: float = 1.0,
    **controller_args,
) -> dict[str, dict[str, float]]:
    """For every category: fit the priors on the other categories' recordings, replay `auto` (one
    controller for the category's prompts, learning across them as in a bench run, its drafts
    ending at the first of the target's end-of-generation tokens `stops`; with the draft's ranks
    recorded, choosing the draft model's trees as auto_controller lets it, each tree's forward
    `tree_cost` times a chain's) on the held-out ones, and compare it with the clairvoyant
    controller (over trees too, where auto may draft them). category -> {"auto", "clairvoyant":
    median speedups; "ratio": median of auto / clairvoyant per prompt; "speedups": auto's on each
    prompt, in the recording's order; "worst": auto's worst prompt; "prompts"}."""
    import statistics

    from specdec.acceptance import SIBLING_PRIOR
    from specdec.controller import NGRAM_TREE_WIDTH, TREE_WIDTHS, CostAwareController

    with_draft, trees = recorded_draft(records, draft_costs)
    out = {}
    for category in dict.fromkeys(r["category"] for r in records):
        train = [r for r in records if r["category"] != category]
        test = [r for r in records if r["category"] == category]
        recorded = RecordedDrafter.of(test) if with_draft else None
        # the controller learns live ratios on its tables: its own copies, the replay's stay as measured
        auto = CostAwareController(
            NgramDrafter(),
            recorded,
            copy.deepcopy(costs),
            copy.deepcopy(draft_costs) if with_draft else None,
            match_prior=fit_match_prior(train),
            draft_prior=fit_draft_prior(train) if with_draft else None,
            stops=stops,
            **{"tree_widths": TREE_WIDTHS if trees else (1,), "free_width": NGRAM_TREE_WIDTH, **controller_args},
        )
        auto.free_siblings[auto.ngram.name].s[:] = fit_ngram_sibling_prior(train, NGRAM_TREE_WIDTH)
        if trees:  # the siblings' rates too are fitted on the other categories
            auto.sibling_accept.s[:] = fit_sibling_prior(train, range(2, len(SIBLING_PRIOR) + 2))
        if with_draft and all("draft_p" in r for r in train):  # and the rates by confidence
            auto.confidence_accept.c[:] = fit_confidence_prior(train)
        autos, clairs = [], []
        for r in test:
            autos.append(
                replay_speedup(r["prompt"], r["output"], costs, auto, recorded, draft_costs, stops, tree_cost)[0]
            )
            clairs.append(
                clairvoyant_speedup(
                    r["prompt"],
                    r["output"],
                    costs,
                    r.get("draft_agrees") if with_draft else None,
                    draft_costs,
                    r.get("draft_ranks") if trees else None,
                    tree_cost,
                )
            )
        out[category] = {
            "auto": statistics.median(autos),
            "clairvoyant": statistics.median(clairs),
            "ratio": paired_ratio(autos, clairs),
            "speedups": autos,
            "worst": min(autos),
            "prompts": len(test),
        }
    return out


def copy_runs(records: Sequence[Mapping], k: int = 63) -> dict[str, dict[int, tuple[int, int]]]:
    """How far prompt lookup's long matches (at least WHOLE_COPY_MIN tokens) run on recorded greedy
    outputs, split by whether the match spans WHOLE_COPY_SHARE of the response so far (the
    controller's whole-copy rule): "whole" / "partial" -> {j: (positions whose next j guesses were
    all right, positions with j tokens left)} for j in 1, 16, 32, k."""
    from specdec.controller import WHOLE_COPY_MIN, whole_copy

    runs = {name: {j: (0, 0) for j in (1, 16, 32, k)} for name in ("whole", "partial")}
    for r in records:
        drafter, context, output = NgramDrafter(), list(r["prompt"]), r["output"]
        for pos in range(len(output)):
            draft = drafter.propose({0: context}, {0: k})[0]
            match = draft.evidence.get("match", 0) if draft.tokens else 0
            if match >= WHOLE_COPY_MIN:
                name = "whole" if whole_copy(match, pos) else "partial"
                run = _accepted(draft.tokens, output, pos)
                for j, (right, left) in runs[name].items():
                    if len(output) - pos >= j and len(draft.tokens) >= j:
                        runs[name][j] = (right + (run >= j), left + 1)
            context.append(output[pos])
    return runs
