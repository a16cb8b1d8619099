"""The flags more than one command takes: the model flags (target, draft, backend, device, threads,
context), defined once here for generate, compare, serve, bench and costs, each with its own
wording where it has one; the suffix cache's flags; and a request's prompt and sampling flags."""

from __future__ import annotations

import argparse
from typing import Callable

from .. import catalog
from ..drafters.base import MAX_DRAFT_TOKENS, MAX_DRAFT_WIDTH
from ..drafters.suffix import DEFAULT_CAP as SUFFIX_CAP
from ..models.load import BACKENDS
from ..sampling import VERIFICATION_RULES
from .options import SEED, TEMPERATURE_HELP, _float_in, _int_in, _non_negative_int, _positive, _text

TARGET_HELP = "built-in name or .gguf path"
DRAFT_HELP = (
    "'auto' (a cost-aware controller picks prompt lookup, the draft model or a "
    "plain step, and k, every step), a built-in name or .gguf path (a draft model, "
    "k tokens a step; one of another vocabulary drafts across tokenizers: its text "
    "re-encoded by the target's tokenizer, or with 'intersect:NAME' its probabilities "
    "on the tokens both vocabularies share; 'string:NAME' is the first way, as NAME alone), "
    "'ngram' (prompt lookup, k tokens a step), "
    "'suffix' (the suffix cache: continues what followed the same tokens in earlier "
    "requests, the corpus or this prompt, k tokens a step), "
    "'early-exit:L' (the target's first L layers draft through its own cache; --backend numpy or torch), "
    "'head:FILE' (a head from `specdec train`: medusa and prophet draft from the target's hidden "
    "states; an early-exit:L+B head runs as a draft model of the target's first layers, built from "
    "the target's GGUF, or on torch, for a chain, through the target's own cache) or "
    "'none'"
)
BACKEND_HELP = (
    "llama: GGUF through llama.cpp; numpy: the pure-NumPy reference; "
    "torch: transformers on PyTorch (a GGUF file, dequantised, or a transformers "
    "model folder); for target and draft alike unless --draft-backend"
)
EXACT_HELP = (
    "exact mode (llama backend): every verified token's logits bit-identical to a one-token step's, so "
    "speculative greedy output is plain greedy output token for token, alone or batched; slower, and "
    "needs `python scripts/install_llama_cpp.py --exact` once (docs/guide/exact.md)"
)
THREADS_HELP = "CPU threads, at most the cores this process may use (default: all of them)"
CTX_HELP = "context window in tokens"

_PROMPT_HELP = {
    "generate": "the prompt text (default: read stdin)",
    "compare": "the prompt text (default: read stdin; when stdin is a terminal, closed or empty, "
    "a built-in demo prompt, said on stderr)",
}


def _draft_model_help() -> str:
    pairs = ", ".join(f"{spec.draft} for {spec.name}" for spec in catalog.CATALOG.values() if spec.draft)
    return (
        f"the draft model --draft auto may use, or 'none' for prompt lookup only (default: the "
        f"target's built-in draft of the same vocabulary, {pairs}; none for any other target); a "
        f"model of another vocabulary drafts across tokenizers, as with --draft; head:FILE puts a "
        f"trained head (specdec train) in the draft model's place"
    )


