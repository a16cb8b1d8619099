"""The draft model's tree shaped by its own confidence (drafters.model, `nodes`): which of the
candidates it keeps, that the kept ones form a tree whose sampled siblings stay in draw order, and
that its chain stops where nothing deeper could be kept."""

from __future__ import annotations

import numpy as np

from specdec.drafters.model import Levels, ModelDrafter, shaping_probs, siblings
from specdec.sampling import SamplingParams, log_softmax

from ..toy import ToyLM


def levels(*probs):
    """Depths' candidates (token ids from 0) with the draft's probabilities, chain token first."""
    out, token = [], 0
    for row in probs:
        out.append((list(range(token, token + len(row))), list(row), None))
        token += len(row)
    return out


def chooser(nodes: int, depths=()) -> Levels:
    shaper = Levels(width=3, nodes=nodes)
    shaper.levels = list(depths)
    return shaper


def test_greedy_siblings_are_the_next_best_ties_by_id_and_their_probabilities_the_softmax():
    """Greedy siblings: the best logits after the chain's token, ties by the lower id (before an
    argmax a sibling, the partition of a sort broke ties at its cut arbitrarily), impossible tokens
    (-inf) last by id; the shaping probabilities are the softmax's."""
    rng = np.random.default_rng(3)
    for trial in range(2000):
        V = int(rng.integers(2, 30))
        logits = rng.integers(-3, 3, V).astype(np.float32)  # many ties
        if trial % 3 == 0:
            logits[rng.integers(0, V, 2)] = -np.inf
        token, n = int(rng.integers(0, V)), int(rng.integers(1, 6))
        want = [i for i in sorted(range(V), key=lambda i: (-logits[i], i)) if i != token][:n]
        assert siblings(logits, token, None, n, None) == want
        if np.isfinite(logits).any():
            p = shaping_probs(logits, None, list(range(V)))
            np.testing.assert_allclose(p, np.exp(log_softmax(logits)), rtol=1e-6, atol=1e-12)


def test_a_sure_draft_keeps_its_chain():
    assert chooser(4, levels([0.9, 0.05], [0.9, 0.05], [0.9, 0.05], [0.9, 0.05], [0.9, 0.05]))._choose() == [
        1,
        1,
        1,
        1,
        0,
    ]


def test_width_goes_where_the_draft_is_unsure():
    # paths: .95, then .475 (chain) and .4275 (sibling) at depth 2, .38 at depth 3
    assert chooser(4, levels([0.95, 0.03], [0.5, 0.45], [0.8, 0.1], [0.9, 0.05]))._choose() == [1, 2, 1, 0]
    # the sibling of depth 1 outranks every chain node below it
    assert chooser(3, levels([0.5, 0.4], [0.6, 0.3], [0.9, 0.05]))._choose() == [2, 1, 0]


def test_sampled_siblings_are_kept_in_the_order_they_were_drawn():
    """A chain token drawn against the odds, then siblings of rising probability: the second
    sibling is kept only after the first, however probable, so the kept ones are the first draws
    (the without-replacement rule verifies them in that order)."""
    assert chooser(2, levels([0.1, 0.2, 0.6], [0.9, 0.05, 0.01]))._choose() == [2, 0]
    assert chooser(3, levels([0.1, 0.2, 0.6], [0.9, 0.05, 0.01]))._choose() == [3, 0]
    assert chooser(4, levels([0.1, 0.2, 0.6], [0.9, 0.05, 0.01]))._choose() == [3, 1]


def test_the_tree_has_the_budgets_nodes_chain_tokens_first():
    shaped = chooser(4, levels([0.95, 0.03], [0.5, 0.45], [0.8, 0.1], [0.9, 0.05])).draft()
    # depth 1: node 0; depth 2: nodes 1 (chain) and 2 under node 0; depth 3: node 3 under node 1
    assert shaped.tokens == [0, 2, 3, 4] and shaped.parents == [-1, 0, 0, 1]


def _propose(draft: ToyLM, nodes: int, k: int, params: SamplingParams, seed=0):
    drafter = ModelDrafter(draft, width=3, nodes=nodes)
    drafter.begin(0, [3, 4, 5], params, np.random.default_rng(seed))
    out = drafter.propose({0: [3, 4, 5]}, {0: k})[0]
    return drafter, out


def _check_tree(draft, budget):
    assert len(draft.tokens) <= budget and len(draft.parents) == len(draft.tokens)
    for i, parent in enumerate(draft.parents):
        assert parent < i
        if parent >= 0:  # a node hangs under its depth's chain node: the first child of its parent
            assert draft.parents.index(draft.parents[parent]) == parent


