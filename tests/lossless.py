"""The greedy check every real-model test uses: speculative output is the target's own greedy output.

llama.cpp's CPU kernels are not batch-invariant (specdec.compare.ROUNDING_GAP): a verification batch
and single-token steps compute logits, and fill the KV cache, with different rounding. Where the
target's top-2 logits are closer than that rounding, two runs may legitimately part. So the check is:
token for token equal to plain decoding; and if they part, it must be at such a tie, and every
later speculative token must still be the target's argmax (or a tie) given the speculative prefix,
replayed one token at a time as plain decoding computes it. The rule lives in the library, where
`specdec check` uses it too (specdec.check.greedy_parting). A verifier that keeps one wrong token
fails it (tests/test_greedy_real.py::test_the_check_catches_a_broken_verifier)."""

from __future__ import annotations

from typing import Sequence

import pytest

from specdec.check import greedy_parting


def assert_greedy_lossless(
    target, prompt_tokens: Sequence[int], plain: Sequence[int], speculative: Sequence[int]
) -> bool:
    """True if identical; False if the outputs part at a named rounding tie (and the speculative
    output stays greedy after it); fails the test otherwise. Uses one spare row of `target`."""
    if list(speculative) == list(plain):
        return True
    _, _, problem = greedy_parting(target, prompt_tokens, plain, speculative)
    if problem is not None:
        pytest.fail(problem)
    return False
