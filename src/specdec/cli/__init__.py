"""The `specdec` command: generate, compare, demo, bench, models, fetch, serve, costs, train, check."""

from __future__ import annotations

import argparse
import os
import sys

from ..errors import SpecdecError
from .bench import _add_bench_parser, cmd_bench
from .check import _add_check_parser, cmd_check
from .costs import _add_costs_parser, cmd_costs
from .generate import _add_generate_parsers, cmd_compare, cmd_demo, cmd_generate
from .loading import _check_threads
from .models import _add_models_parsers, cmd_fetch, cmd_models
from .options import _Parser
from .serve import _add_serve_parser, cmd_serve
from .train import _add_train_parser, cmd_train


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="specdec",
        description="Lossless speculative decoding: a cheap drafter "
        "guesses, the target verifies, the output is the target's own.",
    )
    parser.add_argument("--version", action="version", version=f"specdec {__import__('specdec').__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_generate_parsers(sub)  # generate, compare, demo
    _add_bench_parser(sub)
    _add_models_parsers(sub)  # models, fetch
    _add_serve_parser(sub)
    _add_costs_parser(sub)
    _add_train_parser(sub)
    _add_check_parser(sub)
    return parser


COMMANDS = {
    "generate": cmd_generate,
    "compare": cmd_compare,
    "demo": cmd_demo,
    "bench": cmd_bench,
    "models": cmd_models,
    "fetch": cmd_fetch,
    "serve": cmd_serve,
    "costs": cmd_costs,
    "train": cmd_train,
    "check": cmd_check,
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