def test_greedy_and_sampled_trees_keep_the_budget():
    toy = ToyLM(seed=3, sharpness=1.0)  # unsure: the budget goes to siblings too
    for params in (SamplingParams(), SamplingParams(temperature=1.0)):
        for seed in range(5):
            drafter, draft = _propose(toy, 5, 6, params, seed)
            assert len(draft.tokens) == 5
            _check_tree(draft, 5)
            if params.greedy:
                assert draft.q is None
            else:  # each node's row: the distribution it was drawn from (its depth's)
                assert draft.q.shape == (5, toy.vocab_size)
                assert all(abs(row.sum() - 1) < 1e-6 for row in draft.q)


def test_a_sure_draft_stops_drafting_at_the_budget():
    """Its chain's nodes outrank every sibling: nothing below the budget's depth could be kept, so
    the draft model is not run there."""
    sure = ToyLM(seed=3, sharpness=40.0)
    drafter, draft = _propose(sure, 3, 8, SamplingParams())
    assert draft.parents is None and len(draft.tokens) == 3  # a chain of 3, verified as a chain
    assert drafter._rows[0].drafted == 3  # not 8
    assert len(sure.forward_calls) == 3  # catch-up, then depths 1 and 2 fed (the third is not)


def _first_tokens(shape, trials: int = 20_000) -> np.ndarray:
    """How often a sampled tree of two depths (two candidates each, a budget of two nodes) emits
    each token first, drafting [0.5, 0.3, 0.2] against p = [0.1, 0.6, 0.3] (then [0.5, 0.5, 0] and a flat p
    below), verified by the engine's rule; `shape` gives the probabilities the tree is shaped by."""
    from specdec.drafters import model
    from specdec.engine import _by_parent
    from specdec.sampling import DraftTree, sample, verify_tree

    q0, q1 = np.array([0.5, 0.3, 0.2]), np.array([0.5, 0.5, 0.0])
    p = np.array([[0.1, 0.6, 0.3], *[[1 / 3] * 3] * 2])  # [nodes + 1, vocab]
    rng, counts = np.random.default_rng(0), np.zeros(3)
    for _ in range(trials):
        levels = []
        for q in (q0, q1):
            first = sample(q, rng)
            candidates = [first, *model.siblings(q, first, q, 1, rng)]
            levels.append((candidates, shape(q, q, candidates), q))
        draft = chooser(2, levels).draft()
        tree = DraftTree(tuple(draft.tokens), tuple(draft.parents))
        path, after = verify_tree(p, tree, _by_parent(draft.q, tree, p.shape), rng, replacement=False)
        counts[draft.tokens[path[0]] if path else after] += 1
    return counts


def test_a_sampled_trees_shape_never_reads_a_candidates_own_draw():
    """Which candidates a sampled tree keeps may depend on what came before each (earlier draws,
    ancestors), not on its own drawn q: the first token then follows p. Power: shaped by each
    draw's own q, the second candidate is kept only when it is likely, and the output is off by
    tens of standard errors."""
    from specdec.drafters.model import shaping_probs

    from ..test_sampling import chi2_statistic, chi2_threshold

    want = np.array([0.1, 0.6, 0.3]) * 20_000
    chi2, df = chi2_statistic(_first_tokens(shaping_probs), want)
    assert chi2 < chi2_threshold(df), chi2

    def own_draw(logits, q, tokens):
        return [float(q[t]) for t in tokens]

    chi2, df = chi2_statistic(_first_tokens(own_draw), want)
    assert chi2 > 10 * chi2_threshold(df), chi2


def test_the_replay_keeps_what_a_greedy_fishbone_keeps():
    """replay.tree_run, from the draft's ranks of the target's tokens (one teacher-forced forward,
    as `replay_controller.py record` takes them), keeps at every step exactly what ModelDrafter's
    greedy fishbone tree keeps when the target walks down it, including the steps saved by a
    sibling (there are such steps: the chain alone keeps less at them). The replay's recorded draft
    model, asked for the same width, drafts a tree the target keeps as much of."""
    from specdec.replay import RecordedDrafter, _accepted, _tree_accepted, draft_ranks, tree_run
    from specdec.sampling import DraftTree

    draft = ToyLM(seed=6, sharpness=1.0)
    target = ToyLM(seed=7, noise_from=draft, noise=0.6)
    prompt, output = [3, 4, 5, 6], []
    while len(output) < 120:  # the target's greedy output (its trigram table's argmax)
        context = prompt + output
        output.append(int(np.argmax(target.table[context[-2], context[-1]])))
    [row] = draft.add_rows(1)
    logits = draft.forward_rows({row: prompt + output}, {row: len(output) + 1})[row]
    draft.drop_rows([row])
    ranks = draft_ranks(logits[: len(output)], output)
    agrees = "".join("1" if r == "0" else "0" for r in ranks)
    for width, k in ((2, 4), (3, 3), (1, 5)):
        drafter = ModelDrafter(ToyLM(seed=6, sharpness=1.0), width=width)
        drafter.begin(0, prompt, SamplingParams(), np.random.default_rng(0))
        recorded = RecordedDrafter({tuple(prompt): (output, agrees, ranks)})  # the replay's, asked for the width
        recorded.begin(0, prompt)
        pos, saved = 0, 0
        while pos < len(output) - k:
            d = drafter.propose({0: prompt + output[:pos]}, {0: k})[0]
            replayed = recorded.propose({0: prompt + output[:pos]}, {0: k}, {0: width})[0]
            assert (replayed.parents is None) == (d.parents is None) and len(replayed.tokens) == len(d.tokens)
            tree = DraftTree(d.tokens, d.parents if d.parents is not None else list(range(-1, len(d.tokens) - 1)))
            node, kept = -1, 0
            while True:  # the target walks into the child holding its own token
                node = next((c for c in tree.children(node) if tree.tokens[c] == output[pos + kept]), None)
                if node is None:
                    break
                kept += 1
            assert kept == tree_run(ranks, pos, k, width), (width, pos)
            replayed_kept = (
                _tree_accepted(replayed, output, pos) if width > 1 else _accepted(replayed.tokens, output, pos)
            )
            assert replayed_kept == kept, (width, pos)
            saved += kept > tree_run(ranks, pos, k, 1)
            drafter.accept({0: kept})
            recorded.accept({0: kept})
            pos += kept + 1
        assert saved >= (3 if width > 1 else 0), width


