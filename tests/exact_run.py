"""What tests/test_exact.py checks, run in a process of its own (a process loads llama.cpp's exact
build or its default one, never both): `python tests/exact_run.py forwards|greedy [--exact]`
prints one JSON object.

forwards: for cache depths on both sides of 512 (where flash attention's one-row path splits the
  cache across threads) and every width a step can verify, 2..33 (a draft of up to
  MAX_DRAFT_TOKENS = 32 tokens and the last token; the exact build's tiled matmul takes 20 or more
  tokens, the dot products fewer), a forward of W tokens against W one-token forwards at the same
  positions, for one row and for two rows in one forward.
greedy: the real target, plain decoding alone against speculative decoding (the draft model, prompt
  lookup) alone and in a batch of 4 rows, on test_greedy_real's prompts; and sampled by position
  (reproducible, temperature 0.8, top-p 0.95), the same seeds.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]

DEPTHS = (20, 600)
WIDTHS = tuple(range(2, 34))  # every width a step verifies: 1 + a draft of up to MAX_DRAFT_TOKENS


def forwards(exact: bool) -> dict:
    from specdec import load_model

    model = load_model("qwen2.5-coder-0.5b", n_ctx=1024, max_rows=2, progress=False, exact=exact)
    text = (ROOT / "src" / "specdec" / "engine.py").read_text()
    tokens = model.tokenizer.encode(text)[: max(DEPTHS) + max(WIDTHS)]
    a, b = model.add_rows(2)
    checks = []
    for depth in DEPTHS:
        model.rollback_rows({a: 0, b: 0})
        model.forward_rows({a: tokens[:depth], b: tokens[:depth]}, {})
        # the one-token forwards of the widest width's tokens; a narrower width's are their first W
        every = [model.forward_rows({a: [t]}, {a: 1})[a][0] for t in tokens[depth : depth + max(WIDTHS)]]
        for width in WIDTHS:
            new = tokens[depth : depth + width]
            singles = every[:width]
            model.rollback_rows({a: depth, b: depth})
            one_row = model.forward_rows({a: new}, {a: width})[a]
            model.rollback_rows({a: depth})
            both = model.forward_rows({a: new, b: new[: width // 2 + 1]}, {a: width, b: width // 2 + 1})
            checks.append(
                {
                    "depth": depth,
                    "width": width,
                    "one_row": all(np.array_equal(x, y) for x, y in zip(singles, one_row)),
                    "two_rows": all(np.array_equal(x, y) for x, y in zip(singles, both[a]))
                    and all(np.array_equal(x, y) for x, y in zip(singles, both[b])),
                    "max_diff": float(max(np.max(np.abs(x - y)) for x, y in zip(singles, one_row))),
                }
            )
    return {"checks": checks}


def greedy(exact: bool) -> dict:
    from specdec import GenerationConfig, SpeculativeDecoder, load_model
    from tests.test_greedy_real import PROMPTS

    config = GenerationConfig(max_new_tokens=64)
    target = load_model("qwen2.5-coder-1.5b", n_ctx=2048, max_rows=4, progress=False, exact=exact)
    draft = load_model("qwen2.5-coder-0.5b", n_ctx=2048, max_rows=4, progress=False, exact=exact)
    out = {"plain": [SpeculativeDecoder(target, None).generate(p, config).tokens for p in PROMPTS]}
    runs = {
        "draft model": [SpeculativeDecoder(target, draft, k=4).generate(p, config) for p in PROMPTS],
        "ngram": [SpeculativeDecoder(target, "ngram", k=6).generate(p, config) for p in PROMPTS],
        "draft model, batch of 4": SpeculativeDecoder(target, draft, k=4).generate_batch(PROMPTS[:4], config),
    }
    # sampled by position (reproducible): the same seed, the same text, whatever drafted it
    sampled = replace(config, temperature=0.8, top_p=0.95, reproducible=True, max_new_tokens=32)
    out["sampled plain"] = [SpeculativeDecoder(target, None).generate(p, sampled, seed=7).tokens for p in PROMPTS]
    runs["sampled ngram"] = [SpeculativeDecoder(target, "ngram", k=6).generate(p, sampled, seed=7) for p in PROMPTS]
    runs["sampled draft model"] = [SpeculativeDecoder(target, draft, k=4).generate(p, sampled, seed=7) for p in PROMPTS]
    batch = SpeculativeDecoder(target, draft, k=4).generate_batch(PROMPTS[:4], replace(sampled, seed=7))
    out["sampled plain, seeds 7.."] = [
        SpeculativeDecoder(target, None).generate(p, sampled, seed=7 + i).tokens for i, p in enumerate(PROMPTS[:4])
    ]
    runs["sampled draft model, batch of 4"] = batch  # row i is seeded 7 + i
    for name, results in runs.items():
        out[name] = [r.tokens for r in results]
        out[name + " accepted"] = sum(r.stats.accepted for r in results)
    return out


if __name__ == "__main__":
    what, exact = sys.argv[1], "--exact" in sys.argv[2:]
    print(json.dumps({"forwards": forwards, "greedy": greedy}[what](exact)))
