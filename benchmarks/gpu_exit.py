#!/usr/bin/env python3
"""An early exit with trained blocks (`specdec train early-exit:L+B`) on a GPU, at a real model's
shapes with random weights: what its drafting costs through the target's own cache, with and
without CUDA graphs, against the same exit as a draft model of its own.

    python benchmarks/gpu_exit.py --out DIR [--targets 1.5b 7b] [--exits 14+1 7+1] [--tokens 128]

For each target shape (benchmarks/configs/, static cache + CUDA graphs) and exit L+B (the blocks
are copies of the target's layers L .. L + B - 1: random weights set the costs, not the guesses):
- the target's forward of 1..5 tokens, 1 and 4 rows, before and after the blocks are attached
  (every full forward then runs the blocks over layer L's output too, inside its graph);
- one draft position: the exit's forward of one token a row (its first L layers, the blocks, the
  final norm and head), replayed as a graph and eagerly (graph_exits off), 1 and 4 rows;
- the engine over one prompt of DEPTH random tokens, --tokens generated, 1 row: plain decoding
  (no blocks), the exit's chain of k = 1..4 through the shared cache (graphed and eager), its
  tree of width 2 and 4 nodes, and the same exit as a draft model of L + B layers with its own
  cache (the target's weights: the same drafts), k = 1..4. Per target step: the wall time, the
  drafter's and the target's, and the tokens a step (random weights: not a guess's worth); where
  a run's tokens part from plain's, the target's top-2 logit gap there (a rounding tie or not).

Times are medians of --repeats synchronised calls after a warm-up (the forwards), or one run
after a warm-up run (the engine). DIR/exit-SHAPE.json keeps them with the device and versions.
"""

from __future__ import annotations

import copy
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

from gpu_heads import DEPTH, build_target, forward_costs, log, shape_parser, start, timed  # noqa: E402


def exit_forward(model, layers: int, rows: int, repeats: int, sync) -> float:
    """One draft position for `rows` rows after DEPTH tokens: the exit's forward of one token a row
    and the rollback the drafter does after it, the median seconds."""
    ids = model.add_rows(rows)
    try:
        model.forward_rows({row: [7] * DEPTH for row in ids})

        def step():
            model.forward_rows({row: [7] for row in ids}, {row: 1 for row in ids}, n_layers=layers, blocks=True)
            model.rollback_rows({row: DEPTH for row in ids})

        return timed(step, repeats, sync)
    finally:
        model.drop_rows(ids)


def prompt_of(model) -> list[int]:
    import numpy as np

    return [int(t) for t in np.random.default_rng(0).integers(300, min(5000, model.vocab_size), DEPTH)]


def partings(target, runs: list[dict]) -> list[str]:
    """Where each run's tokens left plain's (runs[0]), with the target's top-2 logit gap there: a
    rounding tie (below compare.ROUNDING_GAP; random weights in bfloat16 give near-flat logits) or not."""
    from specdec.compare import ROUNDING_GAP, first_difference, top2_gap

    plain, found = runs[0]["text"], []
    for run in runs[1:]:
        if run["text"] != plain:
            i = first_difference(plain, run["text"])
            gap = top2_gap(target, prompt_of(target) + plain[:i])
            run["parts_at"], run["gap"] = i, gap
            found.append(f"{run['method']}: token {i}, gap {gap:.3f} ({'tie' if gap < ROUNDING_GAP else 'NOT a tie'})")
    return found


def engine_run(label: str, decoder, args) -> dict:
    """One run of `decoder` over the prompt (after a short one that captures its graphs)."""
    from specdec import GenerationConfig

    prompt = prompt_of(decoder.target)
    decoder.generate(prompt, GenerationConfig(max_new_tokens=16, chat=False))
    out = decoder.generate(prompt, GenerationConfig(max_new_tokens=args.tokens, chat=False))
    stats = out.stats
    per = {key: getattr(stats, f"{key}_seconds") / stats.steps * 1e3 for key in ("decode", "draft", "target")}
    log(
        f"  {label:28s} {per['decode']:7.2f} ms a step; in it the drafter {per['draft']:6.2f}, the target "
        f"{per['target']:6.2f}; {stats.generated_tokens / stats.steps:.2f} tokens a step"
    )
    row = {"method": label, "steps": stats.steps, "tokens": stats.generated_tokens, "accepted": stats.accepted}
    return {**row, **{f"{key}_ms_per_step": ms for key, ms in per.items()}, "text": out.tokens}


