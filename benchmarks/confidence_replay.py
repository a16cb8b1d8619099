"""Would the draft model's confidence in its own guesses pay? A replay on a recording that holds it
(`draft_p`: the draft's probability of its greedy token among its 10 best, teacher-forced;
`scripts/replay_controller.py ranks` adds it) and on any device's cost curves.

Under greedy decoding the draft's guess at a position is kept exactly when it is the target's
token, and its confidence there is well calibrated (on the dev suite: 39% kept under 0.5, 66% at
0.5-0.75, 84% at 0.75-0.9, 96% at 0.9-0.99, 99.8% above). The policy replayed here is a
cost-aware confidence stop for the draft model alone (chains, no prompt lookup), as `auto` could
run it: each step the draft model catches up (which tells it its first guess's confidence), and it
takes a guess while the chain's expected tokens over its seconds (the draft's forwards so far and
the target's verification, on the curves) grow with it, the guess's chance read from a table of
the rate by confidence fitted on the recording's other categories; it feeds a taken guess (and
learns the next one's confidence) while a guess as sure as the last would pay. Its seconds are
counted as the engine would spend them: the catch-up look even where it takes nothing, a forward
for each guess it fed. Beside it, per category (the median speedup over plain decoding over the
category's prompts): the best fixed chain draft:1-8, llama.cpp's confidence stop (p_min 0.75, up
to 16; replay.ConfidenceController) and vLLM's adaptive K over the draft model. `auto` and the
clairvoyant are in docs/results/replay-verdict.md (same recordings and curves).

The confidences past the draft's first miss are the target's context's, not the draft's own
(teacher-forced): they only decide where a failed chain stops, that is its wasted forwards' cost.

    python benchmarks/confidence_replay.py --recording benchmarks/dev-greedy-1.5b-0.5b.jsonl \\
        --curve benchmarks/gpu-h100/costs-7b-static-graphs.json \\
        --draft-curve benchmarks/gpu-h100/costs-0.5b-static-graphs.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "scripts"))
import replay_controller  # noqa: E402

from specdec.acceptance import ConfidenceAcceptance  # noqa: E402
from specdec.controller import FixedController  # noqa: E402
from specdec.drafters.base import ChainCut  # noqa: E402
from specdec_lab.replay import (  # noqa: E402
    AdaptiveKController,
    ConfidenceController,
    RecordedDrafter,
    ReplayPolicy,
    _cost,
    curve_at,
    fit_confidence_prior,
    replay_speedup,
)

K_MAX = 16


class ConfidenceCost(ReplayPolicy):
    """The cost-aware confidence stop (module docstring) on the draft model's chains alone: `auto`'s
    controller.ChainCut, with the rates by confidence it is given, asked by the recorded draft model
    as ModelDrafter asks it (RecordedDrafter.propose with cuts), up to K_MAX deep."""

    def __init__(self, recorded: RecordedDrafter, rates: ConfidenceAcceptance, costs, draft_costs, k_max: int = K_MAX):
        self.recorded, self.rates, self.costs, self.draft_costs, self.k_max = recorded, rates, costs, draft_costs, k_max

    def draft(self, contexts, caps, leaves=None):
        [(row, context)] = contexts.items()
        target, draft = curve_at(self.costs, len(context)), curve_at(self.draft_costs, len(context))
        cut = ChainCut(
            self.rates.rate_of,
            _cost(draft, self.recorded.lag(row, context) or 1),  # the catch-up: it tells the first confidence
            draft[0],
            lambda taken: _cost(target, taken + 1),
        )
        state = self.recorded._rows[row]
        left = len(state["p"]) - (len(context) - state["start"])  # no deeper than the recorded answer
        proposal = self.recorded.propose({row: context}, {row: min(self.k_max, caps[row], left)}, cuts={row: cut})[row]
        return {row: (self.recorded, proposal)}


def category_median(test, make, costs, draft_costs, stops) -> float:
    """The median speedup over the category's prompts of the controller make(recorded drafter) makes,
    one for all of them (a controller that learns does so across them, as in the verdict)."""
    recorded = RecordedDrafter.of(test)
    controller = make(recorded)
    return statistics.median(
        replay_speedup(r["prompt"], r["output"], costs, controller, recorded, draft_costs, stops)[0] for r in test
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recording", default=str(HERE / "dev-greedy-1.5b-0.5b.jsonl"))
    p.add_argument("--curve", help="the target's cost curve (a `specdec costs` JSON; default: the recording's)")
    p.add_argument("--draft-curve", help="the draft model's (default: the recording's)")
    p.add_argument("--depth", type=int, default=None)
    args = p.parse_args()
    args.costs = args.draft_costs = args.tree_costs = None
    header, records, costs, draft_costs = replay_controller.load(args)
    if not all("draft_p" in r for r in records):
        print(f"error: {args.recording} holds no draft confidences: run replay_controller.py ranks", file=sys.stderr)
        return 2
    stops = replay_controller.stops(header)
    c = curve_at(draft_costs, 128)[0] / curve_at(costs, 128)[0]
    print(replay_controller.describe(header, costs, draft_costs))
    print()
    print(
        "| category | prompts | confidence stop | best fixed chain | llama.cpp p 0.75, 16 "
        "| vLLM adaptive K, draft (8) |"
    )
    print("|---|---|---|---|---|---|")
    for category in dict.fromkeys(r["category"] for r in records):
        test = [r for r in records if r["category"] == category]
        train = [r for r in records if r["category"] != category]
        rates = ConfidenceAcceptance(prior=fit_confidence_prior(train, digits=None))
        replayed = [
            category_median(test, make, costs, draft_costs, stops)
            for make in (
                lambda rec: ConfidenceCost(rec, rates, costs, draft_costs),  # noqa: B023 (used at once)
                ConfidenceController,
                lambda rec: AdaptiveKController(rec, 8, c),
                *(lambda rec, k=k: FixedController(rec, k) for k in range(1, 9)),
            )
        ]
        confident, llama, vllm, fixed = replayed[0], replayed[1], replayed[2], replayed[3:]
        best = int(np.argmax(fixed))
        print(
            f"| {category} | {len(test)} | {confident:.2f}x | draft:{best + 1} {fixed[best]:.2f}x | {llama:.2f}x | "
            f"{vllm:.2f}x |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
