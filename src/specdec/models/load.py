"""The one home of model loading: a built-in name or a path -> a loaded RowModel on a backend
(`load_model`), and a second model placed like a loaded one (`load_like`). The CLI's model flags,
the server, bench and the Python API all load through here."""

from __future__ import annotations

import os

from ..errors import SpecdecError

BACKENDS = ("llama", "numpy", "torch")


def check_exact(backend: str, exact: bool) -> None:
    """The exact mode needs the llama backend: a one-line error otherwise (before any import of
    another backend's libraries, which may be missing)."""
    if exact and backend != "llama":
        raise SpecdecError(
            f"the exact mode is for the llama backend only: the {backend} backend's matrix products take "
            f"other kernels for one row than for many (docs/guide/exact.md)"
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
    gpu_layers: int = 0,
):
    """A built-in model name (see `specdec models`) or a path to a .gguf file, loaded on a backend:
    'llama' (llama.cpp, the default), 'numpy' (the pure-NumPy reference, models/numpy_ref.py) or
    'torch' (transformers on `device` in `dtype`; it also takes a transformers model folder).
    `max_rows`: sequences generated together (llama.cpp sizes its KV cache for them; the torch
    and NumPy backends grow as rows join).
    `exact` (llama.cpp only): every row's logits from a forward of many tokens bit-identical to a
    one-token forward's, so speculative greedy is plain greedy token for token (docs/guide/exact.md);
    a process is exact or not from its first llama.cpp model on.
    `trees` (llama.cpp only): whether the model will score tree drafts; without them each row
    keeps a KV cache stream of its own, and a step over many rows reads only its own cells
    (models/llama_cpp.py).
    `cache` and `graphs` (torch only): the KV cache layout, "dynamic" or "static", and whether
    forwards replay as CUDA graphs (static, on CUDA; models/transformers.py).
    `huge_pages` (llama.cpp only, Linux): the memory llama.cpp takes in 2 MiB pages, a longer load
    for a slightly faster token (models/hugepages.py; `specdec serve` asks for it).
    `gpu_layers` (llama.cpp only): the model's first layers offloaded to the GPU (llama.cpp's -ngl),
    which needs llama-cpp-python built with GPU support.
    Built-in models are assembled from their installed packages on first use."""
    from pathlib import Path

    from ..catalog import CATALOG, resolve

    if backend not in BACKENDS:
        raise SpecdecError(f"unknown backend {backend!r}: use one of {', '.join(BACKENDS)}")
    if n_ctx < 16:
        raise SpecdecError(f"the context must hold at least 16 tokens, got {n_ctx}")
    if threads is not None and threads < 1:
        raise SpecdecError(f"threads must be >= 1, got {threads}")
    check_exact(backend, exact)
    if gpu_layers < 0:
        raise SpecdecError(f"gpu layers must be >= 0, got {gpu_layers}")
    if gpu_layers and backend != "llama":
        raise SpecdecError(f"--gpu-layers offloads llama.cpp's layers; the {backend} backend takes --device")
    if gpu_layers and exact:
        raise SpecdecError("--exact runs on the CPU's patched kernels (docs/guide/exact.md): drop --gpu-layers")
    if backend != "torch" and (cache != "dynamic" or graphs):
        raise SpecdecError(f"the KV cache layout and CUDA graphs are the torch backend's, not {backend}'s")
    torch_options = dict(device=device, dtype=dtype, n_ctx=n_ctx, threads=threads, cache=cache, graphs=graphs)
    if backend == "torch" and Path(name_or_path).is_dir():
        from .transformers import load_transformers_model

        return load_transformers_model(name_or_path, **torch_options)
    path = resolve(name_or_path, progress=progress)
    if backend == "torch":
        from .transformers import load_transformers_model

        if progress:
            import sys

            print(
                f"loading {path.name} into transformers (the GGUF is dequantised: this takes a while)", file=sys.stderr
            )
        model = load_transformers_model(path, **torch_options)
    elif backend == "numpy":
        from .numpy_ref import load_numpy_model

        model = load_numpy_model(path, n_ctx=n_ctx)
        if progress:
            import sys

            print(
                f"loaded {path.name} into NumPy in {model.load_seconds:.1f} s "
                f"({model.weight_bytes / 2**30:.2f} GiB of weights)",
                file=sys.stderr,
            )
    else:
        from .llama_cpp import LlamaCppModel

        model = LlamaCppModel(
            path,
            n_ctx=n_ctx,
            n_threads=threads,
            max_rows=max_rows,
            exact=exact,
            trees=trees,
            huge_pages=huge_pages,
            n_gpu_layers=gpu_layers,
        )
    if str(name_or_path) in CATALOG:
        model.name = str(name_or_path)
        model.is_instruct = CATALOG[model.name].chat
    return model


def load_like(target, path, trees: bool = False):
    """A draft model at `path` on the target's backend with the target's context, threads and rows
    (an early-exit head's GGUF: the target's first layers, so it runs where the target runs);
    `trees`: one that scores its own trees (it grows them: drafters.model, `nodes`)."""
    from .llama_cpp import LlamaCppModel
    from .numpy_ref import NumpyModel, load_numpy_model
    from .transformers import TransformersModel, load_transformers_model

    if isinstance(target, LlamaCppModel):
        return LlamaCppModel(
            path,
            n_ctx=target.n_ctx,
            n_threads=target.n_threads,
            max_rows=target.max_rows,
            trees=trees,
            n_gpu_layers=target.n_gpu_layers,
        )
    if isinstance(target, NumpyModel):
        return load_numpy_model(path, n_ctx=target.n_ctx)
    if isinstance(target, TransformersModel):  # dequantised by transformers, on the target's device and dtype
        dtype = str(next(target.model.parameters()).dtype).removeprefix("torch.")
        layout = dict(cache="static" if target.static else "dynamic", graphs=target.graphs)
        return load_transformers_model(path, device=str(target.device), dtype=dtype, n_ctx=target.n_ctx, **layout)
    raise SpecdecError(f"an early-exit head drafts as a GGUF draft model, which {type(target).__name__} cannot load")
