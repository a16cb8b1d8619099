"""Draft shapes compared at the very same contexts: tokens per target step of the draft model's
chains and trees (or a head's, an early exit's) at fixed points of fixed texts, paired.

    python benchmarks/draft_trees.py --methods draft:32 draft:32x3/32 --temperature 1
    python benchmarks/draft_trees.py --methods draft:8 draft:8x2/8 draft:8x3/8 --temperature 0

Each prompt's text is the target's own answer (sampled at --temperature with --seed, plain
decoding, -n tokens). At every --stride-th token of it, every method drafts from the same context
(its own drafter: chains and trees keep their own draft model rows), the target scores the draft
in one forward (a tree by tree attention), and the step's tokens are counted as 1 plus what the
verification rule keeps: greedy, the target's walk down the draft; sampled, in expectation over
the rule's draws (sampling.expected_kept under block or token-by-token verification for a chain,
expected_tree_kept for a tree: node by node, or under --rule traversal walked from its leaves up).
The text does not depend on the method, so the comparison is paired position by position; what is
left is the drafts' own randomness.

It prints, per category and overall, mean tokens per step for each method (a sampled draft also
under token-by-token verification, "token": a tree node by node), and each
method against another (a tree of N nodes against the chain of N where one is among the methods,
else the first): the ratio of their means with its standard error over positions (a ratio
estimator), and the scored tokens per step (how wide the target's forward was). verification_rules.py
measures the same while each arm writes its own text; this one removes the texts' luck.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from specdec import GenerationConfig, SpeculativeDecoder, load_model
from specdec.bench import load_suite, prompt_text
from specdec.build import make_drafter
from specdec.sampling import (
    CHAIN_RULES,
    TREE_RULES,
    VERIFICATION_RULES,
    DraftTree,
    SamplingParams,
    expected_kept,
    expected_tree_kept,
    logits_to_probs,
    q_by_parent,
    verify_greedy,
    verify_tree_greedy,
)
from specdec.spec import parse_method
from specdec_lab.helpers import ratio_of_sums


def step_tokens(target, row: int, last: int, draft, params: SamplingParams, rule: str) -> tuple[float, int, float]:
    """(1 + what the rule keeps of `draft` after the row's context, in expectation where sampled;
    the tokens the target scored; what token-by-token verification keeps of a sampled draft (a tree:
    node by node), else the first). The row holds the context but its last token `last`; it is left so."""
    if draft.parents is not None:
        tree = DraftTree(tuple(draft.tokens), tuple(draft.parents))
        logits = target.forward_tree_rows({row: ([last, *tree.tokens], [-1, *(p + 1 for p in tree.parents)])})[row]
        target.keep_path_rows({row: []})
        if params.greedy:
            kept = len(verify_tree_greedy(logits, tree)[0])
        else:
            p = logits_to_probs(logits, params)
            q = q_by_parent(draft.q, tree, p.shape)
            by = {how: 1 + expected_tree_kept(p, tree, q, False, how) for how in {TREE_RULES[rule], "token"}}
            return by[TREE_RULES[rule]], len(tree.tokens) + 1, by["token"]
        return 1 + kept, len(tree.tokens) + 1, 1 + kept
    tokens = [last, *draft.tokens]
    length = target.row_length(row)
    logits = target.forward_rows({row: tokens}, {row: len(tokens)})[row]
    target.rollback_rows({row: length})
    if params.greedy or not draft.tokens:
        kept = verify_greedy(logits, draft.tokens)[0] if params.greedy else 0
        return 1 + kept, len(tokens), 1 + kept
    p = logits_to_probs(logits, params)
    by = {how: 1 + expected_kept(p, draft.tokens, draft.q, how) for how in {CHAIN_RULES[rule], "token"}}
    return by[CHAIN_RULES[rule]], len(tokens), by["token"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--suite", default="benchmarks/dev-prompts.jsonl")
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("-n", "--max-tokens", type=int, default=128, help="tokens of each prompt's text")
    ap.add_argument("--stride", type=int, default=4, help="a step drafted at every stride-th token of the text")
    ap.add_argument("--methods", nargs="+", required=True, help="draft:K, draft:KxW, draft:KxW/N, head:..., ...")
    ap.add_argument(
        "--rule",
        default="block",
        choices=VERIFICATION_RULES,
        help="a sampled draft's verification (traversal: a tree's block form; a tree goes node by node under block)",
    )
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--backend", default="llama")
    args = ap.parse_args()
    specs = {m: parse_method(m) for m in args.methods}
    for m, spec in specs.items():
        if spec is None or spec.kind not in ("model", "head", "early-exit"):
            ap.error(f"--methods takes draft:K, head:K:FILE, early-exit:L:K and their trees, got {m!r}")
    on = {"backend": args.backend, "threads": args.threads}
    target = load_model(args.target, max_rows=1, **on)
    draft_model = None
    if any(spec.kind == "model" for spec in specs.values()):
        draft_model = load_model(args.draft, max_rows=len(specs), **on)
    drafters = {m: make_drafter(spec, target, draft=draft_model) for m, spec in specs.items()}
    params = SamplingParams(temperature=args.temperature)
    items = load_suite(Path(args.suite), per_category=args.per_category)
    plain = SpeculativeDecoder(target, None)
    config = GenerationConfig(max_new_tokens=args.max_tokens, temperature=args.temperature, chat=False)
    # per method: (category, tokens per step, scored tokens) of every position
    steps: dict[str, list[tuple[str, float, int]]] = defaultdict(list)
    seconds = dict.fromkeys(args.methods, 0.0)
    for n, item in enumerate(items):
        result = plain.generate(prompt_text(target, item), config, seed=args.seed + n)
        prompt, answer = result.prompt_tokens, result.tokens
        [row] = target.add_rows(1)
        target.forward_rows({row: prompt[:-1]}, {})
        fed = len(prompt) - 1
        for drafter in drafters.values():
            drafter.begin(0, prompt, params, np.random.default_rng(args.seed + n))
        for t in range(0, max(0, len(answer) - 1), args.stride):
            context = prompt + answer[:t]
            target.forward_rows({row: context[fed:-1]}, {})
            fed = len(context) - 1
            for m, drafter in drafters.items():
                start = time.perf_counter()
                k = specs[m].k
                draft = drafter.propose({0: context}, {0: k})[0]
                seconds[m] += time.perf_counter() - start
                tokens, scored, by_token = step_tokens(target, row, context[-1], draft, params, args.rule)
                drafter.accept({0: 0})
                steps[m].append((item.get("category", "-"), tokens, scored))
                if args.rule != "token" and not params.greedy:
                    steps[f"{m} token"].append((item.get("category", "-"), by_token, scored))
        target.drop_rows([row])
        for drafter in drafters.values():
            drafter.end([0])
        print(f"prompt {n + 1} of {len(items)}: {len(answer)} tokens", flush=True)

    first = args.methods[0]
    categories = sorted({c for c, _, _ in steps[first]})

    def base(arm: str) -> str:
        """What an arm is set against: a tree of N nodes against the chain of N among the methods
        (as many tokens scored), a draft's token-by-token count against its own rule's, else the first."""
        if arm.endswith(" token"):
            return arm[: -len(" token")]
        spec = specs[arm]
        size = spec.nodes or spec.k * spec.width
        same = [m for m in args.methods if specs[m].kind == spec.kind and specs[m].width == 1 and specs[m].k == size]
        return same[0] if spec.width > 1 and same else first

    print(
        f"\n{args.target} <- {args.draft}, temperature {args.temperature}, {len(items)} prompts, -n "
        f"{args.max_tokens}, a step every {args.stride} tokens ({len(steps[first])} steps a method), "
        f"seed {args.seed}, sampled drafts by {args.rule} verification"
    )
    head = "| method | scored a step | tokens per step | over | ratio | " + " | ".join(categories)
    print(head + " | draft ms a step |")
    print("|---|---|---|---|---|" + "---|" * len(categories) + "---|")
    for m in [arm for method in args.methods for arm in (method, f"{method} token") if arm in steps]:
        rows, against = steps[m], steps[base(m)]
        mean = sum(x for _, x, _ in rows) / len(rows)
        scored = sum(s for _, _, s in rows) / len(rows)
        r, se = ratio_of_sums([(a[1], b[1]) for a, b in zip(rows, against)])
        per = []
        for c in categories:
            rc, sec = ratio_of_sums([(a[1], b[1]) for a, b in zip(rows, against) if a[0] == c])
            per.append(f"{rc:.3f} +- {sec:.3f}")
        print(
            f"| {m} | {scored:.1f} | {mean:.3f} | {base(m)} | {r:.3f} +- {se:.3f} | "
            + " | ".join(per)
            + f" | {1000 * seconds.get(m, 0.0) / len(rows):.0f} |"
        )


if __name__ == "__main__":
    from specdec.errors import SpecdecError

    try:
        main()
    except SpecdecError as exc:  # a missing suite or model, a bad method: one line, exit 2
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        raise SystemExit(130) from None
