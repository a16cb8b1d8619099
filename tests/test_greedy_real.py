"""Greedy speculative output is the target's own greedy output, on the real 1.5B target.

llama.cpp's CPU kernels are not batch-invariant (see specdec.compare.ROUNDING_GAP): a verification
batch and single-token steps compute logits, and fill the KV cache, with different rounding. Where
the target's top-2 logits are closer than that rounding, the two runs may legitimately part ways.
So the check is: token for token equal to plain decoding; and if they part, it must be at such a
tie, and every later speculative token must still be the target's argmax (or a tie) given the
speculative prefix. A verifier that keeps one wrong token fails it (see the last test).
"""
from __future__ import annotations

import numpy as np
import pytest

from specdec import GenerationConfig, SpeculativeDecoder
from specdec.compare import ROUNDING_GAP

pytestmark = pytest.mark.real_models

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Explain in two sentences what a hash map is.",
    "Rename the variable `x` to `total` in this code:\n\ndef f(items):\n    x = 0\n    for i in items:\n"
    "        x += i\n    return x\n",
    "Write a SQL query that lists the ten customers with the highest total order value.",
    "Add type hints to this function:\n\ndef scale(values, factor):\n    return [v * factor for v in values]\n",
]

CONFIG = GenerationConfig(max_new_tokens=64)
EXACT: dict[str, int] = {}   # drafter -> prompts whose output was token-for-token identical


def gap_and_argmax(row: np.ndarray) -> tuple[float, int]:
    top2 = np.partition(row.astype(np.float64), -2)[-2:]
    return float(top2[1] - top2[0]), int(np.argmax(row))


def assert_greedy_lossless(target, prompt_tokens, plain, speculative):
    if speculative == plain:
        return True
    first = next((i for i, (a, b) in enumerate(zip(plain, speculative)) if a != b),
                 min(len(plain), len(speculative)))
    # Replay the speculative output through the target one token at a time, as plain decoding does.
    target.reset()
    target.forward(prompt_tokens[:-1], n_rows=0)
    row = target.forward(prompt_tokens[-1:])[0]
    for j, token in enumerate(speculative):
        gap, best = gap_and_argmax(row)
        if token != best and gap >= ROUNDING_GAP:
            pytest.fail(f"speculative token {j} is {token}, but the target's argmax is {best} with a "
                        f"top-2 gap of {gap:.3f} (>= {ROUNDING_GAP}): not a rounding tie")
        if j == first and j < len(plain) and gap >= ROUNDING_GAP:
            pytest.fail(f"outputs part at token {j} where the target's top-2 gap is {gap:.3f}")
        row = target.forward([token])[0]
    return False


@pytest.fixture(scope="module")
def plain_outputs(target_model):
    decoder = SpeculativeDecoder(target_model, None)
    return [decoder.generate(p, CONFIG) for p in PROMPTS]


def _run(target_model, drafter, k, plain, index):
    result = SpeculativeDecoder(target_model, drafter, k=k).generate(PROMPTS[index], CONFIG)
    exact = assert_greedy_lossless(target_model, plain.prompt_tokens, plain.tokens, result.tokens)
    name = "draft" if drafter != "ngram" else "ngram"
    EXACT[name] = EXACT.get(name, 0) + exact
    return result


@pytest.mark.parametrize("index", range(len(PROMPTS)))
def test_draft_model_is_lossless(target_model, draft_model, plain_outputs, index):
    result = _run(target_model, draft_model, 4, plain_outputs[index], index)
    assert len(result.tokens) == 64 or result.stats.finish_reason == "eog"
    assert result.stats.drafted > 0 and result.stats.accepted > 0


@pytest.mark.parametrize("index", range(len(PROMPTS)))
def test_ngram_is_lossless(target_model, plain_outputs, index):
    _run(target_model, "ngram", 6, plain_outputs[index], index)


def test_most_outputs_are_identical():
    """Ties are rare: most prompts must come out token-for-token identical (4 of 5 measured)."""
    if len(EXACT) < 2:
        pytest.skip("run with the lossless tests above")
    assert EXACT["draft"] >= 3 and EXACT["ngram"] >= 3, EXACT


def test_the_check_catches_a_broken_verifier(target_model, plain_outputs, monkeypatch):
    """Power check: a verifier that always keeps the whole draft must fail the check above."""
    import specdec.engine

    def keep_everything(logits, draft_tokens, q, params, rng):
        return len(draft_tokens), int(np.argmax(logits[-1]))

    monkeypatch.setattr(specdec.engine, "verify", keep_everything)
    result = SpeculativeDecoder(target_model, "ngram", k=6).generate(PROMPTS[2], CONFIG)
    with pytest.raises(pytest.fail.Exception, match="not a rounding tie|top-2 gap"):
        assert_greedy_lossless(target_model, plain_outputs[2].prompt_tokens, plain_outputs[2].tokens,
                               result.tokens)


@pytest.fixture(scope="module")
def target_4_rows():
    from specdec import load_model

    return load_model("qwen2.5-coder-1.5b", n_ctx=2048, max_rows=4, progress=False)


@pytest.mark.parametrize("drafter, k", [(None, 0), ("ngram", 6)])
def test_rows_of_a_batch_equal_their_solo_runs(target_4_rows, plain_outputs, drafter, k):
    """Four prompts in one llama.cpp context, one llama_decode per step: each row is the target's
    greedy output alone (under the rounding-tie rule: a batch is another batch shape)."""
    results = SpeculativeDecoder(target_4_rows, drafter, k=k).generate_batch(PROMPTS[:4], CONFIG)
    exact = 0
    for plain, result in zip(plain_outputs, results):
        assert result.prompt_tokens == plain.prompt_tokens
        exact += assert_greedy_lossless(target_4_rows, plain.prompt_tokens, plain.tokens, result.tokens)
    assert exact >= 2, f"only {exact} of 4 rows identical to their solo runs"


def test_rows_join_a_running_batch(target_4_rows, plain_outputs):
    """A row that joins while others decode (its prompt prefilled in chunks between their steps)
    gives its solo output; a cancelled row frees its sequence for the next."""
    decoder = SpeculativeDecoder(target_4_rows, "ngram", k=4)
    engine = decoder.engine
    engine.prefill_chunk = 8                     # the joining prompt takes several steps
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
