"""specdec: lossless speculative decoding.

from specdec import SpeculativeDecoder, load_model
target = load_model("qwen2.5-coder-1.5b"); draft = load_model("qwen2.5-coder-0.5b")
decoder = SpeculativeDecoder(target, drafter=draft, k=4)
result = decoder.generate("def fib(n):", max_new_tokens=64, temperature=0.0)

A drafter named as on the command line: SpeculativeDecoder.from_spec(target, parse("ngram", k=8)).

The names below load on first use, so that `import specdec` (and the `specdec` command's start,
where a Ctrl-C must find the command's own handler in place) costs nothing.
"""

from __future__ import annotations

import importlib

# name -> the module that defines it
_HOMES = {
    "generate": ".decoder",
    "SpeculativeDecoder": ".decoder",
    "load_model": ".models.load",
    "GenerationConfig": ".config",
    "GenerationResult": ".engine",
    "SpecdecError": ".errors",
    "DraftSpec": ".spec",
    "parse": ".spec",
}
__all__ = list(_HOMES)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'specdec' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name], __name__), name)
    globals()[name] = value  # once: later lookups find it here
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
