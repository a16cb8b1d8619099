"""`specdec serve`: the OpenAI API over HTTP, over one loaded target (the server is specdec.server's)."""

from __future__ import annotations

import argparse
import os
import sys

from .. import catalog
from ..controller import LATENCY_STEP, LONG_STEP_SAVING, LONG_STEP_SHARE, OBJECTIVES, SERVER_OBJECTIVE
from ..engine import HOST_CACHE_MIB, PREFILL_STALL, PREFILL_WASTE
from ..errors import SpecdecError
from ..paths import writable_reason
from .flags import _add_costs_flag, _add_model_flags, _add_suffix_flags
from .loading import _check_device, _check_suffix_flags, _model_loader, _read_costs, _report_costs, _suffix_cache
from .options import _at_least_one, _at_least_one_or_inf, _float_in, _non_negative_int, _port, _positive


def _add_serve_parser(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server with continuous batching",
        description="Serve the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models, "
        "/health, /metrics) over one loaded target: requests join the running "
        "batch between steps and leave when done. Needs the serve extra: "
        "pip install -e '.[serve]' (in specdec's checkout).",
    )
    g = p.add_argument_group("models")
    _add_model_flags(
        g,
        target_help=f"built-in name or .gguf path (default: {catalog.DEFAULT_TARGET})",
        draft_help="the default speculation of a request: 'auto', 'ngram', 'suffix', 'none', a draft model "
        "(built-in name or .gguf path) or head:FILE (a trained head; requests name it 'head'); a request may "
        "pick another in its body "
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
            "--draft-model": lambda: _add_costs_flag(g, "'auto'"),
            "--draft-tokens": lambda: _add_suffix_flags(
                p.add_argument_group("suffix cache (one for all requests; auto and 'suffix' draft from it)")
            ),
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
        "--prefill-stall",
        type=_at_least_one,
        default=PREFILL_STALL,
        metavar="X",
        help="a new request's prompt is prefilled in chunks that ride in the running requests' "
        "steps, each chunk as long as keeps such a step within X times their plain step (from the "
        "cost curve): larger X, the prompt rides in bigger pieces and the running requests "
        f"pause longer; alone, a prompt is prefilled at once (default: {PREFILL_STALL:g})",
    )
    g.add_argument(
        "--prefill-waste",
        type=_at_least_one_or_inf,
        default=PREFILL_WASTE,
        metavar="W",
        help="a chunk whose prompt tokens would cost more than W times, per token, what they cost "
        "read in one piece (on the cost curve, as on a CPU where a few tokens are dear) waits "
        "instead: the new request reads its prompt when the running ones end, or, if they run "
        "on, after waiting as many steps as the chunks would take (default: "
        f"{PREFILL_WASTE:g}; inf: every chunk rides)",
    )
    g.add_argument(
        "--no-prefix-cache",
        dest="prefix_cache",
        action="store_false",
        help="forget each finished request's KV cache. Default: a finished request's row keeps its "
        "cache, and a new prompt that starts the same way (a conversation's next turn, a repeated "
        "prompt, a shared system prompt) takes that row and reads only the rest, as llama-server's "
        "prompt cache and vLLM's prefix caching do; usage.prompt_tokens_details.cached_tokens says "
        "how many were found. Where the server drafts trees (--draft-width > 1) the target's "
        "rows share one pool of cache cells and none is kept there: a finished request's cache "
        "goes to host memory instead (--cache-ram), and is read back the same way",
    )
    g.add_argument(
        "--cache-ram",
        type=_cache_ram,
        default=HOST_CACHE_MIB,
        metavar="MIB",
        help="host memory, in MiB, for the caches of finished requests whose rows went to other "
        "prompts (as llama-server's --cache-ram): a kept row's cache is copied there before a "
        "prompt that does not share it all takes the row, and a later prompt that starts the same "
        "way (another conversation's next turn) reads it back instead of its history; the least "
        f"recently used go first; nothing with --no-prefix-cache. -1: no limit; 0: none (default: {HOST_CACHE_MIB})",
    )
    g.add_argument(
        "--objective",
        choices=OBJECTIVES,
        default=SERVER_OBJECTIVE,
        help="what 'auto' maximises each step over the requests running together: bounded, their "
        f"tokens per second all told, with no step costing more than {LATENCY_STEP:g} plain steps (a "
        "stream's gaps between tokens stay within about that many plain steps); latency, each "
        "request's own tokens per second (the geometric mean) under the same bound, so that a draft "
        "for one request pays only if it outweighs slowing every other stream; or throughput, their "
        "tokens per second all told, long drafts and long gaps included "
        f"(default: {SERVER_OBJECTIVE})",
    )
    g.add_argument(
        "--long-step-share",
        type=_float_in(0.0, 0.5, low_open=False),
        default=LONG_STEP_SHARE,
        metavar="S",
        help="under --objective bounded, this share of steps may pass the bound, each to verify a "
        f"long, sure draft (a copy) that saves at least {LONG_STEP_SAVING:g} plain steps at once; "
        "under 0.01 a stream's 99th-percentile gap between tokens stays the bound's; 0: none "
        f"(default: {LONG_STEP_SHARE:g})",
    )
    g.add_argument(
        "--max-queue",
        type=_non_negative_int,
        default=64,
        metavar="N",
        help="requests waiting for a row; past it a request gets 429 with a Retry-After header (default: 64)",
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
        help="require 'Authorization: Bearer KEY' on /v1/* (/health and /metrics stay open for probes; an "
        "empty key is refused at start) (default: $SPECDEC_API_KEY; none)",
    )
    g.add_argument(
        "--served-model-name", default=None, help="the model id clients send and /v1/models lists (default: --target)"
    )
    g.add_argument(
        "--special-in-turns",
        action="store_true",
        help="for every request (a request cannot change it): read special tokens spelled in a "
        "chat message's content (such as <|im_end|>) as the control tokens they name, the old "
        "behaviour. Risky: any client can then end its turn and open a system one (a prompt "
        "injection of control tokens). Default: off, message text stays text and special tokens "
        "come from the chat template alone (a /v1/completions text prompt keeps its special "
        "tokens either way: it spells its own template)",
    )
    g.add_argument(
        "--reproducible",
        action="store_true",
        help="for every sampled request: sample by position, each token drawn with noise fixed by "
        "(the request's seed, its position), so the same seeded request gives the same text under "
        "any policy, cache or load (bit for bit with --exact; without it a rounding difference can "
        "flip a near-tie). Default: off, the drafts' random draws and the request's share one stream",
    )
    g.add_argument(
        "--record-requests",
        metavar="FILE",
        default=None,
        help="append each accepted request's prompt to FILE as a JSON line (a chat's messages as "
        '{"messages": [...]}, a text completion as {"prompt": ...}), the form `specdec train --requests '
        "FILE` reads: a head trained on the traffic this server sees. The file holds what your users "
        "wrote (created with mode 0600): keep it as private as that (default: none, nothing recorded)",
    )
    g.add_argument(
        "--no-huge-pages",
        dest="huge_pages",
        action="store_false",
        help="llama.cpp backend: leave the weights, the KV cache and the compute buffers in the "
        "kernel's small pages. By default the server asks Linux for 2 MiB pages for them (where "
        "transparent huge pages are in madvise mode, as is usual, llama.cpp never asks), which made a "
        "token 1-3%% faster here for 1-2 s more per model load (more with a large KV cache: the 1.5B at "
        "--max-batch 8 loaded in 3.3-5.1 s against 1.6); the output is the same either way",
    )
    g.add_argument(
        "--log-level",
        choices=("critical", "error", "warning", "info", "debug"),
        default="info",
        help="the HTTP server's (uvicorn's) log on stderr: info writes a line per request, warning only problems",
    )