def engine_runs(target, draft, layers: int, blocks: int, args) -> list[dict]:
    from specdec import SpeculativeDecoder
    from specdec.drafters.early_exit import EarlyExitDrafter

    results = []

    def run(label: str, decoder) -> None:
        results.append(engine_run(label, decoder, args))

    exit_name = f"early-exit:{layers}+{blocks}"
    for k in range(1, 5):
        for graphs in (True, False):
            target.graph_exits = graphs
            drafter = EarlyExitDrafter(target, layers, blocks)
            run(f"{exit_name} k={k} {'graphed' if graphs else 'eager'}", SpeculativeDecoder(target, drafter, k=k))
    target.graph_exits = True
    tree = EarlyExitDrafter(target, layers, blocks, None, 2, 4)
    run(f"{exit_name} tree 4x2/4", SpeculativeDecoder(target, tree, k=4))
    for k in range(1, 5):
        run(f"draft model of {layers + blocks} layers k={k}", SpeculativeDecoder(target, draft, k=k))
    return results


def main() -> int:
    parser = shape_parser(__doc__)
    parser.add_argument("--exits", nargs="+", default=["14+1", "7+1"], help="L+B: the target's layers, then blocks")
    args = parser.parse_args()
    torch, out, sync, device, versions = start(args)
    cuda = args.device.startswith("cuda")

    from specdec import SpeculativeDecoder

    for shape in args.targets:
        config = Path(args.config_dir) / f"qwen2.5-coder-{shape}.json"
        report = {
            "device": device,
            "versions": versions,
            "config": config.name,
            "dtype": args.dtype,
            "depth": DEPTH,
            "exits": {},
        }
        for spec in args.exits:
            started = time.perf_counter()
            layers, blocks = (int(x) for x in spec.split("+"))
            target = build_target(config, args, None)
            entry = {"target": forward_costs(target, args, [1, 2, 3, 4, 5])}
            log(f"{shape} {spec}: the engine, {args.tokens} tokens after {DEPTH}")
            plain = engine_run("plain", SpeculativeDecoder(target), args)
            every = list(target._decoder_layers())
            target.attach_exit_blocks(layers, [copy.deepcopy(every[i]) for i in range(layers, layers + blocks)])
            entry["target_with_blocks"] = forward_costs(target, args, [1, 2, 3, 4, 5])
            entry["exit_forward"] = {}
            for rows in args.rows:
                for graphs in (True, False):
                    target.graph_exits = graphs
                    seconds = exit_forward(target, layers, rows, args.repeats, sync)
                    entry["exit_forward"][f"{rows} {'graphed' if graphs else 'eager'}"] = seconds
            target.graph_exits = True
            draft = build_target(config, args, layers + blocks)  # the same weights: the same drafts
            draft.model.load_state_dict(target.model.state_dict(), strict=False)
            entry["engine"] = [plain, *engine_runs(target, draft, layers, blocks, args)]
            entry["partings"] = partings(target, entry["engine"])
            plain_tokens = entry["engine"][0]["text"]
            for run in entry["engine"]:
                run["plains_tokens"] = run.pop("text") == plain_tokens
            report["exits"][spec] = entry
            del target, draft, every
            torch.cuda.empty_cache() if cuda else None
            print_table(shape, spec, entry)
            log(f"== {shape} {spec} took {time.perf_counter() - started:.1f} s")
        (out / f"exit-{shape}.json").write_text(json.dumps(report, indent=1))
    return 0


def print_table(shape: str, spec: str, entry: dict) -> None:
    for rows, costs in entry["target"].items():
        c1 = costs["1"]
        blocked = entry["target_with_blocks"][rows]
        log(
            f"\n{shape} {spec}, {rows} row(s): target forward of 1 token {c1 * 1e3:.2f} ms; widths 1..5 "
            + ", ".join(f"{s / c1:.2f}x" for s in costs.values())
            + "; with the blocks attached "
            + ", ".join(f"{s / c1:.2f}x" for s in blocked.values())
        )
        for graphs in ("graphed", "eager"):
            s = entry["exit_forward"][f"{rows} {graphs}"]
            log(f"  one draft position, {graphs}: {s * 1e3:.2f} ms = {s / c1:.3f}x the target's 1-token forward")
    log(f"  runs that wrote other tokens than plain's: {len(entry['partings'])} of {len(entry['engine']) - 1}")
    for line in entry["partings"]:
        log(f"    {line}")


if __name__ == "__main__":
    sys.exit(main())
