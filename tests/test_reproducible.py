"""Sampling by position (GenerationConfig(reproducible=True), --reproducible): the token at each
position is argmax(log p + g) with Gumbel noise g fixed by (seed, position), so a seeded request
gives the same text whatever drafted it, and the text still follows the target's distribution.
"""

from __future__ import annotations

import numpy as np
import pytest

import specdec.sampling as S
from specdec import GenerationConfig, SpeculativeDecoder

from .test_sampled_engine import (
    FILTERS,
    N,
    distance,
    exact_outcomes,
    sampled_outcomes,
    toy_decoder,
    toy_target,
)

KINDS = ["draft model", "ngram", "suffix"]


@pytest.fixture(scope="module")
def toy():
    return toy_target()


def test_the_verdict_is_the_plain_token_of_each_position_whatever_the_draft():
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.full(12, 0.3), size=5)  # [k + 1 = 5, vocab 12]
    plain = [S.sample_at(p[i], seed=7, position=3 + i) for i in range(5)]
    for _ in range(200):
        draft = [int(t) for t in rng.integers(0, 12, size=4)]
        right = int(rng.integers(0, 5))
        draft[:right] = plain[:right]  # right for a while, then anything
        n, token = S.verify_at(p, draft, seed=7, start=3)
        assert draft[:n] == plain[:n] and token == plain[n]
        assert n == 4 or draft[n] != plain[n]


def test_a_zero_probability_token_is_never_sampled():
    p = np.array([0.0, 0.5, 0.0, 0.5])
    assert {S.sample_at(p, seed, 0) for seed in range(300)} == {1, 3}


@pytest.mark.parametrize("kind, filters", [(kind, list(FILTERS)[i % 2]) for i, kind in enumerate(KINDS)])
def test_sampling_by_position_samples_the_target(toy, kind, filters):
    target, prompt = toy
    config = GenerationConfig(max_new_tokens=N, chat=False, reproducible=True, **FILTERS[filters])
    expected = exact_outcomes(target, prompt, config.sampling, N)
    counts = sampled_outcomes(toy_decoder(kind, target), prompt, config)
    chi2, chi2_max, tv, tv_max = distance(counts, expected)
    assert chi2 < chi2_max and tv < tv_max, (kind, chi2, chi2_max, tv, tv_max)


def test_the_harness_fails_noise_that_ignores_the_position(toy, monkeypatch):
    """Power: one noise for every position makes a row's tokens depend on each other beyond the
    target's own dependence, and the same harness rejects it."""
    target, prompt = toy
    real = S.position_noise
    monkeypatch.setattr(S, "position_noise", lambda seed, position, vocab: real(seed, 0, vocab))
    config = GenerationConfig(max_new_tokens=N, chat=False, reproducible=True, **FILTERS["t1-top3"])
    expected = exact_outcomes(target, prompt, config.sampling, N)
    counts = sampled_outcomes(toy_decoder("ngram", target), prompt, config)
    chi2, chi2_max, _, _ = distance(counts, expected)
    assert chi2 > 3 * chi2_max, (chi2, chi2_max)


def _texts(decoder, prompt, config, seeds) -> list[list[int]]:
    return [r.tokens for r in decoder.generate_batch([prompt] * len(seeds), config, seed=seeds[0])]


def test_a_seed_gives_the_same_text_with_any_drafter_alone_or_batched(toy):
    target, prompt = toy
    config = GenerationConfig(max_new_tokens=12, chat=False, reproducible=True, temperature=0.9)
    seeds = list(range(100, 140))
    plain = [SpeculativeDecoder(target).generate(prompt, config, seed=s).tokens for s in seeds]
    for kind in KINDS:
        decoder = toy_decoder(kind, target)
        alone = [decoder.generate(prompt, config, seed=s).tokens for s in seeds]
        assert alone == plain, kind
        assert _texts(decoder, prompt, config, seeds) == plain, kind  # row i is seeded seeds[0] + i
    ngram = toy_decoder("ngram", target)
    kept = sum(ngram.generate(prompt, config, seed=s).stats.accepted for s in seeds)
    assert kept > 0  # drafts were kept: the equality is not plain against plain


def test_without_it_the_drafter_changes_a_seeded_text(toy):
    """What the mode is for: under the standard rule the drafts consume the row's random stream,
    so the same seed gives another text with another drafter."""
    target, prompt = toy
    config = GenerationConfig(max_new_tokens=12, chat=False, temperature=0.9)
    seeds = range(100, 140)
    plain = [SpeculativeDecoder(target).generate(prompt, config, seed=s).tokens for s in seeds]
    ngram = [toy_decoder("ngram", target).generate(prompt, config, seed=s).tokens for s in seeds]
    assert sum(a != b for a, b in zip(plain, ngram)) > 20  # measured: all 40
