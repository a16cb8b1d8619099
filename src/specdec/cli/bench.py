"""`specdec bench`: every (prompt, method) pair of a prompt suite, against the peers, with a summary
and plots (the work is specdec.bench's)."""

from __future__ import annotations

import sys

from .. import catalog
from ..errors import SpecdecError
from ..sampling import VERIFICATION_RULES
from .flags import CTX_HELP, _add_costs_flag, _add_model_flags, _add_suffix_flags
from .loading import _check_device, _check_draft_corpus, _read_costs, _report_costs
from .options import SEED, TEMPERATURE_HELP, _float_in, _positive


def _add_bench_parser(sub) -> None:
    from ..bench.methods import DEFAULT_METHODS

    p = sub.add_parser(
        "bench",
        help="benchmark methods and peers on a prompt suite",
        description="Run every (prompt, method) pair of a prompt suite with repeats, "
        "alternating methods, and write results.jsonl (every run, its text "
        "included, and whether it matches plain's; for a greedy run that "
        "parted from plain's text, where, and the target's top-2 logit gap "
        "there), summary.md (median speedups over all pairs and over pairs "
        "whose texts agree, token counts, every parting and whether it is a "
        "rounding tie), speedup.png and acceptance.png to --out. By default: two "
        "prompts per category and the informative methods; --full runs everything.",
    )
    p.add_argument(
        "--suite",
        default=None,
        help="prompt suite (JSONL: id, category, prompt, and "
        "messages for a multi-turn chat; default: "
        "benchmarks/prompts.jsonl; the outside suite: "
        "benchmarks/dev-prompts.jsonl)",
    )
    p.add_argument("--categories", nargs="+", default=None, help="only these categories (default: all)")
    p.add_argument(
        "--methods",
        nargs="+",
        default=None,
        help="plain, auto, auto:suffix, auto:nosuffix (auto with or without the suffix cache), "
        "draft:K, draft:KxW[/N] (a draft model's tree), ngram:K, ngram:KxW (prompt lookup's tree), "
        "suffix:K, suffix:KxW[/N] (the suffix "
        "cache's tree), early-exit:L:K, early-exit:L:KxW[/N] (its tree; --backend numpy or torch), "
        "head:K:FILE (a trained head), head:KxW[/N]:FILE "
        "(a head's tree), "
        "auto:head:FILE (auto with that head in the draft model's place), "
        "llama.cpp:plain, llama.cpp:draft:K, "
        "llama.cpp:ngram-simple:K (or another llama.cpp n-gram type), hf:plain, "
        "hf:assisted:K, hf:prompt-lookup:K, vllm:plain, vllm:ngram:K, vllm:draft:K, vllm:suffix:K, "
        "vllm:specdec:auto:K, vllm:specdec:ngram:K, vllm:specdec:suffix:K (vLLM, and our drafters inside it: "
        "`make vllm-peer`) (default: the informative ones, " + " ".join(DEFAULT_METHODS) + "; --full: all of ours)",
    )
    p.add_argument("--max-tokens", "-n", type=_positive(int), default=256, help="per run")
    p.add_argument(
        "--repeats",
        type=_positive(int),
        default=1,
        help="runs per (prompt, method); a prompt's speedup is the median over them",
    )
    p.add_argument(
        "--passes",
        type=_positive(int),
        default=1,
        metavar="P",
        help="ask the whole suite P times in this process; what learns across prompts (auto, "
        "suffix:K: one decoder and suffix cache per method) keeps what it saw, so pass 2 "
        "is the exact-repeat workload; pass p reports as '<category> (pass p)' (default: 1)",
    )
    p.add_argument(
        "--no-noise",
        action="store_true",
        help="skip the second plain run of every prompt (plain#2, interleaved with the methods), whose "
        "speedup over plain is the bench's own noise, reported at the top of summary.md",
    )
    _add_suffix_flags(
        p.add_argument_group("suffix cache (auto, suffix:K)"), cache_file=False, off="auto goes without it"
    )
    _add_costs_flag(p, "the auto methods")
    p.add_argument(
        "--per-category", type=_positive(int), default=2, help="prompts per category (default: 2; --full: all)"
    )
    p.add_argument("--limit", type=_positive(int), default=None, help="at most this many prompts (default: no limit)")
    p.add_argument("--full", action="store_true", help="every prompt and every method")
    p.add_argument("--out", default="bench-out", help="output folder")
    p.add_argument(
        "--llama-cpp-bin",
        default=None,
        metavar="DIR",
        help="folder with llama.cpp's llama-speculative-simple: adds the llama.cpp peer (default: without it)",
    )
    p.add_argument("--hf", action="store_true", help="add the Hugging Face transformers peer")
    p.add_argument(
        "--vllm",
        action="store_true",
        help="add the vLLM peer (`make vllm-peer`): vLLM's plain, ngram and draft model, and our drafters inside it",
    )
    _add_model_flags(
        p,
        draft_default=catalog.DEFAULT_DRAFT,
        draft_help="the draft model for draft:K methods (one of another "
        "vocabulary drafts across tokenizers; string:NAME or intersect:NAME as for generate --draft)",
        backend_help="as for generate",
        ctx=(8192, CTX_HELP),
        after={
            "--dtype": lambda: p.add_argument(
                "--batch-sizes",
                type=_positive(int),
                nargs="+",
                default=[1],
                metavar="B",
                help="also run our methods on batches of B prompts and report tokens/s summed over the batch "
                "(default: 1)",
            )
        },
    )
    p.add_argument("--temperature", "-t", type=_float_in(0, float("inf"), False), default=0.0, help=TEMPERATURE_HELP)
    p.add_argument(
        "--seed",
        type=SEED,
        default=None,
        help="in 0..2**64-1; makes sampled runs repeatable (default: a fresh seed each run)",
    )
    p.add_argument(
        "--reproducible",
        action="store_true",
        help="sample by position, as generate --reproducible: with --seed every method's sampled text "
        "should be plain's (bit for bit with --exact), and the summary counts the runs that are",
    )
    p.add_argument(
        "--verification",
        choices=VERIFICATION_RULES,
        default="block",
        help="how our sampled runs verify a draft model's drafts: block, token (token by token) or "
        "traversal (a tree from its leaves up), as for generate (default: block)",
    )


