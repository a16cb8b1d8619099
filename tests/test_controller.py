"""The cost-aware controller's decision rule, on synthetic costs and acceptance."""

from __future__ import annotations

import numpy as np
import pytest

from specdec import SpeculativeDecoder
from specdec.acceptance import DRAFT_PRIOR
from specdec.controller import (
    Acceptance,
    CostAwareController,
    FixedController,
    MatchAcceptance,
    Outcome,
    Overlay,
    scores_tree,
)
from specdec.costs import CostTable, measure_forward_costs
from specdec.drafters.base import Declared, Draft
from specdec.drafters.model import ModelDrafter
from specdec.drafters.ngram import NgramDrafter
from specdec.engine import Engine
from specdec.models.base import packed

from .toy import ToyLM, on_virtual_clock

# the 1.5B on a 2-core AVX-512 machine: 1, 2, 3, 5, 8 and 16 rows (llama-bench), interpolated
CURVE = np.interp(np.arange(1, 17), [1, 2, 3, 5, 8, 16], [28, 38, 50, 74, 99, 110]) / 1000
# timed to 64 tokens, and past 8 each token costs 0.3 of one: wide forwards are cheap per token
STEEP_THEN_FLAT = {w: 0.04 * (w if w <= 8 else 8 + 0.3 * (w - 8)) for w in list(range(1, 17)) + [24, 32, 48, 64]}
# each token past the first adds a quarter of a one-token step
QUARTER_A_TOKEN = {w: 0.04 * (1 + 0.25 * (w - 1)) for w in list(range(1, 17)) + [24, 32, 48, 64]}


class FixedProposals(Declared):
    """A drafter that always proposes the same continuation for every row (stands in for prompt
    lookup; by default from a 40-token match, long enough not to cap k)."""

    takes = frozenset()

    def __init__(self, tokens, name="ngram"):
        self.tokens, self.name, self.last_match_length, self.proposed = list(tokens), name, 40, 0
        self.kind = name.partition(":")[0]
        self.last_votes = (1, 1)

    def begin(self, row, prompt, params, rng):
        pass

    def end(self, rows):
        pass

    def lag(self, row, context):
        return 1

    def propose(self, contexts, ks, leaves=None):
        self.proposed += 1
        evidence = {"match": self.last_match_length, "votes": self.last_votes}
        return {row: Draft(self.tokens[:k], evidence=evidence) for row, k in ks.items()}

    def accept(self, n_accepted):
        pass


class OneRow(CostAwareController):
    """The controller driven for a single row, as the one-sequence controller was."""

    def draft(self, context, room):
        if 0 not in self._rows:
            self.begin(0, context)
        return super().draft({0: context}, {0: room})[0]

    def observe(self, drafter, draft, n_accepted, emitted, width, seconds):
        super().observe({0: Outcome(drafter, draft, n_accepted, emitted)}, [width], seconds)


def controller(
    costs, ngram=None, model=None, draft_cost=None, ngram_prior=None, model_prior=None, cls=OneRow, reach=None
):
    c = cls(ngram, model, costs, draft_cost, reach=reach)
    if ngram_prior is not None:
        for table in c.ngram_accept.tables.values():  # every match length and evidence alike
            table[:] = ngram_prior
    if model_prior is not None:
        c.model_accept.a[:] = model_prior
    return c


def test_expected_tokens():
    acc = Acceptance(prior=0.5)
    np.testing.assert_allclose(acc.expected_tokens(3), [1, 1.5, 1.75, 1.875])
    acc.a[:] = 1.0
    np.testing.assert_allclose(acc.expected_tokens(4), [1, 2, 3, 4, 5])


def test_plain_when_drafting_cannot_pay():
    linear = [0.03 * n for n in range(1, 17)]  # a batch costs as much as its tokens
    c = controller(
        linear,
        ngram=FixedProposals(range(10)),
        model=FixedProposals(range(10), "draft:m"),
        draft_cost=[0.02] * 16,
        ngram_prior=0.6,
        model_prior=0.9,
    )
    drafter, draft = c.draft([1, 2, 3], room=100)
    assert drafter is None and draft is None
    assert c.decisions == {"plain": 1}


def test_long_drafts_when_acceptance_is_high_and_verification_cheap():
    flat = [0.03] * 16  # verification almost free
    c = controller(flat, ngram=FixedProposals(range(20)), ngram_prior=0.99)
    drafter, draft = c.draft([1, 2, 3], room=100)
    assert drafter.name == "ngram" and len(draft.tokens) == 15


def test_free_drafts_reach_the_widest_timed_forward():
    """Inside a long copy a free drafter drafts past 16 tokens when the curve timed wider forwards
    and they cost less per token (this CPU: 16 tokens 10-13x one, 32 tokens 18x), never past the
    widest timed width; a match shorter than the draft does not cap it (the estimates decide)."""
    tokens = FixedProposals(range(200))
    tokens.last_match_length = 200
    c = controller(STEEP_THEN_FLAT, ngram=tokens, ngram_prior=1.0)
    assert len(c.draft([1, 2, 3], room=500)[1].tokens) == 63
    tokens.last_match_length = 20
    c = controller(STEEP_THEN_FLAT, ngram=tokens, ngram_prior=1.0)
    c.begin(0, [1])  # 100 tokens generated, the match spans 20
    assert len(c.draft([1] * 101, room=500)[1].tokens) == 63
    # the same costs timed only up to 16 tokens: 15 at most, as before
    narrow = {w: s for w, s in STEEP_THEN_FLAT.items() if w <= 16}
    tokens.last_match_length = 200
    assert len(controller(narrow, ngram=tokens, ngram_prior=1.0).draft([1, 2, 3], room=500)[1].tokens) == 15


# a GPU-like curve: a token of width costs 1% of a one-token step, timed to 64 tokens
FLAT_TO_64 = {w: 0.02 * (1 + 0.01 * (w - 1)) for w in list(range(1, 17)) + [24, 32, 48, 64]}


@pytest.mark.parametrize("match, flat, steep", [(1, 4, 0), (4, 10, 1), (8, 28, 1), (16, 46, 15)])
def test_the_same_estimates_draft_long_on_a_flat_curve_and_short_on_a_steep_one(match, flat, steep):
    """How far a free draft goes past its match is the shipped tables' estimate (one standard error
    below each rate) priced on the curve, with no cap: from an 8-token match a GPU-like curve drafts
    28 tokens, this CPU's curve one; from a 16-token match, 46 and 15 (no constant tuned to one
    machine)."""
    ks = []
    for curve in (FLAT_TO_64, CURVE):
        ngram = FixedProposals(range(100))
        ngram.last_match_length = match
        c = controller(curve, ngram=ngram)
        c.begin(0, [1] * 50)  # 10 tokens generated: not a whole copy
        draft = c.draft([1] * 60, room=500)[1]
        ks.append(len(draft.tokens) if draft else 0)
    assert ks == [flat, steep]


@pytest.mark.parametrize("generated, k", [(0, 40), (40, 40), (41, 16), (200, 16)])
def test_a_whole_copy_is_not_held_to_half_its_match(generated, k):
    """Under a cap of half the match (reach=0.5, as the vLLM proposer sets on a steep curve), a
    32-token match that spans at least WHOLE_COPY_SHARE (0.8) of the response is a copy task (a
    rewrite, an extract): it may draft its whole proposal; spanning less of it, half its match."""
    tokens = FixedProposals(range(40))
    tokens.last_match_length = 32
    c = controller(STEEP_THEN_FLAT, ngram=tokens, ngram_prior=1.0, reach=0.5)
    c.begin(0, [7] * 10)
    assert len(c.draft([7] * (10 + generated), room=500)[1].tokens) == k


def test_k_grows_with_acceptance_on_a_real_cost_curve():
    ks = []
    for prior in (0.3, 0.6, 0.8, 0.95):
        c = controller(CURVE, ngram=FixedProposals(range(20)), ngram_prior=prior)
        _, draft = c.draft([1, 2, 3], room=100)
        ks.append(len(draft.tokens) if draft else 0)
    assert ks[0] == 0 and ks == sorted(ks) and ks[-1] >= 10


def test_a_cap_on_reach_bounds_k_by_the_match():
    """With reach=0.5 (the vLLM proposer's cap on a steep curve), however good the estimates, a draft
    reaches at most half as far ahead as its match reaches back."""
    ngram = FixedProposals(range(20))
    c = controller([0.03] * 16, ngram=ngram, ngram_prior=0.99, reach=0.5)
    for match, k in ((1, 1), (4, 2), (10, 5), (30, 15)):
        ngram.last_match_length = match
        assert len(c.draft([1, 2, 3], room=100)[1].tokens) == k


def test_a_draft_must_promise_more_than_a_plain_step_on_its_cautious_rates():
    """One guess at 0.5 is priced one standard error low (about 0.36 at the shared rate): on a
    2-row step costing 1.4x it would promise 7% more than plain at its estimate, and less on the
    cautious rate, so no draft; at 1.3x the cautious rate promises about 5% more, and it drafts (no
    fixed margin on top: a 10% one would refuse it)."""
    ngram = FixedProposals([5])
    c = controller([0.01, 0.014] + [1.0] * 14, ngram=ngram, ngram_prior=0.5)
    assert c.draft([1, 2], room=100) == (None, None)
    c = controller([0.01, 0.013] + [1.0] * 14, ngram=ngram, ngram_prior=0.5)
    assert c.draft([1, 2], room=100)[1].tokens == [5]


def test_room_caps_k():
    c = controller([0.03] * 16, ngram=FixedProposals(range(20)), ngram_prior=0.99)
    _, draft = c.draft([1, 2, 3], room=3)
    assert len(draft.tokens) == 3


def test_draft_model_only_when_it_pays():
    cheap_verify = [0.03, 0.031, 0.032, 0.033, 0.034] + [0.04] * 11
    c = controller(cheap_verify, model=FixedProposals(range(9), "draft:m"), draft_cost=[0.002] * 16, model_prior=0.9)
    drafter, draft = c.draft([1], room=100)
    assert drafter.name == "draft:m" and len(draft.tokens) >= 4
    c = controller(cheap_verify, model=FixedProposals(range(9), "draft:m"), draft_cost=[0.05] * 16, model_prior=0.9)
    for _ in range(64):  # not even exploration: a perfect draft would not pay either
        assert c.draft([1], room=100) == (None, None)


def test_shadow_learning_turns_a_useless_ngram_off():
    """Prompt lookup is scored after every step, used or not: wrong guesses lower its estimate
    until the controller stops using it."""
    ngram = FixedProposals([7, 7, 7, 7])
    c = controller(CURVE, ngram=ngram, ngram_prior=0.9)
    used = []
    for _ in range(40):
        drafter, draft = c.draft([1, 2], room=100)
        used.append(drafter is not None)
        width = 1 + (len(draft.tokens) if draft else 0)
        c.observe(drafter, draft, 0, [5], width, CURVE[width - 1])  # the target always says 5
    assert used[0] and not any(used[-10:])


