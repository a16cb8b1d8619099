"""`specdec bench` (run.py says how it measures). The names callers use are re-exported here, so
that `from specdec import bench; bench.run_bench(...)` keeps working."""

from .run import (
    DEFAULT_METHODS,
    FULL_METHODS,
    HF_METHODS,
    LLAMA_CPP_METHODS,
    Bench,
    Row,
    _category_tables,
    _partings_table,
    compare_text,
    mark_partings,
    parse_method,
    plot,
    produced,
    prompt_speedups,
    run_bench,
    speedups,
    write_summary,
)
from .suite import CATEGORIES, DEFAULT_SUITE, load_suite, prompt_text

__all__ = [
    "CATEGORIES",
    "DEFAULT_METHODS",
    "DEFAULT_SUITE",
    "FULL_METHODS",
    "HF_METHODS",
    "LLAMA_CPP_METHODS",
    "Bench",
    "Row",
    "_category_tables",
    "_partings_table",
    "compare_text",
    "load_suite",
    "mark_partings",
    "parse_method",
    "plot",
    "produced",
    "prompt_speedups",
    "prompt_text",
    "run_bench",
    "speedups",
    "write_summary",
]
