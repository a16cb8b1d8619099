"""The runners of `specdec bench` (the package docstring says how it measures): our methods
through the engine and the peers through peers.py, one Row per run; run_bench's warm-up, the
interleaved order, the repeats and the timing; mark_partings' scoring where a greedy run parted."""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from ..errors import SpecdecError
from .methods import NOISE_METHOD, parse_method
from .suite import prompt_text

if TYPE_CHECKING:
    from ..spec import DraftSpec


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
    token_ids: list[int] = field(default_factory=list)  # the generated tokens (our runs, vLLM's)
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


def match_of(run: Row, base: Row) -> str:
    """run's text against base's (compare_text), where a "prefix" whose shorter run ended at an
    end-of-generation token (its credited tokens count it; its token_ids do not) before the longer
    one's tokens ended is "differs": the two runs parted there, one writing that token and the
    other another (a greedy parting at a rounding tie, or a bug), which mark_partings then scores.
    A run that went on past the other's token budget (llama-speculative-simple keeps whole drafts
    past -n) is still a prefix."""
    match = compare_text(run.text, base.text)
    if match == "prefix" and run.token_ids and base.token_ids:
        short, long = sorted((run, base), key=lambda r: len(r.token_ids))
        n = len(short.token_ids)
        if n < len(long.token_ids) and short.tokens > n and long.token_ids[:n] == short.token_ids:
            return "differs"
    return match


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
        exact: bool = False,
        reproducible: bool = False,
        verification: str = "block",
        cache: str = "dynamic",
        graphs: bool = False,
    ):
        from .. import load_model
        from ..catalog import resolve
        from ..drafters import model_drafter
        from ..models.llama_cpp import default_threads
        from ..spec import parse

        self.threads = threads or default_threads()
        self.ctx, self.max_tokens, self.temperature, self.seed = ctx, max_tokens, temperature, seed
        self.reproducible = reproducible  # GenerationConfig.reproducible: sampling by position
        self.verification = verification  # GenerationConfig.verification: block or token
        self.backend = backend
        options = dict(
            backend=backend, n_ctx=ctx, threads=self.threads, device=device, dtype=dtype, max_rows=max_rows, exact=exact
        )
        if backend == "torch":  # (the KV cache layout and CUDA graphs are torch's)
            options.update(cache=cache, graphs=graphs)
        self.target = load_model(target_name, **options)
        spec = parse(draft_name)  # string:NAME / intersect:NAME: across tokenizers
        draft_name = spec.model
        self.draft_model = load_model(draft_name, **options)
        self.drafter = model_drafter(self.draft_model, self.target, spec.vocab)
        # decoders that learn across prompts (auto, suffix:K), one per method, repeat and batch size
        self.learners: dict[tuple, object] = {}
        self.batch_curve = None  # the target's cost table for batches (_decoder), timed or read once
        self.costs: tuple | None = None  # auto's cost curves (controller.auto_controller's; None: timed)
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
        self.vllm: dict[tuple, object] = {}  # (method, repeat) -> its open engine (peers.VllmPeer)
        self.target_name, self.draft_name = target_name, draft_name

    def close(self) -> None:
        """Ends the peers' processes (vLLM's engines)."""
        for peer in self.vllm.values():
            peer.close()
        self.vllm = {}

    def _vllm_peer(self, method: str, kind: str, repeat: int):
        """The method's engine, opened at first use and kept. A method that learns across prompts
        (a suffix cache) gets one engine per repeat, as our learners get one decoder per repeat
        (the package docstring): each engine holds its own weights, so mind the memory."""
        from ..peers import VllmPeer
        from ..vllm_peer import VLLM_LEARNING_KINDS

        key = (method, repeat if kind in VLLM_LEARNING_KINDS else 0)
        if key not in self.vllm:
            draft = self.draft_name if kind == "draft" else None
            self.vllm[key] = VllmPeer(self.target_name, method.removeprefix("vllm:"), self.threads, self.ctx, draft)
        return self.vllm[key]

    def vllm_gap(self, prompt_id: str, context: list[int]) -> float:
        """vLLM's own top-2 logprob gap (the logit gap) for the token after the prompt and `context`,
        from the open vllm:plain engine: where a vLLM method parted from vLLM's plain text."""
        peer = self.vllm[("vllm:plain", 0)]
        peer.run(self.prompt_ids[prompt_id] + context, 1, logprobs=2)
        best = sorted(peer.last["logprobs"][0].values(), reverse=True)
        return best[0] - best[1]

    def enable_hf(self):
        from ..peers import HuggingFacePeer

        self.hf = HuggingFacePeer(self.target_path, self.draft_path, self.threads)

    def prompt_text(self, item: dict | str) -> str:
        """The chat-templated prompt (raw text for a base model), as every runner receives it. A
        suite item with `messages` (a multi-turn conversation ending on a user turn) is templated
        turn by turn; its `prompt` is then only a flat rendering for the base-model case."""
        return prompt_text(self.target, item)

    def _config(self, item: dict | None = None):
        """The run's config; a suite item's `response_format` (a structured suite's schema)
        constrains its output, for every method alike."""
        from ..engine import GenerationConfig

        return GenerationConfig(
            response_format=(item or {}).get("response_format"),
            max_new_tokens=self.max_tokens,
            temperature=self.temperature,
            seed=self.seed,
            chat=False,
            reproducible=self.reproducible,
            verification=self.verification,
        )

    def _decoder(self, spec: DraftSpec, repeat: int = 0, batch: int = 1):
        from ..costs import measure_cost_table
        from ..decoder import SpeculativeDecoder

        def costs():
            """A batch steps by the target's cost curve whatever the method, as a server's rows do
            (its forwards split where that is cheaper: costs.split_forward); auto has its curves
            anyway. Timed (or read from the cache) once a run; each new decoder a copy of its own,
            since a table learns its decoder's drift."""
            if spec.is_auto:
                return self.costs
            if batch <= 1:
                return None
            if self.batch_curve is None:
                self.batch_curve = measure_cost_table(self.target)
            return (copy.deepcopy(self.batch_curve), None)

        if spec.is_auto or spec.kind == "suffix":
            # decoders that learn across prompts: one per method, repeat and batch size
            key = (spec, repeat, batch)
            if key not in self.learners:
                suffix = self._suffix_cache() if spec.wants_suffix else False
                self.learners[key] = SpeculativeDecoder.from_spec(
                    self.target, spec, draft=self.drafter, suffix=suffix, costs=costs()
                )
            return self.learners[key]
        return SpeculativeDecoder.from_spec(self.target, spec, draft=self.drafter, costs=costs())

    def _suffix_cache(self):
        """A fresh suffix cache (each method its own), with the corpus if one was given; False for
        `auto` when --suffix-cap 0 turns it off."""
        from ..build import suffix_cache

        return suffix_cache(self.target, self.suffix_cap, self.draft_corpus)

    def run_batch(self, items: list[dict], method: str, repeat: int) -> Row:
        """One of our methods on a batch of prompts (generate_batch): tokens and tokens/s summed
        over the rows, time from the end of the prefill to the last row's last token."""
        runner, spec, _ = parse_method(method)
        if runner != "specdec":
            raise SpecdecError(f"{method}: batches run our methods only")
        if any(i.get("response_format") for i in items):
            raise SpecdecError("a suite whose prompts carry schemas runs one prompt at a time (no --batch)")
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
            result = self._decoder(drafter, repeat).generate(text, self._config(item))
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
            schema = (item.get("response_format") or {}).get("json_schema", {}).get("schema")
            constrained = {"json_schema": schema} if schema is not None else {}
            peer = self.llama_cpp.run(text, self.max_tokens, spec_type, k, **constrained)
            row.tokens, row.seconds = produced(peer.tokens, False, self.max_tokens), peer.seconds
            row.drafted, row.accepted, row.text = peer.drafted, peer.accepted, peer.text
            row.acceptance_rate = peer.accepted / peer.drafted if peer.drafted else 0.0
        elif runner == "vllm":
            from ..request import tokens

            # the same token ids our runs decode (the suite's chat template through our tokenizer)
            ids = self.prompt_ids.get(item["id"]) or tokens(self.target, text)
            peer = self._vllm_peer(method, drafter, repeat).run(ids, self.max_tokens, self.temperature, self.seed)
            row.tokens, row.seconds, row.text = produced(peer.tokens, False, self.max_tokens), peer.seconds, peer.text
            row.drafted, row.accepted, row.token_ids = peer.drafted, peer.accepted, list(peer.token_ids or [])
            row.acceptance_rate = peer.accepted / peer.drafted if peer.drafted else 0.0
        else:
            if self.hf is None:
                raise SpecdecError("hf methods need --hf")
            peer = self.hf.run(text, self.max_tokens, drafter, k)
            row.tokens, row.seconds, row.text = peer.tokens, peer.seconds, peer.text
        row.tokens_per_second = row.tokens / row.seconds if row.seconds > 0 else 0.0
        return row


