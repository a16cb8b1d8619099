#!/usr/bin/env python3
"""A trained head's drafting step, timed beside the target's forward on the same device.

    python benchmarks/gpu_heads.py --out DIR [--targets 1.5b 7b] [--vocab 8192 32768 0]

For each target shape (benchmarks/configs/, random weights: the shapes set the costs):
- the target's forward of 1..5 tokens per row at cache depth 128, 1 and 4 rows, with the layout
  the GPU curves use (static cache + CUDA graphs), through forward_rows as the engine calls it;
- the heads `specdec train` makes, at that target's width: medusa:3 and prophet:3 (8 attention
  heads, MLP 1024 wide), each with a draft vocabulary of every --vocab size (0: the target's
  whole vocabulary), drafting greedy chains of 1..3 tokens (drafters.head_net's `draft`, what
  drafters.head runs on a torch target), timed eager and as one CUDA graph per chain;
- early exit: the target's first L layers plus one trained block, then its norm and output head,
  as a model of L + 1 layers (the draft's one-token forward; the KV cache it would share with
  the target is not modelled), for L a quarter and a half of the target's layers.

With --engine, the engine itself (SpeculativeDecoder) on the target: plain decoding, each head
drafting k = 1..3 tokens a step (drafters.head on the target's device), and plain again with the
hidden states kept; per target step its wall time, the drafter's and the target's.

Every time is the median of --repeats synchronised calls after a warm-up; DIR/heads-SHAPE.json
keeps them all with the device and versions, and the table prints each against the target's
one-token forward. benchmarks/head_replay.py --head-costs DIR/heads-1.5b.json replays with them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

SHAPES = ("0.5b", "1.5b", "7b")
HEAD_STEPS = 3  # medusa:3 and prophet:3
DEPTH = 128


def log(*args) -> None:
    print(*args, flush=True)


def timed(fn, repeats: int, sync) -> float:
    """The median seconds of `repeats` calls of fn, synchronised, after two warm-up calls."""
    for _ in range(2):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def build_target(config: Path, args, layers: int | None):
    """The random-weight model of `config` (cut to its first `layers` layers when given)."""
    from specdec.models.transformers import load_random_weights

    path = config
    if layers is not None:
        values = json.loads(config.read_text())
        values["num_hidden_layers"] = layers
        path = Path(args.out) / f"{config.stem}-{layers}-layers.json"
        path.write_text(json.dumps(values))
    cache, graphs = ("static", True) if args.device.startswith("cuda") else ("dynamic", False)
    return load_random_weights(path, device=args.device, dtype=args.dtype, n_ctx=1024, cache=cache, graphs=graphs)


def forward_costs(model, args, widths) -> dict[str, dict[str, float]]:
    from specdec.costs import measure_forward_costs

    return {
        str(rows): {
            str(w): s
            for w, s in measure_forward_costs(
                model, widths, repeats=args.repeats, depth=DEPTH, use_cache=False, rows=rows
            ).items()
        }
        for rows in args.rows
    }


def time_heads(model, args, torch, sync) -> list[dict]:
    """Every head kind x vocabulary x rows x chain length, eager and graphed."""
    from specdec.drafters.head_net import build, draft
    from specdec.drafters.headfile import KINDS
    from specdec.models.transformers import cuda_graph
    from specdec.train.trainer import TrainConfig

    out_head = model.model.get_output_embeddings().weight.detach()
    embed = model.model.get_input_embeddings().weight.detach()
    n_vocab, d = out_head.shape
    results = []
    for vocab in args.vocab:
        v = vocab or n_vocab
        rows_of = torch.arange(v, device=out_head.device)
        lm_head, draft_embed = out_head[rows_of].contiguous(), embed[rows_of].contiguous()
        config = TrainConfig("prophet", steps=HEAD_STEPS)  # the shapes `specdec train` makes
        heads = {kind: build(kind, lm_head, draft_embed, HEAD_STEPS, config.n_head, config.n_ff) for kind in KINDS}
        for kind, head in heads.items():
            head.to(device=out_head.device, dtype=out_head.dtype).eval()
            for rows in args.rows:
                feature = torch.randn(rows, d, device=out_head.device, dtype=out_head.dtype)
                last = torch.randint(0, v, (rows,), device=out_head.device)
                for k in range(1, HEAD_STEPS + 1):
                    fn = lambda h=head, f=feature, r=last, k=k: draft(h, f, r, k)  # noqa: E731
                    eager = timed(fn, args.repeats, sync)
                    graph = None
                    if out_head.device.type == "cuda":  # (--device cpu on a GPU machine: eager only)
                        with torch.no_grad():
                            graph = timed(cuda_graph(fn)[0].replay, args.repeats, sync)
                    results.append({"kind": kind, "vocab": v, "rows": rows, "k": k, "eager_s": eager, "graph_s": graph})
        del heads
    return results


def write_head(model, kind: str, vocab: int, path: Path) -> Path:
    """A head file of `kind` for `model` at the shapes `specdec train` makes (its initial weights
    plus noise: a random target's text cannot be learned, so this times the head, not its guesses)."""
    import numpy as np
    import torch

    from specdec.drafters import headfile
    from specdec.drafters.head_net import build, file_tensors
    from specdec.train.trainer import TrainConfig

    rows, config = np.arange(vocab), TrainConfig(kind, steps=HEAD_STEPS)
    embed = torch.from_numpy(model.head_weights("embedding", rows))
    head = build(
        kind, torch.from_numpy(model.head_weights("output", rows)), embed, HEAD_STEPS, config.n_head, config.n_ff
    )
    with torch.no_grad():
        for tensor in head.head_tensors().values():
            tensor.add_(torch.randn_like(tensor) * 0.01)
    n_head, n_ff = (config.n_head, config.n_ff) if kind == "prophet" else (0, 0)
    info = headfile.HeadInfo(kind, model.identity, model.name, model.n_embd, model.vocab_size, HEAD_STEPS, n_head, n_ff)
    headfile.save(path, info, file_tensors(head, rows))
    return path


def time_engine(model, args, out: Path) -> list[dict]:
    """The engine over one prompt of DEPTH random tokens, --tokens generated: plain decoding, then
    each head at k = 1..3 (fixed), then plain again with the hidden states kept. Per target step:
    the wall time, the drafter's and the target's."""
    import numpy as np

    from specdec import GenerationConfig, SpeculativeDecoder
    from specdec.drafters.headfile import KINDS
    from specdec.spec import parse

    prompt = [int(t) for t in np.random.default_rng(0).integers(300, min(5000, model.vocab_size), DEPTH)]
    config = GenerationConfig(max_new_tokens=args.tokens, chat=False)
    results = []

    def run(label: str, decoder) -> None:
        decoder.generate(prompt, GenerationConfig(max_new_tokens=16, chat=False))  # graphs captured
        stats = decoder.generate(prompt, config).stats
        per = {key: getattr(stats, f"{key}_seconds") / stats.steps * 1e3 for key in ("decode", "draft", "target")}
        row = {"method": label, "steps": stats.steps, "tokens": stats.generated_tokens, "accepted": stats.accepted}
        results.append({**row, **{f"{key}_ms_per_step": ms for key, ms in per.items()}})
        log(
            f"  {label:22s} {per['decode']:7.2f} ms a step; in it the drafter {per['draft']:6.2f}, the target "
            f"{per['target']:6.2f}; {stats.steps} steps, {stats.accepted} drafted tokens kept"
        )

    run("plain", SpeculativeDecoder(model))
    for kind in KINDS:
        head = write_head(model, kind, args.vocab[0] or model.vocab_size, out / f"{kind}.head")
        for k in range(1, HEAD_STEPS + 1):
            run(f"head:{kind} k={k}", SpeculativeDecoder.from_spec(model, parse(f"head:{head}", backend="torch", k=k)))
        head.unlink()
    run("plain, states kept", SpeculativeDecoder(model))
    return results


def shape_parser(doc: str) -> argparse.ArgumentParser:
    """The flags every random-weight GPU timing here takes (this script's, gpu_exit.py's)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--targets", nargs="+", default=["1.5b", "7b"], choices=SHAPES)
    parser.add_argument("--config-dir", default=str(ROOT / "benchmarks" / "configs"))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--tokens", type=int, default=128, help="tokens the engine generates a run")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    return parser


def start(args):
    """(torch, the output folder, a synchronise function, the device's name, the versions), the
    device named on the log's first line."""
    import torch

    import specdec

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    device = torch.cuda.get_device_name(0) if cuda else "cpu"
    log(f"{device}, torch {torch.__version__}")
    return torch, out, sync, device, {"torch": torch.__version__, "specdec": specdec.__version__}


def main() -> int:
    parser = shape_parser(__doc__)
    parser.add_argument("--vocab", type=int, nargs="+", default=[8192, 32768, 0], help="draft vocabularies (0: all)")
    parser.add_argument("--engine", action="store_true", help="also time the engine drafting with each head")
    args = parser.parse_args()
    torch, out, sync, device, versions = start(args)
    cuda = args.device.startswith("cuda")
    for shape in args.targets:
        started = time.perf_counter()
        config = Path(args.config_dir) / f"qwen2.5-coder-{shape}.json"
        n_layers = json.loads(config.read_text())["num_hidden_layers"]
        model = build_target(config, args, None)
        report = {"device": device, "versions": versions, "config": config.name, "dtype": args.dtype, "depth": DEPTH}
        report["target"] = forward_costs(model, args, [1, 2, 3, 4, 5])
        with torch.no_grad():
            report["heads"] = time_heads(model, args, torch, sync)
        if args.engine:
            log(f"{shape}: the engine, {args.tokens} tokens after {DEPTH}")
            report["engine"] = time_engine(model, args, out)
        del model
        torch.cuda.empty_cache() if cuda else None
        report["early_exit"] = {}
        for exit_after in (n_layers // 4, n_layers // 2):
            model = build_target(config, args, exit_after + 1)
            report["early_exit"][str(exit_after)] = forward_costs(model, args, [1])
            del model
            torch.cuda.empty_cache() if cuda else None
        (out / f"heads-{shape}.json").write_text(json.dumps(report, indent=1))
        print_table(shape, report)
        log(f"== {shape} took {time.perf_counter() - started:.1f} s")
    return 0


def print_table(shape: str, report: dict) -> None:
    for rows, costs in report["target"].items():
        c1 = costs["1"]
        log(
            f"\n{shape}, {rows} row(s): target forward of 1 token {c1 * 1e3:.2f} ms; "
            + ", ".join(f"{w}: {s / c1:.2f}x" for w, s in costs.items())
        )
        log("| head | vocab | k=1 eager | k=3 eager | k=1 graph | k=2 graph | k=3 graph |  (x the 1-token forward)")
        log("|---|---|---|---|---|---|---|")
        for kind in ("medusa", "prophet"):
            for vocab in sorted({h["vocab"] for h in report["heads"]}):
                got = {
                    h["k"]: h for h in report["heads"] if (h["kind"], h["vocab"], str(h["rows"])) == (kind, vocab, rows)
                }
                eager = [f"{got[k]['eager_s'] / c1:.3f}" for k in (1, 3)]
                graph = [f"{got[k]['graph_s'] / c1:.3f}" if got[k]["graph_s"] else "-" for k in (1, 2, 3)]
                log(f"| {kind} | {vocab} | " + " | ".join(eager + graph) + " |")
        for exit_after, costs_ee in report["early_exit"].items():
            log(f"early exit after {exit_after} layers + 1 block: {costs_ee[rows]['1'] / c1:.3f}x")


if __name__ == "__main__":
    sys.exit(main())
