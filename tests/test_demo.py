"""The demo's verdicts: a win or a loss only beyond the noise plain decoding's two runs show, and
"stepped aside" where auto hardly drafted, whatever the timings say."""

from __future__ import annotations

from specdec.compare import Comparison
from specdec.demo import judge
from specdec.engine import GenerationResult
from specdec.stats import GenerationStats


def run(tokens_per_second: float, decisions: dict | None = None) -> GenerationResult:
    stats = GenerationStats(generated_tokens=100, decode_seconds=100 / tokens_per_second)
    stats.decisions = decisions or {"plain": 100}
    stats.steps = sum(stats.decisions.values())
    return GenerationResult("", [], [], stats)


def comparison(plain: float, again: float, auto: float, decisions: dict) -> Comparison:
    return Comparison(run(plain), run(auto, decisions), greedy=True, plain_again=run(again))


def test_a_win_is_claimed_only_beyond_the_noise():
    drafting = {"ngram:8": 40, "plain": 10}
    assert comparison(10.0, 10.0, 13.0, drafting).noise == 0.0
    assert judge(comparison(10.0, 10.0, 13.0, drafting)).startswith("auto won")
    # the two plain runs differ by 20%: a 13% faster auto is inside it
    noisy = comparison(9.0, 11.0, 11.3, drafting)
    assert abs(noisy.noise - 0.2) < 1e-9 and abs(noisy.speedup - 1.13) < 1e-9
    assert "no measured difference" in judge(noisy)
    assert judge(comparison(10.0, 10.0, 8.0, drafting)).startswith("auto lost")
    # a 4% difference is never told as a win, however alike the plain runs
    assert "no measured difference" in judge(comparison(10.0, 10.0, 10.4, drafting))


def test_stepped_aside_is_said_whatever_the_timings():
    """The fresh-clone case that claimed 'auto 1.17x, auto won': auto drafted on 1 of 90 steps."""
    result = comparison(10.0, 10.0, 11.7, {"ngram:4": 1, "plain": 89})
    assert judge(result).startswith("auto stepped aside (drafted on 1 of 90 steps)")
