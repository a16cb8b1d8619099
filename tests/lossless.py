"""The greedy check every real-model test uses: speculative output is the target's own greedy output.

llama.cpp's CPU kernels are not batch-invariant (specdec.compare.ROUNDING_GAP): a verification batch
and single-token steps compute logits, and fill the KV cache, with different rounding. Where the
target's top-2 logits are closer than that rounding, two runs may legitimately part. So the check is:
token for token equal to plain decoding; and if they part, it must be at such a tie, and every
later speculative token must still be the target's argmax (or a tie) given the speculative prefix,
replayed one token at a time as plain decoding computes it. A verifier that keeps one wrong token
fails it (tests/test_greedy_real.py::test_the_check_catches_a_broken_verifier)."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pytest

from specdec.compare import ROUNDING_GAP, first_difference


def _gap_and_argmax(row: np.ndarray) -> tuple[float, int]:
    top2 = np.partition(row.astype(np.float64), -2)[-2:]
    return float(top2[1] - top2[0]), int(np.argmax(row))


def assert_greedy_lossless(
    target, prompt_tokens: Sequence[int], plain: Sequence[int], speculative: Sequence[int]
) -> bool:
    """True if identical; False if the outputs part at a named rounding tie (and the speculative
    output stays greedy after it); fails the test otherwise. Uses one spare row of `target`."""
    plain, speculative = list(plain), list(speculative)
    if speculative == plain:
        return True
    first = first_difference(plain, speculative)
    [r] = target.add_rows(1)
    try:
        target.forward_rows({r: list(prompt_tokens[:-1])})
        row = target.forward_rows({r: list(prompt_tokens[-1:])}, {r: 1})[r][0]  # [vocab]
        for j, token in enumerate(speculative):
            gap, best = _gap_and_argmax(row)
            if token != best and gap >= ROUNDING_GAP:
                pytest.fail(
                    f"speculative token {j} is {token}, but the target's argmax is {best} with a "
                    f"top-2 gap of {gap:.3f} (>= {ROUNDING_GAP}): not a rounding tie"
                )
            if j == first and j < len(plain) and gap >= ROUNDING_GAP:
                pytest.fail(f"outputs part at token {j} where the target's top-2 gap is {gap:.3f}")
            row = target.forward_rows({r: [token]}, {r: 1})[r][0]
        if first == len(speculative) < len(plain):  # the speculative run ended first
            gap, _ = _gap_and_argmax(row)
            if gap >= ROUNDING_GAP:
                pytest.fail(
                    f"the speculative output ends at token {first}, where plain decoding goes on "
                    f"and the target's top-2 gap is {gap:.3f}: not a rounding tie"
                )
    finally:
        target.drop_rows([r])
    return False
