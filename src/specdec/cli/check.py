"""`specdec check`: is this engine lossless? Our decoder in-process (the model flags), or any
OpenAI-compatible server (--url, against --plain-url); the tests live in specdec/check.py."""

from __future__ import annotations

import argparse
import json
import os
from types import SimpleNamespace

from ..errors import SpecdecError
from .flags import _add_costs_flag, _add_model_flags, _add_suffix_flags, _draft_model_help
from .options import SEED, _float_in, _int_in, _non_negative_int, _positive

MIN_SAMPLES = 100  # fewer samples than this give a test with no power worth stating


def _samples(text: str) -> int:
    value = _non_negative_int(text)
    if 0 < value < MIN_SAMPLES:
        raise argparse.ArgumentTypeError(
            f"{value} samples give a test with no power: give 0 (no sampled tests) or at least {MIN_SAMPLES}"
        )
    return value


def _add_check_parser(sub) -> None:
    from ..check import ALPHA, POWER, TWO_SAMPLE_FROM

    p = sub.add_parser(
        "check",
        help="is this engine lossless? greedy and sampled tests, for our decoder or any OpenAI-compatible URL",
        description="Check that speculative decoding is lossless, with evidence. Greedy: speculative "
        "against plain output on a prompt set, every parting located and classed by the target's top-2 "
        "gap there (a rounding tie or a bug; with --exact any parting is a bug). Sampled: seeded short "
        "continuations, every position tested against the target's own probabilities at its prefix, "
        "the last against plain sampling (chi-square), each test with its power: the "
        f"smallest total-variation shift it detects with probability {POWER:g}. Exit code 0: lossless "
        "within that power; 1: not; 2: bad input.",
    )
    g = p.add_argument_group("models (in-process: our decoder)")
    _add_model_flags(
        g,
        draft_model=(None, _draft_model_help()),
        draft_tokens=(1, "draft tokens per step with a fixed drafter (--draft ngram, a model); ignored under auto"),
        draft_backend_help="backend of the draft model (default: --backend)",
        after={"--draft-model": lambda: (_add_suffix_flags(g, cache_file=False), _add_costs_flag(g))},
    )
    g = p.add_argument_group("a server (instead of the models)")
    g.add_argument(
        "--url",
        help="an OpenAI-compatible server to check (specdec serve, llama-server, vLLM): "
        "http://HOST:PORT, with or without /v1 (--exact: the server runs in the exact mode, no tie allowance). "
        "With logprobs its first position is tested against "
        "its own reported probabilities; the rest needs --plain-url (default: check the models in-process)",
    )
    g.add_argument(
        "--plain-url",
        help="a plain (non-speculative) server of the same model: greedy equality and two-sample "
        "tests against it (default: none)",
    )
    g.add_argument("--model", help="the model name to request (default: the server's first in /v1/models)")
    g.add_argument("--api-key", help="bearer key for both servers (default: $SPECDEC_API_KEY, else none)")
    g = p.add_argument_group("the check")
    g.add_argument(
        "--prompts",
        metavar="FILE",
        help='a prompt per line (.jsonl: a "prompt" field per line) (default: 6 built-in prompts, code and prose)',
    )
    chat = g.add_mutually_exclusive_group()
    chat.add_argument("--chat", dest="chat", action="store_true", default=None, help="apply the chat template")
    chat.add_argument("--no-chat", dest="chat", action="store_false", help="send prompts as raw text (in-process)")
    g.add_argument(
        "--max-tokens", "-n", type=_non_negative_int, default=64, help="greedy tokens per prompt; 0: no greedy test"
    )
    g.add_argument(
        "--batch",
        "-b",
        type=_positive(int),
        default=1,
        metavar="B",
        help="speculative rows generated together (in-process); requests in flight at once (--url)",
    )
    g.add_argument(
        "--samples",
        type=_samples,
        default=1000,
        help=f"sampled continuations per prompt and setting, each side; 0: no sampled tests, else "
        f"at least {MIN_SAMPLES}",
    )
    g.add_argument(
        "--sample-tokens",
        type=_int_in(1, 64),
        default=4,
        metavar="L",
        help="tokens per sampled continuation: every position against the target, "
        f"position L-1 against plain sampling (when L > {TWO_SAMPLE_FROM})",
    )
    g.add_argument(
        "--sampled-prompts", type=_positive(int), default=1, metavar="K", help="the first K prompts are sampled"
    )
    g.add_argument(
        "--temperature",
        "-t",
        type=_float_in(0, float("inf"), True),
        default=None,
        help="sampling temperature (default: two settings, temperature 1 alone and with top-k 20, top-p 0.9)",
    )
    g.add_argument("--top-k", type=_non_negative_int, default=None, help="0 = off (default: see --temperature)")
    g.add_argument("--top-p", type=_float_in(0, 1, True), default=None, help="in (0, 1] (default: see --temperature)")
    g.add_argument("--seed", type=SEED, default=0, help="sample i is seeded seed + i")
    g.add_argument(
        "--alpha",
        type=_float_in(0, 0.5, True),
        default=ALPHA,
        help="the whole check's false-alarm rate, split evenly over its tests (Bonferroni)",
    )
    g.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    p.set_defaults(suffix_cache=None)


def _settings(args):
    from ..sampling import SamplingParams

    if args.temperature is None and args.top_k is None and args.top_p is None:
        return [SamplingParams(1.0), SamplingParams(1.0, top_k=20, top_p=0.9)]
    return [SamplingParams(args.temperature or 1.0, args.top_k or 0, args.top_p or 1.0)]


def _prompts(args) -> list[str]:
    from ..check import PROMPTS
    from .prompt import _batch_prompts

    if args.prompts is None:
        return list(PROMPTS)
    try:  # generate's batch reader: a prompt a line, .jsonl a "prompt" field a line
        return _batch_prompts(SimpleNamespace(prompt=None, prompt_file=args.prompts, chat=args.chat))
    except SpecdecError as exc:
        raise SpecdecError(str(exc).replace("--prompt-file", "--prompts")) from None


def cmd_check(args) -> int:
    from ..check import check_decoder, check_remote

    if args.plain_url and not args.url:
        raise SpecdecError("--plain-url is the plain side of a server check: give --url too")
    if args.url and args.costs:
        raise SpecdecError("--costs is for the models checked in-process; a server takes its own (serve --costs)")
    prompts = _prompts(args)
    common = dict(
        greedy_tokens=args.max_tokens,
        samples=args.samples,
        sample_tokens=args.sample_tokens,
        sampled_prompts=args.sampled_prompts,
        settings=_settings(args),
        seed=args.seed,
        alpha=args.alpha,
    )
    if args.url:
        report = check_remote(
            args.url,
            args.plain_url,
            prompts,
            concurrency=args.batch,
            exact=args.exact,
            api_key=args.api_key or os.environ.get("SPECDEC_API_KEY") or None,
            model=args.model,
            **common,
        )
    else:
        from .generate import _drafter_name
        from .loading import _decoder

        args.batch_size = args.batch  # the rows the models are loaded for
        decoder = _decoder(args)
        k = "auto" if decoder.auto else decoder.k
        engine = f"{decoder.target.name}, draft {_drafter_name(decoder)}, k={k}, batch {args.batch}"
        report = check_decoder(decoder, prompts, batch=args.batch, chat=args.chat, engine=engine, **common)
    if args.json:
        print(json.dumps(report.to_dict(), ensure_ascii=False))
    else:
        print("\n".join(report.lines()))
    return 0 if report.passed else 1
