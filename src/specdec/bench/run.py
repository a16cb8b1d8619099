"""`specdec bench`: fixed prompts, warm-up, repeats, medians, and the peers on the same machine.

Every (prompt, method) pair runs `repeats` times; methods alternate per prompt (the order rotates)
so that drift in machine speed hits all methods alike. Speedups are computed pair by pair: each
run against the plain run of the same prompt and repeat, the median over the repeats per prompt,
then the median over the prompts of a category.

Like with like: greedy runs that part at a rounding tie (llama.cpp's kernels are not batch-invariant)
write different texts, often of different lengths, and llama.cpp's `llama-speculative-simple` keeps
whole accepted drafts past `-n` (it wrote 277-321 tokens for 256). So every run's text is kept in
results.jsonl and compared with plain's (`text_match`: identical, prefix — one text is the start of
the other, as when a run wrote more tokens — or differs), and the summary gives the median speedup
over all pairs and over the pairs whose texts agree, with every method's token counts.

Every runner's tokens are counted alike (`produced`): what the model produced in the decode time,
an end-of-generation token included (our engine does not emit it, llama.cpp counts it, and both
spend a forward on it), and at most max_tokens + 1 (llama.cpp's binaries stop only past -n, and a
speculative step that overshoots does no extra work for the tokens past it). Counted otherwise, a
21-token answer gave llama.cpp's n-gram modes 5% over our plain decoding with nothing drafted.

Methods that learn across prompts (auto's controller, the suffix cache) keep one decoder per
method, repeat and batch size for the whole run, so each method only ever sees its own earlier
runs, and never the same prompt in an earlier repeat or at another batch size (that would be the
exact-repeat workload: with the suffix cache, a second repeat would copy the first). `passes` > 1 asks
the whole suite again in the same process (the exact-repeat workload): pass p's prompts are
reported as "<category> (pass p)", each against plain decoding of the same pass.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from ..errors import SpecdecError
from .suite import CATEGORIES, prompt_text

if TYPE_CHECKING:
    from ..spec import DraftSpec

DEFAULT_METHODS = ("plain", "auto", "draft:2", "draft:4", "ngram:8", "ngram:16")
LLAMA_CPP_METHODS = ("llama.cpp:plain", "llama.cpp:draft:4", "llama.cpp:ngram-simple:8", "llama.cpp:ngram-mod:8")
FULL_METHODS = ("plain", "auto", *(f"draft:{k}" for k in range(1, 9)), "ngram:2", "ngram:4", "ngram:8", "ngram:16")
HF_METHODS = ("hf:plain", "hf:assisted:4", "hf:prompt-lookup:8")


@dataclass
class Row:
    prompt_id: str
    category: str
    method: str
    repeat: int
    tokens: int
    seconds: float
    tokens_per_second: float
    drafted: int = 0
    accepted: int = 0
    acceptance_rate: float = 0.0
    mean_accepted_length: float = 0.0
    identical_to_plain: bool | None = None  # text_match is "identical" or "prefix"
    text_match: str | None = None  # against plain's text: identical / prefix / differs
    acceptance_by_position: list[float] = field(default_factory=list)
    drafted_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    batch: int = 1  # prompts run together; tokens and tokens/s summed over them
    text: str = ""
    token_ids: list[int] = field(default_factory=list)  # our runs: the generated tokens
    # a greedy run of ours whose text differs from plain's: the first token where they part, and
    # the target's top-2 logit gap there (single-token scoring of plain's context): a rounding tie
    # below compare.ROUNDING_GAP, a verification bug above it (mark_partings)
    first_difference: int | None = None
    logit_gap: float | None = None


def compare_text(text: str, plain: str) -> str:
    """'identical' (the same text, surrounding whitespace aside), 'prefix' (one is the start of the
    other: the same tokens, one run went on longer) or 'differs' (the runs parted somewhere)."""
    a, b = text.strip(), plain.strip()
    if a == b:
        return "identical"
    if a.startswith(b) or b.startswith(a):
        return "prefix"
    return "differs"


def parse_method(method: str) -> tuple[str, DraftSpec | str, int]:
    """One of our methods (spec.METHODS) -> ('specdec', its DraftSpec, k); a peer's,
    'llama.cpp:plain' | 'llama.cpp:draft:K' | 'llama.cpp:<ngram type>:K' | 'hf:plain' |
    'hf:assisted:K' | 'hf:prompt-lookup:K' -> (runner, the peer's drafter, k)."""
    from ..spec import METHODS
    from ..spec import parse_method as parse_ours

    runner, _, rest = method.partition(":")
    if runner not in ("llama.cpp", "hf"):
        spec = parse_ours(method)
        if spec is not None:
            return "specdec", spec, spec.k
    else:
        drafter, _, k = rest.rpartition(":")
        if rest == "plain":
            return runner, "plain", 0
        if (
            k.isdigit()
            and int(k) >= 1
            and (
                (runner == "llama.cpp" and (drafter == "draft" or drafter.startswith("ngram")))
                or (runner == "hf" and drafter in ("assisted", "prompt-lookup"))
            )
        ):
            return runner, drafter, int(k)
    raise SpecdecError(
        f"unknown method {method!r}: use {METHODS}, llama.cpp:plain, "
        f"llama.cpp:draft:K, llama.cpp:ngram-simple:K, hf:plain, hf:assisted:K, "
        f"hf:prompt-lookup:K"
    )


class Bench:
    def __init__(
        self,
        target_name: str,
        draft_name: str,
        threads: int | None,
        ctx: int,
        max_tokens: int,
        temperature: float = 0.0,
        seed: int | None = None,
        llama_cpp_bin: str | None = None,
        backend: str = "llama",
        device: str = "auto",
        dtype: str = "auto",
        max_rows: int = 1,
        suffix_cap: int | None = None,
        draft_corpus: str | None = None,
    ):
        from .. import load_model
        from ..catalog import resolve
        from ..drafters import model_drafter
        from ..models.llama_cpp import default_threads
        from ..spec import parse

        self.threads = threads or default_threads()
        self.ctx, self.max_tokens, self.temperature, self.seed = ctx, max_tokens, temperature, seed
        self.backend = backend
        self.target = load_model(
            target_name, backend=backend, n_ctx=ctx, threads=self.threads, device=device, dtype=dtype, max_rows=max_rows
        )
        spec = parse(draft_name)  # string:NAME / intersect:NAME: across tokenizers
        draft_name = spec.model
        self.draft_model = load_model(
            draft_name, backend=backend, n_ctx=ctx, threads=self.threads, device=device, dtype=dtype, max_rows=max_rows
        )
        self.drafter = model_drafter(self.draft_model, self.target, spec.vocab)
        # decoders that learn across prompts (auto, suffix:K), one per method, repeat and batch size
        self.learners: dict[tuple, object] = {}
        self.prompt_ids: dict[str, list[int]] = {}  # prompt id -> its tokens, as our runs fed them
        self.suffix_cap, self.draft_corpus = suffix_cap, draft_corpus
        # the GGUF files the peers run (a transformers folder, for --backend torch, has none)
        self.target_path, self.draft_path = (
            Path(n) if Path(n).is_dir() else resolve(n) for n in (target_name, draft_name)
        )
        self.llama_cpp = None
        if llama_cpp_bin:
            from ..peers import LlamaCppPeer

            self.llama_cpp = LlamaCppPeer(llama_cpp_bin, self.target_path, self.draft_path, self.threads, ctx)
        self.hf = None

    def enable_hf(self):
        from ..peers import HuggingFacePeer

        self.hf = HuggingFacePeer(self.target_path, self.draft_path, self.threads)

    def prompt_text(self, item: dict | str) -> str:
        """The chat-templated prompt (raw text for a base model), as every runner receives it. A
        suite item with `messages` (a multi-turn conversation ending on a user turn) is templated
        turn by turn; its `prompt` is then only a flat rendering for the base-model case."""
        return prompt_text(self.target, item)

    def _config(self):
        from ..engine import GenerationConfig

        return GenerationConfig(
            max_new_tokens=self.max_tokens, temperature=self.temperature, seed=self.seed, chat=False
        )

    def _decoder(self, spec: DraftSpec, repeat: int = 0, batch: int = 1):
        from ..engine import SpeculativeDecoder

        if spec.is_auto or spec.kind == "suffix":
            # decoders that learn across prompts: one per method, repeat and batch size
            key = (spec, repeat, batch)
            if key not in self.learners:
                suffix = self._suffix_cache() if spec.wants_suffix else False
                self.learners[key] = SpeculativeDecoder.from_spec(self.target, spec, draft=self.drafter, suffix=suffix)
            return self.learners[key]
        return SpeculativeDecoder.from_spec(self.target, spec, draft=self.drafter)

    def _suffix_cache(self):
        """A fresh suffix cache (each method its own), with the corpus if one was given; None for
        `auto` when --suffix-cap 0 turns it off."""
        from ..drafters import new_suffix_cache

        if self.suffix_cap == 0:
            return False
        cache = new_suffix_cache(self.target, self.suffix_cap)
        if self.draft_corpus:
            cache.load_corpus(self.draft_corpus, self.target.tokenizer)
        return cache

    def run_batch(self, items: list[dict], method: str, repeat: int) -> Row:
        """One of our methods on a batch of prompts (generate_batch): tokens and tokens/s summed
        over the rows, time from the end of the prefill to the last row's last token."""
        runner, spec, _ = parse_method(method)
        if runner != "specdec":
            raise SpecdecError(f"{method}: batches run our methods only")
        texts = [self.prompt_text(i) for i in items]
        results = self._decoder(spec, repeat, len(items)).generate_batch(texts, self._config())
        categories = {i["category"] for i in items}
        row = Row(
            "+".join(i["id"] for i in items),
            categories.pop() if len(categories) == 1 else "mixed",
            method,
            repeat,
            0,
            0.0,
            0.0,
            batch=len(items),
        )
        row.tokens = sum(
            produced(r.stats.generated_tokens, r.stats.finish_reason == "eog", self.max_tokens) for r in results
        )
        row.seconds = max(r.stats.decode_seconds for r in results)
        row.tokens_per_second = row.tokens / row.seconds if row.seconds > 0 else 0.0
        row.drafted = sum(r.stats.drafted for r in results)
        row.accepted = sum(r.stats.accepted for r in results)
        row.acceptance_rate = row.accepted / row.drafted if row.drafted else 0.0
        steps = sum(r.stats.steps for r in results)
        row.mean_accepted_length = row.tokens / steps if steps else 0.0
        row.text = "\n\x00\n".join(r.text for r in results)
        return row

    def run(self, item: dict, method: str, repeat: int) -> Row:
        runner, drafter, k = parse_method(method)
        text = self.prompt_text(item)
        row = Row(item["id"], item["category"], method, repeat, 0, 0.0, 0.0)
        if runner == "specdec":
            result = self._decoder(drafter, repeat).generate(text, self._config())
            s = result.stats
            row.tokens = produced(s.generated_tokens, s.finish_reason == "eog", self.max_tokens)
            row.seconds = s.decode_seconds
            row.drafted, row.accepted = s.drafted, s.accepted
            row.acceptance_rate, row.mean_accepted_length = s.acceptance_rate, s.mean_accepted_length
            row.acceptance_by_position = s.acceptance_by_position
            row.drafted_at, row.accepted_at = s.drafted_at, s.accepted_at
            row.text, row.token_ids = result.text, list(result.tokens)
            self.prompt_ids[item["id"]] = list(result.prompt_tokens)
        elif runner == "llama.cpp":
            if self.llama_cpp is None:
                raise SpecdecError("llama.cpp methods need --llama-cpp-bin DIR (see `make llama-tools`)")
            spec_type = {"plain": "none", "draft": "draft-simple"}.get(drafter, drafter)
            peer = self.llama_cpp.run(text, self.max_tokens, spec_type, k)
            row.tokens, row.seconds = produced(peer.tokens, False, self.max_tokens), peer.seconds
            row.drafted, row.accepted, row.text = peer.drafted, peer.accepted, peer.text
            row.acceptance_rate = peer.accepted / peer.drafted if peer.drafted else 0.0
        else:
            if self.hf is None:
                raise SpecdecError("hf methods need --hf")
            peer = self.hf.run(text, self.max_tokens, drafter, k)
            row.tokens, row.seconds, row.text = peer.tokens, peer.seconds, peer.text
        row.tokens_per_second = row.tokens / row.seconds if row.seconds > 0 else 0.0
        return row


def produced(tokens: int, ended_on_eog: bool, max_tokens: int) -> int:
    """The tokens a run is credited with (module docstring): `tokens` written, plus the
    end-of-generation token when the runner does not count it itself, at most max_tokens + 1."""
    return min(tokens + ended_on_eog, max_tokens + 1)


def _progress(done: int, total: int, started: float, label: str) -> None:
    elapsed = time.perf_counter() - started
    eta = elapsed / done * (total - done) if done else 0.0
    bar = "#" * int(30 * done / total)
    sys.stderr.write(
        f"\r[{bar:<30}] {done}/{total} elapsed {elapsed / 60:4.1f} min, ETA {eta / 60:4.1f} min  {label[:40]:<40}"
    )
    sys.stderr.flush()


def run_bench(
    bench: Bench,
    prompts: list[dict],
    methods: list[str],
    repeats: int,
    out: Path,
    batch_sizes: Sequence[int] = (1,),
    passes: int = 1,
) -> list[Row]:
    """Every (prompt, method, repeat), and for each batch size B > 1 every (B consecutive prompts,
    our method, repeat) as one batch; all of it `passes` times in this process."""
    out.mkdir(parents=True, exist_ok=True)
    prompts = [
        item if p == 1 else {**item, "id": f"{item['id']}#{p}", "category": f"{item['category']} (pass {p})"}
        for p in range(1, passes + 1)
        for item in prompts
    ]
    if "plain" not in methods:
        methods = ["plain", *methods]  # every speedup is measured against it
    ours = [m for m in methods if parse_method(m)[0] == "specdec"]
    units = [([item], methods) for item in prompts] if 1 in batch_sizes else []
    for size in sorted(b for b in set(batch_sizes) if b > 1):
        if size > len(prompts):
            raise SpecdecError(f"batch size {size} needs at least {size} prompts; {len(prompts)} selected")
        # whole batches only (a short last one would be another batch size)
        units += [(prompts[i : i + size], ours) for i in range(0, len(prompts) - size + 1, size)]
    rows: list[Row] = []
    total, started = sum(len(m) for _, m in units) * repeats, time.perf_counter()
    # Warm-up: every weight page of both models touched before any timing.
    bench.run(prompts[0], "draft:4", repeat=-1)
    with open(out / "results.jsonl", "w", encoding="utf-8") as results:
        for i, (items, unit_methods) in enumerate(units):
            for repeat in range(repeats):
                shift = (i * repeats + repeat) % len(unit_methods)
                order = unit_methods[shift:] + unit_methods[:shift]  # alternate methods per prompt
                runs = {}
                for method in order:
                    label = items[0]["id"] if len(items) == 1 else f"batch of {len(items)}"
                    _progress(len(rows), total, started, f"{label} {method}")
                    runs[method] = (
                        bench.run(items[0], method, repeat)
                        if len(items) == 1
                        else bench.run_batch(items, method, repeat)
                    )
                    rows.append(runs[method])
                for method in order:
                    run = runs[method]
                    # every run's text against our plain run's, the peers' too (their prompt echo is
                    # cut off in peers.py; a peer that detokenises differently shows up as 'differs')
                    run.text_match = compare_text(run.text, runs["plain"].text)
                    run.identical_to_plain = run.text_match != "differs"
                    results.write(json.dumps(asdict(run)) + "\n")
                results.flush()
    _progress(total, total, started, "done")
    sys.stderr.write("\n")
    return rows


def mark_partings(bench: Bench, rows: list[Row], out: Path) -> list[Row]:
    """Every greedy run of ours whose text parted from plain's (text_match "differs") gets the first
    token where the two parted and the target's top-2 logit gap there, scored one token at a time
    on plain's context (as `specdec compare` does); results.jsonl is rewritten with them. Done after
    every timed run, so the scoring never sits between two timings. The rows that parted."""
    from ..compare import first_difference, top2_gap

    plain = {(r.prompt_id, r.repeat): r for r in rows if r.method == "plain" and r.batch == 1}
    gaps: dict[tuple, float] = {}
    parted = []
    for r in rows:
        base = plain.get((r.prompt_id, r.repeat))
        if r.batch != 1 or r.text_match != "differs" or not r.token_ids or base is None or not base.token_ids:
            continue
        a = base.token_ids
        i = first_difference(a, r.token_ids)
        key = (r.prompt_id, tuple(a[:i]))
        if key not in gaps:
            gaps[key] = top2_gap(bench.target, bench.prompt_ids[r.prompt_id] + a[:i])
        r.first_difference, r.logit_gap = i, gaps[key]
        parted.append(r)
    tmp = out / "results.jsonl.tmp"
    tmp.write_text("".join(json.dumps(asdict(r)) + "\n" for r in rows), encoding="utf-8")
    tmp.replace(out / "results.jsonl")
    return parted


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
    methods = [m for m in dict.fromkeys(["plain", *methods]) if any(r.method == m for r in rows)]
    lines = [
        "# specdec bench",
        "",
        f"- date: {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- machine: {machine_line(bench.threads)}",
        f"- versions: {versions()}",
        f"- target {bench.target.name}, draft {bench.draft_model.name}, backend {bench.backend}"
        f"{_device_note(bench.target)}, max {bench.max_tokens} tokens, "
        f"{'greedy' if bench.temperature == 0 else f'temperature {bench.temperature}, seed {bench.seed}'}",
        f"- command: `{command}`",
        "",
    ]
    singles = [r for r in rows if r.batch == 1]
    if singles:
        lines += _category_tables(singles, methods)
    batched = [r for r in rows if r.batch > 1]
    if batched:
        lines += _batch_table(rows, methods)
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text, encoding="utf-8")
    return text


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
    """Each greedy run of ours that parted from plain's text: where, and the target's top-2 logit
    gap there (mark_partings): below compare.ROUNDING_GAP a rounding tie, above it a bug."""
    from ..compare import ROUNDING_GAP

    parted = [r for r in rows if r.logit_gap is not None]
    if not parted:
        return []
    ties = sum(r.logit_gap < ROUNDING_GAP for r in parted)
    lines = [
        f"Partings: {len(parted)} greedy runs of ours parted from plain's text; {ties} at a rounding "
        f"tie (top-2 logit gap below {ROUNDING_GAP}: llama.cpp's kernels are not batch-invariant), "
        f"{len(parted) - ties} above it (a verification bug: please report it).",
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
    for i, m in enumerate(shown):
        vals = [statistics.median(ups.get((c, m), [0])) for c in categories]
        ax.bar(x + (i - (len(shown) - 1) / 2) * width, vals, width, label=m)
    ax.axhline(1.0, color="black", linewidth=1, linestyle="--")
    ax.set_xticks(x, categories)
    ax.set_ylabel("median speedup over plain decoding")
    ax.set_title("Speedup by category and method (same prompts, same machine)")
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
