"""The draft model's guesses at the tokens it catches up on (drafters.model, Draft.evidence
"caught_up"): scored on greedy rows for the generated tokens only, the same in the replay's
recorded draft model, and read by auto's controller into the draft model's first-position rate."""

from __future__ import annotations

import numpy as np
import pytest

from specdec.acceptance import DRAFT_PRIOR
from specdec.controller import CostAwareController, Outcome
from specdec.drafters.base import Draft
from specdec.drafters.model import CATCH_UP_MIN, CATCH_UP_SCORED, ModelDrafter
from specdec.sampling import SamplingParams
from specdec_lab.replay import RecordedDrafter, draft_run

from ..toy import ToyLM

PROMPT = [3, 4, 5, 6]


def greedy_guess(draft: ToyLM, context, j: int) -> int:
    """The toy draft's greedy guess at context[j] from context[:j] (its trigram table)."""
    return int(np.argmax(draft.table[context[j - 2], context[j - 1]]))


def agreement(draft: ToyLM, context, start: int) -> list[bool]:
    """Whether the draft's guess at each token from context[start] on was that token."""
    return [greedy_guess(draft, context, j) == context[j] for j in range(start, len(context))]


def test_a_catch_up_scores_the_guesses_at_the_generated_tokens_it_sat_out():
    draft = ToyLM(seed=4, sharpness=1.0)
    drafter = ModelDrafter(draft)
    rng = np.random.default_rng(0)
    drafter.begin(0, PROMPT, SamplingParams(), rng)
    # three plain steps before its first proposal: it scores those three tokens, not the prompt
    context = PROMPT + [7, 8, 9]
    first = drafter.propose({0: context}, {0: 2})[0]
    assert first.evidence["caught_up"] == agreement(draft, context, len(PROMPT))
    # its first guess rejected (the correction is not its token), then four more plain steps: the
    # catch-up scores the four, not the correction, whose guess was the rejected draft token
    drafter.accept({0: 0})
    base = len(context)
    context = context + [(first.tokens[0] + 1) % 32, 10, 11, 12, 13]
    second = drafter.propose({0: context}, {0: 2})[0]
    assert second.evidence["caught_up"] == agreement(draft, context, base + 1)
    assert len(second.evidence["caught_up"]) == 4
    # drafting on without a pause (its last draft token and the bonus to read): nothing scored, its
    # drafts' own outcomes tell (CATCH_UP_MIN); nor after a rejection (the correction alone)
    drafter.accept({0: 2})
    context = context + second.tokens + [greedy_guess(draft, context + second.tokens, len(context) + 2)]
    third = drafter.propose({0: context}, {0: 1})[0]
    assert "caught_up" not in third.evidence and CATCH_UP_MIN >= 2
    drafter.accept({0: 0})
    context = context + [(third.tokens[0] + 1) % 32]
    assert "caught_up" not in drafter.propose({0: context}, {0: 1})[0].evidence
    # a long plain stretch: only the last CATCH_UP_SCORED guesses are scored (a row of logits each)
    drafter.accept({0: 0})
    context = context + [int(t) for t in rng.integers(3, 32, 30)]
    fourth = drafter.propose({0: context}, {0: 1})[0]
    assert fourth.evidence["caught_up"] == agreement(draft, context, len(context) - CATCH_UP_SCORED)


def test_sampled_rows_and_a_catch_up_of_one_token_score_nothing():
    draft = ToyLM(seed=4, sharpness=1.0)
    sampled = ModelDrafter(draft)
    sampled.begin(0, PROMPT, SamplingParams(temperature=1.0), np.random.default_rng(0))
    assert "caught_up" not in sampled.propose({0: PROMPT + [7, 8, 9]}, {0: 2})[0].evidence
    fresh = ModelDrafter(ToyLM(seed=4))
    fresh.begin(0, PROMPT, SamplingParams(), np.random.default_rng(0))
    assert "caught_up" not in fresh.propose({0: PROMPT}, {0: 2})[0].evidence


