"""The CLI's argparse pieces: the parser and help formatter every command uses, the types that check
a flag's value, and help texts more than one command shows."""

from __future__ import annotations

import argparse
import math


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option that takes a value shows its default: argparse's "(default: X)", unless the
    help text already says it in words."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.nargs == 0 or action.default in (None, argparse.SUPPRESS):
            return text
        return text + " (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line on stderr and exit code 2 (no usage dump)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"specdec: error: {message} (see {self.prog} --help)\n")


def _int_in(low: int, high: int, high_text: str | None = None):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be in {low}..{high_text or high}, got {text}")
        return value

    return parse


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value) or value <= 0:
            raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
        return value

    return parse


def _at_least_one(text: str) -> float:
    """A factor that cannot shrink what it multiplies: a finite number >= 1."""
    value = _positive(float)(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def _at_least_one_or_inf(text: str) -> float:
    """A factor >= 1, or inf (no bound)."""
    return math.inf if text.strip().lower() in ("inf", "infinity") else _at_least_one(text)


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _text(if_empty: str | None = None):
    """A text flag: valid UTF-8 (Python hands undecodable bytes of argv over as surrogates), and
    not empty when `if_empty` says why it must not be."""

    def parse(text: str) -> str:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise argparse.ArgumentTypeError("is not valid UTF-8 text") from None
        if not text and if_empty:
            raise argparse.ArgumentTypeError(if_empty)
        return text

    return parse


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


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in 0..65535, got {text}")
    return value


SEED = _int_in(0, 2**64 - 1, "2**64-1")  # numpy's generators take seeds in [0, 2**64)
TEMPERATURE_HELP = (
    "0 = greedy: the target's own greedy output, except that at a near-tie of its "
    "top two logits greedy speculative output can part from plain decoding, because "
    "llama.cpp's CPU kernels are not batch-invariant (`specdec compare` reports the gap)"
)
