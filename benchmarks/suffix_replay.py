"""Replays the exact-repeat workload offline: our suffix cache (and arctic-inference's
SuffixDecodingCache, when it is importable) drafting for the 1.5B target's recorded greedy outputs.

Under greedy decoding a draft token is accepted exactly when it equals the target's own next token,
so with the target's outputs recorded (benchmarks/greedy-1.5b-0.5b.jsonl) a drafter can be replayed
without the model: every step it drafts k tokens, the matching prefix is kept plus one token.
Pass 1 asks the recorded prompts in order (the cache fills as they finish), pass 2 asks them again.
Reported per drafter and pass: mean tokens per step (accepted + 1), acceptance rate, and the
drafter's time per call (its propose / speculate plus bookkeeping), median and 95th percentile.

    python benchmarks/suffix_replay.py [--k 8]        # ours only
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

from specdec.drafters.suffix import SuffixCacheDrafter  # noqa: E402
from specdec.sampling import SamplingParams  # noqa: E402


class Ours:
    name = "specdec suffix"

    def __init__(self):
        self.cache = SuffixCacheDrafter()

    def start(self, rid, prompt):
        self.cache.begin(rid, prompt, SamplingParams(), None)

    def draft(self, rid, context, k):
        return self.cache.propose({rid: context}, {rid: k})[rid].tokens

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


def replay(drafter, records, k, passes=2):
    out = []
    rid = 0
    for p in range(1, passes + 1):
        steps = drafted = accepted = 0
        times = []
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
                n = 0
                while n < len(guess) and guess[n] == output[pos + n]:
                    n += 1
                emitted = output[pos : pos + n + 1]
                t = time.perf_counter()
                context += emitted
                drafter.emitted(rid, emitted)
                times[-1] += time.perf_counter() - t
                steps += 1
                drafted += len(guess)
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
                "acceptance": accepted / drafted if drafted else 0.0,
                "us_per_call_median": 1e6 * statistics.median(times),
                "us_per_call_p95": 1e6 * times[int(0.95 * (len(times) - 1))],
            }
        )
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--recording", default=str(HERE / "greedy-1.5b-0.5b.jsonl"))
    args = ap.parse_args()
    records = [json.loads(line) for line in Path(args.recording).read_text().splitlines()[1:] if line.strip()]
    drafters = [Ours()]
    try:
        drafters.append(Arctic())
    except ImportError as exc:
        print(f"(arctic-inference not importable here: {exc})", file=sys.stderr)
    for d in drafters:
        for row in replay(d, records, args.k):
            print(json.dumps(row))


if __name__ == "__main__":
    main()
