"""Plain vs speculative decoding of the same request on the same loaded models."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from .config import GenerationConfig
from .decoder import SpeculativeDecoder
from .engine import GenerationResult
from .models.base import RowModel

# llama.cpp's CPU kernels are not batch-invariant: the same tokens scored in one batch or one at a
# time give log-probabilities that differ by up to ~0.5 (measured on Qwen2.5 Q4_K_M, AVX-512, with
# or without repacked weights and flash attention), and the KV cache a verification batch fills
# differs from the one single steps fill by as much. A top-2 logit gap below this at the first
# difference is such a rounding tie; above it, a verification bug.
ROUNDING_GAP = 0.5


@dataclass
class Comparison:
    plain: GenerationResult
    speculative: GenerationResult
    greedy: bool
    first_difference: int | None = None  # index into the generated tokens; None = identical
    logit_gap: float | None = None  # target's top-1 minus top-2 logit there
    plain_again: GenerationResult | None = None  # plain decoding once more, after the speculative run
    exact: bool = False  # the target ran in the exact mode, where greedy runs may not part at all

    @property
    def plain_tokens_per_second(self) -> float:
        """Plain decoding's tokens/s: the mean of its runs."""
        runs = [r for r in (self.plain, self.plain_again) if r is not None]
        return sum(r.stats.tokens_per_second for r in runs) / len(runs)

    @property
    def noise(self) -> float | None:
        """How far plain decoding's two runs (before and after the speculative one) differ, as a
        share of their mean; None with one run. A speedup inside it is not a measured win."""
        if self.plain_again is None:
            return None
        a, b = self.plain.stats.tokens_per_second, self.plain_again.stats.tokens_per_second
        return abs(a - b) / ((a + b) / 2) if a + b else 0.0

    @property
    def identical(self) -> bool:
        return self.plain.tokens == self.speculative.tokens

    @property
    def speedup(self) -> float:
        plain = self.plain_tokens_per_second
        return self.speculative.stats.tokens_per_second / plain if plain else 0.0

    def verdict(self) -> str:
        if self.identical:
            return "identical"
        if not self.greedy:
            return "different (expected when sampling: both follow the target's distribution)"
        if self.exact:
            return (
                f"different from token {self.first_difference} in the exact mode, where a verification "
                f"forward scores every token as a one-token step does (top-2 logit gap there "
                f"{self.logit_gap:.4f}): this is a bug, please report it"
            )
        if self.logit_gap is not None and self.logit_gap < ROUNDING_GAP:
            return (
                f"different from token {self.first_difference}: the target's top-2 logit gap there is "
                f"{self.logit_gap:.4f} (< {ROUNDING_GAP}), a rounding tie between llama.cpp's batched "
                f"and single-token kernels, not a bug"
            )
        return (
            f"different from token {self.first_difference}: the target's top-2 logit gap there is "
            f"{self.logit_gap:.4f}, too large for rounding: this is a bug, please report it"
        )

    def to_dict(self) -> dict:
        return {
            "plain": self.plain.to_dict(),
            "speculative": self.speculative.to_dict(),
            "identical": self.identical,
            "speedup": self.speedup,
            "first_difference": self.first_difference,
            "logit_gap": self.logit_gap,
            "exact": self.exact,
        }


def first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    """The first index where two token lists differ (the shorter one's length if one is the start
    of the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def top2_gap(target: RowModel, tokens: Sequence[int]) -> float:
    """The target's top-1 minus top-2 logit for the token after `tokens` (single-token scoring)."""
    [r] = target.add_rows(1)
    try:
        target.forward_rows({r: tokens[:-1]})
        row = target.forward_rows({r: tokens[-1:]}, {r: 1})[r][0]  # [vocab]
    finally:
        target.drop_rows([r])
    return logit_gap(row)


def logit_gap(row: np.ndarray) -> float:
    """A logits row's top-1 minus top-2 logit (in float64)."""
    top2 = np.partition(row.astype(np.float64), -2)[-2:]
    return float(top2[1] - top2[0])


def compare(
    speculative: SpeculativeDecoder, prompt, config: GenerationConfig, warmup: bool = True, repeat_plain: bool = False
) -> Comparison:
    """Plain decoding, then `speculative`, on the same request and the same loaded target; with
    `repeat_plain`, plain decoding once more after it, so that the machine's drift between runs
    is measured (Comparison.noise) and the speedup reads the two plain runs' mean."""
    target = speculative.target
    plain = SpeculativeDecoder(target, None)
    if warmup:  # touch every weight page of both models so that neither run pays for it
        speculative.generate(prompt, replace(config, max_new_tokens=min(8, config.max_new_tokens)))
    plain_result = plain.generate(prompt, config)
    spec_result = speculative.generate(prompt, config)
    again = plain.generate(prompt, config) if repeat_plain else None
    result = Comparison(
        plain_result,
        spec_result,
        greedy=config.sampling.greedy,
        plain_again=again,
        exact=target.exact,
    )
    if not result.identical:
        a, b = plain_result.tokens, spec_result.tokens
        i = result.first_difference = first_difference(a, b)
        if result.greedy:
            result.logit_gap = top2_gap(target, plain_result.prompt_tokens + a[:i])
    return result
