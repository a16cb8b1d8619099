"""Where a run's time goes, forward by forward: every target and draft-model forward of plain,
draft:K and auto runs timed and counted by width, beside the cost curve the replay would use.

    python benchmarks/forward_log.py --backend torch --costs costs.json --out runs.jsonl
    python scripts/replay_controller.py replay --recording benchmarks/greedy-1.5b-0.5b.jsonl \
        --curve costs.json --draft-curve costs.json -v        # the prediction for the same prompts

The methods take turns on each prompt, so that a slow spell of the machine lands on all of them.
One JSON line per (method, prompt): decode seconds (the draft model's catch-up on the prompt
included, as in `specdec bench`), and per model and width the forwards' count and seconds. With
`--costs` it first times both models' curves (one row, depth 128, 5 repeats, not cached) in the
`specdec costs --out` format. Take the CPU to yourself while it runs.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))


def timed(model, tag: str, log) -> None:
    """Wrap the model's forward_rows so that every call is logged as (tag, tokens fed) -> seconds."""
    forward = model.forward_rows

    def forward_rows(feed, n_logits=None):
        t = time.perf_counter()
        out = forward(feed, n_logits)
        log[f"{tag}:{sum(len(v) for v in feed.values())}"].append(time.perf_counter() - t)
        return out

    model.forward_rows = forward_rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b")
    p.add_argument("--backend", default="torch", choices=("llama", "torch", "numpy"))
    p.add_argument("--methods", nargs="+", default=["plain", "draft:4", "auto"])
    p.add_argument("--per-category", type=int, default=1)
    p.add_argument("-n", "--max-tokens", type=int, default=128)
    p.add_argument("--costs", type=Path, default=None, help="time both models' curves first and save them here")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    from specdec.spec import METHODS, parse_method

    bad = [m for m in args.methods if parse_method(m) is None]
    if bad:
        p.error(f"unknown method {bad[0]!r}: use {METHODS}")

    from specdec import GenerationConfig, SpeculativeDecoder, load_model
    from specdec.bench import load_suite, prompt_text
    from specdec.costs import cost_report
    from specdec.drafters.model import ModelDrafter

    target = load_model(args.target, backend=args.backend)  # torch: CUDA where PyTorch sees one
    draft = load_model(args.draft, backend=args.backend)
    if args.costs:
        report = {
            "command": "benchmarks/forward_log.py " + " ".join(sys.argv[1:]),
            "target": {"name": target.name, "curves": cost_report(target, (1,), (128,), 5)},
            "draft": {"name": draft.name, "curves": cost_report(draft, (1,), (128,), 5)},
        }
        args.costs.write_text(json.dumps(report, indent=1))
    log: dict[str, list[float]] = collections.defaultdict(list)
    timed(target, "target", log)
    timed(draft, "draft", log)
    items = list(load_suite(HERE / "prompts.jsonl", per_category=args.per_category))
    config = GenerationConfig(max_new_tokens=args.max_tokens, temperature=0.0, chat=False)
    auto = None
    with args.out.open("a") as out:
        for item in items:  # methods take turns prompt by prompt: the host's speed drifts
            for method in args.methods:
                spec = parse_method(method)
                if spec.is_auto:  # one for the suite: it learns across prompts, as in a bench
                    auto = auto or SpeculativeDecoder.from_spec(target, spec, draft=ModelDrafter(draft, target))
                    decoder = auto
                else:
                    decoder = SpeculativeDecoder.from_spec(target, spec, draft=ModelDrafter(draft, target))
                log.clear()
                s = decoder.generate(prompt_text(target, item), config).stats
                row = {
                    "method": method,
                    "id": item["id"],
                    "tokens": s.generated_tokens,
                    "decode_s": s.decode_seconds,
                    "prefill_s": s.prefill_seconds,
                    "decisions": s.decisions,
                    "forwards": {k: [len(v), round(sum(v), 4)] for k, v in sorted(log.items())},
                }
                out.write(json.dumps(row) + "\n")
                out.flush()
                print(f"{method:10s} {item['id']:22s} {s.generated_tokens / s.decode_seconds:6.2f} tok/s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
