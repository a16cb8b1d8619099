"""Tests of specdec.sampling: the filters, the verifiers, and statistical losslessness."""

from __future__ import annotations

import math

import numpy as np
import pytest

import specdec.sampling as S
from specdec.sampling import (
    VERIFICATION_RULES,
    SamplingParams,
    logits_to_probs,
    residual,
    sample,
    verify,
    verify_block,
    verify_greedy,
    verify_stochastic,
)


def softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


# ---------------------------------------------------------------------------- params


def test_params_defaults_are_greedy():
    assert SamplingParams().greedy
    assert not SamplingParams(temperature=0.7).greedy


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": -0.01}, "min_p"),
        ({"min_p": 1.01}, "min_p"),
    ],
)
def test_params_validation_names_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        SamplingParams(**kwargs)


def test_params_validation_message():
    with pytest.raises(ValueError, match=r"^top_p must be in \(0, 1\], got 1.5$"):
        SamplingParams(top_p=1.5)


# ---------------------------------------------------------------------------- filters


def test_greedy_is_one_hot_of_argmax_lowest_index_on_ties():
    logits = np.array([[1.0, 3.0, 3.0, 2.0], [5.0, 0.0, 5.0, 5.0]], dtype=np.float32)
    probs = logits_to_probs(logits, SamplingParams())
    assert probs.dtype == np.float64
    np.testing.assert_array_equal(probs, [[0, 1, 0, 0], [1, 0, 0, 0]])
    np.testing.assert_array_equal(logits_to_probs(logits[0], SamplingParams()), [0, 1, 0, 0])


def test_shapes_dtype_and_normalisation():
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.8, min_p=0.02)
    for shape in [(50,), (3, 50)]:
        for dtype in (np.float16, np.float32, np.float64):
            probs = logits_to_probs(rng.normal(size=shape).astype(dtype), params)
            assert probs.shape == shape and probs.dtype == np.float64
            np.testing.assert_allclose(probs.sum(axis=-1), 1.0, rtol=1e-12)
            assert (probs >= 0).all()


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
def test_temperature_is_softmax_of_scaled_logits(temperature):
    logits = np.random.default_rng(1).normal(size=(2, 30)) * 3
    probs = logits_to_probs(logits, SamplingParams(temperature=temperature))
    np.testing.assert_allclose(probs, softmax(logits / temperature), rtol=1e-12)


def test_tiny_temperature_does_not_overflow():
    probs = logits_to_probs(np.array([1.0, 3.0, 2.0]), SamplingParams(temperature=1e-300))
    np.testing.assert_array_equal(probs, [0, 1, 0])


def test_top_k_keeps_k_largest_and_renormalises():
    logits = np.array([0.5, 2.0, -1.0, 1.5, 0.0, 3.0])
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=3))
    keep = [1, 3, 5]
    expected = np.zeros(6)
    expected[keep] = softmax(logits[keep])
    np.testing.assert_allclose(probs, expected, rtol=1e-12)


def test_top_k_at_or_above_vocab_is_off():
    logits = np.random.default_rng(2).normal(size=10)
    full = logits_to_probs(logits, SamplingParams(temperature=1.0))
    for k in (10, 11, 1000):
        np.testing.assert_allclose(logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=k)), full)


def test_top_k_ties_at_the_cut_are_all_kept():
    # documented rule: every token tied with the k-th largest logit is kept (index-independent)
    logits = np.array([3.0, 1.0, 2.0, 2.0, 0.0])
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert np.flatnonzero(probs).tolist() == [0, 2, 3]


def test_top_p_smallest_set_reaching_the_mass():
    base = np.array([0.05, 0.5, 0.15, 0.3])
    logits = np.log(base)
    for top_p, keep in [(0.4, [1]), (0.75, [1, 3]), (0.85, [1, 2, 3]), (0.99, [0, 1, 2, 3])]:
        probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))
        expected = np.zeros(4)
        expected[keep] = base[keep] / base[keep].sum()
        np.testing.assert_allclose(probs, expected, rtol=1e-12, err_msg=f"top_p={top_p}")