def _add_model_flags(
    g,
    *,
    target_help: str = TARGET_HELP,
    draft_default: str | None = "auto",
    draft_help: str = DRAFT_HELP,
    draft_model: tuple[str | None, str] | None = None,
    draft_tokens: tuple[int, str] | None = None,
    backend_help: str | None = BACKEND_HELP,
    draft_backend_help: str | None = None,
    threads_help: str | None = THREADS_HELP,
    ctx: tuple[int, str] = (4096, CTX_HELP),
    after: dict[str, Callable[[], object]] | None = None,
) -> None:
    """The model flags, in this order: --target, --draft, --draft-model (when `draft_model` gives
    its default and help), -k/--draft-tokens (when `draft_tokens` gives its lowest value and help),
    --backend, --draft-backend (when its help is given), --device, --dtype, --threads, --ctx (its
    default and help), --exact. `after` adds a command's own flags right after the one it names (its long
    form); a help of None shows none, as in argparse."""
    after = dict(after or {})

    def then(flag: str) -> None:
        if flag in after:
            after.pop(flag)()

    g.add_argument("--target", default=catalog.DEFAULT_TARGET, help=target_help)
    g.add_argument("--draft", default=draft_default, help=draft_help)
    if draft_model is not None:
        g.add_argument("--draft-model", default=draft_model[0], help=draft_model[1])
        then("--draft-model")
    if draft_tokens is not None:
        g.add_argument(
            "-k",
            "--draft-tokens",
            type=_int_in(draft_tokens[0], MAX_DRAFT_TOKENS),
            default=4,
            metavar="K",
            help=draft_tokens[1],
        )
        g.add_argument(
            "--draft-width",
            type=_int_in(1, MAX_DRAFT_WIDTH),
            default=1,
            metavar="W",
            help="candidates per draft position from a draft model, an early-exit:L or a trained head:FILE: "
            "W > 1 drafts a tree (its top W at each "
            "depth when greedy, W draws without replacement when sampling), all scored by one target "
            "forward; with --draft suffix, the cache's W most frequent continuations under each node; "
            "with --draft ngram, the continuations of up to W earlier occurrences, best match first "
            "(default: 1, a chain)",
        )
        g.add_argument(
            "--draft-nodes",
            type=_int_in(0, MAX_DRAFT_TOKENS * MAX_DRAFT_WIDTH),
            default=0,
            metavar="N",
            help="with --draft-width: a tree of the N nodes whose paths the drafter finds most probable (width "
            "where it is unsure, depth where it is sure), so the target scores N tokens a step: a draft model or "
            "a head grows it best first, each node with up to W children of its own (EAGLE-2's dynamic tree, up "
            "to --draft-tokens deep), an early-exit:L keeps its chain's N best candidates; with --draft suffix, "
            "the N whose paths most of the cache's occurrences agree with (default: 0, all of them; the suffix "
            "cache: K x W)",
        )
        then("--draft-tokens")
    g.add_argument("--backend", choices=BACKENDS, default="llama", help=backend_help)
    if draft_backend_help is not None:
        g.add_argument("--draft-backend", choices=BACKENDS, default=None, help=draft_backend_help)
    _add_torch_flags(g)
    then("--dtype")
    _add_threads_flag(g, threads_help)
    g.add_argument("--ctx", type=_positive(int), default=ctx[0], help=ctx[1])
    g.add_argument("--exact", action="store_true", help=EXACT_HELP)
    g.add_argument(
        "--gpu-layers",
        "-ngl",
        type=_non_negative_int,
        default=0,
        metavar="N",
        help="llama backend: the first N layers of each model on the GPU (llama.cpp's -ngl; needs "
        "llama-cpp-python built with CUDA: `python scripts/install_llama_cpp.py --cuda`) (default: 0, the CPU)",
    )
    if after:
        raise ValueError(f"no model flag {', '.join(after)} to add flags after")


def _add_torch_flags(g, auto_layout: bool = False) -> None:
    """--device, --dtype, --cache, --graphs. `auto_layout` (specdec train): --cache also takes and
    defaults to auto, the static cache with CUDA graphs on a GPU and the dynamic one elsewhere
    (resolved by torch_layout once the device is known)."""
    g.add_argument("--device", default="auto", help="torch backend: cuda, cuda:N, cpu, or auto (CUDA when present)")
    g.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16", "float16"),
        default="auto",
        help="torch backend: weights and activations (auto: bfloat16 on CUDA, float32 on CPU)",
    )
    g.add_argument(
        "--cache",
        choices=("auto", "dynamic", "static") if auto_layout else ("dynamic", "static"),
        default="auto" if auto_layout else "dynamic",
        help="torch backend: the KV cache layout (static: preallocated buffers, which CUDA graphs need; "
        + (
            "auto: static with --graphs on a GPU, dynamic on a CPU; default: auto)"
            if auto_layout
            else "default: dynamic)"
        ),
    )
    g.add_argument(
        "--graphs",
        action="store_true",
        help="torch backend on CUDA: replay each decode, verification and early-exit forward as a CUDA graph "
        "(one launch instead of hundreds; needs --cache static; the GPU tables in docs/results/gpu.md use it)",
    )


def _add_threads_flag(g, help_text: str | None = THREADS_HELP) -> None:
    g.add_argument("--threads", type=_positive(int), default=None, help=help_text)


