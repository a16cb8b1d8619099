"""Block verification against token-by-token verification on the real models: the draft model's
sampled chains, the same prompts and seeds under each rule, the rules alternating batch by batch.
Prints, per rule, tokens per target step (all tokens over all steps, with its standard error over
the rows), acceptance by draft position, and wall-clock tokens/s (only alone on the machine does
that mean anything).

    python benchmarks/verification_rules.py --suite benchmarks/dev-prompts.jsonl --per-category 2 \
        -n 128 -k 4 --temperature 1 --batch 4 --seed 5

Both rules sample the target exactly (tests/test_verify_rules.py); block verification keeps at
least as many tokens in expectation (Sun et al. 2025, arXiv:2403.10444).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

from specdec import GenerationConfig, SpeculativeDecoder, load_model
from specdec.bench import load_suite, prompt_text
from specdec.drafters import model_drafter
from specdec.sampling import VERIFICATION_RULES
from specdec.spec import parse_method


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--suite", default="benchmarks/dev-prompts.jsonl")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("-n", "--max-tokens", type=int, default=128)
    ap.add_argument("-k", type=int, default=4, help="draft tokens a step")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--batch", type=int, default=4, help="rows generated together")
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()

    target = load_model(args.target, threads=args.threads, max_rows=args.batch)
    draft = load_model(args.draft, threads=args.threads, max_rows=args.batch)
    drafter = model_drafter(draft, target, None)
    items = load_suite(Path(args.suite), per_category=args.per_category)
    texts = [prompt_text(target, item) for item in items]
    rows = {rule: [] for rule in VERIFICATION_RULES}  # (tokens, target steps) of each row
    by_position = {rule: [[0, 0] for _ in range(args.k)] for rule in VERIFICATION_RULES}  # [kept, drafted]
    tokens, seconds = dict.fromkeys(VERIFICATION_RULES, 0), dict.fromkeys(VERIFICATION_RULES, 0.0)
    for b, start in enumerate(range(0, len(texts), args.batch)):
        batch = texts[start : start + args.batch]
        order = VERIFICATION_RULES if b % 2 == 0 else VERIFICATION_RULES[::-1]  # alternate who goes first
        for rule in order:
            decoder = SpeculativeDecoder.from_spec(target, parse_method(f"draft:{args.k}"), draft=drafter)
            config = GenerationConfig(
                max_new_tokens=args.max_tokens,
                temperature=args.temperature,
                top_p=args.top_p,
                chat=False,
                verification=rule,
            )
            t = time.perf_counter()
            results = decoder.generate_batch(batch, config, seed=args.seed + start)
            seconds[rule] += time.perf_counter() - t
            for r in results:
                s = r.stats
                tokens[rule] += s.generated_tokens
                rows[rule].append((s.generated_tokens, s.steps))
                for i in range(min(args.k, len(s.drafted_at))):
                    by_position[rule][i][0] += s.accepted_at[i]
                    by_position[rule][i][1] += s.drafted_at[i]
        print(f"batch {b + 1}: done", flush=True)
    print(
        f"\n{args.target} <- {args.draft}, k {args.k}, temperature {args.temperature}, top-p {args.top_p}, "
        f"{len(texts)} prompts, -n {args.max_tokens}, batches of {args.batch}, seed {args.seed}"
    )
    print("| rule | tokens per target step | steps | acceptance by draft position | tokens/s (wall) |")
    print("|---|---|---|---|---|")
    for rule in VERIFICATION_RULES:
        t, n = (sum(col) for col in zip(*rows[rule]))
        ratio, m = t / n, len(rows[rule])
        # the ratio estimator's standard error over rows: sqrt(sum (t_i - R n_i)^2 / (m (m - 1))) / mean n
        se = math.sqrt(sum((ti - ratio * ni) ** 2 for ti, ni in rows[rule]) / (m * max(1, m - 1))) / (n / m)
        acc = " ".join(f"{a / d:.2f}" if d else "-" for a, d in by_position[rule])
        print(f"| {rule} | {ratio:.3f} +- {se:.3f} | {n} | {acc} | {tokens[rule] / seconds[rule]:.1f} |")


if __name__ == "__main__":
    main()