def test_top_p_ties_at_the_cut_are_all_kept():
    logits = np.log(np.array([0.4, 0.2, 0.2, 0.2]))
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.5))
    np.testing.assert_allclose(probs, [0.4, 0.2, 0.2, 0.2], rtol=1e-12)


def reference_chain(logits, params):
    """Straightforward full-sort implementation of the same chain, for comparison."""
    x = np.array(logits, dtype=np.float64)
    if params.top_k:
        kth = np.sort(x)[::-1][min(params.top_k, x.size) - 1]
        x[x < kth] = -np.inf
    p = softmax(x / params.temperature)
    if params.top_p < 1:
        srt = np.sort(p)[::-1]
        cut = srt[min(np.searchsorted(np.cumsum(srt), params.top_p), srt.size - 1)]
        p[p < cut] = 0
        p /= p.sum()
    if params.min_p:
        p[p < params.min_p * p.max()] = 0
        p /= p.sum()
    return p


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=0.6, top_p=0.5),
        SamplingParams(temperature=1.0, top_p=0.999),
        SamplingParams(temperature=1.0, top_k=40),
        SamplingParams(temperature=1.0, min_p=0.1),
        SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05),
        SamplingParams(temperature=1.7, top_k=1000, top_p=0.95, min_p=0.01),
    ],
)
@pytest.mark.parametrize("scale", [0.5, 3.0, 30.0])  # flat, peaked, with underflowing probs
def test_filters_match_full_sort_reference(params, scale):
    logits = np.random.default_rng(3).normal(size=(2, 5000)) * scale
    probs = logits_to_probs(logits, params)
    for row, out in zip(logits, probs):
        np.testing.assert_allclose(out, reference_chain(row, params), rtol=1e-9, atol=1e-300)


@pytest.mark.parametrize("scale", [1.0, 4.0])
def test_filters_match_reference_on_a_real_vocab_width(scale):
    logits = (np.random.default_rng(4).normal(size=151_936) * scale).astype(np.float32)
    for params in [SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=0.7, top_k=40, min_p=0.05)]:
        got = logits_to_probs(logits, params)
        np.testing.assert_allclose(got, reference_chain(logits, params), rtol=1e-9)


def test_input_is_not_modified():
    logits = np.random.default_rng(5).normal(size=(2, 100))
    before = logits.copy()
    for params in [SamplingParams(temperature=0.5, top_p=0.8, min_p=0.1), SamplingParams(temperature=2.0, top_k=5)]:
        logits_to_probs(logits, params)
    np.testing.assert_array_equal(logits, before)


def test_filter_order_top_k_then_temperature_then_top_p_then_min_p():
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.06, 0.04]))
    # top_k=4 drops 0.04; T=2 flattens to sqrt-proportions; top_p=0.7 is reached after 3
    # tokens on the flattened probs (it would take only 2 on the raw ones);
    # min_p=0.75 then drops the third (0.2**.5 / 0.4**.5 = 0.707 < 0.75)
    params = SamplingParams(temperature=2.0, top_k=4, top_p=0.7, min_p=0.75)
    probs = logits_to_probs(logits, params)
    w = np.sqrt([0.4, 0.3])
    np.testing.assert_allclose(probs, np.r_[w / w.sum(), 0, 0, 0], rtol=1e-12)
    no_min_p = logits_to_probs(logits, SamplingParams(temperature=2.0, top_k=4, top_p=0.7))
    assert np.flatnonzero(no_min_p).tolist() == [0, 1, 2]


def test_min_p_drops_below_fraction_of_max():
    base = np.array([0.5, 0.3, 0.1, 0.06, 0.04])
    probs = logits_to_probs(np.log(base), SamplingParams(temperature=1.0, min_p=0.15))
    keep = [0, 1, 2]  # 0.1 >= 0.075 > 0.06
    np.testing.assert_allclose(probs[keep], base[keep] / base[keep].sum(), rtol=1e-12)
    assert (probs[3:] == 0).all()


# ---------------------------------------------------------------------------- sample, residual


