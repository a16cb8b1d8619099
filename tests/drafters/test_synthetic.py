"""The synthetic drafter: acceptance per position is the asked `a`, and the output stays the
target's greedy output (it is a drafter like any other)."""

from __future__ import annotations

import numpy as np
import pytest

from specdec import GenerationConfig, SpeculativeDecoder
from specdec_lab.synthetic import SyntheticDrafter

from ..toy import ToyLM as ToyModel


def test_each_position_is_accepted_with_probability_a():
    truth = list(range(10, 10 + 4000))
    drafter = SyntheticDrafter({(1, 2, 3): truth}, acceptance=0.7, vocab_size=5000, seed=1)
    drafter.begin(0, [1, 2, 3], None, None)
    context = [1, 2, 3]
    runs = []
    while len(context) - 3 < 3000:
        draft = drafter.propose({0: context}, {0: 4})[0].tokens
        n = next((i for i, t in enumerate(draft) if t != truth[len(context) - 3 + i]), 4)
        runs.append(n)
        context += truth[len(context) - 3 : len(context) - 3 + n + 1]
    expected = sum(0.7**i for i in range(1, 5))
    assert np.mean(runs) == pytest.approx(expected, abs=0.1)
    assert drafter.propose({0: [1, 2, 3] + truth}, {0: 2})[0].tokens != truth[-2:]  # past the end: wrong


def test_the_output_is_the_targets_greedy_output():
    target = ToyModel()
    prompt = [1, 2, 3, 4]
    config = GenerationConfig(max_new_tokens=40, temperature=0.0)
    plain = SpeculativeDecoder(target, None).generate(prompt, config).tokens
    for a in (0.0, 0.5, 1.0):
        result = SpeculativeDecoder(target, SyntheticDrafter({tuple(prompt): plain}, a, target.vocab_size), 4).generate(
            prompt, config
        )
        assert result.tokens == plain
        if a == 1.0:
            assert result.stats.accepted == result.stats.drafted > 0
        if a == 0.0:
            assert result.stats.accepted == 0


def test_acceptance_out_of_range_is_refused():
    with pytest.raises(ValueError):
        SyntheticDrafter({}, 1.5, 10)
