"""Greedy speculative output is the target's own greedy output, on the real 1.5B target: `auto`
(the default), the 0.5B draft model, prompt lookup, the suffix cache and a draft of another
vocabulary; alone and in a batch of four llama.cpp rows; a row that joins a running batch.

Every comparison goes through tests/lossless.py: token for token equal to plain decoding, or
parting at a named rounding tie of llama.cpp's kernels with the output greedy after it.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from specdec import GenerationConfig, SpeculativeDecoder
from specdec.costs import CostTable, cost_table

from .lossless import assert_greedy_lossless
from .toy import frozen

pytestmark = pytest.mark.real_models

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Explain in two sentences what a hash map is.",
    "Rename the variable `x` to `total` in this code:\n\ndef f(items):\n    x = 0\n    for i in items:\n"
    "        x += i\n    return x\n",
    "Write a SQL query that lists the ten customers with the highest total order value.",
    "Add type hints to this function:\n\ndef scale(values, factor):\n    return [v * factor for v in values]\n",
]
COPYING = (2, 4)  # prompts whose answers copy from the prompt: prompt lookup drafts there
CONFIG = GenerationConfig(max_new_tokens=64)


def shipped_costs(curve: str) -> tuple:
    """auto's cost curves, frozen, so that no test times the models and no decision depends on how
    busy the machine is. 'cpu': this CPU's llama.cpp curves from a shipped `specdec costs` report,
    where width is dear. 'flat': the H100's target curve (static shapes and graphs), nearly flat,
    with a draft model a fifth of its cost, where auto drafts long and with the draft model. (The
    0.5B costs 0.76x the 1.5B on the H100, where both are launch-bound, and there auto rightly leaves
    it; a fifth is a draft model much smaller than its target.)"""
    if curve == "cpu":
        report = json.loads((ROOT / "benchmarks" / "cpu" / "costs-1.5b-0.5b.json").read_text())
        return frozen(cost_table(report, "target")), frozen(cost_table(report, "draft"))
    target = cost_table(json.loads((ROOT / "benchmarks" / "gpu-h100" / "costs-1.5b-static-graphs.json").read_text()))
    return frozen(target), frozen(CostTable({w: s / 5 for w, s in target.base.items()}))


@pytest.fixture(scope="module")
def plain_outputs(target_model):
    decoder = SpeculativeDecoder(target_model, None)
    return [decoder.generate(p, CONFIG) for p in PROMPTS]


@pytest.fixture(scope="module")
def alone(target_model, draft_model):
    """Each drafter on every prompt, alone; the checks below read these runs."""

    def run(make):
        return [make().generate(p, CONFIG) for p in PROMPTS]

    return {
        "draft model": run(lambda: SpeculativeDecoder(target_model, draft_model, k=4)),
        "ngram": run(lambda: SpeculativeDecoder(target_model, "ngram", k=6)),
        # auto as a user on this CPU meets it (one decoder: what it learns carries over) ...
        "auto": [
            d.generate(p, CONFIG)
            for d in [SpeculativeDecoder(target_model, "auto", draft_model=draft_model, costs=shipped_costs("cpu"))]
            for p in PROMPTS
        ],
        # ... and where width is cheap, so that it drafts long and with the draft model
        "auto, flat curve": [
            d.generate(p, CONFIG)
            for d in [SpeculativeDecoder(target_model, "auto", draft_model=draft_model, costs=shipped_costs("flat"))]
            for p in PROMPTS
        ],
    }


DRAFTERS = ["draft model", "ngram", "auto", "auto, flat curve"]


@pytest.mark.parametrize("drafter", DRAFTERS)
@pytest.mark.parametrize("index", range(len(PROMPTS)))
def test_greedy_speculation_is_the_targets_greedy_output(target_model, plain_outputs, alone, drafter, index):
    plain, result = plain_outputs[index], alone[drafter][index]
    assert result.prompt_tokens == plain.prompt_tokens
    assert_greedy_lossless(target_model, plain.prompt_tokens, plain.tokens, result.tokens)
    assert len(result.tokens) == 64 or result.stats.finish_reason == "eog"


def test_each_drafter_drafted_and_was_kept(alone):
    """The checks above mean something: every drafter drafted and had drafts kept, prompt lookup
    on each answer that copies its prompt, and auto copied from the prompt on both curves and used
    the draft model on the flat one.

    Copying from the prompt is prompt lookup's or the suffix cache's (which also indexes the live
    row's own context): which of the two auto picks for a step is a near tie that its live timing
    decides, so either counts."""
    for drafter in ("draft model", "ngram", "auto, flat curve"):
        checked = alone[drafter] if drafter == "draft model" else [alone[drafter][i] for i in COPYING]
        assert all(r.stats.drafted > 0 and r.stats.accepted > 0 for r in checked), drafter
    used = lambda name: {key.split(":")[0] for r in alone[name] for key in r.stats.decisions}  # noqa: E731
    assert used("auto") & {"ngram", "suffix"}, used("auto")
    assert used("auto, flat curve") & {"ngram", "suffix"}, used("auto, flat curve")
    assert "draft" in used("auto, flat curve"), used("auto, flat curve")


def test_most_outputs_are_identical(target_model, plain_outputs, alone):
    """Ties are rare: most prompts come out token-for-token identical (4 or 5 of 5 measured)."""
    for drafter in DRAFTERS:
        identical = sum(r.tokens == p.tokens for r, p in zip(alone[drafter], plain_outputs))
        assert identical >= 3, (drafter, identical)


def test_the_check_catches_a_broken_verifier(target_model, plain_outputs, monkeypatch):
    """Power check: a verifier that always keeps the whole draft must fail the check above."""
    import specdec.engine
    import specdec.sampling

    def keep_everything(logits, draft_tokens, q, params, rng, rule="block"):
        return len(draft_tokens), int(np.argmax(logits[-1]))

    monkeypatch.setattr(specdec.sampling, "verify", keep_everything)
    result = SpeculativeDecoder(target_model, "ngram", k=6).generate(PROMPTS[2], CONFIG)
    with pytest.raises(pytest.fail.Exception, match="not a rounding tie|top-2 gap"):
        assert_greedy_lossless(target_model, plain_outputs[2].prompt_tokens, plain_outputs[2].tokens, result.tokens)


# -- four rows of one llama.cpp context, one llama_decode a step ------------------------------------


def _load(name: str, rows: int):
    from specdec import load_model

    from .conftest import _real_model

    _real_model(name)  # fails (or skips) with the reason where the model is missing
    return load_model(name, n_ctx=2048, max_rows=rows, progress=False)


@pytest.fixture(scope="module")
def target_4_rows(target_model):
    return _load("qwen2.5-coder-1.5b", 4)


@pytest.fixture(scope="module")
def draft_4_rows(draft_model):
    return _load("qwen2.5-coder-0.5b", 4)


BATCHED = ["draft model", "suffix", "auto, flat curve", "gemma (another vocabulary)"]
BATCH_TOKENS = 32  # of plain's 64: the batches are the slowest tests here


def _batched_decoder(drafter: str, target, draft):
    if drafter == "draft model":
        return SpeculativeDecoder(target, draft, k=4)
    if drafter == "auto, flat curve":
        return SpeculativeDecoder(target, "auto", draft_model=draft, costs=shipped_costs("flat"))
    if drafter.startswith("gemma"):
        return SpeculativeDecoder(target, _load("gemma-3-270m", 4), k=4)
    return SpeculativeDecoder(target, drafter, k=6)  # suffix


@pytest.mark.parametrize("drafter", BATCHED)
def test_rows_of_a_batch_are_the_targets_greedy_output(target_4_rows, draft_4_rows, plain_outputs, drafter):
    """Four prompts in one llama.cpp context, each row the target's greedy output alone (under the
    rounding-tie rule: a batch is another batch shape). Prompt lookup runs in a batch under auto
    and in test_rows_join_a_running_batch. The suffix cache runs the batch twice: the second time
    it drafts every row from the first."""
    decoder = _batched_decoder(drafter, target_4_rows, draft_4_rows)
    config = replace(CONFIG, max_new_tokens=BATCH_TOKENS)
    results = decoder.generate_batch(PROMPTS[:4], config)
    if drafter == "suffix":
        results = decoder.generate_batch(PROMPTS[:4], config)
    exact = 0
    for plain, result in zip(plain_outputs, results):
        assert result.prompt_tokens == plain.prompt_tokens
        exact += assert_greedy_lossless(target_4_rows, plain.prompt_tokens, plain.tokens[:BATCH_TOKENS], result.tokens)
    assert exact >= 2, f"only {exact} of 4 rows identical to their solo runs"
    assert sum(r.stats.accepted for r in results) > 0, drafter
    if drafter == "auto, flat curve":
        used = {key.split(":")[0] for r in results for key in r.stats.decisions}
        assert "draft" in used, used


def test_rows_join_a_running_batch(target_4_rows, plain_outputs):
    """A row that joins while others decode (its prompt prefilled in chunks between their steps)
    gives its solo output; a cancelled row frees its sequence for the next."""
    decoder = SpeculativeDecoder(target_4_rows, "ngram", k=4)
    engine = decoder.engine
    engine.prefill_chunk = 8  # the joining prompt takes several steps
    config = CONFIG
    first = engine.add(decoder.prompt_tokens(PROMPTS[0], config), config)
    doomed = engine.add(decoder.prompt_tokens(PROMPTS[1], config), config)
    for _ in range(5):
        engine.step()
    engine.cancel(doomed)
    late = engine.add(decoder.prompt_tokens(PROMPTS[2], config), config)
    engine.step()
    assert late.row is not None and 0 < late.prefilled < len(late.prompt_tokens) - 1
    engine.run([first, late])
    for index, request in ((0, first), (2, late)):
        plain = plain_outputs[index]
        assert_greedy_lossless(target_4_rows, plain.prompt_tokens, plain.tokens, request.result.tokens)
    assert doomed.result.stats.finish_reason == "cancelled"