def test_costs_are_measured_once_and_cached(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    monkeypatch.setattr("specdec.costs.machine_was_busy", lambda times, costs, retimed=(): "")  # timing noise aside
    model = ToyLM(vocab_size=32, n_ctx=512)
    model.path = tmp_path / "toy.gguf"
    model.path.write_bytes(b"toy")
    costs = measure_forward_costs(model, widths=[1, 2, 3, 4], repeats=1)
    assert list(costs) == [1, 2, 3, 4] and all(s > 0 for s in costs.values())
    assert "timing" in capsys.readouterr().err  # the pause is explained, once
    calls = len(model.forward_calls)
    assert measure_forward_costs(model, widths=[1, 2, 3, 4], repeats=1) == costs
    assert len(model.forward_calls) == calls  # served from the cache
    assert capsys.readouterr().err == ""


def test_a_cost_table_is_timed_in_stages_a_few_widths_a_run(tmp_path, monkeypatch, capsys):
    """A first run times the coarse grid (FIRST) at FIRST_REPEATS; each later run times up to
    REFINE_TOKENS tokens of the missing widths beside the narrowest, joined by its scale, until
    the curve is whole and nothing more is timed."""
    from specdec import costs as costs_module

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    monkeypatch.setattr("specdec.costs.machine_was_busy", lambda times, costs, retimed=(): "")
    model = ToyLM(vocab_size=32, n_ctx=512)
    model.path = tmp_path / "toy.gguf"
    model.path.write_bytes(b"toy")
    widths, forward = costs_module.WIDTHS, model.forward_rows
    fed: list[int] = []
    model.forward_rows = lambda tokens, n_logits=None: (
        fed.append(max(map(len, tokens.values()))) or forward(tokens, n_logits)
    )

    def timed():
        fed.clear()
        costs = measure_forward_costs(model, first=costs_module.FIRST)
        return costs, sorted(set(fed[2:]))  # the fill of the cache and the warm-up aside

    costs, fed_first = timed()
    assert list(costs) == list(costs_module.FIRST) and fed_first == list(costs_module.FIRST)
    assert len(fed) - 2 == costs_module.FIRST_REPEATS * len(costs_module.FIRST)
    assert f"at {len(costs_module.FIRST)} of {len(widths)} widths" in capsys.readouterr().err
    seen, runs = set(costs), 1
    while len(seen) < len(widths):
        costs, fed_now = timed()
        runs += 1
        new = set(costs) - seen
        assert new and sum(new) <= max(costs_module.REFINE_TOKENS, min(new))
        assert fed_now == sorted({min(seen), *new})  # beside the narrowest, for the scale
        assert list(costs) == sorted(costs) and all(a <= b for a, b in zip(costs.values(), list(costs.values())[1:]))
        assert "refining" in capsys.readouterr().err
        seen |= new
        assert runs < 10
    assert list(costs) == sorted(widths)
    again, fed_now = timed()
    assert again == costs and fed == []  # whole: served from the cache
    assert capsys.readouterr().err == ""


def test_cost_table_follows_the_machine():
    table = CostTable([0.01, 0.02])
    for _ in range(50):
        table.observe([1], 0.02)  # the machine got twice as slow
    assert table(1) == pytest.approx(0.02, rel=0.05) and table(2) > 0.03
    grid = CostTable({1: 1.0, 16: 4.0, 64: 10.0})  # measured widths, linear between
    assert grid(40) == pytest.approx(7.0)


def test_a_width_seen_rarely_follows_the_machine_and_keeps_its_own_shape():
    # width 2 seen once, as timed; then only plain steps, the machine twice as slow: width 2 is
    # priced twice as slow too (a ratio learned at width 2 alone kept 1: a draft priced at half its
    # cost passed the step bound)
    table = CostTable([0.01, 0.02])
    table.observe([2], 0.02)
    for _ in range(50):
        table.observe([1], 0.02)
    assert table(2) == pytest.approx(0.04, rel=0.05)
    # a width whose forwards take 1.5x its curve's point (against width 1's) keeps that shape
    # through the machine's slow and fast phases, and between its forwards
    table = CostTable([0.01, 0.02])
    for phase in range(8):
        slow = 2.0 if phase % 2 else 1.0
        for i in range(100):
            w = 2 if i % 10 == 0 else 1
            table.observe([w], table.measured(w) * slow * (1.5 if w == 2 else 1.0))
        assert table(1) == pytest.approx(0.01 * slow, rel=0.05)
        if phase:
            assert table(2) / table(1) == pytest.approx(2 * 1.5, rel=0.1)


def test_a_tree_forward_teaches_the_tree_factor_not_the_chains_shape():
    # every forward scoring a tree of 9 nodes costs 1.07x a chain of 9 tokens (the H200's); chains
    # of 9 tokens are timed as the curve says. Before, the width's shape took the trees' 1.07 and
    # priced every 9-token chain as a tree
    table = CostTable([0.01 * (1 + 0.1 * (w - 1)) for w in range(1, 17)])
    for i in range(60):
        tree = i % 3 != 0
        table.observe([9], table.measured(9) * (1.07 if tree else 1.0), tree=tree)
        table.observe([1], table.measured(1))
    assert table.tree == pytest.approx(1.07, rel=0.01)
    assert table(9) == pytest.approx(table.measured(9), rel=0.01)
    assert table.overall == pytest.approx(1.0, rel=0.01)
    # the controller prices a tree's forward with the factor, a chain's without (9 tokens: a tree
    # 3 deep, or a chain 8 deep)
    assert scores_tree(3, 9) and not scores_tree(8, 9)
    ctl = CostAwareController(NgramDrafter(), None, table)
    assert ctl._alone_seconds(9, None, tree=True) == pytest.approx(table.tree * ctl._alone_seconds(9, None), rel=1e-9)
    # the machine turns twice as slow: the machine's factor follows, the tree factor stays
    for i in range(60):
        table.observe([9], 2 * table.measured(9) * (1.07 if i % 3 else 1.0), tree=i % 3 != 0)
        table.observe([1], 2 * table.measured(1))
    assert table.overall == pytest.approx(2.0, rel=0.02) and table.tree == pytest.approx(1.07, rel=0.02)
    # seen through trees alone, the two factors cannot be told apart, but a tree's price follows
    for _ in range(60):
        table.observe([9], 3 * 1.07 * table.measured(9), tree=True)
    assert table(9) * table.tree == pytest.approx(3 * 1.07 * table.measured(9), rel=0.02)


def test_past_the_widest_width_a_forward_costs_the_curves_marginal_rate():
    # a draft model catching up on a whole prompt: 64 more tokens at the upper half's marginal
    # rate (32 -> 64 tokens cost 6 -> 10: 0.125 a token), not 64 / 64 x 10 more
    grid = CostTable({1: 1.0, 16: 4.0, 64: 10.0})
    assert grid(128) == pytest.approx(10.0 + 64 * 0.125)
    # a curve whose top was flattened: at least half its widest cost per token
    flat = CostTable({1: 1.0, 16: 8.0, 64: 8.0})
    assert flat(128) == pytest.approx(8.0 + 64 * 8.0 / 128)
    # never more per token than the widest forward (a forward's cost per token only falls)
    steep = CostTable({1: 1.0, 32: 1.0, 64: 10.0})
    assert steep(128) == pytest.approx(20.0)
    # the replay prices a draft model's catch-up past its curve by the same rule
    from specdec_lab.replay import draft_seconds

    curve = [grid.measured(w) for w in range(1, 65)]
    assert draft_seconds(curve, 128, 1) == pytest.approx(grid(128))


# the 1.5B Q4_K_M's curve on the 2-core EPYC, seconds (every row's logits): 8 rows sit on ggml's
# tiled-matmul cliff, 7.1 single steps where 4 + 4 cost 6.3
CLIFF = CostTable(
    {1: 0.0296, 2: 0.0543, 3: 0.0758, 4: 0.0926, 5: 0.116, 6: 0.135, 7: 0.157, 8: 0.211, 9: 0.227, 10: 0.243,
     11: 0.256, 12: 0.265, 13: 0.278, 14: 0.299, 15: 0.306, 16: 0.306, 24: 0.382, 32: 0.422}
)  # fmt: skip


def test_a_forward_on_the_curves_cliff_is_split_in_two():
    from specdec.costs import SPLIT_GAIN, split_forward
    from specdec.models.base import packed
    from specdec.models.llama_cpp import stream_passes

    eight = {row: 1 for row in range(8)}
    groups, seconds = split_forward(eight, packed, CLIFF)
    assert groups == [{0: 1, 1: 1, 2: 1, 3: 1}, {4: 1, 5: 1, 6: 1, 7: 1}]  # halves in row order, not again
    assert seconds == pytest.approx(2 * CLIFF(4))
    # llama.cpp's streams: each half is one run of consecutive rows, one pass
    assert split_forward(eight, lambda fed: stream_passes(fed, 512), CLIFF)[0] == groups
    # 4 rows of a one-token draft each are 8 tokens too
    assert split_forward({row: 2 for row in range(4)}, packed, CLIFF)[0] == [{0: 2, 1: 2}, {2: 2, 3: 2}]
    # where the curve is concave, one forward: 16 rows, 12 rows (6 + 6 cost 2% more), one row
    for fed in ({row: 1 for row in range(16)}, {row: 1 for row in range(12)}, {0: 8}):
        assert split_forward(fed, packed, CLIFF) == ([fed], pytest.approx(CLIFF(sum(fed.values()))))
    # the halves are cut nearest half the tokens: a prompt chunk beside one-token rows
    halves = split_forward({0: 1, 1: 5, 2: 1, 3: 1}, packed, lambda w, depth=None: float(w) ** 2, parts=2)[0]
    assert halves == [{0: 1, 1: 5}, {2: 1, 3: 1}]
    # a split must save SPLIT_GAIN: a curve that saves less keeps one forward
    shallow = lambda w, depth=None: 0.05 * w * (1 + SPLIT_GAIN / 2 if w >= 8 else 1)  # noqa: E731
    assert len(split_forward(eight, packed, shallow)[0]) == 1
    # at most `parts` forwards, however steep the curve
    cubic = lambda w, depth=None: float(w) ** 3  # noqa: E731
    assert len(split_forward(eight, packed, cubic)[0]) == 4
    assert len(split_forward(eight, packed, cubic, parts=2)[0]) == 2


def test_specdec_costs_says_where_a_batchs_step_is_split():
    from specdec.costs import format_curves

    curve = {"rows": 1, "depth": 128, "widths": CLIFF.widths, "seconds": CLIFF.seconds}
    assert format_curves("t", [curve]).splitlines()[-1].startswith("split: 8, 9 one-token rows go in more")
    concave = {**curve, "seconds": [0.01 * w**0.5 for w in CLIFF.widths]}
    assert format_curves("t", [concave]).splitlines()[-1].startswith("split: none")


def test_the_controller_prices_a_step_as_the_engine_splits_it():
    ctrl = CostAwareController(None, None, CLIFF)
    assert ctrl._forward_seconds({row: 1 for row in range(8)}, None) == pytest.approx(2 * CLIFF(4))
    assert ctrl._forward_seconds({row: 1 for row in range(4)}, None) == pytest.approx(CLIFF(4))


def test_a_forward_is_priced_at_its_depth():
    # timed at depth 128 (every width) and 1024 (a few): one token 10 -> 19 ms, 16 tokens 40 -> 58 ms
    table = CostTable(
        {1: 0.010, 2: 0.016, 16: 0.040, 64: 0.100}, deep={1: 0.019, 16: 0.058, 64: 0.090}, depth=128, deep_depth=1024
    )
    assert table(1, 128) == pytest.approx(0.010) and table(1, 1024) == pytest.approx(0.019)
    assert table(1) == pytest.approx(0.010)  # no depth: the curve's own
    assert table(16, 2048) == pytest.approx(0.040 + 1920 * 0.018 / 896)  # linear past the deep curve
    assert table(8, 1024) == pytest.approx(table.measured(8) + 0.009 + 7 / 15 * 0.009)  # slopes interpolated
    assert table(2, 1024) / table(1, 1024) < table(2, 128) / table(1, 128)  # width is cheaper deep
    # 64 tokens timed faster deep than shallow: noise. Deeper is never cheaper, and a wider forward
    # gains at least a narrower one's cost per token of depth (16 tokens': 0.018 s over 896)
    assert table(64, 1024) == pytest.approx(0.118)
    assert table(1, 0) == pytest.approx(0.010 - 128 * 0.009 / 896)  # shallower than timed: the same line
    with pytest.raises(ValueError):
        CostTable({1: 0.01}, deep={1: 0.02}, depth=128, deep_depth=128)


def test_the_live_ratio_follows_the_machine_not_the_depth():
    table = CostTable({1: 0.010, 2: 0.016}, deep={1: 0.019, 2: 0.026}, depth=128, deep_depth=1024)
    for _ in range(50):
        table.observe([1], 0.019, depth=1024)  # plain steps deep in a long prompt, as timed
    assert table.overall == pytest.approx(1.0) and table(2, 1024) == pytest.approx(0.026)
    for _ in range(50):
        table.observe([1], 0.038, depth=1024)  # the machine got twice as slow
    assert table(2, 1024) == pytest.approx(0.052, rel=0.05)


def test_a_steps_depth_weighs_each_row_by_the_tokens_it_feeds():
    from specdec.costs import step_depth

    assert step_depth({0: 1, 1: 3}, {0: 100, 1: 500}) == pytest.approx(400)
    assert step_depth({}, {}) == 0.0


def test_deep_in_a_long_prompt_a_draft_pays_that_would_not_near_its_start():
    # one guess right 80% of the time (69% one standard error below, what the controller drafts on):
    # about 1.7 tokens for a 2-token forward. Near the start (depth 128) 2 tokens cost 2x one, a loss;
    # deep (depth 2000) one token is twice as dear and 2 tokens much less than twice: a gain
    table = CostTable({1: 0.010, 2: 0.020}, deep={1: 0.020, 2: 0.022}, depth=128, deep_depth=2000)
    ngram = FixedProposals([3])
    plans = {}
    for depth in (128, 2000):
        c = CostAwareController(ngram, None, table, match_prior={kind: [0.8] * 13 for kind in MatchAcceptance.KINDS})
        c.begin(0, [1] * depth)
        plans[depth] = c.draft({0: [1] * depth}, {0: 8})[0]
    assert plans[128] == (None, None)
    assert plans[2000][0] is ngram and plans[2000][1].tokens == [3]


def test_the_engine_tells_the_controller_each_steps_depth():
    seen = []

    class Recording(FixedController):
        def observe(self, outcomes, passes, target_seconds, depth=None):
            seen.append((passes, depth))

    target = ToyLM(vocab_size=32, seed=1)
    decoder = SpeculativeDecoder(target, None)
    decoder._engine = Engine(target, Recording(None, 0), [], 1)
    decoder.generate([5, 6, 7, 8, 9], max_new_tokens=4)
    # plain steps of one token over 5, 6, 7, 8 context tokens (the last token's step emits the 4th)
    assert seen == [([1], 5), ([1], 6), ([1], 7), ([1], 8)]


def test_auto_is_lossless_on_toy_models():
    target = ToyLM(vocab_size=32, seed=1)
    target.path = None
    prompt = [5, 6, 7, 5, 6, 7, 8, 5, 6]
    plain = SpeculativeDecoder(target, None).generate(prompt, max_new_tokens=60).tokens
    draft = ToyLM(vocab_size=32, seed=2, noise_from=target, noise=0.5)
    draft.path = None
    flat = CostTable({w: 0.01 for w in range(1, 17)})  # width is cheap: auto drafts, with both
    auto = SpeculativeDecoder(
        target, "auto", draft_model=draft, suffix=False, costs=(flat, CostTable({w: 0.001 for w in range(1, 17)}))
    )
    auto.engine.clock = on_virtual_clock(target, flat.measured)
    auto.controller().tree_widths = [1]  # chains: on this free curve trees would win every step (below)
    result = auto.generate(prompt, max_new_tokens=60)
    assert result.tokens == plain
    assert sum(result.stats.decisions.values()) == result.stats.steps
    assert {key.split(":")[0] for key in result.stats.decisions} >= {"ngram", "draft"}, result.stats.decisions
    assert 0 < result.stats.accepted < result.stats.drafted
    assert result.stats.predicted_speedup > 1.0


def test_a_slower_machine_slows_the_draft_model_too():
    """The target's live timing teaches auto that the machine is ten times slower than its named
    curves; the draft model, on the same machine, slows as much. A draft model as dear as the target
    never pays (not even as a probe), and once the drift is learned (the first request) it still
    does not: were its curve left as named it would look a tenth of the target's cost and be drafted
    with."""
    target = ToyLM(vocab_size=32, seed=1)
    target.path = None
    draft = ToyLM(vocab_size=32, seed=2, noise_from=target, noise=0.1)
    draft.path = None
    flat = CostTable({w: 0.01 for w in range(1, 17)})
    auto = SpeculativeDecoder(
        target, "auto", draft_model=draft, suffix=False, costs=(flat, CostTable({w: 0.01 for w in range(1, 17)}))
    )
    auto.engine.clock = on_virtual_clock(target, lambda w: 10 * flat.measured(w))
    auto.generate([9, 3, 14, 27, 5, 11], max_new_tokens=60)
    result = auto.generate([9, 3, 14, 27, 5, 11], max_new_tokens=60)
    assert not any(key.startswith("draft") for key in result.stats.decisions), result.stats.decisions
    assert auto.engine.controller.target_cost.overall == pytest.approx(10, rel=0.05)


def test_copied_runs_earn_long_drafts():
    """As a copy goes on, prompt lookup's match grows and the controller drafts longer; after a
    miss the match is short again and so are the drafts."""
    ngram = FixedProposals(range(100, 120))
    ngram.last_match_length = 1
    c = controller(CURVE, ngram=ngram)
    lengths = []
    for _ in range(30):
        drafter, draft = c.draft([1, 2], room=100)
        k = len(draft.tokens) if draft else 0
        lengths.append(k)
        emitted = list(range(100, 100 + k + 1))  # the target agrees with every guess
        c.observe(drafter, draft, k, emitted, k + 1, CURVE[k])
        ngram.last_match_length += len(emitted)  # ... so the copied run grows
    assert lengths[0] == 0 and lengths[-1] == 15 and lengths == sorted(lengths)
    drafter, draft = c.draft([1, 2], room=100)
    c.observe(drafter, draft, 0, [7], len(draft.tokens) + 1, CURVE[len(draft.tokens)])  # a miss ends the run
    ngram.last_match_length = 1
    _, after = c.draft([1, 2], room=100)
    assert after is None or len(after.tokens) <= 2


def test_match_acceptance_learns_per_match_length():
    acc = MatchAcceptance()
    for table in acc.tables.values():
        table[:] = 0.5
    # a draft from a 4-token match: guesses at lengths 4, 5, 6; the first two right, the third wrong
    for _ in range(100):
        acc.observe(4, checked=3, matched=2, kind="agreed")
    b = MatchAcceptance.bucket
    first, later = acc.tables["agreed"], acc.tables["later"]
    assert first[b(4)] > 0.99 and later[b(5)] > 0.99 and later[b(6)] < 0.01
    assert first[b(5)] == 0.5 and later[b(4)] == 0.5 and later[b(100)] == 0.5  # unseen: prior
    assert (acc.tables["split"] == 0.5).all() and (acc.tables["single"] == 0.5).all()
    # P(first i accepted) multiplies h along the growing match: h(4) h(5) h(6) ...
    np.testing.assert_allclose(acc.expected_tokens(4, 3, "agreed"), [1, 2, 3, 3], atol=0.02)
    np.testing.assert_allclose(acc.expected_tokens(4, 1, "split"), [1, 1.5])
    assert b(1) == 0 and b(7) == b(6) and b(64) == b(1000) == len(first) - 1


def test_evidence_of_a_first_guess():
    assert MatchAcceptance.evidence((1, 1)) == "single"
    assert MatchAcceptance.evidence((3, 3)) == "agreed"
    assert MatchAcceptance.evidence((2, 3)) == "split"


def test_guesses_earlier_occurrences_disagree_on_are_not_drafted():
    """Same match length, same costs: drafted when every earlier occurrence continued the same
    way, not when they split."""
    ngram = FixedProposals(range(100, 120))
    ngram.last_match_length = 3
    ngram.last_votes = (4, 4)
    drafter, draft = controller(CURVE, ngram=ngram).draft([1, 2], room=100)
    assert drafter is ngram and len(draft.tokens) >= 1
    ngram.last_votes = (1, 4)
    assert controller(CURVE, ngram=ngram).draft([1, 2], room=100) == (None, None)


# -- width allocation over rows ------------------------------------------------------------------


def allocate(costs, rows=4, prior=0.8, passes=packed):
    c = CostAwareController(FixedProposals(range(30)), None, costs, passes=passes)
    for table in c.ngram_accept.tables.values():
        table[:] = prior
    for row in range(rows):
        c.begin(row, [1, 2])
    plan = c.draft({row: [1, 2] for row in range(rows)}, {row: 100 for row in range(rows)})
    return {row: len(draft.tokens) if draft else 0 for row, (_, draft) in plan.items()}


def test_a_flat_curve_drafts_for_every_row():
    ks = allocate({1: 0.03, 8: 0.03, 16: 0.031, 32: 0.06, 64: 0.12}, rows=4)
    assert all(k >= 1 for k in ks.values()), ks


def test_a_linear_curve_drafts_for_no_row():
    ks = allocate({w: 0.03 * w for w in (1, 2, 4, 8, 16, 32, 64)}, rows=4)
    assert set(ks.values()) == {0}


def test_width_goes_where_it_pays_most():
    """Same costs, two rows: the row whose guesses are trusted gets the draft tokens."""
    c = CostAwareController(FixedProposals(range(30)), None, CURVE)
    for row in (0, 1):
        c.begin(row, [1, 2])
    good, bad = FixedProposals(range(30)), FixedProposals(range(30))
    good.last_match_length, bad.last_match_length = 40, 1
    c.ngram.propose = lambda contexts, ks: {
        0: good.propose({0: 0}, {0: ks[0]})[0],
        1: bad.propose({1: 0}, {1: ks[1]})[1],
    }
    plan = c.draft({0: [1, 2], 1: [1, 2]}, {0: 15, 1: 15})
    assert len(plan[0][1].tokens) > 0 and plan[1] == (None, None)


def test_an_uneven_draft_over_llama_streams_pays_for_its_extra_pass():
    """llama.cpp's per-row streams split a forward into equal passes (models.llama_cpp.stream_passes):
    row 0 drafting k beside row 1's one token is a pass of 2 and one of k. On a flat curve (each
    pass costs the same) a half-trusted draft for row 0 alone pays where the rows are packed into
    one pass, not where it costs a second; drafts for both rows stay one pass and pay there too."""
    from specdec.models.llama_cpp import stream_passes  # pure arithmetic: no llama.cpp needed

    flat = {w: 0.03 for w in (1, 2, 4, 8, 16, 32)} | {64: 0.06}

    def drafts(passes, caps):
        c = CostAwareController(FixedProposals(range(30)), None, flat, passes=passes)
        for table in c.ngram_accept.tables.values():
            table[:] = 0.5
        for row in caps:
            c.begin(row, [1, 2])
        plan = c.draft({row: [1, 2] for row in caps}, caps)
        return [len(draft.tokens) if draft else 0 for _, draft in plan.values()]

    streams = lambda fed: stream_passes(fed, 512)  # noqa: E731
    alone = {0: 100, 1: 0}  # row 1 may not draft (its token budget is spent)
    assert drafts(packed, alone)[0] > 0
    assert drafts(streams, alone) == [0, 0]
    assert min(drafts(streams, {0: 100, 1: 100})) > 0


def test_a_free_proposal_is_valued_up_to_its_first_eog():
    """Prompt lookup copying its prompt runs into the prompt's end-of-turn token and on into the
    chat template: auto drafts up to that token, never the width past it."""
    proposal = list(range(100, 120)) + [99] + list(range(120, 160))
    ks = {}
    for stops in (frozenset(), frozenset({99})):
        c = CostAwareController(FixedProposals(proposal), None, STEEP_THEN_FLAT, stops=stops)
        for table in c.ngram_accept.tables.values():
            table[:] = 0.99
        c.begin(0, [1, 2])
        [(drafter, draft)] = c.draft({0: [1, 2]}, {0: 63}).values()
        ks[bool(stops)] = draft.tokens
    assert len(ks[False]) > 21 and ks[True] == proposal[:21]


def test_one_row_allocation_is_the_single_row_argmax():
    """At one row, the allocation is argmax_k E[k] / cost(k + 1) over k = 0..cap (a draft only where it beats plain)."""
    for prior in (0.3, 0.5, 0.7, 0.9, 0.97):
        c = controller(CURVE, ngram=FixedProposals(range(20)), ngram_prior=prior)
        _, draft = c.draft([1, 2, 3], room=100)
        expected = c.ngram_accept.expected_tokens(40, 15, cautious=True)
        values = expected / np.array([c.target_cost(k + 1) for k in range(16)])
        k = int(np.argmax(values))
        if values[k] <= values[0]:
            k = 0
        assert (len(draft.tokens) if draft else 0) == k


def test_padded_width_fills_rows_to_the_longest():
    """On a padded backend (torch) every row pays for the longest draft: what one row drafts, the
    others may draft for free, so they do."""
    padded = lambda fed: [len(fed) * max(fed.values())]  # noqa: E731
    ks = allocate({1: 0.03, 4: 0.03, 16: 0.04, 64: 0.2}, rows=4, prior=0.6, passes=padded)
    assert len(set(ks.values())) == 1 and min(ks.values()) >= 1, ks


def test_auto_drafts_in_a_batch_where_it_pays():
    """Toy target, prompts that repeat themselves, and a flat cost curve (as on a GPU): auto drafts
    with prompt lookup for every row of the batch, and each row equals its solo greedy run."""
    target = ToyLM(vocab_size=32, seed=1)
    target.path = None
    prompts = [[5, 6, 7, 8] * 6, [9, 10, 11] * 8, [4, 12, 4, 13] * 5]
    plain = [SpeculativeDecoder(target, None).generate(p, max_new_tokens=40).tokens for p in prompts]
    flat = CostTable({w: 0.01 for w in range(1, 17)} | {24: 0.0101, 32: 0.0102, 48: 0.0103, 64: 0.0104})
    auto = SpeculativeDecoder(target, "auto", suffix=False, costs=(flat, None))
    auto.engine.clock = on_virtual_clock(target, flat.measured)  # what it learns live is the curve
    results = auto.generate_batch(prompts, max_new_tokens=40)
    assert [r.tokens for r in results] == plain
    assert all(r.stats.drafted > 0 for r in results)


def test_a_given_target_curve_without_the_draft_models_has_the_draft_model_timed(monkeypatch):
    """costs=(the target's curve, None) with a draft model (as --costs gives from a report without
    it): the target's curve is taken as given and the draft model's is timed, so auto may draft
    with it (without a curve it never would)."""
    from specdec import costs as cost_module

    target, draft = ToyLM(vocab_size=32, seed=1), ToyLM(vocab_size=32, seed=2)
    target.path = draft.path = None
    timed = []
    real = cost_module.measure_cost_table
    monkeypatch.setattr(cost_module, "measure_cost_table", lambda model: timed.append(model) or real(model))
    flat = CostTable({w: 0.01 for w in range(1, 17)})
    auto = SpeculativeDecoder(target, "auto", draft_model=draft, suffix=False, costs=(flat, None))
    controller = auto.controller()
    assert timed == [draft] and controller.target_cost.base == flat.base
    assert controller.draft_cost is not None


def test_a_curve_timed_on_a_busy_machine_is_not_cached(tmp_path, monkeypatch, capsys):
    from specdec.costs import machine_was_busy

    quiet = {1: [0.040, 0.041, 0.040], 4: [0.125, 0.127, 0.126], 16: [0.25, 0.26, 0.25]}
    costs = {w: min(t) for w, t in quiet.items()}
    assert machine_was_busy(quiet, costs) == ""
    contended = {w: [t[0], 2 * t[1], 3 * t[2]] for w, t in quiet.items()}  # another process on a core
    assert "repeats differ" in machine_was_busy(contended, costs)
    superlinear = {**costs, 16: 0.040 * 17.9}  # the curve that was cached once
    assert "16 tokens cost 17.9x" in machine_was_busy(quiet, superlinear)

    # end to end: a busy timing warns, is used, and is not written to the cache
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    monkeypatch.setattr("specdec.costs.machine_was_busy", lambda times, costs, retimed=(): "repeats differ")
    model = ToyLM(vocab_size=32, n_ctx=512)
    model.path = tmp_path / "toy.gguf"
    model.path.write_bytes(b"toy")
    costs = measure_forward_costs(model, widths=[1, 2], repeats=1)
    assert list(costs) == [1, 2]
    assert "machine was busy" in capsys.readouterr().err
    assert not list(tmp_path.glob("costs/*.json"))


def test_a_width_dearer_than_its_tokens_is_timed_again_and_kept_where_it_holds(tmp_path, monkeypatch, capsys):
    """Some kernels make a forward of W tokens cost more than W of one (this CPU's 0.5B Q8_0: 2
    tokens 2.5x one, repeats agreeing): timed again beside the one-token forward it holds, so the
    curve is the model's and is cached without a warning. A slow spell on that width, gone when it
    is timed again, leaves the quiet cost (also cached)."""
    from specdec import costs as costs_module

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    now = [0.0]
    monkeypatch.setattr(costs_module.time, "perf_counter", lambda: now[0])

    class Timed(ToyLM):
        """Each forward of W tokens advances the clock by seconds(W, the n-th such forward)."""

        def __init__(self, seconds):
            super().__init__(vocab_size=32, n_ctx=512)
            self.seconds, self.calls = seconds, {}
            self.path = tmp_path / f"toy-{id(self)}.gguf"
            self.path.write_bytes(b"toy")

        def forward_rows(self, tokens, n_logits=None):
            w = max(len(t) for t in tokens.values())
            self.calls[w] = self.calls.get(w, 0) + 1
            now[0] += self.seconds(w, self.calls[w])
            return super().forward_rows(tokens, n_logits)

    steep = Timed(lambda w, n: 0.010 * (2.5 if w == 2 else w))
    costs = measure_forward_costs(steep, widths=[1, 2, 4], repeats=3)
    assert costs[2] == pytest.approx(0.025) and costs[1] == pytest.approx(0.010)
    assert steep.calls[2] == 3 + 3  # 3 repeats, then 3 more beside width 1's
    assert "busy" not in capsys.readouterr().err
    assert len(list(tmp_path.glob("costs/*.json"))) == 1  # cached

    # a spell: width 2's first three forwards slow, then quiet
    spell = Timed(lambda w, n: 0.010 * (3.0 if w == 2 and n <= 3 else w))
    costs = measure_forward_costs(spell, widths=[1, 2, 4], repeats=3)
    assert costs[2] == pytest.approx(0.020)
    assert "busy" not in capsys.readouterr().err
    assert len(list(tmp_path.glob("costs/*.json"))) == 2


# -- several free drafters (prompt lookup and the suffix cache) ---------------------------------


def test_each_row_takes_the_free_drafter_that_promises_most_and_both_are_scored():
    ngram, suffix = FixedProposals(range(20)), FixedProposals(range(100, 120), "suffix")
    ngram.last_match_length, suffix.last_match_length = 2, 40
    c = controller(CURVE, ngram=[ngram, suffix])
    drafter, draft = c.draft([1, 2, 3], room=100)
    assert drafter is suffix and draft.tokens[:2] == [100, 101]
    assert c.decisions == {f"suffix:{len(draft.tokens)}": 1}
    prior = {name: {kind: t.copy() for kind, t in acc.tables.items()} for name, acc in c.match_accept.items()}
    c.observe(drafter, draft, len(draft.tokens), [*draft.tokens, 7], 1 + len(draft.tokens), 0.05)
    # the unused prompt lookup is scored too (shadow), in its own table: its first guess was wrong
    b2, b40 = MatchAcceptance.bucket(2), MatchAcceptance.bucket(40)
    assert c.match_accept["ngram"].tables["single"][b2] < prior["ngram"]["single"][b2]
    assert c.match_accept["suffix"].tables["single"][b40] > prior["suffix"]["single"][b40]
    assert c.match_accept["suffix"].tables["single"][b2] == prior["suffix"]["single"][b2]
    # the other way round, prompt lookup wins
    ngram.last_match_length, suffix.last_match_length = 40, 1
    assert controller(CURVE, ngram=[ngram, suffix]).draft([1, 2, 3], room=100)[0] is ngram


def test_free_drafters_need_distinct_names():
    with pytest.raises(ValueError, match="distinct names"):
        CostAwareController([FixedProposals([1]), FixedProposals([2])], None, CURVE)


# -- per-request overlay -----------------------------------------------------------------------


def test_a_request_reaches_its_own_rate_within_a_few_dozen_guesses():
    """The shared table says 0.3 for 16-token matches; this request's copies are always right. Its
    overlay estimate passes 0.8 within 30 guesses, the shared table moves only at its rate, a cell
    the request never saw moves with its kind, and a new request starts from the shared table."""
    from specdec.controller import MatchAcceptance

    acc = MatchAcceptance({kind: [0.3] * 13 for kind in MatchAcceptance.KINDS}, rate=0.01)
    mine = acc.overlay(weight=8.0)
    b = MatchAcceptance.bucket(16)
    estimates = []
    for _ in range(30):
        acc.observe(16, checked=1, matched=1, kind="single", overlay=mine)
        estimates.append(acc.expected_tokens(16, 1, "single", mine)[1] - 1)
    assert estimates[0] < 0.4 and estimates[-1] > 0.8 and all(np.diff(estimates) > 0)
    assert acc.tables["single"][b] < 0.3 + 30 * 0.01 * 0.7 + 1e-9  # the shared table: slowly
    assert acc.expected_tokens(12, 1, "single", mine)[1] - 1 > 0.8  # a 12-token match: pooled
    assert acc.expected_tokens(2, 1, "single", mine)[1] - 1 == pytest.approx(0.3)  # a short one: not
    assert acc.expected_tokens(16, 1, "split", mine)[1] - 1 == pytest.approx(0.3)  # another kind: not
    fresh = acc.overlay(weight=8.0)
    assert acc.expected_tokens(16, 1, "single", fresh)[1] - 1 == pytest.approx(acc.tables["single"][b])


def test_the_draft_models_overlay_follows_the_request():
    acc = Acceptance(prior=[0.9] * 15, rate=0.01)
    mine = Overlay(1, weight=8.0)
    for _ in range(40):
        acc.observe(4, 0, mine)  # every draft's first token rejected
    assert acc.expected_tokens(1, mine)[1] < 1.25 and acc.expected_tokens(1)[1] > 1.6
    assert mine.n[0] == 40 and mine.r[0] == 0  # only position 0 was ever examined


def test_auto_keeps_an_overlay_per_row():
    c = CostAwareController(FixedProposals(range(30)), None, CURVE)
    c.begin(0, [1, 2])
    c.begin(1, [1, 2])
    assert c._rows[0].overlays["ngram"] is not c._rows[1].overlays["ngram"]
    assert c._rows[0].overlays["ngram"].weight == c.overlay_weight


# -- the draft model at batch > 1 ----------------------------------------------------------------


class BatchModel(FixedProposals):
    """A draft model for every row: records each propose call's rows and ks, and lags `lag` tokens."""

    def __init__(self, tokens, lag=1):
        super().__init__(tokens, name="draft:m")
        self.calls, self._lag = [], lag

    def lag(self, row, context):
        return self._lag

    def propose(self, contexts, ks, leaves=None):
        self.calls.append(dict(ks))
        return super().propose(contexts, ks, leaves=leaves)


def model_controller(target_costs, draft_costs, rows: int, prior: float, lag: int = 1, **kw):
    model = BatchModel(range(30), lag=lag)
    c = CostAwareController(None, model, target_costs, draft_costs, draft_prior=prior, **kw)
    for row in range(rows):
        c.begin(row, [1, 2])
    return c, model


def test_a_batch_drafts_with_the_draft_model_in_one_call_where_it_pays():
    """Four rows, a draft model that is usually right, a cheap one and a flat target curve: every
    row drafts with it, in one propose call; where its forwards cost as much as the target's, none."""
    flat, cheap = {w: 0.03 for w in (1, 16, 64)}, {w: 0.001 for w in (1, 16, 64)}
    c, model = model_controller(flat, cheap, rows=4, prior=0.9)
    plan = c.draft({row: [1, 2] for row in range(4)}, {row: 100 for row in range(4)})
    assert all(drafter is model and len(draft.tokens) >= 2 for drafter, draft in plan.values()), plan
    assert len(model.calls) == 1 and set(model.calls[0]) == {0, 1, 2, 3}
    c, model = model_controller(flat, {w: 0.03 for w in (1, 16, 64)}, rows=4, prior=0.9)
    plan = c.draft({row: [1, 2] for row in range(4)}, {row: 100 for row in range(4)})
    assert all(p == (None, None) for p in plan.values()) and not model.calls


def test_the_draft_models_forwards_are_priced_over_the_rows_still_drafting():
    """A step's seconds: the target over every row's k + 1, the draft model's catch-up over the
    rows' summed lags, then one draft forward per position over the rows that draft that far."""
    from specdec.controller import _Option

    target = {w: 0.01 * w for w in range(1, 65)}
    draft = {w: 0.001 + 0.0001 * w for w in range(1, 65)}
    c, _ = model_controller(target, draft, rows=3, prior=0.5, lag=3)
    options = {
        0: _Option("draft", np.ones(6), lag=3),
        1: _Option("draft", np.ones(6), lag=5),
        2: _Option("plain", np.ones(1)),
    }
    ks = {0: 4, 1: 2, 2: 0}
    d = lambda w: 0.001 + 0.0001 * w  # noqa: E731
    expected = 0.01 * (5 + 3 + 1) + d(3 + 5) + d(2) + d(1) + d(1)  # positions 2, 3, 4: rows 0+1, 0, 0
    assert c._step_cost(ks, options) == pytest.approx(expected)
    assert c._step_cost({0: 0, 1: 0, 2: 0}, options) == pytest.approx(0.03)  # plain: no draft forward


def test_each_row_of_a_batch_probes_the_draft_model_now_and_then():
    """The draft model's estimate is 0 (it never pays by its estimate) but a perfect draft would:
    each row probes it with one token every explore_every steps, then ever more rarely."""
    flat, cheap = {w: 0.03 for w in (1, 16, 64)}, {w: 0.001 for w in (1, 16, 64)}
    c, model = model_controller(flat, cheap, rows=2, prior=0.0, explore_every=4, explore_growth=2.0)
    probes = {0: [], 1: []}
    for step in range(1, 30):
        plan = c.draft({0: [1, 2], 1: [1, 2]}, {0: 100, 1: 100})
        for row, (drafter, draft) in plan.items():
            if drafter is model:
                assert len(draft.tokens) == 1
                probes[row].append(step)
        c.observe({row: Outcome(d, dr, 0, [7]) for row, (d, dr) in plan.items()}, [2], 0.03)
    assert probes[0] == probes[1] == [4, 12, 28], probes
    assert all(len(call) == 2 for call in model.calls)  # the rows' probes share one call


def _copy_row_and_three_others(objective: str, rows: int = 4, curve=STEEP_THEN_FLAT) -> dict[int, int]:
    """Row 0 inside a long sure copy, the others with nothing to copy, on a steep-then-flat curve:
    each row's k."""
    c = CostAwareController(FixedProposals(range(40)), None, curve, objective=objective)
    for table in c.ngram_accept.tables.values():
        table[:] = 0.99
    for row in range(rows):
        c.begin(row, [1, 2])
    c.ngram.propose = lambda contexts, ks: {
        row: Draft(list(range(40))[: ks[row]], evidence={"match": 40}) for row in ks if row == 0
    }
    plan = c.draft({row: [1, 2] for row in range(rows)}, {row: 63 for row in range(rows)})
    return {row: len(draft.tokens) if draft else 0 for row, (_, draft) in plan.items()}


def test_latency_first_keeps_one_rows_long_draft_from_slowing_the_others():
    """Throughput first, the copying row drafts long: the batch's tokens per second rise though
    the three other streams each get one token per much longer step. Latency first (the rows' own
    speeds, geometric mean), that step is not worth it."""
    throughput, latency = _copy_row_and_three_others("throughput"), _copy_row_and_three_others("latency")
    assert throughput[0] >= 16 and set(throughput.values()) - {throughput[0]} == {0}, throughput
    assert latency == {0: 0, 1: 0, 2: 0, 3: 0}, latency
    assert _copy_row_and_three_others("throughput", rows=1)[0] >= 16


def test_latency_first_bounds_a_step_to_latency_step_plain_steps():
    """Latency first, even a row alone drafts no further than keeps its step within LATENCY_STEP
    (2) plain steps: on a curve where each token adds a quarter of a plain step, 4 draft tokens
    (5 scored: exactly 2 steps), though the sure copy would pay further (throughput first: 8 or more).
    On a flat curve the bound never binds: alone, latency drafts as long as throughput."""
    from specdec.controller import LATENCY_STEP

    assert LATENCY_STEP == 2.0
    assert _copy_row_and_three_others("latency", rows=1, curve=QUARTER_A_TOKEN) == {0: 4}
    assert _copy_row_and_three_others("throughput", rows=1, curve=QUARTER_A_TOKEN)[0] >= 8
    flat = {w: 0.04 for w in list(range(1, 17)) + [24, 32, 48, 64]}
    alone = _copy_row_and_three_others("latency", rows=1, curve=flat)
    assert alone == _copy_row_and_three_others("throughput", rows=1, curve=flat) and alone[0] >= 16


def test_bounded_drafts_for_the_batch_within_latency_step_plain_steps():
    """Objective "bounded": the batch's tokens per second, as throughput first, but no step past
    LATENCY_STEP plain steps. On a curve where each token adds a quarter of a plain step, with
    four rows (a plain step scores 4 tokens, 1.75 units), the copying row drafts 7 (11 scored:
    3.5 units, exactly 2 plain steps) where throughput first drafts further and latency first, which
    weighs the three other streams' slowdown, drafts 1. Alone, it is latency first's bound."""
    bounded = _copy_row_and_three_others("bounded", curve=QUARTER_A_TOKEN)
    assert bounded == {0: 7, 1: 0, 2: 0, 3: 0}, bounded
    assert _copy_row_and_three_others("throughput", curve=QUARTER_A_TOKEN)[0] > 7
    assert _copy_row_and_three_others("latency", curve=QUARTER_A_TOKEN)[0] < 7
    assert _copy_row_and_three_others("bounded", rows=1, curve=QUARTER_A_TOKEN) == {0: 4}
    # where a plain step's tokens cost what a draft's do (the steep part of the curve), none pays
    assert _copy_row_and_three_others("bounded") == {0: 0, 1: 0, 2: 0, 3: 0}


def test_under_the_step_bound_a_row_takes_the_drafter_whose_affordable_draft_pays():
    """Where the bound lets a row draft one token only (a 2-token forward costs 1.9 plain steps, 3
    tokens more than 2), its drafter is chosen by that token: the suffix cache's sure first guess,
    not prompt lookup's long copy behind an unsure first guess, which throughput first (no bound)
    rightly drafts dozens deep. Pricing the copy past the bound had left the row a plain step."""
    curve = {1: 0.04, 2: 0.076, **{w: 0.04 * (2.1 + 0.05 * (w - 3)) for w in list(range(3, 17)) + [24, 32, 48, 64]}}

    def first_choice(objective):
        ngram, suffix = FixedProposals(range(40)), FixedProposals(range(100, 140), "suffix")
        c = CostAwareController([ngram, suffix], None, curve, objective=objective)
        for name, first, later in (("ngram", 0.6, 0.99), ("suffix", 0.99, 0.3)):
            for kind, table in c.match_accept[name].tables.items():
                table[:] = later if kind == "later" else first
        c.begin(0, [1, 2])
        drafter, draft = c.draft({0: [1, 2]}, {0: 63})[0]
        return (drafter.name, len(draft.tokens)) if drafter else None

    assert first_choice("bounded") == first_choice("latency") == ("suffix", 1)
    drafter, k = first_choice("throughput")
    assert drafter == "ngram" and k >= 16


def test_bounded_spends_its_tail_budget_on_a_long_sure_copy():
    """Under "bounded" with a tail budget (long_step_share), a step may pass the bound once the
    budget holds a whole step's credit (one every 1 / share steps), and only for a draft that
    saves at least LONG_STEP_SAVING plain steps against drafting within the bound. On a curve
    where 2 tokens cost 1.8 plain steps and every token past 3 a twentieth of one, a row alone in
    a sure copy drafts 1 token a step (the bound's), and every fourth step the whole copy, as
    throughput first would; an unsure copy saves nothing, and the credit waits (up to its cap)."""
    from specdec.controller import LONG_STEP_CREDIT

    curve = {1: 0.04, 2: 0.072, **{w: 0.1 + 0.002 * (w - 3) for w in list(range(3, 17)) + [24, 32, 48, 64]}}

    def run(rate: float, share: float = 0.25) -> tuple[list[int], CostAwareController]:
        c = CostAwareController(FixedProposals(range(40)), None, curve, objective="bounded", long_step_share=share)
        for table in c.ngram_accept.tables.values():
            table[:] = rate
        c.begin(0, [1, 2])
        c.ngram.propose = lambda contexts, ks: {0: Draft(list(range(40))[: ks[0]], evidence={"match": 40})}
        ks = []
        for _ in range(8):
            _, draft = c.draft({0: [1, 2]}, {0: 63})[0]
            ks.append(len(draft.tokens) if draft else 0)
        return ks, c

    ks, c = run(0.99)
    assert ks[:3] == ks[4:7] == [1, 1, 1] and ks[3] == ks[7] >= 16 and c.long_steps == 2, ks
    assert run(0.99, share=0.0)[0] == [1] * 8  # no budget: the bound every step
    ks, c = run(0.5, share=0.75)
    assert max(ks) <= 1 and c.long_steps == 0 and c._credit == LONG_STEP_CREDIT, ks  # 8 x 0.75 past the cap
    with pytest.raises(ValueError, match="long_step_share"):
        CostAwareController(None, None, CURVE, objective="bounded", long_step_share=1.0)


def test_the_tail_budget_banks_a_burst_for_a_copy_that_comes_late():
    """Credit earned while nothing was worth a long step waits, up to LONG_STEP_CREDIT, for a copy
    that comes later: its first LONG_STEP_CREDIT steps all pass the bound (a cap of 2 spent itself
    on the copy's first two long steps), then one every 1 / share steps."""
    from specdec.controller import LONG_STEP_CREDIT

    curve = {1: 0.04, 2: 0.072, **{w: 0.1 + 0.002 * (w - 3) for w in list(range(3, 17)) + [24, 32, 48, 64]}}
    c = CostAwareController(FixedProposals(range(40)), None, curve, objective="bounded", long_step_share=0.1)
    c.begin(0, [1, 2])
    c.ngram.propose = lambda contexts, ks: {0: Draft(list(range(40))[: ks[0]], evidence={"match": 40})}

    def steps(rate: float, n: int) -> list[int]:
        for table in c.ngram_accept.tables.values():
            table[:] = rate
        ks = []
        for _ in range(n):
            _, draft = c.draft({0: [1, 2]}, {0: 63})[0]
            ks.append(len(draft.tokens) if draft else 0)
        return ks

    assert max(steps(0.5, 60)) <= 1 and c._credit == LONG_STEP_CREDIT == 5  # an unsure copy: none
    ks = steps(0.99, 10)
    assert min(ks[:5]) >= 16 and ks[5:] == [1] * 5 and c.long_steps == 5, ks


def test_the_tail_budget_prices_no_long_step_where_nothing_uncut_could_save_enough():
    """A long step of E expected tokens saves at most E / rows - 1 plain steps, so where no ask the
    bound cut could promise LONG_STEP_SAVING + 1 tokens a row, were it asked for more (no proposal,
    a copy that ends within the bound, an unsure one), the unbounded pass is not run at all: the
    credit waits at its cap and each step is priced once. A sure copy the bound cuts is priced
    past it (the test above)."""
    from specdec.controller import LONG_STEP_CREDIT

    # a plain step 0.04 s: the bound (2 plain steps) allows 4 draft tokens
    curve = {1: 0.04, 2: 0.05, 3: 0.06, 4: 0.07, 5: 0.078, **{w: 0.1 + 0.01 * w for w in list(range(6, 17)) + [32, 64]}}
    # no match; a sure copy that ends 2 tokens on, within the bound; a long copy the bound cuts, but
    # half of whose guesses are kept
    for proposal, rate in (([], 0.99), ([7, 8], 0.99), (list(range(40)), 0.5)):
        c = CostAwareController(FixedProposals(range(40)), None, curve, objective="bounded", long_step_share=0.75)
        for table in c.ngram_accept.tables.values():
            table[:] = rate
        c.begin(0, [1, 2])
        c.ngram.propose = lambda contexts, ks, p=proposal: {0: Draft(p[: ks[0]], evidence={"match": 40})}
        priced = []
        inner = c._options
        c._options = lambda *a, priced=priced, inner=inner: (priced.append(1), inner(*a))[1]
        for _ in range(8):
            c.draft({0: [1, 2]}, {0: 63})
        assert len(priced) == 8 and c.long_steps == 0 and c._credit == LONG_STEP_CREDIT, proposal


def test_expected_tokens_are_numpys_cumulative_products_and_sums_bit_for_bit():
    """The tables price E[k] in Python (acceptance.emitted_tokens): the same floats as
    1 + [0, cumsum(cumprod(a))], for the draft model's table and prompt lookup's, with and without
    an overlay and the cautious rates, so that auto's decisions do not move by a rounding."""
    from specdec.acceptance import MATCH_BUCKETS, cautious_rates, emitted_tokens

    rng = np.random.default_rng(3)
    for _ in range(300):
        a = rng.random(int(rng.integers(0, 70)))
        assert np.array_equal(emitted_tokens(a.tolist()), 1.0 + np.concatenate([[0.0], np.cumsum(np.cumprod(a))]))
        h = float(rng.random())
        assert cautious_rates(h, 0.1) == cautious_rates(np.array([h]), 0.1)[0]
    acc = MatchAcceptance({kind: rng.random(13).tolist() for kind in MatchAcceptance.KINDS}, rate=0.1)
    overlay = acc.overlay(8.0)
    for group in range(8):
        overlay.observe(group, bool(group % 2), 0.6)
    for m in (1, 5, 7, 30, 70):
        for k in (0, 1, 6, 40):
            for kind in MatchAcceptance.KINDS:
                for ov in (None, overlay):
                    a = np.array([acc._estimate(kind if i == 0 else "later", acc.bucket(m + i), ov) for i in range(k)])
                    for cautious in (False, True):
                        rates = cautious_rates(a, acc.rate) if cautious else a
                        want = 1.0 + np.concatenate([[0.0], np.cumsum(np.cumprod(rates))])
                        assert np.array_equal(acc.expected_tokens(m, k, kind, ov, cautious), want), (m, k, kind)
    assert MATCH_BUCKETS[-1] < 70 + 40  # the last bucket, open-ended, was priced too


def test_a_one_row_price_follows_the_curve_the_last_forward_taught():
    """One row's forward is priced once a step (_alone_seconds); a forward observed since makes a new
    price, not the one from before it (a stale price would draft on a machine that has slowed)."""
    table = CostTable([0.01 * (1 + 0.5 * (w - 1)) for w in range(1, 17)])
    ctl = CostAwareController(NgramDrafter(), None, table)
    ctl.begin(0, [1, 2, 3])
    before = ctl._forward_seconds({0: 2}, 3)
    assert ctl._forward_seconds({5: 2}, 3) == before == ctl._alone_seconds(2, 3)  # any one row alike
    for _ in range(10):
        ctl.observe({}, [1], 3 * table.at_depth(1, 3), 3)  # the machine is three times as slow
    assert ctl._forward_seconds({0: 2}, 3) == pytest.approx(3 * before, rel=0.05)
    # two rows are priced by their passes, never from one row's price
    assert ctl._forward_seconds({0: 1, 1: 1}, 3) == pytest.approx(table(2, 3), rel=1e-12)


def test_an_unknown_objective_is_refused():
    with pytest.raises(ValueError, match="objective must be one of throughput, latency, bounded"):
        CostAwareController(None, None, CURVE, objective="fast")


def test_the_controller_drafts_on_rates_one_standard_error_below_the_estimate():
    """A moving average at rate r weighs about (2 - r) / r observations: at r = 0.15 a rate of 0.99
    is known to about 0.027, and a sure or hopeless one exactly; the estimate itself is unchanged.
    So for prompt lookup's and the suffix cache's tables and for the draft model's alike, and the
    controller prices the draft model's chain on the cautious rates."""
    from specdec.acceptance import cautious_rates

    np.testing.assert_allclose(
        cautious_rates(np.array([0.99, 1.0, 0.0, 0.5]), 0.15), [0.9627, 1.0, 0.0, 0.3631], atol=1e-4
    )
    acc = MatchAcceptance({kind: [0.99] * 13 for kind in MatchAcceptance.KINDS}, rate=0.15)
    np.testing.assert_allclose(acc.expected_tokens(40, 2), [1, 1.99, 1.99 + 0.99**2])
    np.testing.assert_allclose(acc.expected_tokens(40, 2, cautious=True), [1, 1.96275, 1.96275 + 0.96275**2], atol=1e-4)
    model = Acceptance(prior=0.99, rate=0.15)
    np.testing.assert_allclose(model.expected_tokens(2), [1, 1.99, 1.99 + 0.99**2])
    np.testing.assert_allclose(model.expected_tokens(2, cautious=True), [1, 1.96275, 1.96275 + 0.96275**2], atol=1e-4)
    c = controller([1.0] * 16, model=FixedProposals(range(9), "draft:m"), draft_cost=[0.01] * 16, model_prior=0.99)
    c.begin(0, [1, 2, 3])
    option = c._options({0: [1, 2, 3]}, {0: 8})[0]
    assert option.kind == "draft"
    np.testing.assert_allclose(option.expected, c.model_accept.expected_tokens(8, cautious=True))


def test_auto_drafts_trees_where_width_is_cheap_and_chains_where_it_is_not():
    """Where the target scores trees, auto may draft the draft model's fishbone: on a flat curve it
    does (decisions "draft:KxW"), on a curve whose forward grows with every token (this CPU's
    shape) it never does; greedy output is plain greedy output either way."""
    target = ToyLM(vocab_size=32, seed=1)
    target.path = None
    prompt = [5, 6, 7, 5, 6, 7, 8, 5, 6]
    plain = SpeculativeDecoder(target, None).generate(prompt, max_new_tokens=60).tokens
    assert target.scores_trees
    for name, curve in (("flat", {w: 0.01 for w in range(1, 17)}), ("steep", {w: 0.01 * w for w in range(1, 17)})):
        draft = ToyLM(vocab_size=32, seed=2, noise_from=target, noise=1.5)
        draft.path = None
        costs = CostTable(curve)
        auto = SpeculativeDecoder(
            target, "auto", draft_model=draft, suffix=False, costs=(costs, CostTable({w: 0.0001 for w in range(1, 17)}))
        )
        auto.engine.clock = on_virtual_clock(target, costs.measured)
        result = auto.generate(prompt, max_new_tokens=60)
        assert result.tokens == plain, name
        trees = [key for key in auto.controller().decisions if "x" in key]
        assert bool(trees) == (name == "flat"), (name, auto.controller().decisions)


def test_a_chain_cut_takes_sure_tokens_as_far_as_they_pay_and_stops_at_an_unsure_one():
    """ChainCut: a token is taken while the chain's expected tokens over its seconds grow with it,
    its chance read from its confidence; fed while a next one as sure would pay. On a flat curve
    with cheap draft forwards sure tokens run on, and an unsure one is taken only where verifying
    it costs next to nothing; where every token costs a step only a near-certain one pays; a
    fishbone's siblings make an unsure depth worth it."""
    from specdec.acceptance import ConfidenceAcceptance
    from specdec.drafters.base import ChainCut

    rate_of = ConfidenceAcceptance().rate_of
    flat = lambda t: 1.0 + 0.01 * t  # noqa: E731  the target's forward verifying t tokens
    cut = ChainCut(rate_of, look=0.1, feed=0.1, target=flat)
    assert all(cut.take(0.999) and cut.feed() for _ in range(6)) and cut.fed == 6
    assert cut.take(0.2)  # its confidence is paid for: where verifying costs nothing even 39% pays
    assert cut.taken == 7 and cut.expected == pytest.approx(1 + sum(0.997**d for d in range(1, 7)) + 0.997**6 * 0.389)
    sloped = ChainCut(rate_of, look=0.1, feed=0.1, target=lambda t: 1.0 + 0.2 * t)
    assert all(sloped.take(0.999) for _ in range(6))
    assert not sloped.take(0.2)  # where each verified token costs a fifth of a step, 39% does not
    steep = ChainCut(rate_of, look=0.1, feed=0.1, target=lambda t: 1.0 + t)
    assert not steep.take(0.8)  # a token costs a whole step: 84% does not pay it
    dear = ChainCut(rate_of, look=0.1, feed=2.0, target=flat)  # a draft forward dearer than a step
    assert dear.take(0.999) and not dear.feed()  # the first token's confidence was free; the next is not
    unsure = ChainCut(rate_of, look=0.1, feed=0.1, target=lambda t: 1.0 + 0.8 * t)
    tree = ChainCut(rate_of, look=0.1, feed=0.1, target=lambda t: 1.0 + 0.8 * t, sibling=0.7)
    assert not unsure.take(0.6) and tree.take(0.6)  # 0.655, and a sibling's 0.7 where it fails


def test_auto_cuts_the_draft_models_greedy_chains_by_its_confidence_and_writes_plain_greedy():
    """auto's draft-model chains (greedy rows) are cut by the draft's confidence: on a flat curve the
    drafts' lengths follow it (not one k for every step), each draft says its tokens' confidences,
    the controller learns their rates, and greedy output is plain greedy output, alone and in a
    batch. A sampled row's chain is not cut."""
    from specdec.acceptance import CONFIDENCE_PRIOR

    target = ToyLM(vocab_size=32, seed=1)
    target.path = None
    prompts = [[5, 6, 7, 5, 6, 7, 8, 5, 6], [9, 3, 4, 9, 3]]
    plain = [SpeculativeDecoder(target, None).generate(p, max_new_tokens=60).tokens for p in prompts]
    flat = CostTable({w: 0.01 for w in range(1, 17)})
    draft = ToyLM(vocab_size=32, seed=2, noise_from=target, noise=1.5)
    draft.path = None
    auto = SpeculativeDecoder(
        target, "auto", draft_model=draft, suffix=False, costs=(flat, CostTable({w: 0.001 for w in range(1, 17)}))
    )
    auto.engine.clock = on_virtual_clock(target, flat.measured)
    controller = auto.controller()
    seen = []
    propose = controller.model.propose

    def spy(contexts, ks, widths=None, cuts=None):
        drafts = propose(contexts, ks, widths, cuts)
        seen.extend((bool(cuts) and row in cuts, d) for row, d in drafts.items())
        return drafts

    controller.model.propose = spy
    assert auto.generate(prompts[0], max_new_tokens=60).tokens == plain[0]
    assert [r.tokens for r in auto.generate_batch(prompts, max_new_tokens=60)] == plain
    cut = [d for was_cut, d in seen if was_cut]
    assert cut and all(len(d.evidence["confidence"]) == len(d.first_branch().tokens) for d in cut)
    assert len({len(d.first_branch().tokens) for d in cut}) > 1  # lengths follow the confidence
    assert not np.allclose(controller.confidence_accept.c, CONFIDENCE_PRIOR)  # it learned
    seen.clear()
    auto.generate(prompts[0], max_new_tokens=30, temperature=1.0, seed=3)
    assert seen and not any("confidence" in d.evidence for _, d in seen)  # the drafter cut none


def test_a_trees_outcome_teaches_its_chain_and_its_siblings():
    """E_w[k] adds the sibling's rate times the chance the chain fails within k; a tree's outcome
    scores the chain's positions as a chain's would, and where the chain failed, whether a sibling
    was kept (which tells every wider tree on a hit, every narrower one on a miss)."""
    from specdec.acceptance import SiblingAcceptance

    model = ModelDrafter(ToyLM(seed=4))
    auto = CostAwareController(None, model, [1.0] * 16, [0.3] * 16, tree_widths=(1, 2, 3))
    auto.begin(0, [3, 4, 5])
    chain = auto.model_accept.expected_tokens(3)
    survive = np.cumprod(auto.model_accept.a[:3])
    s2 = auto.sibling_accept.rate_at(2)
    assert auto.tree_expected(chain, 2) == pytest.approx(chain + s2 * (1 - np.concatenate([[1.0], survive])))
    assert list(auto.tree_expected(chain, 1)) == list(chain)
    a0 = auto.model_accept.a[0]
    # a 2-deep fishbone of width 2: chain [7, 8], siblings [9] and [10]; the target took 7, then 10
    tree = Draft([7, 9, 8, 10], parents=[-1, -1, 0, 0])
    before = auto.sibling_accept.s.copy()
    auto.observe({0: Outcome(model, tree, 2, [7, 10, 11])}, [5], 1.0)
    assert auto.model_accept.a[0] > a0  # the chain's first token was kept
    assert auto.model_accept.a[1] < DRAFT_PRIOR[1]  # its second was not
    assert (auto.sibling_accept.s > before).all()  # a hit at width 2: width 3 would have kept it too
    table = SiblingAcceptance()
    table.observe(3, False)
    assert table.s[2] == SiblingAcceptance().s[2]  # a miss at width 3 says nothing of width 4
    assert (table.s[:2] < SiblingAcceptance().s[:2]).all()


def test_a_tree_row_beside_chains_costs_a_forward_of_its_own():
    """The engine scores trees in a forward of their own where chains share the step: a step with a
    tree row and a chain row is priced as two forwards; trees alone, or chains alone, as one."""
    from specdec.controller import _Option

    model = ModelDrafter(ToyLM(seed=4))
    curve = {w: 1.0 + 0.1 * w for w in range(1, 33)}
    auto = CostAwareController(None, model, CostTable(curve), CostTable({w: 0.0 for w in range(1, 33)}))
    tree = _Option("draft", np.ones(4), lag=1, depth=10, width=3)
    chain = _Option("draft", np.ones(4), lag=1, depth=10)
    both = auto._step_cost({0: 2, 1: 2}, {0: tree, 1: chain})
    assert both == pytest.approx(auto.target_cost(7, 10) + auto.target_cost(3, 10))  # 2 x 3 + 1, then 2 + 1
    trees = auto._step_cost({0: 2, 1: 2}, {0: tree, 1: tree})
    assert trees == pytest.approx(auto.target_cost(14, 10))
    chains = auto._step_cost({0: 2, 1: 2}, {0: chain, 1: chain})
    assert chains == pytest.approx(auto.target_cost(6, 10))
    plain_tree = auto._step_cost({0: 0, 1: 2}, {0: tree, 1: chain})  # a tree row at k = 0 is a plain row
    assert plain_tree == pytest.approx(auto.target_cost(4, 10))


def test_the_draft_models_forwards_are_priced_by_its_own_passes():
    """The draft model lends rows of its own: over llama.cpp's streams a catch-up of uneven lags,
    or a position's forward over rows whose seq ids leave a gap, is several passes
    (stream_passes), each priced on the draft curve, not one pass of their sum."""
    from specdec.controller import _Option
    from specdec.models.llama_cpp import stream_passes  # pure arithmetic: no llama.cpp needed
    from specdec.sampling import SamplingParams

    lm = ToyLM(seed=4)
    lm.passes = lambda fed: stream_passes(fed, 512)
    model = ModelDrafter(lm)
    for row in range(3):
        model.begin(row, [3, 4, 5], SamplingParams(), np.random.default_rng(0))
    model.propose({row: [3, 4, 5] for row in range(3)}, {row: 1 for row in range(3)})  # lends it rows 0, 1, 2
    model.end([1])  # engine rows 0 and 2 keep model rows 0 and 2: a gap
    assert model.passes({0: 3, 2: 5}) == [3, 5] and model.passes({0: 1, 2: 1}) == [1, 1]
    model.begin(1, [3, 4, 5], SamplingParams(), np.random.default_rng(0))  # lent none yet: priced past row 2
    assert model.passes({0: 1, 1: 1, 2: 1}) == [1, 2]
    auto = CostAwareController(
        None, model, CostTable({w: 1.0 for w in range(1, 33)}), CostTable({w: 0.1 + 0.01 * w for w in range(1, 33)})
    )
    options = {0: _Option("draft", np.ones(4), lag=3, depth=10), 2: _Option("draft", np.ones(4), lag=5, depth=10)}
    d = lambda w: auto._draft_seconds(w, 10)  # noqa: E731
    # the target's one pass of 4 + 4 tokens; the catch-up's passes of 3 and 5; positions 2 and 3: 1 and 1
    expected = 1.0 + d(3) + d(5) + 2 * (d(1) + d(1))
    assert auto._step_cost({0: 3, 2: 3}, options) == pytest.approx(expected)
    assert expected > 1.0 + d(8) + 2 * d(2)  # what one pass of each sum would have cost


def test_auto_drafts_prompt_lookups_trees_where_width_is_cheap_and_chains_where_it_is_not():
    """Where the target scores trees, auto's prompt lookup may draft its tree (the earlier
    occurrences' continuations, branching where they part): on a flat curve it does (decisions
    "ngram:KxW"), on a curve whose forward grows with every token it never does; greedy output is
    plain greedy output either way."""
    target = ToyLM(vocab_size=16, seed=3)
    target.path = None
    prompt = [1, 2, 3, 9, 4, 1, 2, 3, 10, 5, 1, 2, 3, 11, 6, 1, 2, 3, 12, 7, 1, 2, 3]
    plain = SpeculativeDecoder(target, None).generate(prompt, max_new_tokens=80).tokens
    assert target.scores_trees
    for name, curve in (("flat", {w: 0.01 for w in range(1, 65)}), ("steep", {w: 0.01 * w for w in range(1, 65)})):
        costs = CostTable(curve)
        auto = SpeculativeDecoder(target, "auto", suffix=False, costs=(costs, None))
        assert auto.controller().free_width == 4
        auto.engine.clock = on_virtual_clock(target, costs.measured)
        result = auto.generate(prompt, max_new_tokens=80)
        assert result.tokens == plain, name
        trees = [key for key in auto.controller().decisions if key.startswith("ngram:") and "x" in key]
        assert bool(trees) == (name == "flat"), (name, auto.controller().decisions)
    # in a batch (a server's rows), the one prompt lookup drafts trees for some rows beside others'
    # chains and plain steps, and every row is its solo greedy run
    prompts = [prompt, [4, 5, 6, 7] * 5, prompt[3:]]
    solo = [SpeculativeDecoder(target, None).generate(p, max_new_tokens=60).tokens for p in prompts]
    flat = CostTable({w: 0.01 for w in range(1, 65)})
    auto = SpeculativeDecoder(target, "auto", suffix=False, costs=(flat, None))
    auto.engine.clock = on_virtual_clock(target, flat.measured)
    assert [r.tokens for r in auto.generate_batch(prompts, max_new_tokens=60)] == solo
    assert any(key.startswith("ngram:") and "x" in key for key in auto.controller().decisions)


def test_auto_drafts_the_suffix_caches_tree_where_earlier_answers_parted():
    """Two earlier requests went alike and then parted: where the live row reaches that point, auto
    (on a flat curve, where the target scores trees) drafts the suffix cache's tree over both sides,
    the cache's shape (what fixed `suffix:K` requests get) unchanged, and the tree's outcome teaches
    the suffix cache's own siblings' rate, not prompt lookup's."""
    from specdec.drafters.ngram import NgramDrafter
    from specdec.drafters.suffix import SuffixCacheDrafter

    cache = SuffixCacheDrafter()
    shared = [40, 41, 42, 43, 44, 45, 46, 47]
    cache.add([1, 2, *shared, 50, 51, 52, 53, 54, 55])
    cache.add([3, 4, *shared, 60, 61, 62, 63, 64, 65])
    auto = CostAwareController([NgramDrafter(), cache], None, [0.01] * 64, free_width=4)
    context = [7, 8, 9, *shared]  # prompt lookup finds nothing of it in the row's own context
    auto.begin(0, context)
    drafter, draft = auto.draft({0: context}, {0: 12})[0]
    assert drafter is cache and draft.parents is not None
    assert {draft.tokens[i] for i, p in enumerate(draft.parents) if p == -1} == {50, 60}  # both sides
    assert (cache.width, cache.nodes) == (1, 0)
    assert [key for key in auto.decisions if key.startswith("suffix:") and "x" in key]
    # the target took the other side: the first branch failed at once, where the tree parts
    other = [61, 62] if draft.first_branch().tokens[0] == 50 else [51, 52]
    other = [other[0] - 1, *other]
    before = dict(s=auto.free_siblings["suffix"].rate_at(2), ngram=auto.free_siblings["ngram"].rate_at(2))
    auto.observe({0: Outcome(cache, draft, 2, other)}, [len(draft.tokens) + 1], 1.0)
    assert auto.free_siblings["suffix"].rate_at(2) > before["s"]
    assert auto.free_siblings["ngram"].rate_at(2) == before["ngram"]
    # a chain's drafters (free_width 1) get chains from it
    chains = CostAwareController([NgramDrafter(), cache], None, [0.01] * 64)
    chains.begin(0, context)
    drafter, draft = chains.draft({0: context}, {0: 12})[0]
    assert drafter is cache and draft.parents is None


def test_prompt_lookups_tree_is_worth_its_chain_and_another_branch_where_it_parts():
    """E_tree[k] = E[k] plus, at each depth d <= k where the tree branches, P(the first d - 1
    kept) (1 - a_d) s times the other branch's expected tokens below d; its nodes k deep are what
    the forward feeds. A tree's outcome where the first branch failed at a branching depth tells
    the siblings' rate whether another branch was kept there."""
    from specdec.drafters.ngram import NgramDrafter

    auto = CostAwareController(NgramDrafter(), None, [1.0] * 16, free_width=4)
    auto.begin(0, [1, 2, 3])
    # first branch 5 6 7 8; another parts at depth 2 (9 10), a third at depth 3 (11)
    tree = Draft([5, 6, 7, 8, 9, 10, 11], parents=[-1, 0, 1, 2, 0, 4, 1])
    table = auto.match_accept["ngram"]
    chain = table.expected_tokens(6, 4, "single", cautious=True)
    expected, nodes = auto._free_tree("ngram", tree, chain, 6, auto._rows[0].overlays["ngram"])
    assert list(nodes) == [0, 1, 3, 6, 7]
    survive = np.diff(chain, prepend=1.0)
    survive[0] = 1.0
    s = auto.free_siblings["ngram"].rate_at(2)
    at2 = (survive[1] - survive[2]) * s * table.expected_tokens(8, 0, "later", cautious=True)
    at3 = (survive[2] - survive[3]) * s * table.expected_tokens(9, 0, "later", cautious=True)
    at2_deeper = (survive[1] - survive[2]) * s * table.expected_tokens(8, 1, "later", cautious=True)
    assert expected[:2] == pytest.approx(chain[:2])
    assert expected[2] == pytest.approx(chain[2] + at2[0])
    assert expected[3] == pytest.approx(chain[3] + at2_deeper[1] + at3[0])
    assert expected[4] == pytest.approx(chain[4] + at2_deeper[1] + at3[0])
    assert tree.to_depth(2).tokens == [5, 6, 9] and tree.to_depth(1).parents is None
    # the target took 5, then 9 (the first branch's 6 failed where the tree branches): a hit
    before = auto.free_siblings["ngram"].rate_at(2)
    auto.observe({0: Outcome(auto.ngram, tree, 2, [5, 9, 10])}, [8], 1.0)
    assert auto.free_siblings["ngram"].rate_at(2) > before
    # the target took 5, 6, then 13 (depth 3 branches, to 11, and neither was kept): a miss
    before = auto.free_siblings["ngram"].rate_at(2)
    auto.observe({0: Outcome(auto.ngram, tree, 2, [5, 6, 13])}, [8], 1.0)
    assert auto.free_siblings["ngram"].rate_at(2) < before
    # under a cap on reach (the vLLM proposer's) the tree is priced only as deep as the chain may go
    capped = CostAwareController(NgramDrafter(), None, [0.01] * 64, free_width=4, reach=0.5)
    context = [8, 0, 1, 2, 3, 9, 5, 6, 7, 5, 0, 1, 2, 3, 10, 8, 0, 1, 2, 3]
    capped.begin(0, context)
    _, draft = capped.draft({0: context}, {0: 20})[0]
    assert draft.parents is not None and max(draft.depths()) == 2  # half its 5-token match (8 0 1 2 3)
    # the target took 5, 6, 7, then 14: the first branch failed at depth 4, where nothing branches
    before = auto.free_siblings["ngram"].rate_at(2)
    auto.observe({0: Outcome(auto.ngram, tree, 3, [5, 6, 7, 14])}, [8], 1.0)
    assert auto.free_siblings["ngram"].rate_at(2) == before
