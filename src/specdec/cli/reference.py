"""docs/guide/cli.md, the command line's reference, written from the parsers themselves: every command,
its description, and each flag with its `--help` text and default, in the groups `--help` shows.

    python -m specdec.cli.reference docs/guide/cli.md     # (make cli-docs) rewrite it
    python -m specdec.cli.reference --check docs/guide/cli.md   # exit 1 if it differs from the parsers

tests/test_cli.py checks the committed file, so a flag added or reworded without `make cli-docs`
fails the suite instead of leaving the reference behind the code.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HEADER = """# The command line: every flag

Written from the parsers by `make cli-docs` (`python -m specdec.cli.reference docs/guide/cli.md`); the
test suite fails when it differs from them, so this is what `specdec COMMAND --help` says. The
guide's install.md and serving.md say what the commands are for.
"""


def _cell(text: str) -> str:
    """One table cell: one line; pipes, angle brackets and asterisks escaped (`<category>` would be
    read as an HTML tag, `2**64` as the start of bold)."""
    return " ".join(text.split()).replace("|", "\\|").replace("<", "&lt;").replace("*", "\\*")


def _commands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(name, one-line summary, parser) of each subcommand, in `specdec --help`'s order."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            summaries = {a.dest: a.help or "" for a in action._choices_actions}
            return [(name, summaries.get(name, ""), p) for name, p in action.choices.items()]
    return []


def _invocation(formatter: argparse.HelpFormatter, action: argparse.Action) -> str:
    """`-k K`, `--draft-tokens K`: each spelling with its value, the same on every Python (3.13's
    --help writes `-k, --draft-tokens K`, older ones `-k K, --draft-tokens K`)."""
    if not action.option_strings:
        return f"`{formatter._format_args(action, action.dest)}`"
    value = "" if action.nargs == 0 else " " + formatter._format_args(action, action.dest.upper())
    return ", ".join(f"`{option}{value}`" for option in action.option_strings)


def _flags(parser: argparse.ArgumentParser) -> list[str]:
    """A table of the parser's arguments per group, help expanded as `--help` expands it."""
    formatter = parser._get_formatter()
    lines = []
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.help is not argparse.SUPPRESS and a.dest != "help"]
        if not actions:
            continue
        lines += ["", f"*{group.title}*" + (f": {_cell(group.description)}" if group.description else ""), ""]
        lines += ["| argument | what it does |", "|---|---|"]
        for action in actions:
            what = _cell(formatter._expand_help(action)) if action.help else ""
            lines.append(f"| {_invocation(formatter, action)} | {what} |")
    return lines


def markdown() -> str:
    from . import build_parser

    parser = build_parser()
    lines = [HEADER.rstrip("\n"), ""]
    commands = _commands(parser)
    lines += ["| command | what it does |", "|---|---|"]
    lines += [f"| [`specdec {name}`](#specdec-{name}) | {_cell(summary)} |" for name, summary, _ in commands]
    for name, _summary, sub in commands:
        lines += ["", f"## specdec {name}"]
        if sub.description:
            lines += ["", _cell(sub.description)]
        lines += _flags(sub)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specdec.cli.reference", description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path, help="the Markdown file (docs/guide/cli.md)")
    parser.add_argument("--check", action="store_true", help="compare instead of writing: exit 1 if it differs")
    args = parser.parse_args(argv)
    text = markdown()
    if args.check:
        same = args.path.is_file() and args.path.read_text(encoding="utf-8") == text
        if not same:
            print(f"{args.path} is not what the parsers say: run `make cli-docs`", file=sys.stderr)
        return 0 if same else 1
    from ..paths import write_atomically

    write_atomically(args.path, text.encode("utf-8"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
