"""Verification rules beyond the token-by-token chain (sampling.py): block verification of a chain,
several candidates for one position, a tree of drafts. Each is held to the target's distribution:
block verification exactly, by enumerating every draft and every cut of a Markov toy; all three by
sampling the code itself against the exact distribution (chi-square and total variation at 1e-4),
with a broken variant of each that the same test fails (its power)."""

from __future__ import annotations

import inspect
import itertools

import numpy as np
import pytest

import specdec.sampling as S
from specdec.sampling import (
    DraftTree,
    block_residual,
    block_weights,
    residual,
    sample,
    verify_block,
    verify_candidates,
    verify_tree,
    verify_tree_greedy,
)

from .test_sampling import chi2_statistic, chi2_threshold, tv_threshold

V = 4  # the toy vocabulary
L = 3  # emitted tokens compared with the target's joint


def markov(seed: int, noise: float = 0.9) -> tuple[np.ndarray, np.ndarray]:
    """A target and a worse drafter over V tokens whose next-token distribution depends on the
    previous token (row V: the start): p, q [V + 1, V], some entries 0 (as filters leave them)."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 1.2, size=(V + 1, V))
    p = np.exp(logits)
    p[rng.random(p.shape) < 0.15] = 0.0
    p[np.arange(V + 1), rng.integers(0, V, V + 1)] += 0.05  # every row keeps some mass
    q = np.exp(logits + rng.normal(0, noise, size=logits.shape))
    return p / p.sum(1, keepdims=True), q / q.sum(1, keepdims=True)


def joint(p: np.ndarray) -> np.ndarray:
    """The target's own distribution of its first L tokens, [V] * L."""
    out = p[V]
    for _ in range(1, L):
        out = out[..., None] * p[:V]  # [..., previous, next]: times p(next | previous)
    return out


def rows(p: np.ndarray, prev: int, chain: list[int]) -> np.ndarray:
    """The Markov rows after `prev` and after each token of `chain`: [len(chain) + 1, V]."""
    return np.stack([p[t] for t in [prev, *chain]])


def draw_chain(q: np.ndarray, prev: int, k: int, rng) -> list[int]:
    """k tokens the drafter draws after `prev`, each from q's row after the one before."""
    draft, t = [], prev
    for _ in range(k):
        t = sample(q[t], rng)
        draft.append(t)
    return draft


# -- block verification, exactly --------------------------------------------------------------------


def block_step(p, q, prev: int, k: int, after_cut=block_residual) -> dict[tuple, float]:
    """Every outcome of one block-verified step after `prev` (drafts of k tokens from q), exactly:
    {emitted tokens: probability}, from block_weights and `after_cut` (block_residual)."""
    out: dict[tuple, float] = {}
    for draft in itertools.product(range(V), repeat=k):
        pq = np.prod([q[t][x] for t, x in zip([prev, *draft], draft)])
        if pq == 0:
            continue
        pr, qr = rows(p, prev, list(draft)), rows(q, prev, list(draft))[:k]
        w, h = block_weights(pr, list(draft), qr)
        for n in range(k + 1):  # the block keeps n tokens: n passes and every later one fails
            cut = (h[n - 1] if n else 1.0) * np.prod(1 - h[n:])
            after = pr[k] if n == k else after_cut(pr[n], qr[n], w[n])
            for y in range(V):
                if cut * after[y] > 0:
                    key = (*draft[:n], y)
                    out[key] = out.get(key, 0.0) + pq * cut * after[y]
    return out


def block_distribution(p, q, k: int, after_cut=block_residual) -> np.ndarray:
    """The first L tokens of block-verified speculative sampling, exactly, [V] * L."""
    dist = np.zeros((V,) * L)

    def walk(emitted: tuple, mass: float):
        if len(emitted) >= L:
            dist[emitted[:L]] += mass
            return
        for tokens, m in block_step(p, q, emitted[-1] if emitted else V, k, after_cut).items():
            walk(emitted + tokens, mass * m)

    walk((), 1.0)
    return dist


@pytest.mark.parametrize("seed, k", [(1, 1), (2, 2), (3, 3), (4, 3)])
def test_block_verification_emits_the_targets_distribution_exactly(seed, k):
    p, q = markov(seed)
    assert np.abs(block_distribution(p, q, k) - joint(p)).max() < 1e-12


