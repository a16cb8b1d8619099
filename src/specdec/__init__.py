"""specdec: lossless speculative decoding.

from specdec import SpeculativeDecoder, load_model
target = load_model("qwen2.5-coder-1.5b"); draft = load_model("qwen2.5-coder-0.5b")
decoder = SpeculativeDecoder(target, drafter=draft, k=4)
result = decoder.generate("def fib(n):", max_new_tokens=64, temperature=0.0)

A drafter named as on the command line: SpeculativeDecoder.from_spec(target, parse("ngram", k=8)).
"""

from __future__ import annotations

import os

from .config import GenerationConfig
from .engine import GenerationResult, SpeculativeDecoder, generate
from .errors import SpecdecError
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


BACKENDS = ("llama", "numpy", "torch")


def check_exact(backend: str, exact: bool) -> None:
    """The exact mode needs the llama backend: a one-line error otherwise (before any import of
    another backend's libraries, which may be missing)."""
    if exact and backend != "llama":
        raise SpecdecError(
            f"the exact mode is for the llama backend only: the {backend} backend's matrix products take "
            f"other kernels for one row than for many (docs/exact.md)"
        )


def load_model(
    name_or_path: str | os.PathLike,
    backend: str = "llama",
    n_ctx: int = 4096,
    threads: int | None = None,
    progress: bool = True,
    device: str = "auto",
    dtype: str = "auto",
    max_rows: int = 1,
    exact: bool = False,
    trees: bool = True,
    cache: str = "dynamic",
    graphs: bool = False,
    huge_pages: bool = False,
):
    """A built-in model name (see `specdec models`) or a path to a .gguf file, loaded on a backend:
    'llama' (llama.cpp, the default), 'numpy' (the pure-NumPy reference, models/numpy_ref.py) or
    'torch' (transformers on `device` in `dtype`; it also takes a transformers model folder).
    `max_rows`: sequences generated together (llama.cpp sizes its KV cache for them; the torch
    and NumPy backends grow as rows join).
    `exact` (llama.cpp only): every row's logits from a forward of many tokens bit-identical to a
    one-token forward's, so speculative greedy is plain greedy token for token (docs/exact.md);
    a process is exact or not from its first llama.cpp model on.
    `trees` (llama.cpp only): whether the model will score tree drafts; without them each row
    keeps a KV cache stream of its own, and a step over many rows reads only its own cells
    (models/llama_cpp.py).
    `cache` and `graphs` (torch only): the KV cache layout, "dynamic" or "static", and whether
    forwards replay as CUDA graphs (static, on CUDA; models/transformers.py).
    `huge_pages` (llama.cpp only, Linux): the memory llama.cpp takes in 2 MiB pages, a longer load
    for a slightly faster token (models/hugepages.py; `specdec serve` asks for it).
    Built-in models are assembled from their installed packages on first use."""
    from pathlib import Path

    from .catalog import CATALOG, resolve

    if backend not in BACKENDS:
        raise SpecdecError(f"unknown backend {backend!r}: use one of {', '.join(BACKENDS)}")
    if n_ctx < 16:
        raise SpecdecError(f"the context must hold at least 16 tokens, got {n_ctx}")
    if threads is not None and threads < 1:
        raise SpecdecError(f"threads must be >= 1, got {threads}")
    check_exact(backend, exact)
    if backend != "torch" and (cache != "dynamic" or graphs):
        raise SpecdecError(f"the KV cache layout and CUDA graphs are the torch backend's, not {backend}'s")
    torch_options = dict(device=device, dtype=dtype, n_ctx=n_ctx, threads=threads, cache=cache, graphs=graphs)
    if backend == "torch" and Path(name_or_path).is_dir():
        from .models.transformers import load_transformers_model

        return load_transformers_model(name_or_path, **torch_options)
    path = resolve(name_or_path, progress=progress)
    if backend == "torch":
        from .models.transformers import load_transformers_model

        if progress:
            import sys

            print(
                f"loading {path.name} into transformers (the GGUF is dequantised: this takes a while)", file=sys.stderr
            )
        model = load_transformers_model(path, **torch_options)
    elif backend == "numpy":
        from .models.numpy_ref import load_numpy_model

        model = load_numpy_model(path, n_ctx=n_ctx)
        if progress:
            import sys

            print(
                f"loaded {path.name} into NumPy in {model.load_seconds:.1f} s "
                f"({model.weight_bytes / 2**30:.2f} GiB of weights)",
                file=sys.stderr,
            )
    else:
        from .models.llama_cpp import LlamaCppModel

        model = LlamaCppModel(
            path, n_ctx=n_ctx, n_threads=threads, max_rows=max_rows, exact=exact, trees=trees, huge_pages=huge_pages
        )
    if str(name_or_path) in CATALOG:
        model.name = str(name_or_path)
        model.is_instruct = CATALOG[model.name].chat
    return model
