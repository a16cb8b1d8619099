import numpy as np
import pytest

from specdec.drafters.base import Draft
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


def test_a_tree_tries_every_earlier_continuation_best_match_first():
    """With width W the occurrences' continuations form a tree, best match first (its branch is
    the chain width 1 drafts), branching where they part, at most W branches; continuations that
    agree add nothing, and a tree that never branches goes as the chain."""
    # "1 2 3" was followed by 4 5 6 (a match of 3) and by 7 8 (a match of 4: 0 1 2 3), and "2 3"
    # alone by 9: at n = 3 the candidates are the two "1 2 3"s, the longer match first
    context = [0, 1, 2, 3, 7, 8, 5, 1, 2, 3, 4, 5, 6, 2, 3, 9, 5, 0, 1, 2, 3]
    chain = drafter(n_max=3).propose(context, 3)
    assert chain.tokens == [7, 8, 5] and chain.parents is None
    tree = drafter(n_max=3, width=2).propose(context, 3)
    assert tree.tokens == [7, 8, 5, 4, 5, 6] and tree.parents == [-1, 0, 1, -1, 3, 4]
    assert tree.first_branch().tokens == chain.tokens and tree.evidence == chain.evidence
    assert drafter(n_max=3, width=3).propose(context, 3).tokens == tree.tokens  # only two occurrences
    # a branch where the copies part after a shared start
    context = [1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 6, 0, 1, 2, 3]
    tree = drafter(n_max=3, width=2).propose(context, 3)
    assert tree.tokens == [4, 6, 0, 5, 0] and tree.parents == [-1, 0, 1, 0, 3]
    # every occurrence continues alike: a chain
    context = [1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3]
    same = drafter(n_max=3, width=3).propose(context, 3)
    assert same.tokens == [4, 5, 0] and same.parents is None
    assert NgramDrafter(width=2).name == "ngram"  # as auto and the server know it
    with pytest.raises(ValueError):
        NgramDrafter(width=0)


def test_a_call_may_ask_a_chain_drafter_for_a_tree_and_a_tree_cut_to_a_depth():
    """`auto` asks the one prompt lookup it shares with fixed requests for trees per call (widths);
    the drafter's own width stays its default. Cut k deep, a tree keeps its nodes that deep and,
    left with one branch, is a chain."""
    context = [1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 6, 0, 1, 2, 3]
    shared = NgramDrafter(n_max=3)
    tree = shared.propose({0: context}, {0: 3}, {0: 2})[0]
    assert tree.tokens == [4, 6, 0, 5, 0] and tree.parents == [-1, 0, 1, 0, 3]
    assert shared.propose({0: context}, {0: 3})[0].parents is None
    assert tree.depths() == [1, 2, 3, 2, 3]
    assert tree.first_branch_nodes() == [0, 1, 2]
    assert tree.leaves() == 2 and tree.siblings_of(1) == [3] and tree.siblings_of(0) == []
    # a first child after another node's subtree: the first branch still takes each first child
    bushy = Draft([1, 2, 3, 4, 5], parents=[-1, -1, 0, 1, 0])
    assert bushy.first_branch_nodes() == [0, 2] and bushy.leaves() == 3 and bushy.siblings_of(2) == [4]
    cut = tree.to_depth(2)
    assert cut.tokens == [4, 6, 5] and cut.parents == [-1, 0, 0]
    assert tree.to_depth(1).tokens == [4] and tree.to_depth(1).parents is None
    assert tree.to_depth(9).tokens == tree.tokens


def test_a_prompt_lookup_tree_writes_plain_greedy_and_keeps_branches():
    """Through the engine on a toy target that scores trees: greedy output is plain greedy output,
    and some steps kept a node off the tree's first branch (the tree did something)."""
    from specdec import GenerationConfig, SpeculativeDecoder

    from ..toy import ToyLM

    target = ToyLM(vocab_size=12, seed=3, sharpness=1.5)
    prompt = [3, 4, 5, 6, 7, 3, 4, 5, 8, 9, 3, 4, 5, 10, 11, 3, 4, 5, 6, 9, 3, 4]
    config = GenerationConfig(max_new_tokens=60, chat=False)
    plain = SpeculativeDecoder(target, None).generate(prompt, config).tokens
    ngram = NgramDrafter(width=3)
    off_branch = []
    propose = ngram.propose

    def spy(contexts, ks):
        drafts = propose(contexts, ks)
        for row, d in drafts.items():
            if d.parents is not None:
                off_branch.append((list(contexts[row]), d))
        return drafts

    ngram.propose = spy
    result = SpeculativeDecoder(target, ngram, k=4).generate(prompt, config)
    assert result.tokens == plain
    kept_off = 0
    for context, d in off_branch:  # did the target's next token stand on a root branch after the first?
        right = plain[len(context) - len(prompt) :][:1]
        later = [d.tokens[i] for i, parent in enumerate(d.parents) if parent == -1][1:]
        kept_off += bool(right) and right[0] in later
    assert off_branch and kept_off >= 1, (len(off_branch), kept_off)
