"""Trees shaped by the draft's own confidence (drafters.model, `nodes`). Levels' shaped fishbone
(the early exit's tree, and what the replay prices): which of the candidates it keeps, that the
kept ones form a tree whose sampled siblings stay in draw order, and that its chain stops where
nothing deeper could be kept. The draft model's grown tree (EAGLE-2's): each node's children are
the draft's own at that node's path, a sure draft grows its chain, and a sampled tree's shape never
reads a candidate's own draw (the target's distribution comes out, and does not where it does)."""

from __future__ import annotations

import numpy as np
import pytest

from specdec.drafters.model import Levels, ModelDrafter, shaping_probs, siblings
from specdec.sampling import SamplingParams, log_softmax, logits_to_probs

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


def _propose(draft: ToyLM, nodes: int, k: int, params: SamplingParams, seed=0, width=3, context=(3, 4, 5)):
    drafter = ModelDrafter(draft, width=width, nodes=nodes)
    drafter.begin(0, list(context), params, np.random.default_rng(seed))
    out = drafter.propose({0: list(context)}, {0: k})[0]
    return drafter, out


def _path(draft, node: int) -> list[int]:
    """The tokens from the root down to `node` of a drafted tree."""
    tokens = []
    while node >= 0:
        tokens.append(draft.tokens[node])
        node = draft.parents[node]
    return tokens[::-1]


def test_a_grown_trees_nodes_are_the_drafts_own_candidates_at_their_paths():
    """Every node's children are its own path's candidates: greedy, the draft's best tokens there
    in order (ties by id); sampled, drawn from the draft's q there (each node's q row). The tree
    has its budget's nodes and, for an unsure draft, branches below a sibling (a true tree, not a
    chain with leaves)."""
    toy = ToyLM(seed=3, sharpness=1.0)  # unsure: the budget goes to siblings too
    context = [3, 4, 5]
    below_a_sibling = 0
    for params in (SamplingParams(), SamplingParams(temperature=1.0)):
        for seed in range(5):
            _, draft = _propose(toy, 8, 6, params, seed)
            assert len(draft.tokens) == 8 and len(draft.parents) == 8
            for node in [-1, *range(8)]:
                seq = context + ([] if node < 0 else _path(draft, node))
                logits = toy.table[seq[-2], seq[-1]]
                children = [c for c, parent in enumerate(draft.parents) if parent == node]
                if not children:
                    continue
                tokens = [draft.tokens[c] for c in children]
                assert len(set(tokens)) == len(tokens) and len(tokens) <= 3
                if params.greedy:
                    assert draft.q is None
                    assert tokens == sorted(range(toy.vocab_size), key=lambda t: (-logits[t], t))[: len(tokens)]
                else:
                    want = logits_to_probs(logits, params)
                    for c in children:
                        np.testing.assert_allclose(draft.q[c], want, rtol=1e-5, atol=1e-7)
                below_a_sibling += node >= 0 and draft.parents.index(draft.parents[node]) != node
    assert below_a_sibling


def test_a_sure_draft_grows_its_chain():
    """Its chain's nodes outrank every sibling: the tree is the chain of the budget, drafted as a
    chain, the draft model reading one node a round (a model without grow_tree_rows scores the tree
    so far again each round), and its cache holds the context alone afterwards."""
    sure = ToyLM(seed=3, sharpness=40.0)
    drafter, draft = _propose(sure, 3, 8, SamplingParams())
    assert draft.parents is None and len(draft.tokens) == 3  # a chain of 3, verified as a chain
    seq = [3, 4, 5]
    for token in draft.tokens:
        assert token == int(np.argmax(sure.table[seq[-2], seq[-1]]))
        seq.append(token)
    assert sure.forward_calls == [3, 1, 2]  # catch-up, then rounds of the tree so far (the third node is not read)
    assert drafter._rows[0].fed == [3, 4, 5] and sure.row_length(drafter._rows[0].model_row) == 3


def test_a_sampled_grown_tree_never_reads_a_candidates_own_draw(monkeypatch):
    """The first token a sampled grown tree emits (budget 2: a second root candidate or the first
    one's child), verified by the engine's rule, follows the target's p; the power of that: a
    candidate placed by its own drawn q is kept when likely, and the output is off by many standard
    errors."""
    from specdec.drafters import model
    from specdec.sampling import DraftTree, q_by_parent, verify_tree

    from ..test_sampling import chi2_statistic, chi2_threshold

    p_row, trials = np.array([0.1, 0.6, 0.3]), 20_000
    draft = ToyLM(vocab_size=3, seed=0, eog=())
    draft.table[:] = np.log([0.5, 0.3, 0.2])  # the same q after any context

    def first_tokens() -> np.ndarray:
        counts, rng = np.zeros(3), np.random.default_rng(1)
        drafter = ModelDrafter(draft, width=2, nodes=2)
        drafter.begin(0, [1, 2], SamplingParams(temperature=1.0), rng)
        for _ in range(trials):
            d = drafter.propose({0: [1, 2]}, {0: 2})[0]
            parents = d.parents if d.parents is not None else list(range(-1, len(d.tokens) - 1))
            tree = DraftTree(tuple(d.tokens), tuple(parents))
            p = np.tile(p_row, (len(d.tokens) + 1, 1))
            path, after = verify_tree(p, tree, q_by_parent(d.q, tree, p.shape), rng, replacement=False)
            counts[d.tokens[path[0]] if path else after] += 1
            drafter.accept({0: 0})
        return counts

    chi2, df = chi2_statistic(first_tokens(), p_row * trials)
    assert chi2 < chi2_threshold(df), chi2

    def own_draw(logits, q, tokens):
        return [float(q[t]) for t in tokens] if q is not None else shaping_probs(logits, q, tokens)

    monkeypatch.setattr(model, "shaping_probs", own_draw)
    chi2, df = chi2_statistic(first_tokens(), p_row * trials)
    assert chi2 > 3 * chi2_threshold(df), chi2  # 102 against 19


