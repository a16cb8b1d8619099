"""Verification rules and draft shapes at temperature > 0 on the real models: the draft model's (a
trained head's, an early exit's) sampled chains and trees under each verification rule (block and
token by token; a tree node by node under both, or walked from its leaves up under traversal), the
same prompts and seeds for every arm, the arms taking turns batch by batch.

    python benchmarks/verification_rules.py --suite benchmarks/dev-prompts.jsonl --per-category 2 \\
        -n 128 --methods draft:4 --temperature 1 --batch 4 --seed 5
    python benchmarks/verification_rules.py --methods draft:8 draft:8x2/8 --rules block --seeds 3
    python benchmarks/verification_rules.py --backend torch --target qwen2.5-coder-0.5b \
        --methods early-exit:20:4 early-exit:20:4x2/4 --rules block

Per arm (a method, and for a chain a rule) it prints tokens per target step two ways, each with its
standard error over the rows:
- counted: the tokens the steps emitted;
- expected: one plus what the rule keeps of each step's draft in expectation over its uniform draws
  (sampling.expected_kept, expected_tree_kept). Same mean, less noise: the draws' luck is gone, the
  drafts' and the text's remain (a Rao-Blackwellised count; it ignores the cut at end-of-generation
  and at -n, so it reads a little above the counted one).
It also prints what block (a tree: traversal) and token-by-token verification keep of the SAME drafts
(block / token, expected tokens per step, with the paired standard error): the comparison the
rules' own runs can only make through two samples of text. Every arm is also set against the first
on the same prompts and seeds (the geometric mean of the rows' ratios of expected tokens per step,
with its standard error): each arm samples its own text, but the prompts' own spread is gone.
Wall-clock tokens/s leaves out the expectations' own time, and means something only alone on the
machine.

Both rules sample the target exactly (tests/test_verify_rules.py); block verification keeps at
least as many tokens of a chain in expectation over the drafts (Sun et al. 2025, arXiv:2403.10444),
though not on every single draft; of a tree, more on the toys there (no theorem says always).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import specdec.engine as engine
from specdec import GenerationConfig, SpeculativeDecoder, load_model
from specdec.bench import load_suite, prompt_text
from specdec.drafters import model_drafter
from specdec.sampling import (
    CHAIN_RULES,
    TREE_RULES,
    VERIFICATION_RULES,
    expected_kept,
    expected_tree_kept,
    logits_to_probs,
)
from specdec.spec import parse_method
from specdec_lab.helpers import ratio_of_sums


class Expectations:
    """Wraps the engine's sampled verifiers (engine.verify, engine.verify_tree): every step, before
    the rule runs, it adds what each rule keeps of that draft (chain or tree) in expectation to the
    row's sums. A row is known by its random stream (one per request)."""

    def __init__(self):
        # id(rng) -> sums over the row's steps: "steps"; each rule's expected kept (by name,
        # VERIFICATION_RULES); and that of the rule the step used ("used")
        self.rows: dict[int, dict[str, float]] = {}
        self.seconds = 0.0  # spent here, not in decoding
        self._verify, self._verify_tree = engine.verify, engine.verify_tree

    def __enter__(self) -> "Expectations":
        engine.verify, engine.verify_tree = self.verify, self.verify_tree
        return self

    def __exit__(self, *exc) -> None:
        engine.verify, engine.verify_tree = self._verify, self._verify_tree

    def _row(self, rng) -> dict[str, float]:
        return self.rows.setdefault(id(rng), {**dict.fromkeys(VERIFICATION_RULES, 0.0), "used": 0.0, "steps": 0})

    def verify(self, logits, draft, q, params, rng, rule="block"):
        if not params.greedy:
            t = time.perf_counter()
            row = self._row(rng)
            row["steps"] += 1
            if len(draft):
                p = logits_to_probs(logits, params)  # [k + 1, vocab]
                # (a one-hot draft: every rule keeps the same, as verify does)
                kept = {how: expected_kept(p, draft, q, how) for how in set(CHAIN_RULES.values())}
                _add(row, rule, kept, CHAIN_RULES)
            self.seconds += time.perf_counter() - t
        return self._verify(logits, draft, q, params, rng, rule)

    def verify_tree(self, p, tree, q, rng, replacement=True, rule="block"):
        t = time.perf_counter()
        row = self._row(rng)
        row["steps"] += 1
        kept = {how: expected_tree_kept(p, tree, q, replacement, how) for how in set(TREE_RULES.values())}
        _add(row, rule, kept, TREE_RULES)
        self.seconds += time.perf_counter() - t
        return self._verify_tree(p, tree, q, rng, replacement, rule)

    def take(self) -> list[dict[str, float]]:
        """The rows' sums so far (one batch's), and a fresh start."""
        rows, self.rows = list(self.rows.values()), {}
        return rows


