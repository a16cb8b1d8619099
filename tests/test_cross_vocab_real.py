"""Gemma-3-270M drafting for the Qwen2.5-Coder-1.5B target across tokenizers (262 144 vs 151 936
tokens): greedy output is the target's own, under the rounding-tie rule of tests/lossless.py,
in both modes; the CLI takes the pair."""

from __future__ import annotations

import json

import pytest

from specdec import SpeculativeDecoder
from specdec.drafters.cross_vocab import CrossVocabDrafter

from .conftest import _real_model, costs_report
from .lossless import assert_greedy_lossless
from .test_greedy_real import CONFIG, PROMPTS
from .test_user_errors import specdec

pytestmark = pytest.mark.real_models


@pytest.fixture(scope="module")
def gemma():
    return _real_model("gemma-3-270m")


@pytest.fixture(scope="module")
def plain_outputs(target_model):
    decoder = SpeculativeDecoder(target_model, None)
    return [decoder.generate(p, CONFIG) for p in PROMPTS[:3]]


@pytest.fixture(scope="module")
def runs(target_model, gemma):
    """Each mode on the first three prompts: (drafter, result)."""
    out = {}
    for mode in ("string", "intersect"):
        drafters = [CrossVocabDrafter(gemma, target_model, mode) for _ in range(3)]
        out[mode] = [
            (d, SpeculativeDecoder(target_model, d, k=4).generate(p, CONFIG)) for d, p in zip(drafters, PROMPTS[:3])
        ]
    return out


@pytest.mark.parametrize("mode", ["string", "intersect"])
@pytest.mark.parametrize("index", range(3))
def test_gemma_drafts_for_qwen_losslessly(target_model, plain_outputs, runs, mode, index):
    plain = plain_outputs[index]
    drafter, result = runs[mode][index]
    assert_greedy_lossless(target_model, plain.prompt_tokens, plain.tokens, result.tokens)
    assert result.stats.drafted > 0 and result.stats.accepted > 0
    special = drafter.target_special
    assert not any(t in special for t in result.tokens)


def test_most_cross_vocabulary_outputs_are_identical(plain_outputs, runs):
    for mode in ("string", "intersect"):
        identical = sum(r.tokens == p.tokens for (_, r), p in zip(runs[mode], plain_outputs))
        assert identical >= 2, (mode, identical)


def test_the_cli_takes_a_draft_of_another_vocabulary(tmp_path):
    for draft in ("gemma-3-270m", "intersect:gemma-3-270m"):
        proc = specdec("generate", "-p", "Write hello world in C.", "-n", "12", "--draft", draft, "--json")
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout)
        assert out["draft"] == "gemma-3-270m" and out["stats"]["drafted"] > 0
    costs = costs_report(tmp_path, draft="gemma-3-270m")
    proc = specdec(
        "generate", "-p", "Write hello world in C.", "-n", "12", "--draft-model", "gemma-3-270m", "--costs", costs,
        "--json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["draft"] == "auto (ngram + gemma-3-270m)"