def test_the_exact_check_fails_a_block_cut_with_the_plain_residual():
    """Power of the exact check: after a cut, sampling from norm(max(0, p - q)) (the token rule's
    residual, weight 1) instead of the block's weighted one moves the distribution."""
    p, q = markov(2)
    plain = block_distribution(p, q, 2, after_cut=lambda p_row, q_row, w: residual(p_row, q_row))
    assert np.abs(plain - joint(p)).sum() > 1e-3


def tokenwise_expected(p, q, prev: int, k: int) -> float:
    """Expected draft tokens kept by token-by-token verification, exactly."""
    total = 0.0
    for draft in itertools.product(range(V), repeat=k):
        pq = np.prod([q[t][x] for t, x in zip([prev, *draft], draft)])
        kept = 1.0
        for t, x in zip([prev, *draft], draft):
            kept *= min(1.0, p[t][x] / q[t][x]) if q[t][x] > 0 else 0.0
            total += pq * kept
    return total


def block_expected(p, q, prev: int, k: int) -> float:
    return sum(m * (len(tokens) - 1) for tokens, m in block_step(p, q, prev, k).items())


def test_block_verification_keeps_the_papers_example_and_never_less_than_token_by_token():
    # Sun et al.'s example: two tokens, target (1/3, 2/3), drafter (2/3, 1/3), 2 drafted:
    # token by token keeps 10/9 in expectation, block verification 11/9
    pr, qr = np.array([[1 / 3, 2 / 3]] * 3), np.array([[2 / 3, 1 / 3]] * 2)
    kept = 0.0
    for draft in itertools.product(range(2), repeat=2):
        w, h = block_weights(pr, list(draft), qr)
        kept += np.prod(qr[0, list(draft)]) * sum(n * h[n - 1] * np.prod(1 - h[n:]) for n in (1, 2))
    assert kept == pytest.approx(11 / 9, abs=1e-12)
    gains = []
    for seed in range(5, 11):
        p, q = markov(seed)
        for prev in range(V + 1):
            block, token = block_expected(p, q, prev, 3), tokenwise_expected(p, q, prev, 3)
            assert block >= token - 1e-12
            gains.append(block - token)
    assert max(gains) > 0.01


# -- block verification of a tree, exactly ----------------------------------------------------------


def drawn_trees(q, prev: int, mode: str, more, depth: int) -> list[tuple[float, tuple, tuple]]:
    """Every tree the drafter can draw after `prev`, with its probability: [(prob, tokens, parents)].
    Drawn depth first: a node draws a child (from q, "with" replacement or "without" the earlier
    ones), grows its subtree, then asks more(tokens, parents, node, drawn) whether to draw another,
    so a tree's shape may hang on anything drawn before (as a grown tree's does), never on the draw
    it decides."""
    out = []

    def grow(tokens: list, parents: list, prob: float, open_: list) -> None:
        if not open_:
            out.append((prob, tuple(tokens), tuple(parents)))
            return
        node, last, drawn, level = open_[-1]
        if level >= depth or not more(tokens, node, drawn):
            grow(tokens, parents, prob, open_[:-1])
            return
        row = q[last].copy()
        if mode == "without":
            row[list(drawn)] = 0.0
            if not row.sum() > 0:
                grow(tokens, parents, prob, open_[:-1])
                return
            row /= row.sum()
        for x in np.flatnonzero(row):
            child = (len(tokens), int(x), (), level + 1)
            grow(
                [*tokens, int(x)],
                [*parents, node],
                prob * row[x],
                [*open_[:-1], (node, last, (*drawn, int(x)), level), child],
            )

    grow([], [], 1.0, [(-1, prev, (), 0)])
    return out


def two_each(tokens, node, drawn) -> bool:
    return len(drawn) < 2


def uneven(tokens, node, drawn) -> bool:
    """A second child under the root only after an even first one (whose subtree is grown by then),
    one child elsewhere."""
    return len(drawn) < (2 if node == -1 and drawn and drawn[0] % 2 == 0 else 1) or not drawn