def test_sample_never_returns_zero_probability_tokens():
    probs = np.array([0.0, 0.5, 0.0, 0.0, 0.5, 0.0])
    rng = np.random.default_rng(4)
    assert {sample(probs, rng) for _ in range(2000)} == {1, 4}

    class Edge:  # u at the extreme ends of [0, 1)
        def __init__(self, u):
            self.u = u

        def random(self):
            return self.u

    assert sample(probs, Edge(0.0)) == 1
    assert sample(probs, Edge(np.nextafter(1.0, 0.0))) == 4


def test_sample_uses_exactly_one_uniform_draw():
    probs = np.array([0.2, 0.3, 0.5])
    a, b = np.random.default_rng(5), np.random.default_rng(5)
    sample(probs, a)
    b.random()
    assert a.random() == b.random()


def test_sample_inverse_cdf_distribution():
    probs = np.array([0.1, 0.0, 0.6, 0.3])
    rng = np.random.default_rng(6)
    counts = np.bincount([sample(probs, rng) for _ in range(20000)], minlength=4)
    np.testing.assert_allclose(counts / 20000, probs, atol=0.015)


def test_residual():
    p = np.array([0.5, 0.2, 0.3, 0.0])
    q = np.array([0.25, 0.5, 0.1, 0.15])
    np.testing.assert_allclose(residual(p, q), [0.25 / 0.45, 0, 0.2 / 0.45, 0])
    np.testing.assert_array_equal(residual(p, p), p)  # DESIGN rule: p == q -> p


# ---------------------------------------------------------------------------- greedy verification


def test_verify_greedy_all_accepted_gives_bonus():
    logits = np.eye(5)[[3, 1, 4]] * 2.0  # argmax rows: 3, 1, 4
    assert verify_greedy(logits, [3, 1]) == (2, 4)


def test_verify_greedy_first_mismatch_gives_correction():
    logits = np.eye(5)[[3, 1, 4, 0]]
    assert verify_greedy(logits, [3, 2, 4]) == (1, 1)
    assert verify_greedy(logits, [0, 1, 4]) == (0, 3)


def test_verify_greedy_k0_and_ties_and_probs():
    assert verify_greedy(np.array([[0.0, 2.0, 2.0]]), []) == (0, 1)
    probs = np.array([[0.1, 0.9], [0.6, 0.4]])
    assert verify_greedy(probs, [1]) == (1, 0)
    with pytest.raises(ValueError):
        verify_greedy(probs, [1, 0])


def test_verify_dispatches_on_params():
    logits = np.random.default_rng(7).normal(size=(3, 10))
    draft = [int(logits[0].argmax()), 0 if logits[1].argmax() else 1]
    greedy = verify(logits, draft, None, SamplingParams(), np.random.default_rng(0))
    assert greedy == (1, int(logits[1].argmax()))
    # a q that is not p (a shift of the logits would be p itself: softmax ignores it), so that the
    # rules part on some seeds and the dispatch by rule is seen
    params = SamplingParams(temperature=0.8, top_k=5)
    noise = np.random.default_rng(9).normal(size=(2, 10))
    q = logits_to_probs(logits[:2] + 1.5 * noise, params)
    p = logits_to_probs(logits, params)
    rules = {"block": verify_block, "traversal": verify_block, "token": verify_stochastic}
    assert set(rules) == set(VERIFICATION_RULES)
    parted = 0
    for seed in range(200):
        got = {rule: verify(logits, draft, q, params, np.random.default_rng(seed), rule) for rule in rules}
        for rule, verifier in rules.items():
            assert got[rule] == verifier(p, draft, q, np.random.default_rng(seed)), (rule, seed)
        parted += got["block"] != got["token"]
    assert parted > 0  # the two rules draw differently here: the test tells them apart
    # the default is block verification; a one-hot draft (q None) goes token by token under every rule
    assert verify(logits, draft, q, params, np.random.default_rng(3)) == verify_block(
        p, draft, q, np.random.default_rng(3)
    )
    for rule in rules:
        got = verify(logits, draft, None, params, np.random.default_rng(4), rule)
        assert got == verify_stochastic(p, draft, None, np.random.default_rng(4)), rule


# ---------------------------------------------------------------------------- stochastic verification


