"""Offline replay of drafting policies (specdec.replay): the ceilings bound every controller."""
from __future__ import annotations

import numpy as np
import pytest

from specdec.controller import CostAwareController, FixedController
from specdec.drafters.ngram import NgramDrafter
from specdec.replay import copy_ceiling, oracle_speedup, replay_speedup

from .test_controller import CURVE


def edited_copy(seed: int, n_prompt: int = 300, edits: int = 6):
    """A prompt of random tokens and an output that copies a stretch of it with a few tokens changed."""
    rng = np.random.default_rng(seed)
    prompt = [int(t) for t in rng.integers(0, 500, n_prompt)]
    output = prompt[50:250]
    for pos in rng.choice(len(output), edits, replace=False):
        output[pos] = int(rng.integers(500, 600))          # tokens the prompt never had
    return prompt, output


@pytest.mark.parametrize("seed", range(4))
def test_ceilings_bound_every_controller(seed):
    prompt, output = edited_copy(seed)
    ceiling = copy_ceiling(prompt, output, CURVE)
    oracle = oracle_speedup(prompt, output, CURVE)
    auto, decisions = replay_speedup(prompt, output, CURVE, CostAwareController(NgramDrafter(), None, CURVE))
    fixed, _ = replay_speedup(prompt, output, CURVE, FixedController(NgramDrafter(), 8))
    assert ceiling >= oracle - 1e-9 and oracle >= auto - 1e-9 and oracle >= fixed - 1e-9
    assert auto > 1.5 and fixed > 1.5                      # a copy with six edits pays well
    assert sum(n for key, n in decisions.items() if key != "plain") > 0


def test_nothing_to_copy_means_plain_speed():
    prompt = list(range(100))
    output = list(range(1000, 1200))                       # every token new
    assert copy_ceiling(prompt, output, CURVE) == pytest.approx(1.0)
    assert oracle_speedup(prompt, output, CURVE) == pytest.approx(1.0)
    auto, decisions = replay_speedup(prompt, output, CURVE, CostAwareController(NgramDrafter(), None, CURVE))
    assert auto == pytest.approx(1.0) and decisions == {"plain": len(output)}


def test_a_wrong_guess_costs_a_wider_step():
    # the prompt says 1 2 3 4 then 1 2 3 5; the output copies neither continuation after "1 2 3"
    prompt, output = [9, 1, 2, 3, 4, 8, 1, 2, 3], [7, 7, 7, 7]
    speedup, decisions = replay_speedup(prompt, output, CURVE, FixedController(NgramDrafter(), 4))
    # step one drafts [4, 8, 1, 2] from "1 2 3" and keeps none; later steps draft from "7"
    assert decisions["ngram:4"] >= 1 and speedup < 1.0