def _first_tokens(shape, trials: int = 20_000) -> np.ndarray:
    """How often a sampled tree of two depths (two candidates each, a budget of two nodes) emits
    each token first, drafting [0.5, 0.3, 0.2] against p = [0.1, 0.6, 0.3] (then [0.5, 0.5, 0] and a flat p
    below), verified by the engine's rule; `shape` gives the probabilities the tree is shaped by."""
    from specdec.drafters import model
    from specdec.sampling import DraftTree, q_by_parent, sample, verify_tree

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
        path, after = verify_tree(p, tree, q_by_parent(draft.q, tree, p.shape), rng, replacement=False)
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
    from specdec.sampling import DraftTree
    from specdec_lab.replay import RecordedDrafter, _accepted, _tree_accepted, draft_ranks, tree_run

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


def _shaped_fishbone(draft: ToyLM, context: list[int], k: int, width: int, nodes: int):
    """Levels' greedy tree of `nodes` over k depths of the draft's chain, drafted as the early exit
    drafts it (a depth at a time, until no deeper node could be kept): (the Draft, depths drafted)."""
    levels, seq = Levels(width, nodes), list(context)
    for depth in range(k):
        seq.append(levels.add(draft.table[seq[-2], seq[-1]], SamplingParams(), np.random.default_rng(0)))
        if levels.settled():
            return levels.draft(), depth + 1
    return levels.draft(), k


def test_the_replay_keeps_what_a_greedy_shaped_tree_keeps():
    """replay.shaped_run, from the draft's ranks and top probabilities (one teacher-forced forward),
    builds the tree Levels' greedy KxW/N shapes (as many nodes, tree or chain, as deep) and
    keeps what the target keeps of it, wherever the recording holds every depth drafted (up to the
    draft's first miss); past it, the bounds of PAST_MISS order what a sibling there can keep."""
    from specdec.sampling import DraftTree
    from specdec_lab.replay import draft_ranks, draft_tops, shaped_run

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
        for pos in range(len(output) - nodes):
            miss = next((d for d in range(nodes) if ranks[pos + d] != "0"), nodes)
            k = min(nodes, miss + 1)  # every depth drafted is the target's context up to the miss
            d, drafted = _shaped_fishbone(draft, prompt + output[:pos], k, width, nodes)
            parents = d.parents if d.parents is not None else list(range(-1, len(d.tokens) - 1))
            tree = DraftTree(d.tokens, parents)
            node, kept = -1, 0
            while pos + kept < len(output):
                node = next((c for c in tree.children(node) if tree.tokens[c] == output[pos + kept]), None)
                if node is None:
                    break
                kept += 1
            run, fed, is_tree, depth = shaped_run(ranks, tops, pos, k, width, nodes)
            assert (run, fed, is_tree, depth) == (kept, len(d.tokens), d.parents is not None, drafted)
            trees += is_tree
            siblings_kept += run > miss
    assert trees and siblings_kept  # both shapes met, and a sibling kept somewhere
    # past the first miss the recording is an estimate: certain chain tokens there keep the fewest siblings
    for pos in range(len(output) - 8):
        sure, unsure = (shaped_run(ranks, tops, pos, 8, 3, 6, past)[0] for past in ("sure", "unsure"))
        assert sure <= shaped_run(ranks, tops, pos, 8, 3, 6)[0] <= unsure


def test_a_grown_tree_needs_a_draft_model_that_scores_trees():
    """llama.cpp's exact build (a cache stream per row) scores no trees: a tree of nodes is refused
    in one line, before any drafting."""
    from specdec.errors import SpecdecError

    toy = ToyLM(seed=3)
    toy.scores_trees = False
    with pytest.raises(SpecdecError, match="does not score"):
        ModelDrafter(toy, width=2, nodes=4)
    assert ModelDrafter(toy, width=2).width == 2  # its fishbone needs no tree forward of the draft's


def test_rows_past_the_draft_models_sequence_ids_grow_smaller_trees():
    """A node may take a sequence id of the draft model's own (llama.cpp lends TREE_SEQS): rows
    drafting at once share what is left, the last down to a single node, rather than fail."""
    toy = ToyLM(seed=3, sharpness=1.0)
    toy.tree_leaves = 5
    drafter = ModelDrafter(toy, width=3, nodes=4)
    contexts = {row: [3, 4, 5 + row] for row in range(3)}
    for row, context in contexts.items():
        drafter.begin(row, context, SamplingParams(), np.random.default_rng(row))
    drafts = drafter.propose(contexts, dict.fromkeys(contexts, 6))
    assert [len(drafts[row].tokens) for row in contexts] == [4, 1, 1]
