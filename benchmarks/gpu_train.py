#!/usr/bin/env python3
"""What `specdec train` costs on a GPU: the target answering (`--data self`) and the head's updates,
timed on a random-weight model of a real shape (benchmarks/configs/), since real weights cannot
travel to the lent machine.

    python benchmarks/gpu_train.py --out DIR [--targets 1.5b] [--rows 4 16 64 128]

- answering: train.conversations.collect, as `specdec train --backend torch --data self` runs it
  (the dynamic cache, eager; --layouts adds static + CUDA graphs), `--rows R` answers at a time,
  over this machine's own sources (parsed once, timed apart), for about R x --tokens-per-row
  tokens each (the rows fill and drain as conversations end, so a run must be long beside one
  answer). Per run: tokens, seconds,
  tokens/s, decode steps, and the share of the time inside the target's forward_rows
  (synchronised) against the host's (the logits' argmax, the hidden states' copies, the files).
  Random weights never end an answer early, so every answer runs its 256 tokens, and the byte
  tokenizer of a random model makes a request's text about four times as many tokens as Qwen's
  would (more of the requests are skipped as too long): the costs are the shape's, the data is
  not the text a real target would write.
- training: train.trainer.train on the last run's features, each of --kinds, the defaults of
  `specdec train` (batch 128, AdamW) for --updates updates, on the target's device: ms an update,
  and the minutes a million tokens would take (2 epochs, the default).

DIR/train-SHAPE-LAYOUTS.json (a '+' written '-') keeps it all with the device and versions.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_heads import log, shape_parser, start  # noqa: E402

MILLION = 1_000_000


def read_sources_once() -> float:
    """Parse the requests' sources once (seconds; the same for every run), and have every
    collection below reuse that parse, so that its time is the answering's."""
    from specdec.train import conversations, features

    t = time.perf_counter()
    pools = conversations.read_pools(features.default_sources())
    conversations.read_pools = lambda files, seed=0, limit=400: pools
    return time.perf_counter() - t


def time_answers(model, rows: int, tokens: int, sync) -> dict:
    """One `--data self` collection of `tokens` at `rows` rows, in a fresh SPECDEC_HOME."""
    from specdec.train import conversations, features

    inside = [0.0, 0]
    forward = model.forward_rows

    def timed_forward(fed, n_logits=None):
        sync()
        t = time.perf_counter()
        out = forward(fed, n_logits)
        sync()
        inside[0] += time.perf_counter() - t
        inside[1] += all(len(ids) == 1 for ids in fed.values())  # a decode step, not a request's prefill
        return out

    model.forward_rows = timed_forward
    try:
        with tempfile.TemporaryDirectory() as home:
            os.environ["SPECDEC_HOME"] = home
            corpus = conversations.SelfCorpus(features.default_sources(), tokens)
            t = time.perf_counter()
            folder = conversations.collect(model, corpus, progress=False, rows=rows)
            seconds = time.perf_counter() - t
            data = json.loads((folder / "data.json").read_text())
            loaded = features.load_features(folder)
    finally:
        model.forward_rows = forward
    return {
        "rows": rows,
        "tokens": data["tokens"],
        "conversations": data["windows"],
        "seconds": round(seconds, 2),
        "tokens_per_s": round(data["tokens"] / seconds, 1),
        "decode_steps": inside[1],
        "forward_share": round(inside[0] / seconds, 3),
        "minutes_a_million": round(MILLION / (data["tokens"] / seconds) / 60, 1),
    }, loaded


def time_training(model, loaded, kind: str, updates: int, out: Path) -> dict:
    from specdec.cli.train import _kind
    from specdec.train.trainer import TrainConfig, start_positions, train

    steps = _kind(kind)
    positions = len(start_positions(loaded.split()[0], steps["steps"]))
    epochs = min(2.0, updates * 128 / max(positions, 1))
    config = TrainConfig(**steps, epochs=epochs)
    head = out / f"{kind.replace(':', '-')}.head"
    info = train(model, loaded, config, head, {"kind": "random"}, progress=False)
    head.unlink(missing_ok=True)
    done = info.training["updates"]
    seconds = info.training["seconds_this_run"]  # the updates alone (kept to the millisecond)
    per_update = seconds / max(done, 1)
    return {
        "kind": kind,
        "device": info.training["device"],
        "updates": done,
        "seconds": seconds,
        "ms_an_update": round(1e3 * per_update, 2),
        "tokens_per_s": round(done * 128 / max(seconds, 1e-3), 1),  # chain starts (about a token each) a second
        "minutes_a_million_2_epochs": round(2 * MILLION / 128 * per_update / 60, 1),
    }


def main() -> int:
    parser = shape_parser(__doc__)
    parser.set_defaults(targets=["1.5b"], rows=[4, 16, 64, 128])
    parser.add_argument("--tokens-per-row", type=int, default=700, help="tokens answered a row, each run")
    parser.add_argument("--min-tokens", type=int, default=6000, help="tokens a run answers at least")
    parser.add_argument(
        "--kinds", nargs="*", default=["prophet:3", "medusa:3"], help="heads trained (none: answering only)"
    )
    parser.add_argument("--updates", type=int, default=400, help="training updates timed for each kind")
    parser.add_argument("--layouts", nargs="+", default=["dynamic"], choices=["dynamic", "static+graphs"])
    args = parser.parse_args()
    torch, out, sync, device, versions = start(args)
    from specdec.models.transformers import load_random_weights
    from specdec.train import conversations

    for shape in args.targets:
        config = Path(args.config_dir) / f"qwen2.5-coder-{shape}.json"
        report = {"device": device, "versions": versions, "config": config.name, "dtype": args.dtype}
        report["reading_the_sources_s"] = round(read_sources_once(), 2)
        log(f"reading the requests' sources (once a run of specdec train): {report['reading_the_sources_s']:.1f} s")
        report["answers"], loaded = [], None
        for layout in args.layouts:
            cache, graphs = layout.split("+")[0], "graphs" in layout
            model = load_random_weights(
                config, device=args.device, dtype=args.dtype, n_ctx=conversations.N_CTX, cache=cache, graphs=graphs
            )
            for rows in args.rows:
                tokens = max(args.min_tokens, rows * args.tokens_per_row)
                row, loaded = time_answers(model, rows, tokens, sync)
                row["layout"] = layout
                report["answers"].append(row)
                log(
                    f"{shape} {layout} answering, {rows:3d} rows: {row['tokens']:6d} tokens "
                    f"in {row['seconds']:6.1f} s, "
                    f"{row['tokens_per_s']:7.1f} tokens/s ({row['forward_share']:.0%} in the forward), "
                    f"a million tokens {row['minutes_a_million']:.0f} min"
                )
        report["training"] = []
        for kind in args.kinds:
            row = time_training(model, loaded, kind, args.updates, out)
            report["training"].append(row)
            log(
                f"{shape} training {kind} on {row['device']}: {row['ms_an_update']:.1f} ms an update of 128, "
                f"a million tokens x 2 epochs {row['minutes_a_million_2_epochs']:.1f} min"
            )
        layouts = "-".join(args.layouts).replace("+", "-")  # (a '+' does not come back from the lent machine)
        (out / f"train-{shape}-{layouts}.json").write_text(json.dumps(report, indent=1))
        del model
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
