#!/usr/bin/env python3
"""Does a tree of W drafts cost what a chain of W tokens costs? The verification forward timed both
ways, interleaved, on any backend: a chain (forward_rows, then rollback_rows) and a tree of the same
width (forward_tree_rows: W tokens in `--branches` chains under the row's last token, then
keep_path_rows of no node, which leaves the row where the chain's rollback does), after a context
of --depth tokens, per batch size.

    python benchmarks/tree_costs.py --random-weights benchmarks/configs/qwen2.5-coder-1.5b.json \\
        --device cuda --cache static --graphs --rows 1 4 --widths 4 8 16 32 64 --out tree-costs.json
    python benchmarks/tree_costs.py --gguf MODEL.gguf --widths 4 8 16 --rows 1

On torch a tree is the chain's forward with another mask, so the two should match; on llama.cpp
each leaf is a sequence of its own and the costs may part. Prints a table and writes JSON: per
(rows, width) the median milliseconds of chain and tree over --repeats, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))


def load(args):
    if args.gguf:
        from specdec.models.llama_cpp import LlamaCppModel

        return LlamaCppModel(args.gguf, n_ctx=args.depth + 256, max_rows=max(args.rows), n_threads=args.threads)
    from specdec.models.transformers import load_random_weights

    return load_random_weights(
        args.random_weights,
        device=args.device,
        dtype=args.dtype,
        n_ctx=args.depth + 256,
        cache=args.cache,
        graphs=args.graphs,
    )


def tree_of(width: int, branches: int) -> list[int]:
    """Parents of `width` nodes: `branches` chains (the first ones one longer where it does not
    divide) hanging under the row's last token."""
    parents: list[int] = []
    for b in range(branches):
        n = width // branches + (b < width % branches)
        parents += [-1, *range(len(parents), len(parents) + n - 1)] if n else []
    return parents


def _steps(model, rows, tokens, parents, depth):
    """(chain, tree): one verification step each, leaving the rows at `depth` tokens."""

    def chain():
        model.forward_rows({r: tokens for r in rows}, {r: len(tokens) for r in rows})
        model.rollback_rows({r: depth for r in rows})

    def tree():
        model.forward_tree_rows({r: (tokens, parents) for r in rows})
        model.keep_path_rows({r: [] for r in rows})

    return chain, tree


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--random-weights", help="a Hugging Face config.json (torch, random weights)")
    src.add_argument("--gguf", help="a GGUF model (llama.cpp)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--cache", default="static", choices=("dynamic", "static"))
    ap.add_argument("--graphs", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1])
    ap.add_argument("--widths", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    ap.add_argument("--branches", type=int, default=4)
    ap.add_argument("--depth", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out")
    args = ap.parse_args(argv)

    model = load(args)
    sync = lambda: None  # noqa: E731
    if getattr(model, "device", None) is not None and str(model.device).startswith("cuda"):
        import torch

        sync = torch.cuda.synchronize
    rng = __import__("numpy").random.default_rng(0)
    vocab = min(model.vocab_size, 30000)
    results = []
    for B in args.rows:
        rows = model.add_rows(B)
        model.forward_rows({r: rng.integers(1, vocab, args.depth).tolist() for r in rows}, {})
        for W in args.widths:
            parents = tree_of(W, args.branches)
            tokens = rng.integers(1, vocab, W).tolist()

            chain, tree = _steps(model, rows, tokens, parents, args.depth)
            times = {"chain": [], "tree": []}
            for rep in range(args.repeats + 1):  # the first of each is a warm-up (a graph's capture)
                for name, fn in (("chain", chain), ("tree", tree)) if rep % 2 else (("tree", tree), ("chain", chain)):
                    sync()
                    t = time.perf_counter()
                    fn()
                    sync()
                    if rep:
                        times[name].append(1e3 * (time.perf_counter() - t))
            chain_ms, tree_ms = statistics.median(times["chain"]), statistics.median(times["tree"])
            results.append(
                {"rows": B, "width": W, "chain_ms": chain_ms, "tree_ms": tree_ms, "tree_over_chain": tree_ms / chain_ms}
            )
            print(
                f"rows {B:2d} width {W:3d}: chain {chain_ms:8.2f} ms  tree {tree_ms:8.2f} ms  "
                f"tree/chain {tree_ms / chain_ms:.3f}",
                flush=True,
            )
        model.drop_rows(rows)
    info = {"model": getattr(model, "name", ""), "args": vars(args), "results": results}
    if args.out:
        Path(args.out).write_text(json.dumps(info, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
