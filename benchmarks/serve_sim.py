"""The server's scheduling on a virtual clock: what mixed steps and --prefill-stall do to a
stream's pauses, time to first token and the aggregate, with machine noise taken out.

The real Engine runs a toy target (tests/toy.py: tokens carry no meaning, so every request decodes
plain, its full --max-tokens) whose every forward advances a virtual clock by a measured cost
curve's estimate for its width and depth (a `specdec costs` report). C clients each send the next
prompt of the suite (the categories in turn, as benchmarks/serve_load.py picks them) when their
last one ends; prompt lengths are the real target's token counts. Reports what serve_load reports,
per --prefill-stall value:

    python benchmarks/serve_sim.py --costs benchmarks/cpu/costs-1.5b-default-beside-exact.json \\
        --stalls 1.5 2 4 8 1000 -c 1 2 4 8

It measures the schedule only: the curve's estimate of each forward, not the forward itself (a
real run adds noise, Python and HTTP; benchmarks/serve_compare.py measures those).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
import serve_load  # noqa: E402
from tests.toy import ToyLM  # noqa: E402

from specdec import GenerationConfig  # noqa: E402
from specdec.controller import FixedController  # noqa: E402
from specdec.costs import cost_table, step_depth  # noqa: E402
from specdec.engine import PREFILL_WASTE, Engine  # noqa: E402


class ClockedToy(ToyLM):
    """A toy target whose forwards cost the curve's estimate (width and depth) on a virtual clock."""

    def __init__(self, curve, n_ctx: int, max_rows: int):
        super().__init__(vocab_size=32, seed=1, n_ctx=n_ctx, eog=())
        self.curve, self.now, self.max_rows = curve, 0.0, max_rows

    def forward_rows(self, tokens, n_logits=None):
        fed = {row: len(t) for row, t in tokens.items() if t}
        if fed:
            depth = step_depth(fed, {row: self.row_length(row) for row in fed})
            self.now += sum(self.curve(w, depth) for w in self.passes(fed))
        return super().forward_rows(tokens, n_logits)


def prompt_lengths(target: str, n: int) -> list[int]:
    """The real target's token counts of the n prompts serve_load sends (chat template included)."""
    from specdec import load_model
    from specdec.request import prepare

    model = load_model(target, n_ctx=8192)
    prompts = serve_load.load_prompts(serve_load.SUITE, n, None)
    return [
        len(prepare(model, None, GenerationConfig(), messages=[{"role": "user", "content": p}])[0]) for p in prompts
    ]


def simulate(curve, lengths: list[int], c: int, stall: float, max_tokens: list[int], waste: float) -> dict:
    target = ClockedToy(curve, n_ctx=max(lengths) + max(max_tokens) + 8, max_rows=c)
    if stall > 0:
        engine = Engine(
            target, FixedController(None, 0), max_rows=c, costs=curve, prefill_stall=stall, prefill_waste=waste
        )
    else:  # fixed chunks of -stall tokens, the scheduling before mixed steps
        engine = Engine(target, FixedController(None, 0), max_rows=c, prefill_chunk=int(-stall))
    todo = list(enumerate(lengths))
    clients: dict[int, dict] = {}  # client -> its request's record
    done = []

    def send(client: int) -> None:
        if not todo:
            return
        i, n = todo.pop(0)
        prompt = [(i * 7 + j * 3) % 31 + 1 for j in range(n)]
        request = engine.add(prompt, GenerationConfig(max_new_tokens=max_tokens[i]))
        clients[client] = {"request": request, "sent": target.now, "emits": [], "seen": 0}

    for client in range(c):
        send(client)
    while clients:
        engine.step()
        for client, rec in list(clients.items()):
            r = rec["request"]
            generated = len(r.context) - len(r.prompt_tokens) if r.result is None else len(r.result.tokens)
            if generated > rec["seen"]:
                rec["emits"].append(target.now)
                rec["seen"] = generated
            if r.done:
                done.append(rec)
                del clients[client]
                send(client)
    ttft = [rec["emits"][0] - rec["sent"] for rec in done]
    itl = [b - a for rec in done for a, b in zip(rec["emits"], rec["emits"][1:])]
    tpot = [(rec["emits"][-1] - rec["emits"][0]) / (rec["seen"] - 1) for rec in done if rec["seen"] > 1]
    tokens = sum(rec["seen"] for rec in done)
    q = lambda xs, p: statistics.quantiles(xs, n=100, method="inclusive")[p - 1] if len(xs) > 1 else xs[0]  # noqa: E731
    return {
        "label": (f"stall {stall:g}, waste {waste:g}" if stall > 0 else f"chunk {-stall:g}"),
        "concurrency": c,
        "tokens_per_s": tokens / target.now,
        "ttft_p50": statistics.median(ttft),
        "ttft_p99": q(ttft, 99),
        "itl_p50": statistics.median(itl),
        "itl_p99": q(itl, 99),
        "itl_max": max(itl),
        "tpot_p50": statistics.median(tpot),
        "tpot_p99": q(tpot, 99),
        "tokens": tokens,
        "acceptance": None,
        "errors": [],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--costs", type=Path, required=True, help="a `specdec costs` report (JSON) of the target")
    p.add_argument("--target", default="qwen2.5-coder-1.5b", help="whose tokenizer counts the prompts")
    p.add_argument(
        "--stalls",
        type=float,
        nargs="+",
        default=[-256, 1.5, 2.0, 4.0, 8.0, 1000.0],
        help="--prefill-stall values; a negative -N: fixed N-token chunks, as before mixed steps "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--wastes",
        type=float,
        nargs="+",
        default=[PREFILL_WASTE],
        help="--prefill-waste values (inf: every chunk rides, as before the waste rule) (default: %(default)s)",
    )
    p.add_argument("-c", "--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("-n", "--prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument(
        "--spread",
        type=float,
        default=0.0,
        help="answers of uneven length: request i generates max_tokens x U(1 - s, 1 + s) tokens (seeded), "
        "so requests end apart and others join while some decode (default 0: all --max-tokens, as "
        "serve_load's greedy runs of the suite mostly are)",
    )
    args = p.parse_args(argv)
    curve = cost_table(json.loads(args.costs.read_text()))
    lengths = prompt_lengths(args.target, args.prompts)
    rng = random.Random(0)
    max_tokens = [max(1, round(args.max_tokens * rng.uniform(1 - args.spread, 1 + args.spread))) for _ in lengths]
    print(f"prompt tokens: {lengths}; tokens asked: {max_tokens}; curve {args.costs.name}", flush=True)
    names, rule = serve_load.HEADER.split("\n")
    print(names.rsplit("|", 2)[0] + "| ITL max ms |\n" + rule, flush=True)  # in the acceptance's place
    for c in args.concurrency:
        for stall in args.stalls:
            for waste in args.wastes if stall > 0 else [float("inf")]:
                row = simulate(curve, lengths, c, stall, max_tokens, waste)
                line = serve_load.fmt(row).rsplit("|", 2)[0] + f"| {1000 * row['itl_max']:.0f} |"
                print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
