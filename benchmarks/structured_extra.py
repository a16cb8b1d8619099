#!/usr/bin/env python3
"""What `specdec bench` does not report for the structured suite (benchmarks/structured.jsonl):

- the share of each greedy answer's tokens that the schema forced (one token allowed);
- the suite's clairvoyant ceiling on this machine's cost curve: a drafter that knew the answer
  and drafted, each step, the longest run that forced tokens and copies of the prompt (or of the
  answer so far) cover, its length chosen by dynamic programming over the curve;
- the mask's cost on plain decoding: the host time the grammar takes a token (masks, the copy of
  the masked logits, advancing the state) against a plain step's, and plain decoding's seconds a
  token with the schema against without it, interleaved.

    python benchmarks/structured_extra.py [--per-category N] [--repeats R] [--max-tokens T]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from specdec import GenerationConfig, SpeculativeDecoder, load_model  # noqa: E402
from specdec.bench.suite import load_suite  # noqa: E402
from specdec.costs import measure_cost_table  # noqa: E402
from specdec.engine import Engine  # noqa: E402
from specdec_lab.replay import _best_time, _curves, _plain_time  # noqa: E402


def sure_lengths(grammars, spec, prompt: list[int], output: list[int]) -> tuple[list[int], int]:
    """Each position's run of forced tokens and copies (alternating, as far as they reach), and
    how many of the output's tokens were forced."""
    forced_at = []
    c = grammars.constraint(spec)
    for tok in output:
        forced_at.append(int(c.allowed().sum()) == 1)
        c.consume([tok])
    seq = prompt + output
    start = len(prompt)
    lengths = []
    for pos in range(len(output)):
        n = 0
        while pos + n < len(output):
            f = 0
            while pos + n + f < len(output) and forced_at[pos + n + f]:
                f += 1
            n += f
            copied = _longest_copy(seq, start + pos + n, start + len(output))
            n += copied
            if not f and not copied:
                break
        lengths.append(n)
    return lengths, sum(forced_at)


def _longest_copy(seq: list[int], at: int, end: int) -> int:
    """The longest run from seq[at:end] that occurs earlier, wholly before `at`."""
    best = 0
    for j in range(at):
        n = 0
        while at + n < end and j + n < at and seq[j + n] == seq[at + n]:
            n += 1
        best = max(best, n)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-category", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=160)
    args = ap.parse_args()
    items = load_suite(ROOT / "benchmarks" / "structured.jsonl", per_category=args.per_category)
    target = load_model("qwen2.5-coder-1.5b")
    costs = measure_cost_table(target)
    plain = SpeculativeDecoder(target, None)
    grammars = plain.engine.grammars

    # the grammar's host time: Engine._mask and Constraint.consume, timed on plain decoding
    spent = [0.0]
    real_mask = Engine._mask

    def timed_mask(self, rows, drafts, logits):
        t = time.perf_counter()
        real_mask(self, rows, drafts, logits)
        spent[0] += time.perf_counter() - t

    Engine._mask = timed_mask
    ceilings, shares, mask_share, with_schema, without = [], [], [], [], []
    for item in items:
        cfg = GenerationConfig(max_new_tokens=args.max_tokens, response_format=item["response_format"])
        free = GenerationConfig(max_new_tokens=args.max_tokens)
        runs = {"schema": [], "free": []}
        for _ in range(args.repeats):  # interleaved
            spent[0] = 0.0
            r = plain.generate(item["prompt"], cfg)
            runs["schema"].append(r.stats.decode_seconds / r.stats.generated_tokens)
            mask_s = spent[0] / r.stats.generated_tokens
            f = plain.generate(item["prompt"], free)
            runs["free"].append(f.stats.decode_seconds / f.stats.generated_tokens)
        lengths, forced = sure_lengths(grammars, cfg.constraint, list(r.prompt_tokens), list(r.tokens))
        curves = _curves(costs, len(r.prompt_tokens), len(r.tokens))
        ceilings.append(_plain_time(curves) / _best_time(lengths, curves))
        shares.append(forced / len(r.tokens))
        step = min(runs["schema"])
        mask_share.append(mask_s / step)
        with_schema.append(min(runs["schema"]))
        without.append(min(runs["free"]))
        print(
            f"{item['id']}: {len(r.tokens)} tokens, forced {forced} ({shares[-1]:.0%}), ceiling "
            f"{ceilings[-1]:.2f}x, mask {1000 * mask_s:.3f} ms/token ({mask_share[-1]:.1%} of a plain step), "
            f"plain {1000 * with_schema[-1]:.1f} ms/token with the schema, {1000 * without[-1]:.1f} without",
            flush=True,
        )
    med = statistics.median
    ratio = [a / b for a, b in zip(with_schema, without)]
    print(
        f"\n{len(items)} prompts: forced share median {med(shares):.1%} ({min(shares):.1%}-{max(shares):.1%}); "
        f"clairvoyant forced+copied ceiling median {med(ceilings):.2f}x ({min(ceilings):.2f}-{max(ceilings):.2f}); "
        f"the grammar's host time median {med(mask_share):.2%} of a plain step; plain seconds a token with the "
        f"schema over without, median {med(ratio):.3f} ({min(ratio):.3f}-{max(ratio):.3f}; fastest of "
        f"{args.repeats} each, different answers: a rough check)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
