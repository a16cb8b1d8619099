"""Trained heads on a recording of the target's greedy outputs: each head's agreement per position,
and the replay of head drafting on any device's cost curves (the H100's in benchmarks/gpu-h100/).

Under greedy decoding a head's guess is kept exactly when it is the target's own next token, and a
kept guess is the true context for the next one, so one teacher-forced pass per prompt gives, at
every position, how many of a k-token chain the target would keep (`runs`). A step of k head tokens
then costs the target's forward of k + 1 tokens plus k head steps. On the H100 the head's step is
its share of the target's one-token forward as timed there (--head-costs, from
benchmarks/gpu_heads.py: the engine drafting with the head at the target's real shapes, and what
keeping the target's hidden states adds to every step); on this CPU's curve, and on the H100 with
--head-costs none, it is an estimate: the larger of two shares of the target's one-token forward,
its multiply-adds against the target's, and its kernels (one layer and an output head) against the
target's (its layers and output head).

    python benchmarks/head_replay.py --head /work/heads-v2/prophet3-60000.head \\
        --runs-out benchmarks/cpu/head-runs.jsonl [--sampled]

prints, per category of the recording (benchmarks/dev-greedy-1.5b-0.5b.jsonl, the dev prompts:
never trained on), first-position agreement, tokens per target step of a fixed head:K chain, and
the speedup over plain decoding of head:K, of a clairvoyant controller over the head (drafting
exactly what will be kept), and of the 0.5B draft model (draft:4 and its clairvoyant), on this
CPU's recorded curve and on the H100's. Positions right after the prefill draft nothing (the
engine keeps no state there).

--sampled adds, per category, the first guess's acceptance at temperature 1 in expectation (the
rejection rule keeps a draft token drawn from q with probability sum min(p, q)), exact at every
position of the greedy recording rather than one noisy sampled run: it loads the target's output
head (the 1.5B's: 0.9 GB in float32).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np

from specdec.costs import cost_table
from specdec.drafters import headfile
from specdec_lab.replay import curve_at, draft_run, head_replay

HERE = Path(__file__).resolve().parent


def answer_states(target, prompt: list[int], output: list[int]) -> np.ndarray:
    """[len(output) - 1, d]: row pos - 1 is the state a head drafts from at output position pos
    (the one that chose output[pos - 1]: the sequence position before it). One teacher-forced forward."""
    [row] = target.add_rows(1)
    try:
        target.forward_rows({row: prompt + output}, {row: len(output) + 1})
        first, states = target.hidden_rows([row])[row]
    finally:
        target.drop_rows([row])
    start = len(prompt) - 1 - first  # output position 1's state: sequence position len(prompt) - 1
    return states[start : start + len(output) - 1]


def head_runs(head, states: np.ndarray, output: list[int]) -> list[int | None]:
    """At each output position, how many of the head's greedy chain of head.max_k guesses the
    target keeps (None at position 0: the engine keeps no state after a prefill)."""
    from specdec.sampling import SamplingParams

    params, rng = SamplingParams(), np.random.default_rng(0)
    runs: list[int | None] = [None]
    for pos in range(1, len(output)):
        guesses = head._draft(states[pos - 1], output[pos - 1], head.max_k, params, rng).tokens
        agrees = "".join("1" if g == t else "0" for g, t in zip(guesses, output[pos:]))
        runs.append(draft_run(agrees, 0, len(guesses)))
    return runs


def sampled_first(head, states: np.ndarray, output: list[int], weights: np.ndarray) -> float:
    """The mean over output positions 1 .. n - 2 of sum min(p, q): p the target's distribution over
    output[pos] at temperature 1 (the next state, the one that chose it, through its output head
    `weights` [V, d]), q the head's first step's from the state before and output[pos - 1]."""
    from specdec.sampling import SamplingParams, logits_to_probs

    params, rng = SamplingParams(temperature=1.0), np.random.default_rng(0)
    # row pos - 1: p at pos, as the rejection rule computes it
    p = logits_to_probs(states[1 : len(output) - 1].astype(np.float32) @ weights.T, params)
    kept = [
        np.minimum(p[pos - 1], head._draft(states[pos - 1], output[pos - 1], 1, params, rng).q[0]).sum()
        for pos in range(1, len(output) - 1)
    ]
    return float(np.mean(kept))


class StoredStates:
    """What a head needs of its target, once the states are stored: its identity and shape."""

    def __init__(self, meta: dict):
        self.name, self.identity = meta["target"], meta["identity"]
        self.vocab_size, self.n_embd = meta["vocab_size"], meta["n_embd"]

    def keep_hidden(self) -> None:
        pass

    def hidden_rows(self, rows):
        raise NotImplementedError("stored states only")

    def head_weights(self, name, tokens):
        raise NotImplementedError("stored states only")


def store_states(args, records) -> Path:
    """The states of every recorded answer under --states (one .npy a prompt, written whole, so an
    interrupted run resumes), with meta.json naming the target."""
    import os
    import time

    folder = Path(args.states)
    folder.mkdir(parents=True, exist_ok=True)
    todo = [r for r in records if not (folder / f"{r['id']}.npy").exists()]
    if not todo and (folder / "meta.json").exists():
        return folder
    from specdec import load_model

    n_ctx = max(len(r["prompt"]) + len(r["output"]) for r in records) + 16
    target = load_model(args.target, n_ctx=n_ctx, progress=False)
    target.keep_hidden()
    meta = {"target": target.name, "identity": target.identity, "vocab_size": target.vocab_size}
    (folder / "meta.json").write_text(json.dumps({**meta, "n_embd": target.n_embd}))
    started = time.perf_counter()
    for done, r in enumerate(todo, 1):
        tmp = folder / f"{r['id']}.tmp.npy"
        np.save(tmp, answer_states(target, r["prompt"], r["output"]))
        os.replace(tmp, folder / f"{r['id']}.npy")
        print(f"\rstates of {done}/{len(todo)} answers, {time.perf_counter() - started:.0f} s", end="", flush=True)
    print()
    return folder


def head_share(info, w: dict, config: dict) -> tuple[float, float]:
    """(multiply-add share, kernel share) of one step of a head (its file's info and weights)
    against the target's one-token forward (its Hugging Face config)."""
    d, L = config["hidden_size"], config["num_hidden_layers"]
    kv = d * config["num_key_value_heads"] // config["num_attention_heads"]
    target = L * (2 * d * d + 2 * d * kv + 3 * d * config["intermediate_size"]) + config["vocab_size"] * d
    if info.kind == "medusa":
        step = w["medusa.0.weight"].size + w["lm_head"].size
    else:
        names = ("fuse.weight", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "lm_head")
        step = sum(w[name].size for name in names)
    return step / target, 2 / (L + 1)


def measured_share(report: dict, info, vocab: int) -> tuple[float, float]:
    """(a head step, keeping the states) as shares of the target's one-token step, timed by
    benchmarks/gpu_heads.py: from its engine runs where it has them (the drafter's time a step at
    the head's full chain, per token; plain with the states kept against plain), else from its
    module timing (one row, a graphed chain, per step; nothing for the states)."""
    engine = {row["method"]: row for row in report.get("engine", [])}
    chain = engine.get(f"head:{info.kind} k={info.steps}")
    if chain and "plain" in engine and "plain, states kept" in engine:
        plain = engine["plain"]["decode_ms_per_step"]
        keep = engine["plain, states kept"]["decode_ms_per_step"] / plain - 1
        return chain["draft_ms_per_step"] / info.steps / plain, max(0.0, keep)
    timed = sorted({h["vocab"] for h in report["heads"] if h["kind"] == info.kind})
    size = next((v for v in timed if v >= vocab), timed[-1])
    [chain] = [
        h for h in report["heads"] if (h["kind"], h["vocab"], h["rows"], h["k"]) == (info.kind, size, 1, info.steps)
    ]
    return (chain["graph_s"] or chain["eager_s"]) / info.steps / report["target"]["1"]["1"], 0.0


def median(rows: list[dict], key: str, k: int | None = None) -> float:
    return statistics.median(x[key] if k is None else x[key][k] for x in rows)


def record(args, records) -> dict[str, list[list[int | None]]]:
    from specdec.drafters.head import HeadDrafter

    folder = store_states(args, records)
    target = StoredStates(json.loads((folder / "meta.json").read_text()))
    heads = [HeadDrafter(target, path) for path in args.head]
    runs: dict[str, list] = {}
    for path, head in zip(args.head, heads):
        runs[path] = [head_runs(head, np.load(folder / f"{r['id']}.npy"), r["output"]) for r in records]
    return runs


def sampled_acceptance(args, records) -> dict[str, list[float]]:
    """Per head file, per record: sampled_first."""
    from specdec import load_model
    from specdec.drafters.head import HeadDrafter

    folder = store_states(args, records)
    target = load_model(args.target, n_ctx=64, progress=False)
    weights = target.head_weights("output", np.arange(target.vocab_size))
    stored = StoredStates(json.loads((folder / "meta.json").read_text()))
    out = {}
    for path in args.head:
        head = HeadDrafter(stored, path)
        out[path] = [sampled_first(head, np.load(folder / f"{r['id']}.npy"), r["output"], weights) for r in records]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head", nargs="+", required=True, help="head files (specdec train --out)")
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--recording", default=str(HERE / "dev-greedy-1.5b-0.5b.jsonl"))
    parser.add_argument("--per-category", type=int, default=None, help="only the first N prompts of each category")
    parser.add_argument(
        "--states",
        default=str(Path.home() / ".cache" / "specdec" / "head-replay-states"),
        help="where the target's states on the recorded answers are kept (computed once)",
    )
    parser.add_argument("--runs", default=None, help="read the runs from this file (a --runs-out) instead")
    parser.add_argument("--runs-out", default=None, help="write the runs per position here (JSONL)")
    parser.add_argument(
        "--sampled", action="store_true", help="also the first guess's expected acceptance at temperature 1"
    )
    parser.add_argument("--curve", default=str(HERE / "gpu-h100" / "costs-1.5b-static-graphs.json"))
    parser.add_argument("--draft-curve", default=str(HERE / "gpu-h100" / "costs-0.5b-static-graphs.json"))
    parser.add_argument("--config", default=str(HERE / "configs" / "qwen2.5-coder-1.5b.json"))
    parser.add_argument(
        "--head-costs",
        default=str(HERE / "gpu-h100" / "heads-engine-1.5b.json"),
        help="the head's step on the --curve's device, timed there by benchmarks/gpu_heads.py "
        "('none': estimate it from its multiply-adds and kernels there too)",
    )
    args = parser.parse_args()

    lines = Path(args.recording).read_text().splitlines()
    header, records = json.loads(lines[0]), [json.loads(line) for line in lines[1:]]
    if args.per_category:
        by_category: dict[str, list[dict]] = {}
        for r in records:
            by_category.setdefault(r["category"], []).append(r)
        records = [r for r in records if by_category[r["category"]].index(r) < args.per_category]
    if args.runs:
        saved = [json.loads(line) for line in Path(args.runs).read_text().splitlines()]
        runs = {path: [[None if c == "-" else int(c) for c in s["runs"][path]] for s in saved] for path in args.head}
    else:
        runs = record(args, records)
    if args.runs_out:
        with open(args.runs_out, "w") as out:
            for i, r in enumerate(records):
                text = {p: "".join("-" if x is None else str(x) for x in runs[p][i]) for p in args.head}
                out.write(json.dumps({"id": r["id"], "category": r["category"], "runs": text}) + "\n")

    sampled = sampled_acceptance(args, records) if args.sampled else {}
    config = json.loads(Path(args.config).read_text())
    devices = {
        "this CPU (the recording's curve)": (header["costs"], header["draft_costs"]),
        "H100 (static shapes, graphs)": tuple(
            cost_table(json.loads(Path(p).read_text())) for p in (args.curve, args.draft_curve)
        ),
    }
    for path in args.head:
        info, w = headfile.load(path)
        flops, kernels = head_share(info, w, config)
        shares = {device: (max(flops, kernels), 0.0) for device in devices}
        print(
            f"\n## {path} ({info.kind}, {info.steps} steps): a head step = max({flops:.3f}, {kernels:.3f}) "
            "of the target's one-token forward (multiply-adds, kernels)"
        )
        if args.head_costs != "none":
            report = json.loads(Path(args.head_costs).read_text())
            device = list(devices)[1]
            shares[device] = measured_share(report, info, len(w["vocab"]))
            print(
                f"on the {device.split()[0]}: {shares[device][0]:.3f}, and keeping the target's states "
                f"{shares[device][1]:.3f} a step, timed by benchmarks/gpu_heads.py ({report['device']}, "
                f"{args.head_costs})"
            )
        if sampled:  # (the greedy first position is each device table's first-pos)
            by_category = {}
            for r, kept in zip(records, sampled[path]):
                by_category.setdefault(r["category"], []).append(kept)
            print("\ntemperature 1, the first guess kept in expectation (sum min(p, q)), medians: ", end="")
            print(", ".join(f"{category} {statistics.median(x):.2f}" for category, x in by_category.items()))
        for device, (costs, draft_costs) in devices.items():
            print(f"\n### {device}")
            print(
                "| category | first-pos | tokens/step head:1/2/3 | head:1 | head:2 | head:3 | head ceiling "
                "| draft:4 | draft ceiling |"
            )
            print("|---|---|---|---|---|---|---|---|---|")
            by_category: dict[str, list[dict]] = {}
            for r, run in zip(records, runs[path]):
                share, keep = shares[device]
                step = share * curve_at(costs, len(r["prompt"]))[0]
                by_category.setdefault(r["category"], []).append(head_replay(r, run, costs, draft_costs, step, keep))
            for category, rows in by_category.items():
                print(
                    f"| {category} | {median(rows, 'first'):.2f} | "
                    + "/".join(f"{median(rows, 'tokens_per_step', k):.2f}" for k in range(3))
                    + " | "
                    + " | ".join(f"{median(rows, 'head', k):.2f}x" for k in range(3))
                    + " | "
                    + " | ".join(f"{median(rows, key):.2f}x" for key in ("head_ceiling", "draft4", "draft_ceiling"))
                    + " |"
                )
    print("\nmedians over each category's prompts; " + f"{len(records)} prompts from {Path(args.recording).name}")


if __name__ == "__main__":
    main()