def tree_block_step(p, q, prev: int, mode: str, more, depth: int, cuts=S.tree_block_cuts) -> dict[tuple, float]:
    """Every outcome of one step that verifies a drawn tree by block verification, exactly:
    {emitted tokens: probability}, from `cuts` (tree_block_cuts) over every tree drawn_trees draws."""
    out: dict[tuple, float] = {}
    for prob, tokens, parents in drawn_trees(q, prev, mode, more, depth):
        states = [prev, *tokens]
        pr, qr = np.stack([p[t] for t in states]), np.stack([q[t] for t in states])
        ends, after = cuts(pr, DraftTree(tokens, parents), qr, mode == "with")
        assert ends.sum() == pytest.approx(1.0, abs=1e-12)
        for j in np.flatnonzero(ends):
            path, node = [], j - 1
            while node >= 0:
                path.append(tokens[node])
                node = parents[node]
            for y in np.flatnonzero(after[j]):
                key = (*path[::-1], int(y))
                out[key] = out.get(key, 0.0) + prob * ends[j] * after[j][y]
    return out


def tree_block_distribution(p, q, mode: str, more, depth: int, cuts=S.tree_block_cuts) -> np.ndarray:
    """The first L tokens of speculative sampling with block-verified trees, exactly, [V] * L."""
    dist, steps = np.zeros((V,) * L), {}

    def walk(emitted: tuple, mass: float):
        if len(emitted) >= L:
            dist[emitted[:L]] += mass
            return
        prev = emitted[-1] if emitted else V
        if prev not in steps:
            steps[prev] = tree_block_step(p, q, prev, mode, more, depth, cuts)
        for tokens, m in steps[prev].items():
            walk(emitted + tokens, mass * m)

    walk((), 1.0)
    return dist


@pytest.mark.parametrize(
    "seed, mode, more, depth",
    [(1, "without", two_each, 2), (2, "with", two_each, 2), (3, "without", uneven, 3), (4, "with", uneven, 3)],
)
def test_tree_block_verification_emits_the_targets_distribution_exactly(seed, mode, more, depth):
    """Every tree of the shape, drawn with or without replacement, every end of its kept path and
    every token after it: the first L tokens equal the target's joint within 1e-12."""
    p, q = markov(seed)
    assert np.abs(tree_block_distribution(p, q, mode, more, depth) - joint(p)).max() < 1e-12


def mutant(source_line: str, broken_line: str):
    """tree_block_cuts with one line of its source changed (a power check's broken rule)."""
    source = inspect.getsource(S.tree_block_cuts)
    assert source.count(source_line) == 1, source_line
    space = dict(vars(S))
    exec(source.replace(source_line, broken_line), space)
    return space["tree_block_cuts"]


@pytest.mark.parametrize(
    "line, broken",
    [
        # a later sibling weighed against what is left of the node's measure without its scale
        ("m[x] / (z * q_i[x])", "m[x] / q_i[x]"),
        # the node's "not this node" mass forgotten: a path would end wherever the walk got to
        ("m, b = weight * row, 1.0 - weight", "m, b = weight * row, 0.0"),
        # what a rejected child's draw covered left in the node's measure
        ("m, b = np.maximum(m / z - q_i, 0.0), b / z", "m, b = m / z, b / z"),
    ],
)
def test_the_exact_tree_check_fails_a_broken_rule(line, broken):
    """Power of the exact check: each one-line break of tree_block_cuts moves the distribution."""
    p, q = markov(1)
    with np.errstate(invalid="ignore", divide="ignore"):  # a broken rule may divide 0 by 0
        broken_dist = tree_block_distribution(p, q, "without", two_each, 2, cuts=mutant(line, broken))
    assert np.abs(broken_dist - joint(p)).sum() > 1e-3


