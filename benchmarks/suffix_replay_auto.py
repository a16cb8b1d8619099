"""`auto` with and without the suffix cache, replayed on the 1.5B target's recorded greedy outputs
(benchmarks/greedy-1.5b-0.5b.jsonl, or --recording) with a cost curve: costs only, no noise (see
src/specdec_lab/replay.py).

One controller and one suffix cache for the whole run, as in one process: pass 1 is a fresh
process (its cache starts empty and fills as requests end, in the recording's order), pass 2 asks
every prompt again. The curve: this CPU's, timed on a quiet machine (benchmarks/cpu/costs-1.5b-0.5b.json,
1..16 and 24/32/48/64 tokens at depths 128 and 1024: drafts up to 63 tokens, each step priced at its
own depth as the engine prices it), or --curve FILE (another `specdec costs --out` report, or a JSON
list of seconds for 1..W tokens at one depth).

    python benchmarks/suffix_replay_auto.py
    python benchmarks/suffix_replay_auto.py --recording benchmarks/near-repeat-greedy256-1.5b-0.5b.jsonl \\
        --passes 1 --trees --curve benchmarks/gpu-h100/costs-1.5b-static-graphs.json \\
        --tree-costs benchmarks/gpu-h100/tree-costs-1.5b.json

--siblings prints instead the suffix cache's siblings' rate on the recording (one cache, in its order,
each request joining it as it ends): at every position, its tree 8 deep and 4 wide, where the first
branch's token fails at a depth where the tree branches, how often another branch there holds the
target's token (acceptance.NGRAM_SIBLING_PRIOR's provenance says what it is for).

--trees replays `auto` as it drafts where the target scores trees (prompt lookup's trees, and the
suffix cache's chains, or its trees too) and fixed suffix:K chains and suffix:KxW trees beside it:
each tree's forward priced at the curve's for its nodes times the tree / chain ratio (--tree-costs,
as scripts/replay_controller.py takes it; 1 without), and prints how many steps drafted a tree.
"""

import argparse
import copy
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE.parent / "scripts"))

from replay_controller import tree_cost_of  # noqa: E402

from specdec.controller import NGRAM_TREE_WIDTH, CostAwareController, FixedController  # noqa: E402
from specdec.costs import cost_table  # noqa: E402
from specdec.drafters.ngram import NgramDrafter  # noqa: E402
from specdec.drafters.suffix import SuffixCacheDrafter  # noqa: E402
from specdec.spec import parse_method  # noqa: E402
from specdec_lab.replay import replay_speedup, sibling_statistics  # noqa: E402

FIXED = ((8, 1), (16, 1), (8, 2), (8, 4), (16, 4))  # suffix:K and suffix:KxW with --trees


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--curve", default=str(HERE / "cpu" / "costs-1.5b-0.5b.json"))
    ap.add_argument("--recording", default=str(HERE / "greedy-1.5b-0.5b.jsonl"))
    ap.add_argument("--passes", type=int, default=2, help="times the recording is asked, in one process")
    ap.add_argument("--trees", action="store_true", help="also auto with trees, and fixed suffix chains and trees")
    ap.add_argument("--tree-cost", type=float, default=1.0, help="a tree's forward over a chain's of as many nodes")
    ap.add_argument("--tree-costs", help="a benchmarks/tree_costs.py report: its one-row ratios' median")
    ap.add_argument("--siblings", action="store_true", help="the suffix cache's siblings' rate on the recording")
    args = ap.parse_args()
    tree_cost = tree_cost_of(args)
    data = json.loads(Path(args.curve).read_text())
    curve = data if isinstance(data, list) else cost_table(data)
    records = [json.loads(line) for line in Path(args.recording).read_text().splitlines()[1:]]
    if args.siblings:  # one cache for the whole recording, each request joining it as it ends
        cache = SuffixCacheDrafter()
        hits, failures = sibling_statistics(records, lambda r: cache, k=8, width=4)
        print(f"suffix cache's siblings' rate: {hits} of {failures} = {hits / max(1, failures):.3f}")
        return
    # name -> (a fresh controller over its drafters, or a fixed one; whether it consults a suffix cache)
    setups = {"auto:nosuffix": ("auto", False, 1), "auto:suffix": ("auto", True, 1)}
    if args.trees:  # prompt lookup's trees as the engine drafts them; then the suffix cache's too
        setups = {
            "auto:nosuffix": ("auto", False, NGRAM_TREE_WIDTH),
            "auto:suffix, its chains": ("auto", True, NGRAM_TREE_WIDTH),
            "auto:suffix, its trees": ("auto", True, NGRAM_TREE_WIDTH),
        }
        for k, w in FIXED:
            setups[f"suffix:{k}" + (f"x{w}" if w > 1 else "")] = ("fixed", k, w)
    results = {}
    for name, (kind, a, b) in setups.items():
        if kind == "auto":
            suffix = SuffixCacheDrafter() if a else None
            free = [NgramDrafter()] + ([suffix] if suffix is not None else [])
            # it learns on its own copy of the curve
            controller = CostAwareController(free, None, copy.deepcopy(curve), free_width=b)
            if name.endswith("its chains"):  # trees from prompt lookup only, as before the suffix cache drafted them
                controller._tree_free = {free[0].name}
        else:
            suffix = SuffixCacheDrafter(width=b)
            controller = FixedController(suffix, a)
        for p in range(1, args.passes + 1):
            for rec in records:
                speedup, decisions = replay_speedup(
                    rec["prompt"], rec["output"], curve, controller, tree_cost=tree_cost
                )
                if suffix is not None:
                    suffix.end([0])  # the request ends: it joins the cache
                results.setdefault((name, p, rec["category"]), []).append(speedup)
                trees = sum(n for key, n in decisions.items() if parse_method(key).width > 1)
                results.setdefault((name, "trees"), []).append((trees, sum(decisions.values())))
    categories = list(dict.fromkeys(r["category"] for r in records))
    print("| pass | category | " + " | ".join(setups) + " |\n|---|---|" + "---|" * len(setups))
    for p in range(1, args.passes + 1):
        for c in categories:
            cells = [f"{statistics.median(results[(n, p, c)]):.2f}x" for n in setups]
            print(f"| {p} | {c} | " + " | ".join(cells) + " |")
    if args.trees:
        steps = {n: [sum(x) for x in zip(*results[(n, "trees")])] for n in setups}
        print("\ntree steps / steps: " + ", ".join(f"{n} {t} / {s}" for n, (t, s) in steps.items()))


if __name__ == "__main__":
    main()