def _add_request_flags(p: argparse.ArgumentParser, max_tokens: int) -> None:
    """generate's and compare's flags: the models, the prompt and the sampling."""
    g = p.add_argument_group("models")
    _add_model_flags(
        g,
        draft_model=(None, _draft_model_help()),
        draft_tokens=(
            0,
            f"draft tokens per step with a fixed drafter (--draft ngram, a model or "
            f"early-exit), 0..{MAX_DRAFT_TOKENS}; 0 = plain decoding; ignored under "
            f"--draft auto, which picks k every step",
        ),
        draft_backend_help="backend of the draft model (default: --backend); e.g. a llama.cpp draft "
        "for a torch target, when the vocabularies match",
        after={"--draft-model": lambda: (_add_suffix_flags(g), _add_costs_flag(g))},
    )
    g = p.add_argument_group("prompt")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--prompt", "-p", type=_text(), help=_PROMPT_HELP[p.prog.split()[-1]])
    src.add_argument("--prompt-file", "-f", help="read the prompt from this UTF-8 file (default: --prompt, else stdin)")
    chat = g.add_mutually_exclusive_group()
    chat.add_argument(
        "--chat",
        dest="chat",
        action="store_true",
        default=None,
        help="apply the model's chat template (default for instruct models)",
    )
    chat.add_argument("--no-chat", dest="chat", action="store_false", help="send the prompt as raw text")
    g.add_argument("--system", type=_text(), help="system message for the chat template (default: none)")
    g.add_argument(
        "--special-in-turns",
        action="store_true",
        help="under the chat template, read special tokens spelled in the prompt and --system "
        "(such as <|im_end|>) as the control tokens they name: the old behaviour. Risky with text "
        "you did not write: it can end its turn and open a system one (a prompt injection of "
        "control tokens). Default: off, a turn's text stays text and special tokens come from "
        "the template alone (a --no-chat prompt keeps its special tokens either way)",
    )
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", "-n", type=_positive(int), default=max_tokens, help="tokens to generate at most")
    g.add_argument("--temperature", "-t", type=_float_in(0, float("inf"), False), default=0.0, help=TEMPERATURE_HELP)
    g.add_argument("--top-k", type=_non_negative_int, default=0, help="0 = off")
    g.add_argument("--top-p", type=_float_in(0, 1, True), default=1.0, help="in (0, 1]; 1 = off")
    g.add_argument("--min-p", type=_float_in(0, 1, False), default=0.0, help="in [0, 1]; 0 = off")
    g.add_argument(
        "--seed",
        type=SEED,
        default=None,
        help="in 0..2**64-1; the same seed repeats a sampled run whose drafts repeat: --draft none, "
        "ngram or a draft model (auto and suffix also draft from earlier requests) (default: a fresh "
        "seed each run)",
    )
    g.add_argument(
        "--reproducible",
        action="store_true",
        help="sample by position: each token is drawn with noise fixed by (--seed, its position), so "
        "the same seed gives the same text with any drafter, cache or batch (bit for bit with "
        "--exact; without it a rounding difference can flip a near-tie). Prompt lookup and the "
        "suffix cache keep as many drafts as usual; a draft model's sampled drafts fewer",
    )
    g.add_argument(
        "--verification",
        choices=VERIFICATION_RULES,
        default="block",
        help="how a draft model's (or a head's) sampled drafts are verified: block (block "
        "verification, Sun et al. 2025: the whole chain judged at once, never fewer tokens kept in "
        "expectation; a tree node by node), token (token by token; a tree node by node) or traversal "
        "(a chain as block; a tree walked from its leaves up, each path judged whole: no gain "
        "measured on the draft model's trees, ten times the host time); all sample the target "
        "exactly (default: block)",
    )
    g.add_argument(
        "--stop",
        type=_text("an empty stop string would end every generation at once"),
        action="append",
        default=[],
        help="stop string (repeatable; default: none)",
    )
    g.add_argument(
        "--json-schema",
        metavar="FILE|JSON",
        default=None,
        help="the output is JSON following this JSON Schema (a file, or the schema itself); speculated "
        "exactly under it, the schema's forced tokens drafted free (default: free text)",
    )
    g.add_argument(
        "--grammar",
        metavar="FILE",
        default=None,
        help="the output follows this GBNF grammar (llama.cpp's format; a .lark file: Lark) (default: free text)",
    )


def _add_costs_flag(g, who: str = "--draft auto") -> None:
    """--costs: auto's cost curves from a `specdec costs` report instead of timing them."""
    g.add_argument(
        "--costs",
        metavar="REPORT",
        default=None,
        help=f"{who}'s cost curves (what a target forward of W tokens costs, and the draft model's) from "
        "a `specdec costs --out REPORT` of the same target, backend and draft model, instead of timing "
        "them at start: a curve timed once on a quiet machine, for every machine like it (one timed at "
        "other threads or elsewhere misleads auto's choices, never the output; a report without the "
        "draft model's curve: that one is timed) (default: timed at first use, cached per model and threads)",
    )


def _add_suffix_flags(g, cache_file: bool = True, off: str = "--draft auto goes without the suffix cache") -> None:
    """The suffix cache's flags (--draft suffix, and auto, which consults it); `off` says what
    --suffix-cap 0 does in this command."""
    g.add_argument(
        "--suffix-cap",
        type=_non_negative_int,
        default=SUFFIX_CAP,
        metavar="TOKENS",
        help=f"tokens the suffix cache holds at most, corpus included (default: {SUFFIX_CAP}, "
        f"about 400 bytes of memory a token); past it the oldest requests are forgotten "
        f"first, down to 80%% of the cap. 0: {off}",
    )
    g.add_argument(
        "--draft-corpus",
        metavar="FILE",
        default=None,
        help="a UTF-8 text file the suffix cache drafts from too, tokenized by the target's "
        "tokenizer; never forgotten (default: none)",
    )
    if cache_file:
        g.add_argument(
            "--suffix-cache",
            metavar="FILE",
            default=None,
            help="load the suffix cache from FILE at start (if it exists) and save it there "
            "at exit, atomically (default: none; the cache lives as long as the process)",
        )
    else:
        g.set_defaults(suffix_cache=None)  # one shape of args for the suffix helpers