def test_the_recorded_draft_model_scores_what_the_real_one_scores():
    """The replay's RecordedDrafter, fed the real draft's agreement string, reports the same
    caught-up guesses as ModelDrafter over one answer with drafting and plain stretches mixed."""
    draft = ToyLM(seed=5, sharpness=1.5)
    rng = np.random.default_rng(1)
    output = [int(t) for t in rng.integers(3, 32, 60)]
    agrees = "".join("1" if ok else "0" for ok in agreement(draft, PROMPT + output, len(PROMPT)))
    real, recorded = ModelDrafter(draft), RecordedDrafter({tuple(PROMPT): (output, agrees)})
    real.begin(0, PROMPT, SamplingParams(), rng)
    recorded.begin(0, PROMPT)
    pos, scored = 0, 0
    for k in [0, 0, 3, 0, 0, 0, 2, 2, 0, 4, 1, 0, 0, 3] + [0] * 20 + [2, 1, 0, 3]:
        if pos >= len(output) - 1:
            break
        context = PROMPT + output[:pos]
        k = min(k, len(output) - pos - 1)
        if k:
            mine = real.propose({0: context}, {0: k})[0].evidence.get("caught_up", [])
            theirs = recorded.propose({0: context}, {0: k})[0].evidence.get("caught_up", [])
            assert mine == theirs, pos
            scored += len(mine)
            n = draft_run(agrees, pos, k)
            real.accept({0: n})
            recorded.accept({0: n})
        else:
            n = 0
        pos += n + 1
    assert scored >= 10


def test_auto_reads_the_caught_up_guesses_into_the_first_position():
    """A draft model whose estimate fell after a few misses recovers from the guesses scored at its
    next catch-up: the first position's rate rises toward what they show, the later ones stay."""
    model = ModelDrafter(ToyLM(seed=4))
    auto = CostAwareController(None, model, [1.0] * 16, [0.3] * 16)
    auto.begin(0, PROMPT)
    auto.model_accept.a[0] = 0.4  # lowered by bad luck
    later = auto.model_accept.a[1:].copy()
    draft = Draft([5], evidence={"caught_up": [True] * 20})
    auto.observe({0: Outcome(model, draft, 1, [5, 6])}, [2], 1.0)
    assert auto.model_accept.a[0] > 0.9
    assert auto.model_accept.a[1:] == pytest.approx(later)
    assert DRAFT_PRIOR[0] < 0.9  # the rise is the evidence's, not the prior's


def test_after_a_kept_sibling_the_lag_is_what_the_next_catch_up_feeds():
    """A fishbone's chain is what the draft model fed; where the target kept a sibling instead of
    the chain's token, the cache holds the chain's token there, and the next catch-up starts at it.
    `lag` (what auto prices the catch-up by) counts that token too."""
    draft = ToyLM(seed=4)
    drafter = ModelDrafter(draft, width=2)
    drafter.begin(0, PROMPT, SamplingParams(), np.random.default_rng(0))
    tree = drafter.propose({0: PROMPT}, {0: 3})[0]
    chain = tree.first_branch().tokens
    first = tree.first_branch_nodes()
    sibling = next(tree.tokens[i] for i, p in enumerate(tree.parents) if p == first[0] and i not in first)
    assert sibling != chain[1]
    drafter.accept({0: 2})  # the target kept the chain's first token, then the sibling at depth 2
    context = PROMPT + [chain[0], sibling, 9]
    fed = []
    forward = draft.forward_rows
    draft.forward_rows = lambda feed, scored=None: fed.append(sum(map(len, feed.values()))) or forward(feed, scored)
    assert drafter.lag(0, context) == 2
    drafter.propose({0: context}, {0: 1})
    assert fed[0] == 2
    # no sibling kept: the cache is the context so far, and the lag is the tokens past it
    drafter.accept({0: 0})
    assert drafter.lag(0, context + [5, 6]) == 2