class CountingRng:
    def __init__(self, values):
        self.values = list(values)
        self.calls = 0

    def random(self):
        self.calls += 1
        return self.values.pop(0)


def test_verify_stochastic_q_zero_rejects_without_a_draw():
    p = np.array([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    q = np.array([[0.6, 0.0, 0.4]])
    rng = CountingRng([0.99])  # the only draw: the recovered token
    n, tok = verify_stochastic(p, [1], q, rng)
    assert (n, rng.calls) == (0, 1)
    assert tok == 1  # residual = norm(max(0, p - q)) = [0, 1, 0]


def test_verify_stochastic_accept_rule_and_draw_order():
    p = np.array([[0.3, 0.7], [0.8, 0.2], [0.5, 0.5]])
    q = np.array([[0.6, 0.4], [0.4, 0.6]])
    # token 0 at row 0: accept iff u < 0.3 / 0.6 = 0.5; token 1 at row 1: iff u < 0.2 / 0.6
    assert verify_stochastic(p, [0, 1], q, CountingRng([0.49, 0.3, 0.7])) == (2, 1)
    rng = CountingRng([0.51, 0.0])
    assert verify_stochastic(p, [0, 1], q, rng) == (0, 1) and rng.calls == 2  # residual [0, 1]
    assert verify_stochastic(p, [0, 1], q, CountingRng([0.1, 0.34, 0.0])) == (1, 0)  # residual [1, 0]


def test_verify_stochastic_one_hot_drafter():
    p = np.array([[0.25, 0.25, 0.5], [0.0, 0.0, 1.0]])
    # q None: accept iff u < p[x]; on rejection sample p without x, renormalised
    assert verify_stochastic(p, [2], None, CountingRng([0.49, 0.0])) == (1, 2)
    assert verify_stochastic(p, [2], None, CountingRng([0.5, 0.6])) == (0, 1)
    assert verify_stochastic(p, [0], None, CountingRng([0.3, 0.6])) == (0, 2)


def test_verify_stochastic_k0_and_shapes_and_repeatability():
    p = np.array([[0.2, 0.8]])
    assert verify_stochastic(p, [], None, CountingRng([0.1])) == (0, 0)
    with pytest.raises(ValueError):
        verify_stochastic(p, [0], None, np.random.default_rng(0))
    with pytest.raises(ValueError):
        verify_stochastic(np.ones((2, 2)) / 2, [0], np.ones((1, 3)) / 3, np.random.default_rng(0))
    logits = np.random.default_rng(9).normal(size=(5, 16))
    pp, qq = softmax(logits), softmax(logits[:4] * 0.5)
    runs = [
        [verify_stochastic(pp, [1, 2, 3, 4], qq, rng) for _ in range(50)]
        for rng in (np.random.default_rng(10), np.random.default_rng(10))
    ]
    assert runs[0] == runs[1]


# ---------------------------------------------------------------------------- statistical losslessness
#
# A mini decode loop: each step drafts k tokens, verifies them and appends the accepted
# tokens plus the next token, until at least M tokens are out; the first M are recorded.
# To make the exact answer enumerable, the target's and the drafter's distributions are
# fixed per absolute output position (tables p_pos, q_pos that do not depend on the earlier
# tokens). The target alone would then emit independent tokens with distribution p_pos at
# position pos, so the first M tokens must follow prod_pos p_pos over the V**M sequences.
# Both tables come from raw logits processed by logits_to_probs with the same params.
# With q passed, the drafter samples its tokens from q_pos; with q None it is a deterministic
# guesser (argmax q_pos) and verify_stochastic treats the draft as one-hot.
#
# Checks: no sequence of target probability 0 ever appears; Pearson chi-square (cells with
# expected count < 5 pooled) below the 99.99th percentile of chi2(df); total variation below
# a distribution-free bound that also holds w.p. >= 1 - 1e-4. The seeds are fixed, so the
# tests are deterministic; 1e-4 is the chance that another seed would fail an honest verifier.
# test_detector_has_power shows that the same harness rejects broken verifiers by far.

V, M, N_SAMPLES = 8, 3, 200_000
Z_9999 = 3.7190164854556804  # standard normal 99.99th percentile


def chi2_threshold(df):
    """99.99th percentile of chi2(df) by the Wilson-Hilferty approximation (no scipy)."""
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + Z_9999 * math.sqrt(c)) ** 3


def chi2_statistic(counts, expected):
    """Pearson statistic with cells of expected count < 5 (incl. impossible ones) pooled."""
    small = expected < 5
    obs, exp = list(counts[~small]), list(expected[~small])
    if small.any():
        o, e = counts[small].sum(), expected[small].sum()
        if e >= 5:
            obs.append(o)
            exp.append(e)
        else:  # too little mass to stand alone: fold into the smallest cell
            j = int(np.argmin(exp))
            obs[j] += o
            exp[j] += e
    obs, exp = np.array(obs, dtype=np.float64), np.array(exp)
    return float(((obs - exp) ** 2 / exp).sum()), len(exp) - 1


def tv_threshold(probs, n, delta=1e-4):
    """Bound on the total variation of an honest empirical distribution, w.p. >= 1 - delta.

    E[TV] <= 1/2 sum_i sqrt(p_i (1 - p_i) / n) (Jensen); TV moves by <= 1/n per sample, so
    by McDiarmid P(TV > E[TV] + t) <= exp(-2 n t^2), i.e. t = sqrt(ln(1/delta) / (2 n)).
    """
    return 0.5 * np.sqrt(probs * (1 - probs) / n).sum() + math.sqrt(math.log(1 / delta) / (2 * n))


def make_tables(seed, k, params):
    rng = np.random.default_rng(seed)
    n_pos = M + k  # a step starting at position M - 1 reads rows up to M - 1 + k
    target_logits = rng.normal(0.0, 1.0, size=(n_pos, V))
    draft_logits = target_logits + rng.normal(0.0, 0.8, size=(n_pos, V))  # a related, worse model
    return logits_to_probs(target_logits, params), logits_to_probs(draft_logits, params)


def run_decode(verify_fn, p_tab, q_tab, k, pass_q, seed, n=N_SAMPLES):
    """Counts of the first M emitted tokens over n seeded decodes, as a [V**M] array.

    The drafter samples its tokens from q_pos (fresh draws each step) and q is passed;
    with pass_q False it is a deterministic drafter guessing argmax q_pos, verified as one-hot.
    """
    n_pos = p_tab.shape[0]
    drafter_rng, rng = np.random.default_rng([seed, 0]), np.random.default_rng([seed, 1])
    if pass_q:
        # draws[s, step, pos]: pre-drawn drafter samples (the drafter is the test's, not under test)
        cdf = np.cumsum(q_tab, axis=1)  # [n_pos, V]
        u = drafter_rng.random((n, M, n_pos, 1)) * cdf[:, -1:]
        draws = (u >= cdf).sum(axis=-1).astype(np.int64).tolist()  # inverse CDF
    else:
        guess = q_tab.argmax(axis=1).tolist()
    counts = np.zeros(V**M, dtype=np.int64)
    for s in range(n):
        out = []
        step = 0
        while len(out) < M:
            pos = len(out)
            if pass_q:
                draft = draws[s][step][pos : pos + k]
                n_acc, nxt = verify_fn(p_tab[pos : pos + k + 1], draft, q_tab[pos : pos + k], rng)
            else:
                draft = guess[pos : pos + k]
                n_acc, nxt = verify_fn(p_tab[pos : pos + k + 1], draft, None, rng)
            out += draft[:n_acc]
            out.append(nxt)
            step += 1
        code = (out[0] * V + out[1]) * V + out[2]
        counts[code] += 1
    return counts


def exact_distribution(p_tab):
    """The target's own distribution of the first M tokens: prod_pos p_pos, as [V**M]."""
    joint = p_tab[0]
    for pos in range(1, M):
        joint = np.multiply.outer(joint, p_tab[pos])
    return joint.reshape(-1)


def measure(verify_fn, case):
    seed, k, pass_q, params = case
    p_tab, q_tab = make_tables(seed, k, params)
    counts = run_decode(verify_fn, p_tab, q_tab, k, pass_q, seed)
    exact = exact_distribution(p_tab)
    stat, df = chi2_statistic(counts, N_SAMPLES * exact)
    tv = 0.5 * np.abs(counts / N_SAMPLES - exact).sum()
    return counts, exact, stat, df, tv


PARAMS_A = SamplingParams(temperature=0.7, top_k=6, top_p=0.9)
PARAMS_B = SamplingParams(temperature=1.3, top_k=7, top_p=0.95, min_p=0.03)
CASES = {  # name: (seed, k, pass_q, params applied to both target and draft logits)
    "k1-q": (11, 1, True, PARAMS_A),
    "k4-q": (12, 4, True, PARAMS_B),
    "k1-onehot": (13, 1, False, PARAMS_B),
    "k4-onehot": (14, 4, False, PARAMS_A),
}


@pytest.mark.parametrize("name", list(CASES))
def test_lossless(name):
    counts, exact, stat, df, tv = measure(verify_stochastic, CASES[name])
    print(
        f"{name}: chi2 {stat:.1f} df {df} threshold {chi2_threshold(df):.1f}; "
        f"TV {tv:.4f} bound {tv_threshold(exact, N_SAMPLES):.4f}"
    )
    assert counts[exact == 0].sum() == 0  # a sequence the target cannot produce never appears
    assert stat < chi2_threshold(df)
    assert tv < tv_threshold(exact, N_SAMPLES)


def test_block_verification_is_lossless_under_filters():
    """verify_block in the same harness: k 4 drafted from a real q, top-k/top-p/min-p zeros in p
    and q (tests/test_verify_rules.py holds it exactly and with its power check)."""
    counts, exact, stat, df, tv = measure(S.verify_block, CASES["k4-q"])
    assert counts[exact == 0].sum() == 0
    assert stat < chi2_threshold(df) and tv < tv_threshold(exact, N_SAMPLES), (stat, chi2_threshold(df), tv)


def verify_q_over_p(p, draft_tokens, q, rng):
    """Broken: accepts with min(1, q/p) instead of min(1, p/q)."""
    for i, x in enumerate(draft_tokens):
        px, qx = p[i, x], (1.0 if q is None else q[i, x])
        if px > 0 and rng.random() * px < qx:
            continue
        q_row = np.eye(p.shape[1])[x] if q is None else q[i]
        return i, sample(residual(p[i], q_row), rng)
    return len(draft_tokens), sample(p[len(draft_tokens)], rng)


def verify_always_accept(p, draft_tokens, q, rng):
    """Broken: accepts every draft token (emits the drafter's distribution)."""
    return len(draft_tokens), sample(p[len(draft_tokens)], rng)


@pytest.mark.parametrize(
    "broken, name",
    [("residual_is_p", name) for name in CASES]
    + [("accept_q_over_p", "k1-q"), ("accept_q_over_p", "k4-q")]
    + [("always_accept", "k4-q"), ("always_accept", "k4-onehot")],
)
def test_detector_has_power(broken, name, monkeypatch):
    verify_fn = verify_stochastic
    if broken == "residual_is_p":  # samples the correction from p instead of norm(max(0, p - q))
        monkeypatch.setattr(S, "residual", lambda p_row, q_row: p_row)
    elif broken == "accept_q_over_p":
        verify_fn = verify_q_over_p
    else:
        verify_fn = verify_always_accept
    counts, exact, stat, df, tv = measure(verify_fn, CASES[name])
    print(f"{broken} on {name}: chi2 {stat:.1f} df {df} threshold {chi2_threshold(df):.1f}; TV {tv:.4f}")
    assert stat > chi2_threshold(df)


def test_draft_token_greedy_and_sampled():
    from specdec.sampling import draft_token

    logits = np.array([0.1, 2.0, -1.0, 1.9])
    assert draft_token(logits, SamplingParams(), np.random.default_rng(0)) == (1, None)
    params = SamplingParams(temperature=0.7, top_k=2)
    token, q = draft_token(logits, params, np.random.default_rng(0))
    np.testing.assert_allclose(q, logits_to_probs(logits, params))
    assert q[token] > 0 and token in (1, 3)