def _add(row: dict[str, float], rule: str, kept: dict[str, float], rules: dict[str, str]) -> None:
    """Adds a step's expectations to a row's sums: `kept` holds each distinct verifier's (computed
    once), `rules` (sampling.CHAIN_RULES or TREE_RULES) says which verifier each rule is."""
    for name in VERIFICATION_RULES:
        row[name] += kept[rules[name]]
    row["used"] += kept[rules[rule]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--suite", default="benchmarks/dev-prompts.jsonl")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("-n", "--max-tokens", type=int, default=128)
    ap.add_argument(
        "--methods",
        nargs="+",
        default=["draft:4"],
        help="draft:K chains and draft:KxW[/N] trees of the draft model; head:K:FILE and head:KxW[/N]:FILE of a head",
    )
    ap.add_argument("--rules", nargs="+", default=["block", "token"], choices=VERIFICATION_RULES)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--batch", type=int, default=4, help="rows generated together")
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--seeds", type=int, default=1, help="runs of every prompt, each with its own seed")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--backend",
        default="llama",
        choices=("llama", "numpy", "torch"),
        help="the models' (early exit: numpy or torch)",
    )
    ap.add_argument("--device", default="auto", help="torch backend: cpu, cuda, auto")
    args = ap.parse_args()
    if not args.temperature > 0:
        ap.error("--temperature must be above 0: greedy verification keeps the same tokens under every rule")
    specs = {m: parse_method(m) for m in args.methods}
    for m, spec in specs.items():
        if spec is None or spec.kind not in ("model", "head", "early-exit"):
            ap.error(
                f"--methods takes draft:K, head:K:FILE, early-exit:L:K and their trees (draft:KxW[/N], "
                f"head:KxW[/N]:FILE, early-exit:L:KxW[/N]), got {m!r}"
            )
    arms = [(m, rule) for m in args.methods for rule in args.rules]

    on = {"backend": args.backend, "device": args.device, "threads": args.threads, "max_rows": args.batch}
    target = load_model(args.target, **on)
    drafter = None  # the draft model, loaded where a method drafts with it
    if any(spec.kind == "model" for spec in specs.values()):
        drafter = model_drafter(load_model(args.draft, **on), target, None)
    items = load_suite(Path(args.suite), per_category=args.per_category)
    texts = [prompt_text(target, item) for item in items]
    counted = {arm: [] for arm in arms}  # per row: (tokens, steps)
    expected = {arm: [] for arm in arms}  # per row: Expectations' sums
    by_position = {arm: [] for arm in arms}  # [position] [kept, drafted]
    tokens, seconds = dict.fromkeys(arms, 0), dict.fromkeys(arms, 0.0)
    batches = [(s, j) for j in range(args.seeds) for s in range(0, len(texts), args.batch)]
    # once an arm, outside the timed batches (a head's file is read when its drafter is made)
    decoders = {arm: SpeculativeDecoder.from_spec(target, specs[arm[0]], draft=drafter) for arm in arms}
    with Expectations() as expectations:
        for b, (start, j) in enumerate(batches):
            batch = texts[start : start + args.batch]
            for arm in arms if b % 2 == 0 else arms[::-1]:  # alternate who goes first
                rule = arm[1]
                config = GenerationConfig(
                    max_new_tokens=args.max_tokens,
                    temperature=args.temperature,
                    top_p=args.top_p,
                    chat=False,
                    verification=rule,
                )
                spent, t = expectations.seconds, time.perf_counter()
                results = decoders[arm].generate_batch(batch, config, seed=args.seed + start + 1000 * j)
                seconds[arm] += time.perf_counter() - t - (expectations.seconds - spent)
                sums = expectations.take()  # in the order the rows first verified: the prompts'
                if [e["steps"] for e in sums] != [r.stats.steps for r in results]:
                    raise SystemExit("a row's verified steps differ from its own count: the rows are out of step")
                expected[arm] += sums
                for r in results:
                    s = r.stats
                    tokens[arm] += s.generated_tokens
                    counted[arm].append((s.generated_tokens, s.steps))
                    while len(by_position[arm]) < len(s.drafted_at):
                        by_position[arm].append([0, 0])
                    for i, (a, d) in enumerate(zip(s.accepted_at, s.drafted_at)):
                        by_position[arm][i][0] += a
                        by_position[arm][i][1] += d
            print(f"batch {b + 1} of {len(batches)}: done", flush=True)
    source = f" <- {args.draft}" if drafter else ""
    print(
        f"\n{args.target}{source}, temperature {args.temperature}, top-p {args.top_p}, {len(texts)} prompts "
        f"x {args.seeds} seeds, -n {args.max_tokens}, batches of {args.batch}, seed {args.seed}"
    )
    print(
        "| method | rule | steps | tokens per step, counted | expected | block (tree: traversal) / token, same drafts "
        f"| expected over {arms[0][0]} {arms[0][1]}, same prompts | acceptance by draft position | tokens/s (wall) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    per_row = {arm: [(e["steps"] + e["used"]) / e["steps"] for e in expected[arm]] for arm in arms}
    for arm in arms:
        method, rule = arm
        by_count, se_c = ratio_of_sums(counted[arm])
        by_rule, se_e = ratio_of_sums([(e["steps"] + e["used"], e["steps"]) for e in expected[arm]])
        r, se = ratio_of_sums([(e["steps"] + e["traversal"], e["steps"] + e["token"]) for e in expected[arm]])
        paired = f"{r:.3f} +- {se:.3f}"
        # the same prompt and seed under this arm and the first: the geometric mean of the rows'
        # ratios, with its standard error (over rows, on the log scale)
        logs = [math.log(x / y) for x, y in zip(per_row[arm], per_row[arms[0]])]
        mean = sum(logs) / len(logs)
        se_log = math.sqrt(sum((x - mean) ** 2 for x in logs) / max(1, len(logs) - 1) / len(logs))
        versus = f"{math.exp(mean):.3f} +- {math.exp(mean) * se_log:.3f}" if arm != arms[0] else "1"
        acc = " ".join(f"{a / d:.2f}" if d else "-" for a, d in by_position[arm][:8])
        steps = sum(n for _, n in counted[arm])
        print(
            f"| {method} | {rule} | {steps} | {by_count:.3f} +- {se_c:.3f} | {by_rule:.3f} +- {se_e:.3f} | {paired} "
            f"| {versus} | {acc} | {tokens[arm] / seconds[arm]:.1f} |"
        )


if __name__ == "__main__":
    main()