def cmd_bench(args) -> int:
    from pathlib import Path

    from .. import bench

    methods = list(args.methods or (bench.FULL_METHODS if args.full else bench.DEFAULT_METHODS))
    if not args.methods:
        if args.llama_cpp_bin:
            methods += bench.LLAMA_CPP_METHODS
        if args.hf:
            methods += bench.HF_METHODS
        if args.vllm:
            methods += bench.VLLM_METHODS
    repeated = next((m for i, m in enumerate(methods) if m in methods[:i]), None)
    if repeated:  # (its rows would share one name, and its medians mix both runs)
        raise SpecdecError(
            f"--methods names {repeated} twice: each method runs once a prompt (plain's second run, "
            f"plain#2, is the bench's own noise measure unless --no-noise)"
        )
    parsed = [bench.parse_method(method) for method in methods]  # fail on a typo before loading anything
    if args.costs and not any(getattr(spec, "is_auto", False) for _, spec, _ in parsed):  # a peer's is a str
        raise SpecdecError("--costs is the auto methods' cost curves: give --methods with auto")
    for method in methods:
        if method.startswith(("suffix:", "auto:suffix")) and args.suffix_cap == 0:
            raise SpecdecError(f"method {method} needs the suffix cache: give --suffix-cap >= 1")
    _check_draft_corpus(args)
    _check_device(args)  # --device, --cache and --graphs before a load
    report = _read_costs(args)
    vllm = [m for m in methods if m.startswith("vllm:")]
    if vllm:
        from ..peers import check_vllm

        draft = args.draft if any(m.startswith("vllm:draft:") for m in vllm) else None
        check_vllm(args.target, draft, bench.vllm_engines(vllm, args.repeats))
    prompts = bench.load_suite(
        Path(args.suite) if args.suite else bench.DEFAULT_SUITE,
        args.categories,
        None if args.full else args.per_category,
        args.limit,
    )
    runner = bench.Bench(
        args.target,
        args.draft,
        args.threads,
        args.ctx,
        args.max_tokens,
        args.temperature,
        args.seed,
        args.llama_cpp_bin,
        args.backend,
        args.device,
        args.dtype,
        max_rows=max(args.batch_sizes),
        suffix_cap=args.suffix_cap,
        draft_corpus=args.draft_corpus,
        exact=args.exact,
        reproducible=args.reproducible,
        verification=args.verification,
        cache=args.cache,
        graphs=args.graphs,
    )
    if report is not None:
        runner.costs = _report_costs(args, report, runner.target, runner.drafter)
    if args.hf or any(m.startswith("hf:") for m in methods):
        runner.enable_hf()
    out = Path(args.out)
    print(
        f"{len(prompts)} prompts x {len(methods)} methods x {args.repeats} repeats"
        f"{f' x {args.passes} passes' if args.passes > 1 else ''} -> {out}/",
        file=sys.stderr,
    )
    try:
        rows = bench.run_bench(
            runner, prompts, methods, args.repeats, out, args.batch_sizes, args.passes, noise=not args.no_noise
        )
        if args.temperature == 0:  # every greedy parting from plain, with its top-2 logit gap
            bench.mark_partings(runner, rows, out)  # vLLM's partings are scored by its open plain engine
    finally:
        runner.close()  # the peers' engines (vLLM) end with the bench
    print(bench.write_summary(rows, runner, methods, out, "specdec bench " + " ".join(sys.argv[2:])))
    for path in bench.plot(rows, methods, out):
        print(f"wrote {path}")
    return 0