def _cache_ram(text: str) -> int:
    """--cache-ram: MiB, -1 (no limit) or 0 (none)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer number of MiB, got {text!r}") from None
    if value < -1:
        raise argparse.ArgumentTypeError(f"must be -1 (no limit), 0 (none) or a number of MiB, got {text}")
    return value


def cmd_serve(args) -> int:
    from ..errors import BackendUnavailableError

    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise BackendUnavailableError(
            f"specdec serve needs {exc.name}: pip install -e '.[serve]' (in specdec's checkout)"
        ) from None
    from ..build import serving
    from ..server.app import build_service, serve
    from ..server.record import RequestLog
    from ..spec import parse

    if args.api_key is not None and not args.api_key.strip():
        # an empty key would print "no key needed" yet refuse requests without a header
        raise SpecdecError("--api-key (or $SPECDEC_API_KEY) is empty: give a key, or unset it to serve without one")
    why = writable_reason(args.record_requests) if args.record_requests else None
    if why:  # found before the models load
        raise SpecdecError(f"--record-requests {args.record_requests} cannot be written: {why}")
    spec = parse(
        args.draft,
        args.backend,
        args.draft_tokens,
        draft_model=args.draft_model,
        width=args.draft_width,
        nodes=args.draft_nodes,
    )
    if spec.kind == "early-exit":
        raise SpecdecError("specdec serve takes --draft auto, ngram, suffix, none, a draft model or head:FILE")
    if spec.kind == "suffix" and spec.nodes:  # one cache serves every request, each its own width
        raise SpecdecError(
            f"--draft-nodes {spec.nodes}: the server's suffix cache drafts each request's tree by its "
            "width alone (K x W nodes; a request may ask for its own width): drop --draft-nodes"
        )
    # any request may ask for auto or suffix, whatever the default: the flags hold for every --draft
    _check_suffix_flags(args, "suffix" if spec.kind == "suffix" else "auto")
    _check_device(args)
    report = _read_costs(args)
    draft_spec = spec if spec.kind == "model" else parse(args.draft_model)  # a bad one fails before a load
    load = _model_loader(args, args.max_batch)
    # the target scores trees only where the server drafts them (--draft-width > 1: the draft model,
    # a head, prompt lookup or the suffix cache; then requests may ask for their own widths and auto
    # drafts trees too); without them every row keeps a cache stream of its own (faster steps over
    # many rows)
    target = load(args.target, trees=spec.width > 1)
    policy, draft, head = serving(
        target, spec, draft_spec, lambda name, trees: load(name, args.draft_backend or args.backend, trees=trees)
    )
    # the name requests give the draft model, as the flags wrote it
    draft_name = (args.draft if spec.kind == "model" else args.draft_model) if draft_spec.kind == "model" else None
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
        head=head,
        max_queue=args.max_queue,
        request_timeout=args.request_timeout,
        api_key=args.api_key,
        special_in_turns=args.special_in_turns,
        reproducible=args.reproducible,
        prefill_stall=args.prefill_stall,
        prefill_waste=args.prefill_waste,
        prefix_cache=args.prefix_cache,
        host_cache=None if args.cache_ram == -1 else args.cache_ram << 20,
        objective=args.objective,
        long_step_share=args.long_step_share,
        costs=_report_costs(args, report, target, draft) if report is not None else None,
        record=RequestLog(args.record_requests) if args.record_requests else None,
    )

    def listening(port: int) -> None:  # the port bound (--port 0 picks one)
        print(
            f"specdec serve: {names[0]} | draft {policy.label}"
            f"{f' (model {draft_name})' if draft_name else ''} | {args.max_batch} rows, queue {args.max_queue} | "
            f"ctx {target.n_ctx} | http://{args.host}:{port}/v1"
            f"{' | API key required' if args.api_key else ''}"
            f"{' | special tokens in messages parsed (--special-in-turns)' if args.special_in_turns else ''}"
            f"{' | sampling by position (--reproducible)' if args.reproducible else ''}"
            f"{f' | recording requests to {args.record_requests}' if args.record_requests else ''}",
            file=sys.stderr,
            flush=True,
        )

    code = serve(service, args.host, args.port, log_level=args.log_level, on_listening=listening)
    if args.suffix_cache and suffix:  # the worker has stopped: the cache is ours to read
        suffix.save(args.suffix_cache)
    return code
