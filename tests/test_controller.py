"""The cost-aware controller's decision rule, on synthetic costs and acceptance."""
from __future__ import annotations

import numpy as np
import pytest

from specdec import SpeculativeDecoder
from specdec.controller import (Acceptance, CostAwareController, CostTable, MatchAcceptance,
                                measure_forward_costs)
from specdec.drafters.base import Draft

from .toy import ToyLM

# the 1.5B on a 2-core AVX-512 machine: 1, 2, 3, 5, 8 and 16 rows (llama-bench), interpolated
CURVE = np.interp(np.arange(1, 17), [1, 2, 3, 5, 8, 16], [28, 38, 50, 74, 99, 110]) / 1000


class FixedProposals:
    """A drafter that always proposes the same continuation (stands in for prompt lookup; by
    default from a 40-token match, long enough not to cap k)."""

    def __init__(self, tokens, name="ngram"):
        self.tokens, self.name, self.last_match_length, self.proposed = list(tokens), name, 40, 0

    def begin(self, prompt, params, rng):
        pass

    def propose(self, context, k):
        self.proposed += 1
        return Draft(self.tokens[:k])

    def accept(self, n):
        pass


def controller(costs, ngram=None, model=None, draft_cost=None, ngram_prior=None, model_prior=None):
    c = CostAwareController(ngram, model, costs, draft_cost)
    if ngram_prior is not None:
        for table in c.ngram_accept.tables.values():   # every match length and evidence alike
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
    linear = [0.03 * n for n in range(1, 17)]              # a batch costs as much as its tokens
    c = controller(linear, ngram=FixedProposals(range(10)), model=FixedProposals(range(10), "draft:m"),
                   draft_cost=[0.02] * 16, ngram_prior=0.6, model_prior=0.9)
    drafter, draft = c.draft([1, 2, 3], room=100)
    assert drafter is None and draft is None
    assert c.decisions == {"plain": 1}


def test_long_drafts_when_acceptance_is_high_and_verification_cheap():
    flat = [0.03] * 16                                     # verification almost free
    c = controller(flat, ngram=FixedProposals(range(20)), ngram_prior=0.99)
    drafter, draft = c.draft([1, 2, 3], room=100)
    assert drafter.name == "ngram" and len(draft.tokens) == 15


def test_k_grows_with_acceptance_on_a_real_cost_curve():
    ks = []
    for prior in (0.3, 0.6, 0.8, 0.95):
        c = controller(CURVE, ngram=FixedProposals(range(20)), ngram_prior=prior)
        _, draft = c.draft([1, 2, 3], room=100)
        ks.append(len(draft.tokens) if draft else 0)
    assert ks[0] == 0 and ks == sorted(ks) and ks[-1] >= 10


def test_short_matches_cap_k():
    """However good the estimates, a draft reaches at most half as far ahead as its match reaches
    back (controller.REACH)."""
    ngram = FixedProposals(range(20))
    c = controller([0.03] * 16, ngram=ngram, ngram_prior=0.99)
    for match, k in ((1, 1), (4, 2), (10, 5), (30, 15)):
        ngram.last_match_length = match
        assert len(c.draft([1, 2, 3], room=100)[1].tokens) == k


def test_a_marginal_gain_is_not_worth_a_draft():
    # one guess at 0.5 on a 2-row step costing 1.4x: 1.5 tokens for 1.4 steps, 7% better than plain,
    # inside the 10% margin (controller.MARGIN)
    ngram = FixedProposals([5])
    c = controller([0.01, 0.014] + [1.0] * 14, ngram=ngram, ngram_prior=0.5)
    assert c.draft([1, 2], room=100) == (None, None)
    c = controller([0.01, 0.012] + [1.0] * 14, ngram=ngram, ngram_prior=0.5)   # 25% better: drafted
    assert c.draft([1, 2], room=100)[1].tokens == [5]


def test_room_caps_k():
    c = controller([0.03] * 16, ngram=FixedProposals(range(20)), ngram_prior=0.99)
    _, draft = c.draft([1, 2, 3], room=3)
    assert len(draft.tokens) == 3


def test_draft_model_only_when_it_pays():
    cheap_verify = [0.03, 0.031, 0.032, 0.033, 0.034] + [0.04] * 11
    c = controller(cheap_verify, model=FixedProposals(range(9), "draft:m"), draft_cost=[0.002] * 16,
                   model_prior=0.9)
    drafter, draft = c.draft([1], room=100)
    assert drafter.name == "draft:m" and len(draft.tokens) >= 4
    c = controller(cheap_verify, model=FixedProposals(range(9), "draft:m"), draft_cost=[0.05] * 16,
                   model_prior=0.9)
    for _ in range(64):   # not even exploration: a perfect draft would not pay either
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
        c.observe(drafter, draft, 0, [5], 0.0, CURVE[width - 1])   # the target always says 5
    assert used[0] and not any(used[-10:])


def test_costs_are_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    model = ToyLM(vocab_size=32, n_ctx=512)
    model.path = tmp_path / "toy.gguf"
    model.path.write_bytes(b"toy")
    costs = measure_forward_costs(model, n_max=4, repeats=1)
    assert len(costs) == 4 and costs == sorted(costs)
    calls = len(model.forward_calls)
    assert measure_forward_costs(model, n_max=4, repeats=1) == costs
    assert len(model.forward_calls) == calls                # served from the cache


def test_cost_table_follows_the_machine():
    table = CostTable([0.01, 0.02])
    for _ in range(50):
        table.observe(1, 0.02)                             # the machine got twice as slow
    assert table(1) == pytest.approx(0.02, rel=0.05) and table(2) > 0.03


def test_auto_is_lossless_on_toy_models():
    target = ToyLM(vocab_size=32, seed=1)
    target.path = None
    prompt = [5, 6, 7, 5, 6, 7, 8, 5, 6]
    plain = SpeculativeDecoder(target, None).generate(prompt, max_new_tokens=60).tokens
    draft = ToyLM(vocab_size=32, seed=2, noise_from=target, noise=0.5)
    draft.path = None
    auto = SpeculativeDecoder(target, "auto", draft_model=draft)
    result = auto.generate(prompt, max_new_tokens=60)
    assert result.tokens == plain
    assert sum(result.stats.decisions.values()) == result.stats.steps
    assert result.stats.predicted_speedup is not None


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
        emitted = list(range(100, 100 + k + 1))          # the target agrees with every guess
        c.observe(drafter, draft, k, emitted, 0.0, CURVE[k])
        ngram.last_match_length += len(emitted)          # ... so the copied run grows
    assert lengths[0] == 0 and lengths[-1] == 15 and lengths == sorted(lengths)
    drafter, draft = c.draft([1, 2], room=100)
    c.observe(drafter, draft, 0, [7], 0.0, CURVE[len(draft.tokens)])   # a miss ends the run
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
    assert first[b(5)] == 0.5 and later[b(4)] == 0.5 and later[b(100)] == 0.5   # unseen: prior
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
