"""`specdec bench`: fixed prompts, warm-up, repeats, medians, and the peers on the same machine.

Every (prompt, method) pair runs `repeats` times; methods alternate per prompt (the order rotates)
so that drift in machine speed hits all methods alike. Speedups are computed pair by pair: each
run against the plain run of the same prompt and repeat, the median over the repeats per prompt,
then the median over the prompts of a category.

Like with like: greedy runs that part at a rounding tie (llama.cpp's kernels are not batch-invariant)
write different texts, often of different lengths, and llama.cpp's `llama-speculative-simple` keeps
whole accepted drafts past `-n` (it wrote 277-321 tokens for 256). So every run's text is kept in
results.jsonl and compared with plain's (`text_match`: identical, prefix — one text is the start of
the other, as when a run wrote more tokens — or differs, which includes a run that ended at an
end-of-generation token where the other wrote on: `match_of`), and the summary gives the median speedup
over all pairs and over the pairs whose texts agree, with every method's token counts.

Every runner's tokens are counted alike (`produced`): what the model produced in the decode time,
an end-of-generation token included (our engine does not emit it, llama.cpp counts it, and both
spend a forward on it), and at most max_tokens + 1 (llama.cpp's binaries stop only past -n, and a
speculative step that overshoots does no extra work for the tokens past it). Counted otherwise, a
21-token answer gave llama.cpp's n-gram modes 5% over our plain decoding with nothing drafted.

Methods that learn across prompts (auto's controller, the suffix cache) keep one decoder per
method, repeat and batch size for the whole run, so each method only ever sees its own earlier
runs, and never the same prompt in an earlier repeat or at another batch size (that would be the
exact-repeat workload: with the suffix cache, a second repeat would copy the first). `passes` > 1 asks
the whole suite again in the same process (the exact-repeat workload): pass p's prompts are
reported as "<category> (pass p)", each against plain decoding of the same pass.
"""

from .methods import (
    DEFAULT_METHODS,
    FULL_METHODS,
    HF_METHODS,
    LLAMA_CPP_METHODS,
    VLLM_METHODS,
    parse_method,
    vllm_engines,
)
from .report import _category_tables, _noise_lines, _partings_table, plot, prompt_speedups, speedups, write_summary
from .run import Bench, Row, compare_text, mark_partings, match_of, produced, run_bench
from .suite import CATEGORIES, DEFAULT_SUITE, load_suite, prompt_text

__all__ = [
    "CATEGORIES",
    "DEFAULT_METHODS",
    "DEFAULT_SUITE",
    "FULL_METHODS",
    "HF_METHODS",
    "VLLM_METHODS",
    "vllm_engines",
    "LLAMA_CPP_METHODS",
    "Bench",
    "Row",
    "_category_tables",
    "_noise_lines",
    "_partings_table",
    "compare_text",
    "load_suite",
    "mark_partings",
    "match_of",
    "parse_method",
    "plot",
    "produced",
    "prompt_speedups",
    "prompt_text",
    "run_bench",
    "speedups",
    "write_summary",
]