def test_tree_block_cuts_on_a_chain_are_block_verifications():
    """A chain is a tree of one child a node: where its kept path ends, by tree_block_cuts, is where
    block verification cuts it (block_weights' h: prefix n passes and every longer one fails), and
    the token after follows block_residual there."""
    p, q = markov(6)
    rng = np.random.default_rng(1)
    for _ in range(30):
        draft = draw_chain(q, V, 4, rng)
        pr, qr = rows(p, V, draft), rows(q, V, draft)
        ends, after = S.tree_block_cuts(pr, DraftTree(tuple(draft), tuple(range(-1, 3))), qr)
        w, h = block_weights(pr, draft, qr[:4])
        cut = [(h[n - 1] if n else 1.0) * np.prod(1 - h[n:]) for n in range(5)]
        assert ends == pytest.approx(cut, abs=1e-12)
        for n in range(4):
            if cut[n] > 1e-9:  # (block_weights' product leaves 1e-16 where the walk stops for sure)
                assert after[n] == pytest.approx(block_residual(pr[n], qr[n], w[n]), abs=1e-12)


def test_tree_block_verification_keeps_more_than_node_by_node_over_the_draws():
    """Over every tree drawn (summed with its probability), block verification's tree form
    ("traversal") keeps more than the node-by-node rule on each Markov toy, though not on every
    single tree."""
    for seed in range(5, 9):
        p, q = markov(seed)
        for mode, more, depth in (("without", two_each, 2), ("with", uneven, 2)):
            kept = {"traversal": 0.0, "token": 0.0}
            for prev in range(V + 1):
                for prob, tokens, parents in drawn_trees(q, prev, mode, more, depth):
                    states = [prev, *tokens]
                    pr, qr = np.stack([p[t] for t in states]), np.stack([q[t] for t in states])
                    for rule in kept:
                        kept[rule] += prob * S.expected_tree_kept(
                            pr, DraftTree(tokens, parents), qr, mode == "with", rule
                        )
            assert kept["traversal"] > kept["token"] + 1e-3, (seed, mode, kept)


# -- the code itself, sampled -----------------------------------------------------------------------

SAMPLES = 200_000  # honest runs (DESIGN.md: >= 200 000 seeded samples)
POWER_SAMPLES = 40_000  # a broken rule fails already at a fifth of that


def check(counts: np.ndarray, expected: np.ndarray) -> tuple[bool, float, float]:
    """(within 1e-4 of honest on both tests, chi-square, its threshold); a sequence the target
    cannot produce fails at once (chi-square inf)."""
    counts, expected = counts.reshape(-1), expected.reshape(-1)
    if counts[expected == 0].any():
        return False, float("inf"), 0.0
    stat, df = chi2_statistic(counts.astype(np.float64), expected * counts.sum())
    tv = 0.5 * np.abs(counts / counts.sum() - expected).sum()
    return stat < chi2_threshold(df) and tv < tv_threshold(expected, counts.sum()), stat, chi2_threshold(df)


def decode(p, q, step, seed: int, samples: int = SAMPLES) -> np.ndarray:
    """Counts of the first L tokens over `samples` runs; step(prev, rng) -> emitted tokens."""
    rng = np.random.default_rng(seed)
    counts = np.zeros((V,) * L, dtype=np.int64)
    for _ in range(samples):
        out: list[int] = []
        while len(out) < L:
            out += step(out[-1] if out else V, rng)
        counts[tuple(out[:L])] += 1
    return counts


def chain_step(p, q, k: int, verify):
    def step(prev, rng):
        draft = draw_chain(q, prev, k, rng)
        n, y = verify(rows(p, prev, draft), draft, rows(q, prev, draft)[:k], rng)
        return [*draft[:n], y]

    return step


def test_verify_block_samples_the_target():
    p, q = markov(3)
    ok, stat, limit = check(decode(p, q, chain_step(p, q, 3, verify_block), 0), joint(p))
    assert ok, (stat, limit)


def test_verify_block_sampled_fails_the_plain_residual(monkeypatch):
    p, q = markov(3)
    monkeypatch.setattr(S, "block_residual", lambda p_row, q_row, w: residual(p_row, q_row))
    ok, stat, limit = check(decode(p, q, chain_step(p, q, 3, verify_block), 0, POWER_SAMPLES), joint(p))
    assert not ok, (stat, limit)


