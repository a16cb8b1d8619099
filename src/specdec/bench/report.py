"""What `specdec bench` reports from its rows (Row, run.py): pairwise speedups, the tables of
summary.md and the plots. It loads no model and imports nothing that does (matplotlib only when
plotting), so a results.jsonl can be summarised anywhere (scripts/bench_summary.py)."""

from __future__ import annotations

import os
import platform
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from ..paths import write_atomically
from .methods import NOISE_METHOD
from .suite import CATEGORIES

if TYPE_CHECKING:
    from .run import Bench, Row


def speedups(rows: list[Row], group=lambda r: (r.category, r.method)) -> dict[tuple, list[float]]:
    """group(row) (default: (category, method)) -> speedups, each run against the plain run of its
    prompt, repeat and batch size."""
    plain = {(r.prompt_id, r.repeat, r.batch): r.tokens_per_second for r in rows if r.method == "plain"}
    out: dict[tuple, list[float]] = {}
    for r in rows:
        base = plain.get((r.prompt_id, r.repeat, r.batch))
        if base:
            out.setdefault(group(r), []).append(r.tokens_per_second / base)
    return out


def prompt_speedups(rows: list[Row]) -> dict[tuple[str, str], tuple[str, float, bool]]:
    """(prompt, method) -> (category, the median over repeats of the run's speedup over the plain
    run of the same repeat, whether every repeat's text agreed with plain's). Single-prompt runs."""
    plain = {(r.prompt_id, r.repeat): r.tokens_per_second for r in rows if r.method == "plain" and r.batch == 1}
    runs: dict[tuple[str, str], list[Row]] = {}
    for r in rows:
        if r.batch == 1 and plain.get((r.prompt_id, r.repeat)):
            runs.setdefault((r.prompt_id, r.method), []).append(r)
    return {
        key: (
            rs[0].category,
            statistics.median(r.tokens_per_second / plain[(r.prompt_id, r.repeat)] for r in rs),
            all(r.identical_to_plain is not False for r in rs),
        )
        for key, rs in runs.items()
    }


def machine_line(threads: int) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, {threads} threads"


def versions() -> str:
    import importlib.metadata as md

    from .. import __version__

    parts = [f"specdec {__version__}", f"python {platform.python_version()}"]
    for dist in ("llama_cpp_python", "numpy", "transformers", "torch"):
        try:
            parts.append(f"{dist.replace('_', '-')} {md.version(dist)}")
        except md.PackageNotFoundError:
            pass
    return ", ".join(parts)


def write_summary(rows: list[Row], bench: Bench, methods: list[str], out: Path, command: str) -> str:
    methods = [m for m in dict.fromkeys(["plain", NOISE_METHOD, *methods]) if any(r.method == m for r in rows)]
    lines = [
        "# specdec bench",
        "",
        f"- date: {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- machine: {machine_line(bench.threads)}",
        f"- versions: {versions()}",
        f"- target {bench.target.name}, draft {bench.draft_model.name}, backend {bench.backend}"
        f"{_device_note(bench.target)}, max {bench.max_tokens} tokens, "
        f"{'greedy' if bench.temperature == 0 else f'temperature {bench.temperature}, seed {bench.seed}'}"
        f"{', sampled by position (--reproducible)' if bench.reproducible and bench.temperature else ''}"
        f"{', token-by-token verification' if bench.verification == 'token' and bench.temperature else ''}",
        f"- command: `{command}`",
        "",
    ]
    singles = [r for r in rows if r.batch == 1]
    if singles:
        lines += _noise_lines(singles)
        lines += _category_tables(singles, methods)
    batched = [r for r in rows if r.batch > 1]
    if batched:
        lines += _batch_table(rows, methods)
    text = "\n".join(lines) + "\n"
    write_atomically(out / "summary.md", text.encode("utf-8"))
    return text


def _noise_lines(rows: list[Row]) -> list[str]:
    """How large a difference must be to count: plain decoding's second run against its first,
    per prompt (NOISE_METHOD; none without it)."""
    ups = sorted(s for (_, m), (_, s, _) in prompt_speedups(rows).items() if m == NOISE_METHOD)
    if not ups:
        return []
    spread = max(1 - ups[0], ups[-1] - 1)
    return [
        f"Noise: plain decoding run again ({NOISE_METHOD}, interleaved with the methods) read "
        f"{statistics.median(ups):.2f}x of its first run, per prompt {ups[0]:.2f}-{ups[-1]:.2f}x over "
        f"{len(ups)} prompts: a speedup within 1 +- {spread:.2f} is no difference.",
        "",
    ]


def _device_note(model) -> str:
    device, dtype = getattr(model, "device", None), getattr(model, "dtype", None)
    return f" ({device}, {str(dtype).replace('torch.', '')})" if device is not None else ""