def produced(tokens: int, ended_on_eog: bool, max_tokens: int) -> int:
    """The tokens a run is credited with (the package docstring): `tokens` written, plus the
    end-of-generation token when the runner does not count it itself, at most max_tokens + 1."""
    return min(tokens + ended_on_eog, max_tokens + 1)


def run_bench(
    bench: Bench,
    prompts: list[dict],
    methods: list[str],
    repeats: int,
    out: Path,
    batch_sizes: Sequence[int] = (1,),
    passes: int = 1,
    noise: bool = False,
) -> list[Row]:
    """Every (prompt, method, repeat), and for each batch size B > 1 every (B consecutive prompts,
    our method, repeat) as one batch; all of it `passes` times in this process. With `noise`, each
    prompt's plain decoding runs a second time (NOISE_METHOD), interleaved like a method."""
    out.mkdir(parents=True, exist_ok=True)
    prompts = [
        item if p == 1 else {**item, "id": f"{item['id']}#{p}", "category": f"{item['category']} (pass {p})"}
        for p in range(1, passes + 1)
        for item in prompts
    ]
    if "plain" not in methods:
        methods = ["plain", *methods]  # every speedup is measured against it
    ours = [m for m in methods if parse_method(m)[0] == "specdec"]
    singles = [*methods, NOISE_METHOD] if noise and NOISE_METHOD not in methods else methods
    units = [([item], singles) for item in prompts] if 1 in batch_sizes else []
    for size in sorted(b for b in set(batch_sizes) if b > 1):
        if size > len(prompts):
            raise SpecdecError(f"batch size {size} needs at least {size} prompts; {len(prompts)} selected")
        # whole batches only (a short last one would be another batch size)
        units += [(prompts[i : i + size], ours) for i in range(0, len(prompts) - size + 1, size)]
    rows: list[Row] = []
    from ..progress import Progress

    bar = Progress("bench", sum(len(m) for _, m in units) * repeats, "run")
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
                    bar.update(len(rows), f"{label} {method}"[:40], force=True)
                    runs[method] = (
                        bench.run(items[0], method, repeat)
                        if len(items) == 1
                        else bench.run_batch(items, method, repeat)
                    )
                    rows.append(runs[method])
                for method in order:
                    run = runs[method]
                    # every run's text against our plain run's, the peers' too (their prompt echo is
                    # cut off in peers.py; a peer that detokenises differently shows up as 'differs');
                    # vLLM's drafters against vLLM's plain where it ran (its bf16 weights are not our GGUF's)
                    base = runs.get("vllm:plain") if method.startswith("vllm:") and method != "vllm:plain" else None
                    run.text_match = match_of(run, base or runs["plain"])
                    run.identical_to_plain = run.text_match != "differs"
                    results.write(json.dumps(asdict(run)) + "\n")
                results.flush()
    bar.update(len(rows), "done")
    bar.close()
    return rows


