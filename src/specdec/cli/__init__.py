"""The `specdec` command: generate, compare, demo, bench, models, fetch, serve, costs, train, check."""

from __future__ import annotations

import os
import sys


def build_parser() -> "argparse.ArgumentParser":  # noqa: F821 (imported where it is built)
    from .bench import _add_bench_parser
    from .check import _add_check_parser
    from .costs import _add_costs_parser
    from .generate import _add_generate_parsers
    from .models import _add_models_parsers
    from .options import _Parser
    from .serve import _add_serve_parser
    from .train import _add_train_parser

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


# command -> (module, function): imported when run, so that one command loads none of the others
COMMANDS = {
    "generate": ("generate", "cmd_generate"),
    "compare": ("generate", "cmd_compare"),
    "demo": ("generate", "cmd_demo"),
    "bench": ("bench", "cmd_bench"),
    "models": ("models", "cmd_models"),
    "fetch": ("models", "cmd_fetch"),
    "serve": ("serve", "cmd_serve"),
    "costs": ("costs", "cmd_costs"),
    "train": ("train", "cmd_train"),
    "check": ("check", "cmd_check"),
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
    try:  # everything, imports included: a Ctrl-C at any moment ends in the handler below
        import argparse
        import importlib

        from ..errors import SpecdecError
    except KeyboardInterrupt:
        print("specdec: interrupted", file=sys.stderr)
        return 130
    try:
        parser = build_parser()
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
        args, extra = parser.parse_known_args(argv)
        if args.command == "serve":  # its --config file and SPECDEC_<FLAG> variables, then the flags again
            from .config import defaults

            commands["serve"].set_defaults(**defaults(commands["serve"], args.config))
            args, extra = parser.parse_known_args(argv)
        if extra:  # name the subcommand's --help, not the top level's
            commands[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
        if getattr(args, "threads", None) is not None:
            from .loading import _check_threads

            _check_threads(args)
        module, function = COMMANDS[args.command]
        return getattr(importlib.import_module(f".{module}", __name__), function)(args)
    except SpecdecError as exc:
        print(f"specdec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specdec: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `specdec generate ... | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
