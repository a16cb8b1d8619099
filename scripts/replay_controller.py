#!/usr/bin/env python3
"""Measure drafting policies offline (see src/specdec_lab/replay.py).

    python scripts/replay_controller.py record [--out FILE]    # plain greedy outputs of the target
    python scripts/replay_controller.py replay [--recording FILE] [-v]
    python scripts/replay_controller.py loo [--recording FILE] [--fit] [--set NAME=VALUE ...]
    python scripts/replay_controller.py copies [--recording FILE]
    python scripts/replay_controller.py ranks --recording FILE         # add the draft's ranks, confidences, tops
    python scripts/replay_controller.py trees [--recording FILE] [--curve C --draft-curve D] [--past-miss P] [--check]
    python scripts/replay_controller.py verdict [--recording FILE] [--curve C --draft-curve D] [--check]

`record` runs the default target (or --target) with plain greedy decoding over the benchmark suite
(chat template applied as `specdec bench` does) and writes the token ids, with the target's
measured forward-cost curve on the first line. `replay` needs no model: per category, the median
speedup over plain decoding of fixed prompt lookup (ngram:8), of `--draft auto` (the real
controller, prompt lookup only, learning across prompts as in a bench run), of a clairvoyant
controller over the same drafter, and of a clairvoyant copier (the ceiling for prompt lookup).
With `--curve` (a `specdec costs --out` JSON, from any device) the costs are that curve's; with
`--draft-curve` and a recording that holds the draft model's agreement (`record --draft`, the
default), also fixed draft:K, `auto` with the draft model, and a clairvoyant draft controller.

    python scripts/replay_controller.py replay --recording benchmarks/greedy-1.5b-0.5b.jsonl \
        --curve benchmarks/gpu-h100/costs-1.5b-static-graphs.json \
        --draft-curve benchmarks/gpu-h100/costs-0.5b-static-graphs.json

`trees` sets the draft model's fixed chains against its fixed trees per category, each at its best
shape: fishbones (draft:KxW) from a recording with the draft's ranks, and the trees of its N most
probable paths (draft:KxW/N) from one with its top probabilities as well (`record` writes both;
`ranks` adds them to an older recording; --past-miss: what stands in for the draft's own path past
its first miss, which a teacher-forced recording does not hold).

`verdict` prints auto's bars per category (leave-one-category-out auto against the clairvoyant,
the best of every fixed method and the best of the peers' policies: llama.cpp's ngram-simple and
ngram-mod, vLLM's adaptive K, each the best by its median speedup; auto compared with each prompt
by prompt) and, with --check, exits 1 when one does not hold.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))


def record(args) -> None:
    from specdec import GenerationConfig, SpeculativeDecoder, load_model
    from specdec.bench.suite import load_suite, prompt_text
    from specdec.costs import measure_forward_costs
    from specdec_lab.helpers import single_row_curve

    target = load_model(args.target, backend="llama", n_ctx=args.ctx)
    draft = load_model(args.draft, backend="llama", n_ctx=args.ctx) if args.draft != "none" else None
    decoder = SpeculativeDecoder(target, None)
    config = GenerationConfig(max_new_tokens=args.max_tokens, temperature=0.0)
    out_path = Path(args.out)
    done = set()
    if args.append and out_path.exists():  # a recording made in several runs (each short, under the lock)
        done = {json.loads(line)["id"] for line in out_path.read_text().splitlines()[1:]}
    with open(out_path, "a" if done or (args.append and out_path.exists()) else "w") as out:
        if not out.tell():
            if args.curve:  # a `specdec costs --draft` report, timed with nothing else running
                report = json.loads(Path(args.curve).read_text())
                costs = single_row_curve(report, depth=args.depth)
                draft_costs = single_row_curve(report, "draft", depth=args.depth) if draft else None
            else:
                costs = list(measure_forward_costs(target).values())
                draft_costs = list(measure_forward_costs(draft).values()) if draft else None
            out.write(
                json.dumps(
                    {
                        "target": target.name,
                        "draft": draft.name if draft else None,
                        "suite": Path(args.suite).name,
                        "max_tokens": args.max_tokens,
                        "costs": costs,
                        "draft_costs": draft_costs,
                        "eog": sorted(target.tokenizer.eog_ids),
                    }
                )
                + "\n"
            )
        for item in load_suite(Path(args.suite), args.categories, per_category=args.per_category):
            if item["id"] in done:
                continue
            # the prompt exactly as `specdec bench` gives it (chat template, every turn of `messages`)
            prompt = target.tokenizer.encode(prompt_text(target, item), add_special=True)
            result = decoder.generate(prompt, config)
            line = {"id": item["id"], "category": item["category"], "prompt": prompt, "output": result.tokens}
            if draft is not None:
                agreement = draft_agreement(draft, prompt, result.tokens)
                line["draft_agrees"], line["draft_ranks"], line["draft_p"], line["draft_top"] = agreement
            out.write(json.dumps(line) + "\n")
            out.flush()
            print(f"{item['id']}: {len(prompt)} prompt tokens, {len(result.tokens)} generated", flush=True)


def draft_agreement(draft, prompt: list[int], output: list[int]) -> tuple[str, str, list[float], list[list[float]]]:
    """(agreement, ranks, confidences, top probabilities) of the draft model on the target's output, from one
    teacher-forced forward. agreement: '1' where the draft's greedy token, given the prompt and the target's
    output before it, is the target's token, else '0'. Under greedy decoding a draft of k tokens
    from position i is accepted up to the first '0' at or after i (an accepted draft token IS the
    target's token, so the draft's next guess sees the true context), so this string gives every
    draft:K step's accepted length (specdec_lab.replay.draft_run). ranks: the target's token's rank
    among the draft's candidates there (specdec_lab.replay.draft_ranks), which gives every greedy
    fishbone tree's (specdec_lab.replay.tree_run). confidences: the draft's probability of its own
    greedy token there (specdec_lab.replay.draft_confidences), which llama.cpp's p_min stops on. top
    probabilities: those of its best candidates there (specdec_lab.replay.draft_tops), which shape a
    tree of its most probable paths (specdec_lab.replay.shaped_run)."""
    from specdec_lab.replay import draft_confidences, draft_ranks, draft_tops

    [row] = draft.add_rows(1)
    try:
        logits = draft.forward_rows({row: prompt + output}, {row: len(output) + 1})[row]  # [n + 1, vocab]
    finally:
        draft.drop_rows([row])
    scored = logits[: len(output)]  # row i guesses output[i]
    agrees = "".join("1" if int(g) == t else "0" for g, t in zip(scored.argmax(axis=1), output))
    return agrees, draft_ranks(scored, output), draft_confidences(scored), draft_tops(scored)


def ranks(args) -> int:
    """Add the draft model's top probabilities, and its confidences and ranks where missing, to a
    recording made without them: one teacher-forced forward a prompt, the file replaced whole at
    the end (an interrupted run leaves it as it was). Where the new greedy agreement differs from
    the recorded one (another machine's kernels parting at a rounding tie), the recorded agreement
    is kept and the rank follows it (replay.reconcile_ranks); the count is printed."""
    import os

    from specdec import load_model
    from specdec_lab.replay import reconcile_ranks

    path = Path(args.recording)
    lines = path.read_text().splitlines()
    header, records = json.loads(lines[0]), [json.loads(line) for line in lines[1:]]
    draft = load_model(args.draft or header["draft"], backend="llama", n_ctx=args.ctx)
    parted = 0
    for r in records:
        agrees, found, confidences, r["draft_top"] = draft_agreement(draft, r["prompt"], r["output"])
        r.setdefault("draft_p", confidences)
        if "draft_ranks" in r:  # ranks (and confidences) already there stay (they priced the tables made since)
            print(f"{r['id']}: {len(r['output'])} confidences and top probabilities", flush=True)
            continue
        r["draft_ranks"], differ = reconcile_ranks(found, r.get("draft_agrees", agrees))
        parted += differ
        print(f"{r['id']}: {len(r['output'])} ranks" + (f", {differ} agreements differ" if differ else ""), flush=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("\n".join([lines[0], *(json.dumps(r, separators=(",", ":")) for r in records)]) + "\n")
    os.replace(tmp, path)
    print(
        f"{path}: ranks, confidences and top probabilities for {len(records)} prompts; {parted} positions where "
        "the agreement differed, reconciled"
    )
    return 0


def trees(args) -> int:
    """The draft model's (or prompt lookup's, --drafter ngram) fixed chains against its fixed
    trees, per category, each at the best depth and width found there (by its median speedup over
    the category's prompts), on the given curves; the tree against the chain prompt by prompt
    (the median of the per-prompt ratios)."""
    from specdec.controller import FixedController
    from specdec.drafters.ngram import NgramDrafter
    from specdec.spec import parse_shape
    from specdec_lab.replay import RANK_CAP, TOP_WIDTH, fixed_tree, paired_ratio, replay_speedup

    header, records, costs, draft_costs = load(args)
    if args.drafter == "ngram":  # fixed candidates: replayed step by step, nothing to pay for drafting

        def fixed(r, k, width, tree_cost, nodes=0):
            drafter = FixedController(NgramDrafter(width=width), k)
            speedup, decisions = replay_speedup(
                r["prompt"], r["output"], costs, drafter, stops=stops(header), tree_cost=tree_cost
            )
            return speedup, len(r["output"]) / sum(decisions.values())

    elif not all("draft_ranks" in r for r in records):
        print(f"error: {args.recording} holds no draft ranks: run `{Path(__file__).name} ranks` on it", file=sys.stderr)
        return 2
    elif draft_costs is None:
        print(f"error: {args.recording} holds no draft model curve: give --draft-curve", file=sys.stderr)
        return 2
    if args.drafter == "draft":
        fixed = partial(fixed_tree, costs=costs, draft_costs=draft_costs, past_miss=args.past_miss)
    tree_cost = tree_cost_of(args)
    if min(args.chains) < 1:
        print(f"error: --chains {min(args.chains)}: a chain drafts 1 token or more", file=sys.stderr)
        return 2
    shapes = [(k, 1, 0) for k in args.chains]
    fishbones = [f"{k}x{w}" for w in (2, 3, 4) for k in (1, 2, 3, 4, 6, 8, 12, 16)]
    # the trees of the N most probable paths, N deep at most: as many nodes as each chain's
    shaped = [f"{n}x{w}/{n}" for w in (2, 3, 4) for n in range(2, 17)] if args.drafter == "draft" else []
    for shape in args.trees or fishbones + shaped:
        parsed = None  # the grammar of bench's methods (draft:KxW[/N]), then what a recording can tell
        try:
            parsed = parse_shape(shape) if "x" in shape else None
        except ValueError:
            pass
        k, w, n = parsed or (0, 0, 0)
        if not (k and 2 <= w <= RANK_CAP) or (n and not (w <= TOP_WIDTH and args.drafter == "draft")):
            print(
                f"error: --trees {shape}: want KxW (K >= 1, 2 <= W <= {RANK_CAP}) or, for the draft model, "
                f"KxW/N (N >= 1, W <= {TOP_WIDTH})",
                file=sys.stderr,
            )
            return 2
        if n and not all("draft_top" in r for r in records):
            print(
                f"error: {args.recording} holds no top probabilities: run `{Path(__file__).name} ranks` on it",
                file=sys.stderr,
            )
            return 2
        shapes.append((k, w, n))
    print(
        describe(header, costs, draft_costs)
        + f"a tree's forward costs {tree_cost:.3f}x a chain's of as many nodes"
        + (f"; past a shaped tree's first miss: {args.past_miss}" if any(n for _, _, n in shapes) else "")
        + "\n"
    )
    print(
        "| category | prompts | best chain | tokens/step | best tree | tokens/step | tree / chain "
        "| best tree of the chain's nodes or fewer | tree / chain |"
    )
    print("|---" * 9 + "|")
    matched = beaten = 0
    categories = list(dict.fromkeys(r["category"] for r in records))

    def name(shape):
        k, w, n = shape
        return f"{args.drafter}:{k}" + (f"x{w}" if w > 1 else "") + (f"/{n}" if n else "")

    for category in categories:
        rows = [r for r in records if r["category"] == category]
        result, speedups = {}, {}
        for k, w, n in shapes:
            runs = [fixed(r, k=k, width=w, tree_cost=tree_cost, nodes=n) for r in rows]
            speedups[(k, w, n)] = [s for s, _ in runs]
            result[(k, w, n)] = (statistics.median(s for s, _ in runs), statistics.median(t for _, t in runs))
        chain = max((s for s in result if s[1] == 1), key=lambda s: result[s][0])
        tree = max((s for s in result if s[1] > 1), key=lambda s: result[s][0])
        # no more nodes than the chain
        fewer = [s for s in result if s[1] > 1 and (s[2] or s[0] * s[1]) <= chain[0]]
        small = max(fewer, key=lambda s: result[s][0], default=None)
        ratio = paired_ratio(speedups[tree], speedups[chain])  # on the same prompts, as the verdict reads auto
        matched += ratio >= 1.0
        beaten += ratio > 1.0
        small_cells = (
            f"{name(small)} {result[small][0]:.2f}x | {paired_ratio(speedups[small], speedups[chain]):.4f}"
            if small
            else "- | -"
        )
        print(
            f"| {category} | {len(rows)} | {name(chain)} {result[chain][0]:.2f}x | {result[chain][1]:.2f} "
            f"| {name(tree)} {result[tree][0]:.2f}x | {result[tree][1]:.2f} | {ratio:.4f} | {small_cells} |"
        )
    print(
        "\nSpeedups and tokens/step are medians over a category's prompts (the best chain and tree: the highest "
        "median); 'tree / chain' is the median over its prompts of the tree's speedup over the chain's on each."
    )
    holds = matched == len(categories) and beaten > len(categories) / 2
    print(
        f"\nthe best tree matches the best chain in {matched} of {len(categories)} categories and beats it in "
        f"{beaten}: the bar (every category, most beaten) {'holds' if holds else 'FAILS'}"
    )
    return 1 if args.check and not holds else 0


def load(args):
    """(header, records, the target's costs, the draft model's costs or None) of --recording, with
    --curve / --costs / --draft-curve in place of the recording's own curves."""
    from specdec.costs import cost_table
    from specdec_lab.helpers import single_row_curve

    lines = Path(args.recording).read_text().splitlines()
    header, records = json.loads(lines[0]), [json.loads(line) for line in lines[1:]]
    # a `specdec costs` report: every step priced at its own depth (the report's shallowest and
    # deepest curves, as the engine's controller has them), or at --depth alone
    curve = (lambda report, role: single_row_curve(report, role, depth=args.depth)) if args.depth else cost_table
    if args.curve:
        costs = curve(json.loads(Path(args.curve).read_text()), "target")
    else:
        costs = json.loads(Path(args.costs).read_text()) if args.costs else header["costs"]
    draft_costs = header.get("draft_costs")
    if args.draft_curve:
        report = json.loads(Path(args.draft_curve).read_text())
        draft_costs = curve(report, "draft" if "draft" in report else "target")
    return header, records, costs, draft_costs


def describe(header, costs, draft_costs) -> str:
    """The costs a replay ran on, in one line."""
    from specdec.costs import DEEP, SHALLOW, CostTable
    from specdec_lab.replay import curve_at

    line = f"target {header.get('target')}"
    depths = [SHALLOW]
    if CostTable.of(costs).slopes:
        depths = [costs.depth, DEEP, 2 * DEEP]
        line += ", each step priced at its own depth"
    for depth in depths:
        c = curve_at(costs, depth)
        line += (
            (f"; at depth {depth}" if len(depths) > 1 else "")
            + ": forward of 2/5/9/16 tokens = "
            + "/".join(f"{c[n - 1] / c[0]:.2f}" for n in (2, 5, 9, 16))
            + "x one token"
        )
    if draft_costs:
        ratio = curve_at(draft_costs, SHALLOW)[0] / curve_at(costs, SHALLOW)[0]
        line += f"; draft model's 1-token forward = {ratio:.2f}x the target's"
    return line + "\n"


def tree_cost_of(args) -> float:
    """A tree's forward over a chain's of as many nodes: --tree-cost, or the median of the one-row
    ratios of a benchmarks/tree_costs.py report (--tree-costs)."""
    if args.tree_costs:
        try:
            report = json.loads(Path(args.tree_costs).read_text())
            return statistics.median(x["tree_over_chain"] for x in report["results"] if x["rows"] == 1)
        except (OSError, ValueError, KeyError, TypeError, statistics.StatisticsError) as e:
            print(
                f"error: --tree-costs {args.tree_costs}: not a benchmarks/tree_costs.py report ({e})", file=sys.stderr
            )
            raise SystemExit(2) from None
    if not args.tree_cost > 0:
        print(f"error: --tree-cost {args.tree_cost}: a tree's forward costs more than nothing", file=sys.stderr)
        raise SystemExit(2)
    return args.tree_cost


def stops(header) -> frozenset[int]:
    """The recorded target's end-of-generation tokens, where the engine cuts every draft."""
    return frozenset(header.get("eog", ()))


def loo(args) -> None:
    """Leave one category out: priors fitted on the others, auto against the clairvoyant."""
    from specdec_lab.replay import fit_confidence_prior, fit_draft_prior, fit_match_prior, leave_one_category_out

    header, records, costs, draft_costs = load(args)
    if args.fit:
        print("MATCH_PRIOR fitted on every category:")
        for kind, values in fit_match_prior(records).items():
            print(f"    {kind!r}: {values},")
        if all("draft_agrees" in r for r in records):
            print(f"DRAFT_PRIOR fitted on every category: {fit_draft_prior(records)}")
        if all("draft_p" in r for r in records):
            print(f"CONFIDENCE_PRIOR fitted on every category: {fit_confidence_prior(records)}")
        print()
    import specdec.acceptance as acceptance
    import specdec.controller as controller

    extra = {}
    for setting in args.set or []:  # NAME=VALUE: a module constant (WHOLE_COPY_MIN) or a controller argument (reach)
        name, value = setting.split("=", 1)
        if name.isupper():  # set where it is read: the controller's, or the acceptance tables' (OVERLAY_LONG)
            modules = [module for module in (controller, acceptance) if hasattr(module, name)]
            if not modules:
                print(f"error: --set: no constant {name} in specdec.controller or specdec.acceptance", file=sys.stderr)
                raise SystemExit(2)
            for module in modules:
                setattr(module, name, float(value))
        else:
            extra[name] = float(value)
    result = leave_one_category_out(records, costs, draft_costs, stops(header), tree_cost_of(args), **extra)
    print(describe(header, costs, draft_costs))
    print(
        "| held-out category | prompts | auto | clairvoyant | auto / clairvoyant (median per prompt) "
        "| auto, worst prompt |"
    )
    print("|---|---|---|---|---|---|")
    for category, r in result.items():
        print(
            f"| {category} | {r['prompts']} | {r['auto']:.2f}x | {r['clairvoyant']:.2f}x | {r['ratio']:.2f} "
            f"| {r['worst']:.2f}x |"
        )


def copies(args) -> None:
    """How far long matches run, whole copies against partial ones (the controller's whole-copy rule)."""
    from specdec.controller import WHOLE_COPY_MIN, WHOLE_COPY_SHARE
    from specdec_lab.replay import copy_runs

    lines = Path(args.recording).read_text().splitlines()
    runs = copy_runs([json.loads(line) for line in lines[1:]])
    print(
        f"matches of at least {WHOLE_COPY_MIN} tokens; whole: spanning at least {WHOLE_COPY_SHARE:.0%} of the "
        "response so far\n"
    )
    print("| match | " + " | ".join(f"next {j} right" for j in runs["whole"]) + " |")
    print("|---" * (len(runs["whole"]) + 1) + "|")
    for name, by_j in runs.items():
        print(
            f"| {name} | "
            + " | ".join(f"{right / left:.0%} of {left}" if left else "none" for right, left in by_j.values())
            + " |"
        )


def replay(args) -> None:
    from specdec.controller import TREE_WIDTHS, CostAwareController, FixedController
    from specdec.drafters.ngram import NgramDrafter
    from specdec_lab.replay import (
        LongMatchController,
        RecordedDrafter,
        clairvoyant_speedup,
        copy_ceiling,
        draft_ceiling,
        recorded_draft,
        replay_speedup,
    )

    header, records, costs, draft_costs = load(args)
    if not args.draft_curve and not args.with_draft:
        draft_costs = None  # prompt lookup only, unless asked
    with_draft, trees = recorded_draft(records, draft_costs)  # trees: auto may draft the draft model's trees
    recorded = RecordedDrafter.of(records) if with_draft else None
    tree_cost = tree_cost_of(args)
    # one `auto` for the suite, as in a bench: it learns across prompts
    eog = stops(header)
    auto = CostAwareController(
        NgramDrafter(),
        recorded,
        copy.deepcopy(costs),
        copy.deepcopy(draft_costs),
        stops=eog,
        tree_widths=TREE_WIDTHS if trees else (1,),
    )
    columns = ["ngram:8", "auto", "clairvoyant", "copy ceiling", "ngram-mod-like:8"]
    if with_draft:
        columns += [f"draft:{k}" for k in args.draft_k] + ["draft ceiling"]
    by_category: dict[str, list[tuple[float, ...]]] = {}
    for r in records:
        prompt, output = r["prompt"], r["output"]
        fixed, _ = replay_speedup(prompt, output, costs, FixedController(NgramDrafter(), 8), stops=eog)
        auto_speedup, decisions = replay_speedup(prompt, output, costs, auto, recorded, draft_costs, eog, tree_cost)
        # the clairvoyant controller over the drafters auto has (prompt lookup, and the draft model when recorded)
        clairvoyant = clairvoyant_speedup(
            prompt,
            output,
            costs,
            r.get("draft_agrees") if with_draft else None,
            draft_costs,
            r.get("draft_ranks") if trees else None,
            tree_cost,
        )
        row = [
            fixed,
            auto_speedup,
            clairvoyant,
            copy_ceiling(prompt, output, costs),
            replay_speedup(prompt, output, costs, LongMatchController(NgramDrafter(match_cap=64), 8), stops=eog)[0],
        ]
        if with_draft:
            for k in args.draft_k:
                row.append(
                    replay_speedup(prompt, output, costs, FixedController(recorded, k), recorded, draft_costs, eog)[0]
                )
            row.append(draft_ceiling(prompt, output, r["draft_agrees"], costs, draft_costs))
        by_category.setdefault(r["category"], []).append(tuple(row))
        if args.verbose:
            print(f"{r['id']:24s}" + "".join(f" {c} {v:.2f}x" for c, v in zip(columns, row)) + f"  auto: {decisions}")
    print(describe(header, costs, draft_costs if with_draft else None))
    print("| category | " + " | ".join(columns) + " | auto, worst prompt |")
    print("|---" * (len(columns) + 2) + "|")
    for category, rows in by_category.items():
        medians = [statistics.median(r[i] for r in rows) for i in range(len(columns))]
        print(f"| {category} | " + " | ".join(f"{m:.2f}x" for m in medians) + f" | {min(r[1] for r in rows):.2f}x |")


def verdict(args) -> int:
    from specdec_lab.replay import verdict as bars

    header, records, costs, draft_costs = load(args)
    result = bars(records, costs, draft_costs, stops(header), tree_cost_of(args))
    print(describe(header, costs, draft_costs))
    names = list(next(iter(result.values()))["holds"])
    print(
        "| category | prompts | auto (held out) | clairvoyant | auto / clairvoyant | best fixed | auto / it "
        "| best peer | auto / it | their best / clairvoyant | " + " | ".join(names) + " |"
    )
    print("|---" * (10 + len(names)) + "|")
    failed = []
    for category, r in result.items():
        (fixed, f), (peer, p) = r["best fixed"], r["best peer"]
        marks = ["holds" if r["holds"][n] else "FAILS" for n in names]
        failed += [f"{category}: {n}" for n in names if not r["holds"][n]]
        print(
            f"| {category} | {r['prompts']} | {r['auto']:.2f}x | {r['clairvoyant']:.2f}x | {r['ratio']:.2f} "
            f"| {fixed} {f:.2f}x | {r['vs fixed']:.2f} | {peer} {p:.2f}x | {r['vs peer']:.2f} "
            f"| {max(f, p) / r['clairvoyant']:.2f} | " + " | ".join(marks) + " |"
        )
    print(
        "\nSpeedups are medians over a category's prompts; each 'auto / ...' is the median over its prompts of "
        "auto's speedup over the other's on the same prompt, which the bars read."
    )
    print(f"\n{len(failed)} of {len(result) * len(names)} bars fail" + (": " + "; ".join(failed) if failed else ""))
    return 1 if args.check and failed else 0


def _replay_inputs(p) -> None:
    """The recording and curve flags loo and verdict share with replay."""
    for name, default in (
        ("--recording", "greedy-outputs.jsonl"),
        ("--costs", None),
        ("--curve", None),
        ("--draft-curve", None),
    ):
        p.add_argument(name, default=default, help="as for replay")
    p.add_argument("--depth", type=int, default=None, help="the curves' depth to use")
    _tree_flags(p)


def _tree_flags(p) -> None:
    p.add_argument("--tree-cost", type=float, default=1.0, help="a tree's forward over a chain's of as many nodes")
    p.add_argument("--tree-costs", help="a benchmarks/tree_costs.py report: its one-row ratios' median")


def main() -> int:
    from specdec_lab.replay import PAST_MISS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="plain greedy outputs of the target over the suite")
    rec.add_argument("--target", default="qwen2.5-coder-1.5b")
    rec.add_argument(
        "--draft",
        default="qwen2.5-coder-0.5b",
        help="also record this draft model's greedy agreement with the target ('none': skip)",
    )
    rec.add_argument("--suite", default=str(ROOT / "benchmarks" / "prompts.jsonl"))
    rec.add_argument("--categories", nargs="+", default=None, help="only these categories")
    rec.add_argument("--per-category", type=int, default=None)
    rec.add_argument("--max-tokens", type=int, default=256)
    rec.add_argument("--ctx", type=int, default=8192)
    rec.add_argument("--out", default="greedy-outputs.jsonl")
    rec.add_argument(
        "--curve",
        help="the header's cost curves from this `specdec costs --draft` report "
        "(at --depth) instead of timing them now",
    )
    rec.add_argument("--depth", type=int, default=None, help="the --curve depth to use")
    rec.add_argument(
        "--append",
        action="store_true",
        help="add the prompts not yet in --out to it (record a suite in several short runs)",
    )
    rep = sub.add_parser("replay", help="speedups of drafting policies on a recording")
    rep.add_argument("--recording", default="greedy-outputs.jsonl")
    rep.add_argument(
        "--costs",
        help="a JSON list of forward seconds for 1..W tokens, W - 1 the longest draft (default: the recording's)",
    )
    rep.add_argument(
        "--curve",
        help="the target's curves from `specdec costs --out` instead of --costs: each "
        "step priced at its own depth (the report's shallowest and deepest "
        "one-row curves), or its curve at --depth alone",
    )
    rep.add_argument(
        "--draft-curve",
        help="the draft model's curve from `specdec costs --out` (its draft, else "
        "its target): adds draft:K, auto with the draft model and the "
        "draft ceiling, from the recording's draft agreement",
    )
    rep.add_argument("--depth", type=int, default=None, help="the curves' depth to use")
    rep.add_argument(
        "--with-draft", action="store_true", help="the draft model too, on the recording's own draft curve"
    )
    rep.add_argument("--draft-k", type=int, nargs="+", default=[2, 4], help="fixed draft:K columns (default: 2 4)")
    rep.add_argument("-v", "--verbose", action="store_true", help="a line per prompt")
    _tree_flags(rep)
    out = sub.add_parser("loo", help="leave one category out: fit the priors on the others, test auto on it")
    _replay_inputs(out)
    out.add_argument("--fit", action="store_true", help="also print the priors fitted on every category")
    out.add_argument(
        "--set",
        nargs="+",
        metavar="NAME=VALUE",
        help="try other values: controller constants (WHOLE_COPY_MIN=24) or arguments "
        "(reach=0.5, overlay_weight=16, shared_rate=0.02, explore_growth=1)",
    )
    ver = sub.add_parser("verdict", help="auto's bars per category: clairvoyant, best fixed, best peer policy")
    _replay_inputs(ver)
    ver.add_argument("--check", action="store_true", help="exit 1 when a bar does not hold")
    rk = sub.add_parser(
        "ranks", help="add the draft model's ranks of the target's tokens, and its confidences, to a recording"
    )
    rk.add_argument("--recording", default="greedy-outputs.jsonl")
    rk.add_argument("--draft", default=None, help="the draft model (default: the recording's)")
    rk.add_argument("--ctx", type=int, default=8192)
    tr = sub.add_parser("trees", help="the draft model's (or prompt lookup's) fixed chains against its fixed trees")
    _replay_inputs(tr)
    tr.add_argument(
        "--drafter", choices=("draft", "ngram"), default="draft", help="the draft model (default) or prompt lookup"
    )
    tr.add_argument("--chains", type=int, nargs="+", default=list(range(1, 17)), help="chain depths K to try")
    tr.add_argument(
        "--trees",
        nargs="+",
        default=None,
        help="fishbones KxW to try (W <= 9) and, for the draft model, trees of its N most probable "
        "paths KxW/N (W <= 4); default: KxW for K 1-4, 6, 8, 12, 16 and W 2-4, and NxW/N for N 2-16",
    )
    tr.add_argument(
        "--past-miss",
        choices=PAST_MISS,
        default="recorded",
        help="a shaped tree's probabilities past the draft's first miss, which a recording does not hold: "
        "the recorded ones (an estimate), every chain token sure (fewest siblings kept), or none possible (most)",
    )
    tr.add_argument("--check", action="store_true", help="exit 1 when the tree bar does not hold")
    cop = sub.add_parser("copies", help="how far long matches run: whole copies against partial ones")
    cop.add_argument("--recording", default="greedy-outputs.jsonl")
    args = parser.parse_args()
    commands = {
        "record": record,
        "replay": replay,
        "loo": loo,
        "copies": copies,
        "verdict": verdict,
        "ranks": ranks,
        "trees": trees,
    }
    return commands[args.command](args) or 0


if __name__ == "__main__":
    sys.exit(main())
