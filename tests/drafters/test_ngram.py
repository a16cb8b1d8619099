import numpy as np
import pytest

from specdec.drafters.ngram import NgramDrafter

from ..toy import Solo


def drafter(**kw):
    return Solo(NgramDrafter(**kw), row=0)


def test_continues_the_longest_match():
    d = drafter(n_max=3)
    # "1 2 3" occurred followed by 4 5 6 7; "2 3" alone also occurred followed by 9
    context = [1, 2, 3, 4, 5, 6, 7, 0, 2, 3, 9, 0, 1, 2, 3]
    draft = d.propose(context, 3)
    assert draft.tokens == [4, 5, 6] and draft.q is None
    assert d.last_match_length == 3


def test_most_recent_occurrence_wins_and_k_limits():
    d = drafter(n_max=2)
    context = [8, 9, 1, 8, 9, 2, 3, 8, 9]
    assert d.propose(context, 5).tokens == [2, 3, 8, 9]
    assert d.propose(context, 1).tokens == [2]


def test_the_match_reaching_furthest_back_wins():
    d = drafter(n_max=2)
    # "5 8 9" is the context's tail; "8 9" occurred after 5 (then 1) and later after 6 (then 2)
    context = [5, 8, 9, 1, 0, 6, 8, 9, 2, 0, 5, 8, 9]
    assert d.propose(context, 1).tokens == [1]
    assert d.last_match_length == 3  # the 2-gram plus the 5 before it
    assert d.last_votes == (1, 2)  # of two occurrences, one continues with 1
    assert drafter(n_max=2, candidates=1).propose(context, 1).tokens == [2]  # most recent only


def test_match_length_is_capped():
    d = drafter(n_max=2, match_cap=5)
    context = [1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2, 3, 4, 5, 6, 7]
    assert d.propose(context, 2).tokens == [8, 0]
    assert d.last_match_length == 5
    assert drafter(n_max=2).propose(context, 2).tokens == [8, 0]
    with pytest.raises(ValueError):
        NgramDrafter(n_max=4, match_cap=3)


def test_falls_back_to_shorter_ngrams_and_to_nothing():
    d = drafter(n_max=3, n_min=1)
    assert d.propose([4, 5, 6, 7, 5], 2).tokens == [6, 7]  # only the 1-gram "5" matches
    assert drafter(n_max=3, n_min=2).propose([4, 5, 6, 7, 5], 2).tokens == []
    assert d.propose([1], 3).tokens == []
    assert d.propose([1, 2, 3], 0).tokens == []


def test_incremental_index_equals_fresh_index():
    rng = np.random.default_rng(0)
    context = list(rng.integers(0, 6, size=200))
    grown = drafter()
    for end in range(2, len(context)):
        fresh = drafter().propose(context[:end], 4).tokens
        assert grown.propose(context[:end], 4).tokens == fresh


def test_a_new_context_resets_the_index():
    d = drafter()
    d.propose([1, 2, 3, 1, 2], 2)
    assert d.propose([7, 8, 7], 2).tokens == [8, 7]