def test_a_greedy_tree_that_keeps_no_sibling_is_its_chain():
    """A greedy tree of `nodes` whose most probable paths are all its chain's is drafted as that
    chain (parents None: the engine verifies it as a chain, without a tree's dearer forward); one
    that keeps a sibling stays a tree; a sampled one keeps its tree form."""
    sure = chooser(3, levels([0.9, 0.05], [0.9, 0.05], [0.9, 0.05]))
    assert sure.shape() == [1, 1, 1] and sure.draft().parents is None and sure.draft().tokens == [0, 2, 4]
    unsure = chooser(3, levels([0.5, 0.4], [0.6, 0.3], [0.9, 0.05]))
    assert unsure.draft().parents == [-1, -1, 0]
    q = np.array([0.9, 0.1])
    sampled = chooser(2, [([0], [0.9], q), ([1], [0.9], q)])
    assert sampled.draft().parents == [-1, 0]


def test_the_replay_keeps_what_a_greedy_shaped_tree_keeps():
    """replay.shaped_run, from the draft's ranks and top probabilities (one teacher-forced forward),
    builds the tree ModelDrafter's greedy KxW/N builds (as many nodes, tree or chain, as deep) and
    keeps what the target keeps of it, wherever the recording holds every depth drafted (up to the
    draft's first miss); past it, the bounds of PAST_MISS order what a sibling there can keep."""
    from specdec.replay import draft_ranks, draft_tops, shaped_run
    from specdec.sampling import DraftTree

    draft = ToyLM(seed=6, sharpness=1.0)
    target = ToyLM(seed=7, noise_from=draft, noise=0.6)
    prompt, output = [3, 4, 5, 6], []
    while len(output) < 120:
        context = prompt + output
        output.append(int(np.argmax(target.table[context[-2], context[-1]])))
    [row] = draft.add_rows(1)
    logits = draft.forward_rows({row: prompt + output}, {row: len(output) + 1})[row][: len(output)]
    draft.drop_rows([row])
    ranks, tops = draft_ranks(logits, output), draft_tops(logits)
    trees = siblings_kept = 0
    for width, nodes in ((2, 4), (3, 5), (4, 6)):
        drafter = ModelDrafter(ToyLM(seed=6, sharpness=1.0), width=width, nodes=nodes)
        drafter.begin(0, prompt, SamplingParams(), np.random.default_rng(0))
        for pos in range(len(output) - nodes):
            miss = next((d for d in range(nodes) if ranks[pos + d] != "0"), nodes)
            k = min(nodes, miss + 1)  # every depth drafted is the target's context up to the miss
            d = drafter.propose({0: prompt + output[:pos]}, {0: k})[0]
            parents = d.parents if d.parents is not None else list(range(-1, len(d.tokens) - 1))
            tree = DraftTree(d.tokens, parents)
            node, kept = -1, 0
            while pos + kept < len(output):
                node = next((c for c in tree.children(node) if tree.tokens[c] == output[pos + kept]), None)
                if node is None:
                    break
                kept += 1
            run, fed, is_tree, depth = shaped_run(ranks, tops, pos, k, width, nodes)
            assert (run, fed, is_tree, depth) == (kept, len(d.tokens), d.parents is not None, drafter._rows[0].drafted)
            trees += is_tree
            siblings_kept += run > miss
            drafter.accept({0: 0})
    assert trees and siblings_kept  # both shapes met, and a sibling kept somewhere
    # past the first miss the recording is an estimate: certain chain tokens there keep the fewest siblings
    for pos in range(len(output) - 8):
        sure, unsure = (shaped_run(ranks, tops, pos, 8, 3, 6, past)[0] for past in ("sure", "unsure"))
        assert sure <= shaped_run(ranks, tops, pos, 8, 3, 6)[0] <= unsure
