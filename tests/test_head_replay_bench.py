"""benchmarks/head_replay.py --sampled: the first guess's acceptance at temperature 1 in expectation,
sum min(p, q), with p read from the state after the drafting one and q from the head's first step."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from specdec.drafters.base import Draft

_spec = importlib.util.spec_from_file_location(
    "head_replay", Path(__file__).resolve().parents[1] / "benchmarks" / "head_replay.py"
)
head_replay = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(head_replay)


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


class OffsetHead:
    """Drafts, from states[i] and the token after it, the target's own distribution at row
    i + offset (offset 1: what the target says next, so every draft is kept), or a fixed q."""

    def __init__(self, states, weights, output, offset=1, q=None):
        self.states, self.weights, self.output, self.offset, self.q = states, weights, output, offset, q

    def _draft(self, h, last, k, params, rng):
        assert params.temperature == 1.0 and k == 1
        [i] = np.nonzero((self.states == h).all(-1))[0]
        assert last == self.output[i]  # the token the drafting state chose
        q = self.q if self.q is not None else softmax(self.states[i + self.offset] @ self.weights.T)
        return Draft([int(q.argmax())], q[None])


@pytest.fixture
def recording():
    rng = np.random.default_rng(3)
    states, weights = rng.normal(size=(9, 4)), rng.normal(size=(6, 4))
    output = [int(t) for t in (states @ weights.T).argmax(-1)]  # row r chose output[r]
    return states, weights, output


def test_a_head_drafting_the_targets_next_distribution_is_always_kept(recording):
    states, weights, output = recording
    head = OffsetHead(states, weights, output, offset=1)
    assert head_replay.sampled_first(head, states, output, weights) == pytest.approx(1.0)
    late = OffsetHead(states, weights, output, offset=0)  # one position behind: kept less
    assert head_replay.sampled_first(late, states, output, weights) < 0.99


def test_the_expectation_is_the_mean_of_sum_min_p_q(recording):
    states, weights, output = recording
    q = np.array([0.5, 0.3, 0.2, 0.0, 0.0, 0.0])
    head = OffsetHead(states, weights, output, q=q)
    p = softmax(states @ weights.T)
    want = np.mean([np.minimum(p[pos], q).sum() for pos in range(1, len(output) - 1)])
    assert head_replay.sampled_first(head, states, output, weights) == pytest.approx(want)
