"""`auto` with and without the suffix cache, replayed on the 1.5B target's recorded greedy outputs
(benchmarks/greedy-1.5b-0.5b.jsonl) with a cost curve: costs only, no noise (see src/specdec/replay.py).

One controller and one suffix cache for the whole run, as in one process: pass 1 is a fresh
process (its cache starts empty and fills as requests end), pass 2 asks every prompt again.
The curve: this CPU's, timed on a quiet machine (benchmarks/cpu/costs-1.5b-0.5b.json, 1..16 and
24/32/48/64 tokens at depths 128 and 1024: drafts up to 63 tokens, each step priced at its own
depth as the engine prices it), or --curve FILE (another `specdec costs --out` report, or a JSON
list of seconds for 1..W tokens at one depth).

    python benchmarks/suffix_replay_auto.py
"""

import argparse
import copy
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "src"))

from specdec.controller import CostAwareController  # noqa: E402
from specdec.costs import cost_table  # noqa: E402
from specdec.drafters.ngram import NgramDrafter  # noqa: E402
from specdec.drafters.suffix import SuffixCacheDrafter  # noqa: E402
from specdec.replay import replay_speedup  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--curve", default=str(HERE / "cpu" / "costs-1.5b-0.5b.json"))
    args = ap.parse_args()
    data = json.loads(Path(args.curve).read_text())
    curve = data if isinstance(data, list) else cost_table(data)
    records = [json.loads(line) for line in (HERE / "greedy-1.5b-0.5b.jsonl").read_text().splitlines()[1:]]
    setups = {"auto:nosuffix": None, "auto:suffix": SuffixCacheDrafter()}
    results = {}
    for name, suffix in setups.items():
        free = [NgramDrafter()] + ([suffix] if suffix is not None else [])
        controller = CostAwareController(free, None, copy.deepcopy(curve))  # it learns on its own copy
        for p in (1, 2):
            for rec in records:
                speedup, decisions = replay_speedup(rec["prompt"], rec["output"], curve, controller)
                if suffix is not None:
                    suffix.end([0])  # the request ends: it joins the cache
                results.setdefault((name, p, rec["category"]), []).append(speedup)
    categories = list(dict.fromkeys(r["category"] for r in records))
    print("| pass | category | " + " | ".join(setups) + " |\n|---|---|" + "---|" * len(setups))
    for p in (1, 2):
        for c in categories:
            cells = [f"{statistics.median(results[(n, p, c)]):.2f}x" for n in setups]
            print(f"| {p} | {c} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