def _category_tables(rows: list[Row], methods: list[str]) -> list[str]:
    per_prompt = prompt_speedups(rows)
    repeats = len({r.repeat for r in rows})
    categories = [c for c in CATEGORIES if any(r.category == c for r in rows)]
    categories += sorted({r.category for r in rows} - set(categories))
    methods = [m for m in methods if any(r.method == m for r in rows)]

    def ups(m, cat="all", agreeing=False):
        return [
            s
            for (pid, mm), (c, s, same) in per_prompt.items()
            if mm == m and (cat == "all" or c == cat) and (same or not agreeing)
        ]

    lines = [
        f"Median tokens/s (decode) and median speedup over plain decoding, pair by pair: each run "
        f"against the plain run of the same prompt and repeat, the median over {repeats} repeat(s) per "
        f"prompt, then the median over the prompts. All pairs, whatever their texts.",
        "",
        "| category | " + " | ".join(methods) + " |",
        "|---|" + "---|" * len(methods),
    ]
    for cat in [*categories, "all"]:
        cells = []
        for m in methods:
            sel = [r for r in rows if r.method == m and (cat == "all" or r.category == cat)]
            if not sel:
                cells.append("-")
                continue
            tps = statistics.median(r.tokens_per_second for r in sel)
            su = ups(m, cat)
            cells.append(
                f"{tps:.1f} tok/s" if m == "plain" or not su else f"{tps:.1f} tok/s, {statistics.median(su):.2f}x"
            )
        lines.append(f"| {cat} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Like with like: a pair counts as agreeing when its text is plain's (or one is the start "
        "of the other: the same tokens, one run went on longer); the others parted at a rounding "
        "tie or a stop, and their tokens/s measure different texts. Tokens: what each run is "
        "credited with, counted alike for every runner: the tokens it produced, an end-of-generation "
        "token included, at most -n + 1 (llama.cpp's llama-speculative-simple stops only past -n "
        "and keeps whole accepted drafts beyond it).",
        "",
        "| method | acceptance rate | mean accepted length | agreeing pairs | median, all pairs | "
        "median, agreeing pairs | worst prompt | tokens: median (min-max) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m in methods:
        sel = [r for r in rows if r.method == m]
        tokens = sorted(r.tokens for r in sel)
        counts = f"{statistics.median(tokens):.0f} ({tokens[0]}-{tokens[-1]})"
        if m == "plain":
            lines.append(f"| plain | - | - | - | 1.00x | 1.00x | - | {counts} |")
            continue
        drafted = sum(r.drafted for r in sel)
        rate = f"{sum(r.accepted for r in sel) / drafted:.1%}" if drafted else "-"
        mal = f"{statistics.median(r.mean_accepted_length for r in sel):.2f}" if sel[0].mean_accepted_length else "-"
        pairs = [(pid, s, same) for (pid, mm), (c, s, same) in per_prompt.items() if mm == m]
        agreeing = [s for _, s, same in pairs if same]
        worst = min(pairs, key=lambda p: p[1]) if pairs else None
        cells = [
            rate,
            mal,
            f"{len(agreeing)}/{len(pairs)}",
            f"{statistics.median(s for _, s, _ in pairs):.2f}x" if pairs else "-",
            f"{statistics.median(agreeing):.2f}x" if agreeing else "-",
            f"{worst[1]:.2f}x ({worst[0]})" if worst else "-",
            counts,
        ]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return lines + [""] + _partings_table(rows)


def _partings_table(rows: list[Row]) -> list[str]:
    """Each greedy run that parted from its plain run's text: where, and the top-2 logit gap there
    (mark_partings): below compare.ROUNDING_GAP a rounding tie, above it a bug."""
    from ..compare import ROUNDING_GAP

    parted = [r for r in rows if r.logit_gap is not None]
    if not parted:
        return []
    ties = sum(r.logit_gap < ROUNDING_GAP for r in parted)
    lines = [
        f"Partings: {len(parted)} greedy runs parted from their plain run's text (ours from plain, "
        "scored by our target; vLLM's methods from vllm:plain, scored by vLLM's own logprobs); "
        f"{ties} at a rounding tie (top-2 logit gap below {ROUNDING_GAP}: neither llama.cpp's nor "
        f"vLLM's CPU kernels are batch-invariant), {len(parted) - ties} above it (a verification bug: "
        "please report it).",
        "",
        "| prompt | method | repeat | first different token | top-2 logit gap | verdict |",
        "|---|---|---|---|---|---|",
    ]
    for r in sorted(parted, key=lambda r: (r.prompt_id, r.method, r.repeat)):
        verdict = "rounding tie" if r.logit_gap < ROUNDING_GAP else "NOT a tie"
        lines.append(
            f"| {r.prompt_id} | {r.method} | {r.repeat} | {r.first_difference} | {r.logit_gap:.4f} | {verdict} |"
        )
    return lines + [""]


def _batch_table(rows: list[Row], methods: list[str]) -> list[str]:
    """Per batch size: median tokens/s summed over the batch, and the median speedup over plain
    decoding of the same prompts at the same batch size (batch 1: the single-prompt runs)."""
    ups = speedups(rows, group=lambda r: (r.batch, r.method))
    methods = [m for m in methods if any(r.method == m and r.batch > 1 for r in rows)]
    lines = [
        "By batch size: median tokens/s summed over the batch's rows, and median speedup over "
        "plain decoding of the same prompts at the same batch size.",
        "",
        "| batch | " + " | ".join(methods) + " | acceptance (" + ", ".join(methods[1:]) + ") |",
        "|---|" + "---|" * (len(methods) + 1),
    ]
    for size in sorted({r.batch for r in rows}):
        cells = []
        for m in methods:
            sel = [r for r in rows if r.method == m and r.batch == size]
            if not sel:
                cells.append("-")
                continue
            tps = statistics.median(r.tokens_per_second for r in sel)
            su = ups.get((size, m))
            cells.append(f"{tps:.1f} tok/s" + (f", {statistics.median(su):.2f}x" if su and m != "plain" else ""))
        rates = []
        for m in methods[1:]:
            sel = [r for r in rows if r.method == m and r.batch == size]
            drafted = sum(r.drafted for r in sel)
            rates.append(f"{sum(r.accepted for r in sel) / drafted:.0%}" if drafted else "-")
        lines.append(f"| {size} | " + " | ".join(cells) + " | " + ", ".join(rates) + " |")
    return lines + [""] + _batch_category_table(rows, methods)


def _batch_category_table(rows: list[Row], methods: list[str]) -> list[str]:
    """Per category and batch size: plain decoding's median summed tokens/s and every other
    method's median speedup over it (batches of one category only)."""
    ups = speedups(rows, group=lambda r: (r.category, r.batch, r.method))
    sizes = sorted({r.batch for r in rows})
    others = [m for m in methods if m != "plain"]
    lines = [
        "By category and batch size: plain decoding's median tokens/s summed over the batch, "
        "and the median speedup of " + ", ".join(others) + " over it.",
        "",
        "| category | " + " | ".join(f"batch {b}" for b in sizes) + " |",
        "|---|" + "---|" * len(sizes),
    ]
    for category in sorted({r.category for r in rows}):
        cells = []
        for size in sizes:
            plain = [
                r.tokens_per_second for r in rows if r.method == "plain" and r.batch == size and r.category == category
            ]
            parts = [f"{statistics.median(plain):.1f} tok/s" if plain else "-"]
            parts += [
                f"{m} {statistics.median(ups[(category, size, m)]):.2f}x" for m in others if (category, size, m) in ups
            ]
            cells.append(", ".join(parts))
        lines.append(f"| {category} | " + " | ".join(cells) + " |")
    return lines + [""]


def plot(rows: list[Row], methods: list[str], out: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots (pip install matplotlib)", file=sys.stderr)
        return []
    import numpy as np

    rows = [r for r in rows if r.batch == 1]  # batches have their own table in summary.md
    if not rows:
        return []
    ups = speedups(rows)
    categories = [c for c in CATEGORIES if any(r.category == c for r in rows)]
    shown = [m for m in methods if m != "plain" and any(mm == m for (_, mm) in ups)]
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(categories) + 0.35 * len(shown) * len(categories)), 5))
    width = 0.8 / max(len(shown), 1)
    x = np.arange(len(categories))
    for i, m in enumerate(shown):  # the median, and bars from the prompts' 25th to 75th percentile
        samples = [ups.get((c, m), [0]) for c in categories]
        vals = [statistics.median(v) for v in samples]
        spread = [
            [v - np.percentile(s, 25) for v, s in zip(vals, samples)],
            [np.percentile(s, 75) - v for v, s in zip(vals, samples)],
        ]
        ax.bar(x + (i - (len(shown) - 1) / 2) * width, vals, width, label=m, yerr=spread, capsize=2)
    noise = [s for (_, m), values in ups.items() if m == NOISE_METHOD for s in values]
    if noise:  # the machine's own noise: plain decoding against itself, every prompt
        ax.axhspan(min(noise), max(noise), color="grey", alpha=0.25, label=f"plain against plain ({NOISE_METHOD})")
    ax.axhline(1.0, color="black", linewidth=1, linestyle="--")
    ax.set_xticks(x, categories)
    ax.set_ylabel("median speedup over plain decoding")
    ax.set_title("Speedup by category and method (same prompts, same machine; bars: quartiles over prompts)")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    paths = [out / "speedup.png"]
    fig.savefig(paths[0], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 5))
    for m in methods:
        sel = [r for r in rows if r.method == m and r.drafted_at]
        if not sel:
            continue
        n = max(len(r.drafted_at) for r in sel)
        drafted = np.zeros(n)
        accepted = np.zeros(n)
        for r in sel:
            drafted[: len(r.drafted_at)] += r.drafted_at
            accepted[: len(r.accepted_at)] += r.accepted_at
        keep = drafted > 0
        ax.plot(np.arange(1, n + 1)[keep], (accepted / np.maximum(drafted, 1))[keep], marker="o", label=m)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate (all prompts)")
    ax.set_ylim(0, 1.02)
    ax.set_title("Acceptance by draft position")
    if any(not line.get_label().startswith("_") for line in ax.get_lines()):
        ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out / "acceptance.png")
    fig.savefig(paths[1], dpi=120)
    plt.close(fig)
    return paths