def draw_candidates(q_row, n: int, mode: str, rng) -> list[int]:
    """n candidates as `mode` says they are drawn: "with" (independently from q), "without"
    (from q without the earlier ones), "top" (the n most likely, deterministic)."""
    if mode == "top":
        return [int(i) for i in np.argsort(-q_row, kind="stable")[:n]]
    out, left = [], q_row.copy()
    for _ in range(n):
        x = sample(left, rng)
        out.append(x)
        if mode == "without":
            left[x] = 0.0
            if not left.sum() > 0:
                break
    return out


def candidates_step(p, q, n: int, mode: str, verify=verify_candidates):
    def step(prev, rng):
        cands = draw_candidates(q[prev], n, mode, rng)
        _, y = verify(p[prev], cands, None if mode == "top" else q[prev], rng, replacement=mode == "with")
        return [y]

    return step


@pytest.mark.parametrize("mode, n", [("with", 2), ("with", 3), ("without", 2), ("without", 3), ("top", 2)])
def test_several_candidates_sample_the_target(mode, n):
    p, q = markov(4)
    ok, stat, limit = check(decode(p, q, candidates_step(p, q, n, mode), 1), joint(p))
    assert ok, (mode, n, stat, limit)


@pytest.mark.parametrize("mode, wrong", [("without", "as if with replacement"), ("top", "as if drawn from q")])
def test_several_candidates_fail_the_wrong_rule(mode, wrong):
    """Power: candidates drawn without replacement verified as if drawn with it, and top-k
    candidates verified with the drafter's q as if sampled from it, both move the distribution."""
    p, q = markov(4)

    def step(prev, rng):  # drawn as `mode` says, verified as if drawn from q with replacement
        cands = draw_candidates(q[prev], 3, mode, rng)
        _, y = verify_candidates(p[prev], cands, q[prev], rng, replacement=True)
        return [y]

    ok, stat, limit = check(decode(p, q, step, 1, POWER_SAMPLES), joint(p))
    assert not ok, (mode, wrong, stat, limit)


def draw_tree(p, q, prev: int, mode: str, width: int, depth: int, rng):
    """A full tree (width children a node, depth levels) drafted from the drafter as `mode` says,
    with verify_tree's rows: (p rows, the tree, q rows or None for "top")."""
    tokens, parents, last = [], [], {-1: prev}
    frontier = [-1]
    for _ in range(depth):
        nxt = []
        for node in frontier:
            for x in draw_candidates(q[last[node]], width, mode, rng):
                tokens.append(x)
                parents.append(node)
                last[len(tokens) - 1] = x
                nxt.append(len(tokens) - 1)
        frontier = nxt
    states = [prev, *tokens]
    qr = None if mode == "top" else np.stack([q[t] for t in states])
    return np.stack([p[t] for t in states]), DraftTree(tuple(tokens), tuple(parents)), qr


def tree_step(p, q, mode: str, width: int = 2, depth: int = 2, verify=verify_tree, rule: str = "token"):
    """Draft a full tree from the drafter as `mode` says (draw_tree), verify it with verify_tree
    (by `rule`) on the Markov rows of every node."""

    def step(prev, rng):
        pr, tree, qr = draw_tree(p, q, prev, mode, width, depth, rng)
        path, y = verify(pr, tree, qr, rng, replacement=mode == "with", rule=rule)
        return [tree.tokens[i] for i in path] + [y]

    return step


@pytest.mark.parametrize(
    "mode, rule",
    [("with", "token"), ("without", "token"), ("top", "token"), ("with", "traversal"), ("without", "traversal")],
)
def test_a_tree_samples_the_target(mode, rule):
    p, q = markov(5)
    ok, stat, limit = check(decode(p, q, tree_step(p, q, mode, rule=rule), 2), joint(p))
    assert ok, (mode, rule, stat, limit)


def test_a_block_verified_tree_fails_when_drawn_without_replacement_but_verified_as_with():
    """Power, through verify_tree's own sampling: siblings drawn without replacement verified as if
    drawn with it (q_i kept whole after a rejection) is caught."""
    p, q = markov(5)

    def as_with(pr, tree, qr, rng, replacement, rule):
        return verify_tree(pr, tree, qr, rng, True, rule)

    step = tree_step(p, q, "without", width=3, depth=1, verify=as_with, rule="traversal")
    ok, stat, limit = check(decode(p, q, step, 2, POWER_SAMPLES), joint(p))
    assert not ok, (stat, limit)


