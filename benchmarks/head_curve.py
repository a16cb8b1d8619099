"""The learning curve of a trained head: held-out agreement against training tokens.

Trains each head kind on the first N tokens of one feature cache (computed once by `specdec train`
or by this script: the budgets share it) for several N, and prints, per run, the held-out
agreement by position, the chain's estimated tokens per target step at temperature 0, and the
training time. The held-out windows are the same for every N (train/features.py: every 20th
window), so the points compare alike.

    python benchmarks/head_curve.py --tokens 3750 7500 15000 30000 --out benchmarks/cpu/head-curve.json
    python benchmarks/head_curve.py --self --tokens 5000 10000 20000 --out benchmarks/cpu/head-curve-self.json

--self trains on the target's own chat answers (`specdec train --data self`) instead of the text;
--invented 0.5 has the target write half of those requests itself (`specdec train --invented`).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from specdec import load_model
from specdec.train import conversations, features
from specdec.train.trainer import TrainConfig, train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--tokens", type=int, nargs="+", default=[3750, 7500, 15000, 30000])
    parser.add_argument("--kinds", nargs="+", default=["medusa:3", "prophet:3"])
    parser.add_argument("--epochs", type=float, default=2.0)
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument("--self", action="store_true", help="the target's own answers (--data self)")
    parser.add_argument(
        "--invented",
        type=float,
        default=0.0,
        metavar="SHARE",
        help="with --self: this share of the requests written by the target itself (Magpie)",
    )
    parser.add_argument("--keep", default=None, metavar="DIR", help="keep each head file here (KIND-TOKENS.head)")
    args = parser.parse_args()

    started = time.perf_counter()
    if args.self:
        target = load_model(
            args.target, n_ctx=conversations.N_CTX, max_rows=conversations.ROWS, trees=False, progress=False
        )
        corpus = conversations.SelfCorpus(features.default_sources(), max(args.tokens), invented=args.invented)
        folder = conversations.collect(target, corpus)
    else:
        target = load_model(args.target, n_ctx=features.WINDOW, progress=False)
        folder = features.collect(target, features.Corpus(features.default_sources(), max(args.tokens)))
    feature_seconds = time.perf_counter() - started
    data = json.loads((folder / "data.json").read_text())
    rows = []
    print(
        f"features: {data['tokens']} tokens, {data['windows']} windows, in {feature_seconds:.0f} s (cached ones: 0 s)"
    )
    print(f"{'kind':<10} {'tokens':>7} {'seconds':>8}  agreement by position   chain            tokens/step")
    for spec in args.kinds:
        kind, _, steps = spec.partition(":")
        for budget in args.tokens:
            f = features.load_features(folder, budget)
            config = TrainConfig(kind=kind, steps=int(steps or 3), epochs=args.epochs)
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(args.keep or tmp) / f"{kind}{steps}-{budget}.head"
                t0 = time.perf_counter()
                info = train(target, f, config, out, data, progress=False)
                seconds = time.perf_counter() - t0
            held = info.held_out
            rows.append(
                {
                    "kind": spec,
                    "tokens": info.training["tokens"],
                    "seconds": round(seconds, 1),
                    **held,
                }
            )
            print(
                f"{spec:<10} {info.training['tokens']:>7} {seconds:>8.0f}  "
                f"{' '.join(f'{a:.3f}' for a in held['agreement']):<22} "
                f"{' '.join(f'{c:.3f}' for c in held['chain']):<16} {held['tokens_per_step']:.2f}",
                flush=True,
            )
    if args.out:
        Path(args.out).write_text(
            json.dumps({"target": args.target, "data": data, "epochs": args.epochs, "rows": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
