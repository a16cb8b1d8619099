"""Replays the exact-repeat workload offline: our suffix cache (and arctic-inference's
SuffixDecodingCache, when it is importable) drafting for the 1.5B target's recorded greedy outputs.

Under greedy decoding a draft token is accepted exactly when it equals the target's own next token,
so with the target's outputs recorded (benchmarks/greedy-1.5b-0.5b.jsonl) a drafter can be replayed
without the model: every step it drafts k tokens, the matching prefix is kept plus one token.
Pass 1 asks the recorded prompts in order (the cache fills as they finish), pass 2 asks them again.
A tree keeps its deepest path of right tokens. Reported per drafter and pass: mean tokens per step
(accepted + 1), tokens the target scores a step (1 + the draft's), acceptance rate, and the
drafter's time per call (its propose / speculate plus bookkeeping), median and 95th percentile.

    python benchmarks/suffix_replay.py [--k 8]        # ours only
    python benchmarks/suffix_replay.py --k 16 --trees 2x16 4x16   # and our trees of 16 nodes
    /tmp/arcvenv/bin/python benchmarks/suffix_replay.py   # + arctic, in a venv that has it
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "src"))

from specdec.costs import cost_table  # noqa: E402
from specdec.drafters.suffix import SuffixCacheDrafter  # noqa: E402
from specdec.sampling import SamplingParams  # noqa: E402


class Ours:
    def __init__(self, width=1, nodes=0):
        self.cache = SuffixCacheDrafter(width=width, nodes=nodes)
        self.name = "specdec suffix" + (f" tree x{width}" + (f"/{nodes}" if nodes else "") if width > 1 else "")

    def start(self, rid, prompt):
        self.cache.begin(rid, prompt, SamplingParams(), None)

    def draft(self, rid, context, k):
        draft = self.cache.propose({rid: context}, {rid: k})[rid]
        return draft.tokens if draft.parents is None else (draft.tokens, draft.parents)

    def emitted(self, rid, tokens):
        pass  # the context list grows in place

    def stop(self, rid):
        self.cache.end([rid])


class Arctic:
    name = "arctic SuffixDecodingCache"

    def __init__(self):
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.cache = SuffixDecodingCache(max_tree_depth=64)

    def start(self, rid, prompt):
        self.cache.start_request(rid, prompt)

    def draft(self, rid, context, k):
        # its defaults but for the length: draft up to k tokens, none below 10% estimated probability
        return list(self.cache.speculate(rid, context, max_spec_tokens=k).token_ids)

    def emitted(self, rid, tokens):
        self.cache.add_active_response(rid, tokens)

    def stop(self, rid):
        self.cache.stop_request(rid)


def kept(guess, truth) -> int:
    """Greedy verification: a chain's matching prefix, or a tree's (tokens, parents) deepest path
    whose every node is the target's next token."""
    if not isinstance(guess, tuple):
        n = 0
        while n < len(guess) and n < len(truth) and guess[n] == truth[n]:
            n += 1
        return n
    tokens, parents = guess
    node, n = -1, 0
    while n < len(truth):
        node = next((i for i, p in enumerate(parents) if p == node and tokens[i] == truth[n]), None)
        if node is None:
            break
        n += 1
    return n


def replay(drafter, records, k, passes=2, curves=()):
    """Per pass: tokens and scored tokens a step, acceptance, the drafter's time per call, and for
    each (name, CostTable) in `curves` the speedup over plain decoding that curve predicts (every
    step a forward of its scored tokens at its depth, the drafter's own time left out)."""
    out = []
    rid = 0
    for p in range(1, passes + 1):
        steps = drafted = accepted = 0
        times = []
        seconds = {name: [0.0, 0.0] for name, _ in curves}  # name -> [speculative, plain]
        for rec in records:
            rid += 1
            prompt, output = rec["prompt"], rec["output"]
            context = list(prompt)
            drafter.start(rid, prompt)
            pos = 0
            while pos < len(output):
                t = time.perf_counter()
                guess = drafter.draft(rid, context, min(k, len(output) - pos - 1)) if pos < len(output) - 1 else []
                times.append(time.perf_counter() - t)
                n = kept(guess, output[pos:])
                emitted = output[pos : pos + n + 1]
                t = time.perf_counter()
                context += emitted
                drafter.emitted(rid, emitted)
                times[-1] += time.perf_counter() - t
                steps += 1
                scored = len(guess[0]) if isinstance(guess, tuple) else len(guess)
                drafted += scored
                for name, curve in curves:
                    depth = len(context) - len(emitted)  # before this step's tokens
                    seconds[name][0] += curve(1 + scored, depth)
                    seconds[name][1] += sum(curve(1, depth + i) for i in range(len(emitted)))
                accepted += n
                pos += len(emitted)
            t = time.perf_counter()
            drafter.stop(rid)
            times[-1] += time.perf_counter() - t
        tokens = sum(len(r["output"]) for r in records)
        times.sort()
        out.append(
            {
                "drafter": drafter.name,
                "pass": p,
                "tokens_per_step": tokens / steps,
                "scored_per_step": (steps + drafted) / steps,  # the target's forward: [last, *nodes]
                "acceptance": accepted / drafted if drafted else 0.0,
                "us_per_call_median": 1e6 * statistics.median(times),
                "us_per_call_p95": 1e6 * times[int(0.95 * (len(times) - 1))],
                **{f"speedup_{name}": plain / spec for name, (spec, plain) in seconds.items()},
            }
        )
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--k", type=int, default=8, help="depth: draft tokens of a chain, levels of a tree")
    ap.add_argument(
        "--trees",
        nargs="*",
        default=[],
        metavar="WxN",
        help="our suffix trees too: W continuations under each node, at most N nodes (2x8: width 2, "
        "8 nodes; 2: width 2, k x 2 nodes)",
    )
    ap.add_argument("--recording", default=str(HERE / "greedy-1.5b-0.5b.jsonl"))
    ap.add_argument(
        "--curve",
        nargs="*",
        default=[],
        metavar="NAME=FILE",
        help="price the steps on these `specdec costs` reports (e.g. h100=benchmarks/gpu-h100/"
        "costs-1.5b-static-graphs.json): the speedup over plain each predicts",
    )
    args = ap.parse_args()
    curves = []
    for item in args.curve:
        name, _, path = item.partition("=")
        curves.append((name, cost_table(json.loads(Path(path).read_text()))))
    records = [json.loads(line) for line in Path(args.recording).read_text().splitlines()[1:] if line.strip()]
    drafters = [Ours()]
    for shape in args.trees:
        width, _, nodes = shape.partition("x")
        drafters.append(Ours(int(width), int(nodes or 0)))
    try:
        drafters.append(Arctic())
    except ImportError as exc:
        print(f"(arctic-inference not importable here: {exc})", file=sys.stderr)
    for d in drafters:
        for row in replay(d, records, args.k, curves=curves):
            print(json.dumps(row))


if __name__ == "__main__":
    main()
