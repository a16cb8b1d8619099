"""`specdec serve`: the OpenAI API over HTTP, over one loaded target (the server is specdec.server's)."""

from __future__ import annotations

import argparse
import sys

from .. import catalog
from ..controller import LONG_STEP_SHARE, OBJECTIVES, SERVER_OBJECTIVE
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
    g.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="YAML of flags to values; SPECDEC_<FLAG> variables override it, flags override both (default: none)",
    )
    _add_address_flags(g)
    _add_batching_flags(g)
    _add_objective_flags(g)
    _add_queue_flags(g)
    _add_access_flags(g)
    _add_request_flags(g)
    _add_process_flags(g)


def _add_address_flags(g) -> None:
    """Where the server listens."""
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    g.add_argument("--port", type=_port, default=8000, help="TCP port (default: 8000; 0 picks a free one)")


def _add_batching_flags(g) -> None:
    """How requests share the batch: rows, prompt chunks, the prefix and host caches."""
    g.add_argument(
        "--max-batch",
        type=_positive(int),
        default=4,
        metavar="B",
        help="requests generated together (llama-server's -np, vLLM's --max-num-seqs) (default: 4)",
    )
    g.add_argument(
        "--prefill-stall",
        type=_at_least_one,
        default=PREFILL_STALL,
        metavar="X",
        help=f"a joining prompt's chunk costs at most X plain steps of the running rows (default: {PREFILL_STALL:g})",
    )
    g.add_argument(
        "--prefill-waste",
        type=_at_least_one_or_inf,
        default=PREFILL_WASTE,
        metavar="W",
        help=f"a chunk whose tokens cost over W times their whole-prompt price waits (default: {PREFILL_WASTE:g})",
    )
    g.add_argument(
        "--no-prefix-cache",
        dest="prefix_cache",
        action="store_false",
        help="forget finished requests' caches (default: kept for prompts that start the same way)",
    )
    g.add_argument(
        "--cache-ram",
        type=_cache_ram,
        default=HOST_CACHE_MIB,
        metavar="MIB",
        help=f"MiB of host memory for finished requests' caches; -1: no limit, 0: none (default: {HOST_CACHE_MIB})",
    )


def _add_objective_flags(g) -> None:
    """What 'auto' maximises over the requests running together."""
    g.add_argument(
        "--objective",
        choices=OBJECTIVES,
        default=SERVER_OBJECTIVE,
        help=f"what auto maximises over the batch: bounded, latency or throughput (default: {SERVER_OBJECTIVE})",
    )
    g.add_argument(
        "--long-step-share",
        type=_float_in(0.0, 0.5, low_open=False),
        default=LONG_STEP_SHARE,
        metavar="S",
        help=f"under bounded: the share of steps that may pass it for a long sure draft (default: {LONG_STEP_SHARE:g})",
    )


def _add_queue_flags(g) -> None:
    """Requests waiting, and how long one may run."""
    g.add_argument(
        "--max-queue",
        type=_non_negative_int,
        default=64,
        metavar="N",
        help="requests waiting for a row; past it, 429 with Retry-After (default: 64)",
    )
    g.add_argument(
        "--request-timeout",
        type=_positive(float),
        default=600.0,
        metavar="SECONDS",
        help="a request still running after this ends with finish_reason time_limit (default: 600)",
    )


def _add_access_flags(g) -> None:
    """Who may call, and the model's name to them."""
    g.add_argument(
        "--api-key",
        default=None,  # $SPECDEC_API_KEY: read with every SPECDEC_<FLAG> (cli/config.py)
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $SPECDEC_API_KEY; none)",
    )
    g.add_argument(
        "--served-model-name", default=None, help="the model id clients send and /v1/models lists (default: --target)"
    )
    g.add_argument(
        "--cors-origins",
        default="",
        metavar="ORIGINS",
        help="browser origins that may call the API (CORS), comma-separated, e.g. http://localhost:3000, "
        "or * for any (default: none)",
    )


def _add_request_flags(g) -> None:
    """What holds for every request, whatever it asks: special tokens, sampling by position, recording."""
    g.add_argument(
        "--special-in-turns",
        action="store_true",
        help="read special tokens spelled in chat messages as control tokens (risky: prompt injection; default: off)",
    )
    g.add_argument(
        "--reproducible",
        action="store_true",
        help="sample by position: a seeded request gives the same text under any policy, cache or load",
    )
    g.add_argument(
        "--record-requests",
        metavar="FILE",
        default=None,
        help="append each accepted request's prompt to FILE, for `specdec train --requests FILE` (default: none)",
    )


def _add_process_flags(g) -> None:
    """The process's own: memory pages and the HTTP log."""
    g.add_argument(
        "--no-huge-pages",
        dest="huge_pages",
        action="store_false",
        help="llama backend: leave memory in small pages (default: 2 MiB pages, a token 1-3%% faster)",
    )
    g.add_argument(
        "--log-level",
        choices=("critical", "error", "warning", "info", "debug"),
        default="info",
        help="uvicorn's log on stderr: info a line per request, warning only problems (default: info)",
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
    from ..server.app import serve

    _check_serve_extra()
    spec, draft_spec, report = _checked(args)
    service, suffix, banner = _service(args, spec, draft_spec, report)

    def listening(port: int) -> None:  # the port bound (--port 0 picks one)
        print(f"{banner} | http://{args.host}:{port}/v1{_modes(args)}", file=sys.stderr, flush=True)

    code = serve(service, args.host, args.port, log_level=args.log_level, on_listening=listening)
    if args.suffix_cache and suffix:  # the worker has stopped: the cache is ours to read
        suffix.save(args.suffix_cache)
    return code


def _check_serve_extra() -> None:
    from ..errors import BackendUnavailableError

    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise BackendUnavailableError(
            f"specdec serve needs {exc.name}: pip install -e '.[serve]' (in specdec's checkout)"
        ) from None


def _checked(args):
    """Every flag checked before a model loads: (--draft's DraftSpec, --draft-model's, the --costs
    report or None)."""
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
    draft_spec = spec if spec.kind == "model" else parse(args.draft_model)
    return spec, draft_spec, report


def _service(args, spec, draft_spec, report):
    """The models loaded and the service built over them (build.serving, server.build_service):
    (the service, its suffix cache or False, the start line's first part)."""
    from ..build import serving
    from ..server.app import build_service
    from ..server.record import RequestLog

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
        cors_origins=tuple(o.strip() for o in args.cors_origins.split(",") if o.strip()),
    )
    banner = (
        f"specdec serve: {names[0]} | draft {policy.label}"
        f"{f' (model {draft_name})' if draft_name else ''} | {args.max_batch} rows, queue {args.max_queue} | "
        f"ctx {target.n_ctx}"
    )
    return service, suffix, banner


def _modes(args) -> str:
    """The start line's tail: the server-wide modes the flags turned on."""
    return (
        f"{' | API key required' if args.api_key else ''}"
        f"{' | special tokens in messages parsed (--special-in-turns)' if args.special_in_turns else ''}"
        f"{' | sampling by position (--reproducible)' if args.reproducible else ''}"
        f"{f' | recording requests to {args.record_requests}' if args.record_requests else ''}"
    )
