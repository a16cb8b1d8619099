"""specdec: lossless speculative decoding.

from specdec import SpeculativeDecoder, load_model
target = load_model("qwen2.5-coder-1.5b"); draft = load_model("qwen2.5-coder-0.5b")
decoder = SpeculativeDecoder(target, drafter=draft, k=4)
result = decoder.generate("def fib(n):", max_new_tokens=64, temperature=0.0)

A drafter named as on the command line: SpeculativeDecoder.from_spec(target, parse("ngram", k=8)).
"""

from __future__ import annotations

from .config import GenerationConfig
from .decoder import SpeculativeDecoder, generate
from .engine import GenerationResult
from .errors import SpecdecError
from .models.load import load_model
from .spec import DraftSpec, parse

__all__ = [
    "generate",
    "SpeculativeDecoder",
    "load_model",
    "GenerationConfig",
    "GenerationResult",
    "SpecdecError",
    "DraftSpec",
    "parse",
]
__version__ = "0.1.0"