def test_a_tree_fails_when_a_node_is_verified_against_its_parents_row():
    """Power: verifying a node's children against the distribution after its parent (one row up,
    the off-by-one a tree's row bookkeeping invites) is caught."""
    p, q = markov(5)

    def shifted(pr, tree, qr, rng, replacement, rule):
        parent_rows = np.stack([pr[0], *[pr[tree.parents[i] + 1] for i in range(len(tree.tokens))]])
        return verify_tree(parent_rows, tree, qr, rng, replacement, rule)

    ok, stat, limit = check(decode(p, q, tree_step(p, q, "with", verify=shifted), 2, POWER_SAMPLES), joint(p))
    assert not ok, (stat, limit)


def test_a_tree_keeps_more_than_its_first_chain():
    """The point of a tree: with the same first child per node, the extra siblings add kept tokens."""
    p, q = markov(6)
    rng_a, rng_b = np.random.default_rng(0), np.random.default_rng(0)
    chain, tree = tree_step(p, q, "with", width=1, depth=3), tree_step(p, q, "with", width=2, depth=3)
    kept_chain = np.mean([len(chain(V, rng_a)) - 1 for _ in range(4000)])
    kept_tree = np.mean([len(tree(V, rng_b)) - 1 for _ in range(4000)])
    assert kept_tree > kept_chain + 0.1, (kept_chain, kept_tree)


# -- what each rule keeps in expectation (the benchmarks' Rao-Blackwellised counts) -------------------


@pytest.mark.parametrize("seed", [5, 6, 7])
def test_expected_kept_is_the_rules_exact_expectation(seed):
    """Summed over every draft of the Markov toy, expected_kept gives what the enumerations above
    give: block_step's cuts for block verification, the product of ratios token by token."""
    p, q = markov(seed)
    for prev in range(V + 1):
        by_rule = {"block": 0.0, "token": 0.0}
        for draft in itertools.product(range(V), repeat=3):
            pq = np.prod([q[t][x] for t, x in zip([prev, *draft], draft)])
            if pq:
                pr, qr = rows(p, prev, list(draft)), rows(q, prev, list(draft))[:3]
                for rule in by_rule:
                    by_rule[rule] += pq * S.expected_kept(pr, list(draft), qr, rule)
        assert by_rule["block"] == pytest.approx(block_expected(p, q, prev, 3), abs=1e-12)
        assert by_rule["token"] == pytest.approx(tokenwise_expected(p, q, prev, 3), abs=1e-12)


def test_expected_kept_matches_the_verifiers_own_counts_and_tells_the_rules_apart():
    """Against the code itself: on fixed drafts, the mean count of verify_block and of
    verify_stochastic over 20 000 draws each sits within 4 standard errors of its rule's
    expected_kept; and the two expectations differ by more than twice that on some draft (so the
    check would catch one rule's formula standing in for the other's; on one draft block can keep
    less than token by token, only over the drafts is it never less). One-hot drafts: both rules are
    token by token, p(x) a token."""
    rng = np.random.default_rng(11)
    apart = 0.0
    for seed in (2, 3):
        p, q = markov(seed)
        for _ in range(3):
            draft = draw_chain(q, V, 3, rng)
            pr, qr = rows(p, V, draft), rows(q, V, draft)[:3]
            for rule, verify in (("block", verify_block), ("token", S.verify_stochastic)):
                counts = np.array([verify(pr, draft, qr, rng)[0] for _ in range(20_000)])
                se = counts.std() / np.sqrt(counts.size) + 1e-9
                assert abs(counts.mean() - S.expected_kept(pr, draft, qr, rule)) < 4 * se, (seed, draft, rule)
            gap = S.expected_kept(pr, draft, qr, "block") - S.expected_kept(pr, draft, qr, "token")
            apart = max(apart, abs(gap) / se)
            one_hot = np.cumprod([pr[i, x] for i, x in enumerate(draft)]).sum()
            assert S.expected_kept(pr, draft, None, "block") == pytest.approx(one_hot, abs=1e-12)
    assert apart > 8


