"""`specdec generate` (one prompt streamed, or a batch of them), `specdec compare` (plain against
speculative decoding on the same models) and `specdec demo` (two comparisons), and what they print."""

from __future__ import annotations

import json
import sys

from .. import catalog
from ..config import MAX_LOGPROBS
from ..drafters.suffix import DEFAULT_CAP as SUFFIX_CAP
from .flags import _add_costs_flag, _add_request_flags, _add_threads_flag
from .loading import _decoder, _save_suffix
from .options import _int_in, _positive
from .prompt import _batch_prompts, _config, _read_prompt

DEFAULT_PROMPT = (
    "Write a Python function `merge_intervals(intervals)` that merges overlapping "
    "intervals, with a docstring and a short example."
)


def _add_generate_parsers(sub) -> None:
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
    p.add_argument(
        "--logprobs",
        type=_int_in(0, MAX_LOGPROBS),
        default=None,
        metavar="N",
        help=f"each generated token's log-probability under the target (its raw logits, before "
        f"temperature and the filters; masked by --json-schema or --grammar where given) and the N "
        f"most likely tokens at its position, 0..{MAX_LOGPROBS}: "
        f"a table on stderr after the text, a line a token (stdout keeps the text alone), or "
        f'"logprobs" in --json (default: off)',
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
    p.set_defaults(logprobs=None)  # generate's alone; one shape of args for _config

    p = sub.add_parser(
        "demo",
        help="two short comparisons: where --draft auto pays and where it steps aside",
        description="Load the default models once and compare plain decoding with "
        "--draft auto on two requests: a code edit, whose answer copies "
        "most of the prompt (auto drafts by prompt lookup), and open "
        "generation (auto steps aside). Each ends with the reason auto "
        "gives: its predicted gain and the costs it measured (or was given: --costs).",
    )
    _add_threads_flag(p)
    _add_costs_flag(p, "auto")
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
        cache="dynamic",
        graphs=False,
        ctx=4096,
        exact=False,
        # auto with an empty suffix cache of the default size, as generate has by default
        suffix_cap=SUFFIX_CAP,
        draft_corpus=None,
        suffix_cache=None,
    )


def cmd_generate_batch(args) -> int:
    import time

    prompts = _batch_prompts(args)
    config = _config(args)
    decoder = _decoder(args)
    B = args.batch_size
    started, results = time.perf_counter(), []
    # every prompt joins the engine's queue; B rows run at once and a waiting prompt takes the row
    # of one that finishes (continuous batching). Results print in order, each as soon as it can.
    engine = decoder.engine
    requests = decoder.add_batch(prompts, config)
    tokenizer = decoder.target.tokenizer
    for i, request in enumerate(requests):
        engine.run([request])
        result = request.result
        results.append(result)
        if args.json:
            print(json.dumps({"index": i, **_result_json(result, tokenizer, decoder)}, ensure_ascii=False), flush=True)
        else:
            print(f"--- {i} ---\n{result.text}", flush=True)
            if result.logprobs is not None:
                print("\n".join(_logprob_lines(result.logprobs, tokenizer, args.logprobs, f" of {i}")), file=sys.stderr)
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
        out = _result_json(stream.result, target.tokenizer, decoder)
        out.update(target=target.name, draft=_drafter_name(decoder), k=None if decoder.auto else decoder.k)
        print(json.dumps(out, ensure_ascii=False))
    else:
        for piece in stream:
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        sys.stdout.flush()
        if stream.result.logprobs is not None:
            print("\n".join(_logprob_lines(stream.result.logprobs, target.tokenizer, args.logprobs)), file=sys.stderr)
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
        for run in ("plain", "speculative") if decoder.notes else ():  # CompareResult.to_dict's runs
            out[run]["stats"]["notes"] = list(decoder.notes)
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


def cmd_demo(args) -> int:
    from ..demo import run_demo

    return run_demo(_decoder(args), stats=args.stats)


def _result_json(result, tokenizer, decoder=None) -> dict:
    """GenerationResult.to_dict, its log-probabilities (when asked for) as the server's chat
    logprobs show them (server.protocol.logprobs_body: token, logprob, bytes, top_logprobs; -inf
    floored as OpenAI does, so the JSON stays JSON), with each token's id beside; the decoder's
    notes (how the run was built: trees off under --exact) in its stats."""
    from ..server.protocol import logprobs_body

    out = result.to_dict()
    if decoder is not None and decoder.notes:
        out["stats"]["notes"] = list(decoder.notes)
    if result.logprobs is not None:
        content = logprobs_body("chat", result.logprobs, tokenizer.token_bytes)["content"]
        for entry, e in zip(content, result.logprobs):
            entry["id"] = e.token
            for top, (token, _) in zip(entry["top_logprobs"], e.top):
                top["id"] = token
        out["logprobs"] = content
    return out


def _logprob_lines(entries, tokenizer, top: int, of: str = "") -> list[str]:
    """The --logprobs table: a line per generated token, its text, its log-probability and the
    `top` most likely tokens there with theirs. A text is shown quoted (spaces and newlines
    visible); a token that prints nothing by its vocabulary name (<|im_end|>), one that holds part
    of a character by its bytes (b'\\xe2')."""

    def shown(token: int) -> str:
        data = tokenizer.token_bytes(token)
        if not data:
            return tokenizer.token_text(token)
        try:
            return json.dumps(data.decode("utf-8"), ensure_ascii=False)
        except UnicodeDecodeError:
            return repr(data)

    width = max([len("token")] + [len(shown(e.token)) for e in entries])
    lines = [
        f"--- logprobs{of}: the target's log-probability of each token"
        + (f", and the {top} most likely there" if top else "")
        + " ---",
        f"{'#':>4}  {'token':<{width}}  {'logprob':>9}" + ("  top" if top else ""),
    ]
    for i, e in enumerate(entries):
        best = "  ".join(f"{shown(t)} {lp:.4f}" for t, lp in e.top)
        lines.append(f"{i:>4}  {shown(e.token):<{width}}  {e.logprob:>9.4f}" + (f"  {best}" if best else ""))
    return lines


def _drafter_name(decoder) -> str:
    if decoder.auto:
        model = decoder.model_drafter  # a draft model's drafter, or a head
        name = getattr(getattr(model, "model", None), "name", None) or getattr(model, "name", "")
        return "auto (ngram" + (f" + {name})" if model is not None else ")")
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
