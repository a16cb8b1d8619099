"""Replays drafting policies offline against recorded greedy outputs.

Under greedy decoding a draft token is accepted exactly when it equals the target's own next token,
so once the target's plain output for a prompt is known, any prompt-lookup policy can be replayed
without the model: what it would have drafted, what the target would have kept, and what the step
would have cost on a measured cost curve (seconds of a forward of 1..16 rows). That makes policy
changes measurable in seconds instead of a 40-minute benchmark, and gives two ceilings:

- `oracle_speedup`: a policy that knows in advance how many of prompt lookup's guesses will be
  accepted and drafts exactly those (the best any controller could do with this drafter);
- `copy_ceiling`: the same, drafting from whichever earlier occurrence of the last token continues
  furthest into the real output (the best any prompt-lookup drafter could do).

Costs only: Python's own time per step (well under 1% here) and noise are left out.
"""
from __future__ import annotations

from typing import Sequence

from .controller import K_MAX, Outcome, _agreement
from .drafters.ngram import NgramDrafter


def _best_time(lengths: Sequence[int], costs: Sequence[float]) -> float:
    """Least total seconds to emit len(lengths) tokens when at position i a draft of up to
    lengths[i] tokens would be accepted whole (dynamic programming from the end)."""
    n = len(lengths)
    best = [0.0] * (n + 1)
    for pos in range(n - 1, -1, -1):
        best[pos] = min(costs[k] + best[min(n, pos + k + 1)]
                        for k in range(min(lengths[pos], len(costs) - 1) + 1))
    return best[0]


def _accepted(proposal: Sequence[int], output: Sequence[int], pos: int) -> int:
    """How many of `proposal`'s tokens the target keeps at `pos`: the prefix `output` agrees with."""
    return _agreement(proposal, output[pos:pos + len(proposal)])[1]


def oracle_speedup(prompt: Sequence[int], output: Sequence[int], costs: Sequence[float],
                   drafter: NgramDrafter | None = None) -> float:
    """Speedup over plain decoding of a clairvoyant controller over `drafter`'s proposals."""
    drafter = drafter or NgramDrafter()
    context = list(prompt)
    lengths = []
    for pos in range(len(output)):
        lengths.append(_accepted(drafter.propose({0: context}, {0: K_MAX})[0].tokens, output, pos))
        context.append(output[pos])
    return len(output) * costs[0] / _best_time(lengths, costs)


def copy_ceiling(prompt: Sequence[int], output: Sequence[int], costs: Sequence[float]) -> float:
    """Speedup of a clairvoyant controller that copies from the best earlier occurrence of the
    last token each step (no drafter that guesses from the context can do better)."""
    seq = list(prompt) + list(output)
    start = len(prompt)
    lengths = []
    for pos in range(len(output)):
        end = start + pos                     # the context is seq[:end]
        last = seq[end - 1]
        best = 0
        for j in range(1, end):
            if seq[j - 1] == last:
                best = max(best, _accepted(seq[j:min(end, j + K_MAX)], output, pos))
                if best >= K_MAX:
                    break
        lengths.append(best)
    return len(output) * costs[0] / _best_time(lengths, costs)


def replay_speedup(prompt: Sequence[int], output: Sequence[int], costs: Sequence[float],
                   controller) -> tuple[float, dict[str, int]]:
    """Speedup over plain decoding of `controller` (a FixedController or CostAwareController with
    a prompt-lookup drafter), and its decisions, replayed step by step on the recorded output."""
    controller.begin(0, prompt)
    context = list(prompt)
    pos, seconds, decisions = 0, 0.0, {}
    while pos < len(output):
        [(drafter, draft)] = controller.draft({0: context}, {0: len(costs) - 1}).values()
        tokens = draft.tokens if draft is not None else []
        n = _accepted(tokens, output, pos)
        emitted = output[pos:pos + n + 1]
        cost = costs[len(tokens)]
        seconds += cost
        controller.observe({0: Outcome(drafter, draft, n, emitted)}, len(tokens) + 1, cost)
        key = f"ngram:{len(tokens)}" if tokens else "plain"
        decisions[key] = decisions.get(key, 0) + 1
        context += emitted
        pos += len(emitted)
    controller.end(0)
    return len(output) * costs[0] / seconds, decisions