def mark_partings(bench: Bench, rows: list[Row], out: Path) -> list[Row]:
    """Every greedy run whose text parted from its plain run's (text_match "differs") gets the first
    token where the two parted and the top-2 logit gap there; results.jsonl is rewritten with them.
    Ours are scored by our target one token at a time on plain's context (as `specdec compare`
    does); vLLM's methods (compared with vllm:plain) by vLLM's own logprobs on vllm:plain's context,
    while its engine is still open. Done after every timed run, so the scoring never sits between
    two timings. The rows that parted."""
    from ..compare import first_difference, top2_gap

    plain = {(r.method, r.prompt_id, r.repeat): r for r in rows if r.method in ("plain", "vllm:plain") and r.batch == 1}
    gaps: dict[tuple, float] = {}
    parted = []
    for r in rows:
        if r.method == "vllm:plain":  # other weights than our plain's (bfloat16): no tie to look for
            continue
        vllm = r.method.startswith("vllm:")
        base = plain.get(("vllm:plain" if vllm else "plain", r.prompt_id, r.repeat))
        if r.batch != 1 or r.text_match != "differs" or not r.token_ids or base is None or not base.token_ids:
            continue
        a = base.token_ids
        i = first_difference(a, r.token_ids)
        key = (vllm, r.prompt_id, tuple(a[:i]))
        if key not in gaps:
            if vllm:
                gaps[key] = bench.vllm_gap(r.prompt_id, a[:i])
            else:
                gaps[key] = top2_gap(bench.target, bench.prompt_ids[r.prompt_id] + a[:i])
        r.first_difference, r.logit_gap = i, gaps[key]
        parted.append(r)
    tmp = out / "results.jsonl.tmp"
    tmp.write_text("".join(json.dumps(asdict(r)) + "\n" for r in rows), encoding="utf-8")
    tmp.replace(out / "results.jsonl")
    return parted