@pytest.mark.parametrize(
    "mode, rule", [("with", "token"), ("without", "token"), ("top", "token"), ("without", "traversal")]
)
def test_expected_tree_kept_matches_verify_trees_own_counts(mode, rule):
    """On drafted trees (width 2, depth 2), the mean path verify_tree keeps over 20 000 draws sits
    within 4 standard errors of expected_tree_kept under the same rule. Power: for drafts without
    replacement, the expectation computed as if with replacement (token) or by the other rule
    (block) is off by more than 8 on some tree."""
    p, q = markov(5)
    rng = np.random.default_rng(3)
    worst_wrong = 0.0
    for _ in range(4):
        pr, tree, qr = draw_tree(p, q, V, mode, 2, 2, rng)
        with_ = mode == "with"
        counts = np.array([len(verify_tree(pr, tree, qr, rng, with_, rule)[0]) for _ in range(20_000)])
        se = counts.std() / np.sqrt(counts.size) + 1e-9
        expected = S.expected_tree_kept(pr, tree, qr, with_, rule)
        assert abs(counts.mean() - expected) < 4 * se, (tree, counts.mean(), expected)
        if mode == "without":
            wrong = (
                S.expected_tree_kept(pr, tree, qr, True, rule)
                if rule == "token"
                else S.expected_tree_kept(pr, tree, qr, False, "token")
            )
            worst_wrong = max(worst_wrong, abs(wrong - counts.mean()) / se)
    if mode == "without":
        assert worst_wrong > 8


def test_a_chain_is_a_tree_of_width_one_in_expectation_too():
    """expected_tree_kept of a chain (each node the only child of the one before) is expected_kept
    of the same draft, sampled (q) and fixed (None): block verification's under "traversal",
    token by token's under "token" and "block" (a tree's "block" goes node by node)."""
    p, q = markov(8)
    rng = np.random.default_rng(0)
    for _ in range(20):
        draft = draw_chain(q, V, 4, rng)
        pr, qr = rows(p, V, draft), rows(q, V, draft)
        chain = DraftTree(tuple(draft), tuple(range(-1, 3)))
        for q_rows in (qr, None):
            for rule, chain_rule in (("traversal", "block"), ("token", "token"), ("block", "token")):
                tree = S.expected_tree_kept(pr, chain, q_rows, rule=rule)
                chain_q = None if q_rows is None else qr[:4]
                assert tree == pytest.approx(S.expected_kept(pr, draft, chain_q, chain_rule))


def test_greedy_tree_verification_follows_the_targets_argmax():
    """Greedy on a Markov target: the emitted tokens are plain greedy's chain g1, g2, ..., and the
    accepted path is as deep as the tree spells that chain (no child of its last node holds the
    next greedy token)."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        table = rng.normal(size=(V + 1, V))  # logits after each token; row V: after the root
        greedy = [int(np.argmax(table[V]))]
        for _ in range(9):
            greedy.append(int(np.argmax(table[greedy[-1]])))
        n = int(rng.integers(1, 9))
        tree = DraftTree(
            tuple(int(t) for t in rng.integers(0, V, n)), tuple(int(rng.integers(-1, i)) for i in range(n))
        )
        path, token = verify_tree_greedy(np.stack([table[V], *[table[t] for t in tree.tokens]]), tree)
        emitted = [tree.tokens[i] for i in path] + [token]
        assert emitted == greedy[: len(emitted)]
        assert all(tree.parents[b] == a for a, b in zip([-1, *path], path))  # a path down the tree
        assert token not in [tree.tokens[c] for c in tree.children(path[-1] if path else -1)]  # as deep as it goes


def test_bad_trees_and_shapes_are_refused():
    with pytest.raises(ValueError, match="parent"):
        DraftTree((1, 2), (-1, 1))
    with pytest.raises(ValueError, match="a parent per token"):
        DraftTree((1, 2), (-1,))
    tree = DraftTree((1, 2), (-1, 0))
    with pytest.raises(ValueError, match="nodes \\+ 1"):
        verify_tree(np.full((2, V), 1 / V), tree, None, np.random.default_rng(0))
    with pytest.raises(ValueError, match="k \\+ 1"):
        verify_block(np.full((2, V), 1 / V), [1, 2], None, np.random.default_rng(0))
