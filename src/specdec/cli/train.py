"""`specdec train`: a head that drafts from the target's hidden states (train/), written to one file."""

from __future__ import annotations

import json
import sys

from .. import catalog
from ..errors import SpecdecError
from ..paths import writable_reason
from ..train import EXIT_EPOCHS, EXIT_LR, EXIT_WINDOWS
from .flags import _add_threads_flag, _add_torch_flags
from .loading import _check_device
from .options import _float_in, _positive

KINDS_HELP = (
    "medusa:N (N heads, one draft token each), prophet:K (an EAGLE-style layer drafting chains of K) or "
    "early-exit:L+B (the target's first L layers and B trained blocks: a draft model of its vocabulary)"
)
# what a 2-core CPU has the 1.5B answer in about 16 minutes (31 tokens/s, 4 answers at a time), or
# read as text in about 15 (36 tokens/s); docs/results/provenance.md#default_tokens
DEFAULT_TOKENS = 30_000


def _kind(text: str) -> dict:
    """KIND -> the TrainConfig fields it sets."""
    name, _, n = text.partition(":")
    if name == "early-exit":
        layers, plus, blocks = n.partition("+")
        blocks = blocks if plus else "1"
        if not (layers.isdigit() and blocks.isdigit() and int(layers) >= 1 and 1 <= int(blocks) <= 4):
            raise SpecdecError(
                f"train {text!r}: write early-exit:L+B, L >= 1 layers of the target and B of 1..4 blocks"
            )
        return {"kind": name, "layers": int(layers), "blocks": int(blocks)}
    if name not in ("medusa", "prophet"):
        raise SpecdecError(f"train {text!r}: the kinds are {KINDS_HELP}")
    if n and not (n.isdigit() and 1 <= int(n) <= 8):
        raise SpecdecError(f"train {text!r}: {name}:N takes N from 1 to 8")
    return {"kind": name, "steps": int(n) if n else 3}


def _add_train_parser(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train a draft head on the target's own hidden states",
        description="Have the target answer requests (or read text) once, keeping its hidden states "
        "and greedy tokens (cached under $SPECDEC_HOME/features; an interrupted run resumes), then "
        "train a head on them and write one file (safetensors + JSON: the target's sha256, the data's "
        "provenance, the held-out agreement). Draft with it: specdec generate --draft head:FILE. "
        "Ctrl-C keeps what is done; the same command resumes. Memory: the features, 2 bytes x the "
        "hidden width a token (the 1.5B: 3 KB, so 30 000 tokens take 92 MB, on disk and in memory), "
        "and the model; early-exit:L+B adds as much again for the states after layer L, and the "
        "target's weights read by the NumPy backend with the L + B layers in float32 (the 1.5B at 7+1: "
        "6.6 GB resident while training).",
    )
    p.add_argument("kind", metavar="KIND", help=KINDS_HELP)
    p.add_argument(
        "--target",
        default=catalog.DEFAULT_TARGET,
        help=f"built-in name or .gguf path (default: {catalog.DEFAULT_TARGET})",
    )
    p.add_argument(
        "--backend", choices=("llama", "numpy", "torch"), default="llama", help="the target's backend (default: llama)"
    )
    p.add_argument("--out", required=True, metavar="FILE", help="the head file to write")
    p.add_argument(
        "--data",
        nargs="+",
        metavar="PATH",
        default=None,
        help="what the head learns from. 'self' [PATH ...] (the default): the target's own answers, "
        "through its chat template, to requests made from those files (default: this Python's standard "
        "library sources and the installed packages' documentation): functions to write or explain, "
        "passages to summarise, translate or answer from, word problems. 'text' "
        "[PATH ...], or PATH ...: the files' text itself, one 512-token window a file (faster: a "
        "prefill, not decoding; but not what a head drafts, and it learns far less)",
    )
    p.add_argument(
        "--rows",
        type=_positive(int),
        default=None,
        help="--data self: answers decoded together (default: 16 on a CPU, 64 on a GPU); greedy, so "
        "only the speed changes",
    )
    p.add_argument(
        "--invented",
        type=_float_in(0.0, 1.0, low_open=False),
        default=0.0,
        metavar="SHARE",
        help="--data self: this share of the requests written by the target itself (Magpie: a chat model "
        "given its template up to an open user turn writes what its users ask), the rest from the "
        "files' templates; a chat model only (default: 0, every request from the templates)",
    )
    p.add_argument(
        "--requests",
        metavar="FILE",
        default=None,
        help="--data self: ask the target these requests instead of the templates', each once, in order "
        "(a head learns best from what its users ask): a JSON Lines file (or one JSON list) of OpenAI chat "
        'bodies ({"messages": [...]}, as a server logs them), ShareGPT conversations ({"conversations": '
        '[{"from", "value"}, ...]}) or {"prompt": "..."}; the target answers each one\'s last user turn '
        "(trailing assistant turns are dropped). Training stops where the file or --tokens ends, whichever "
        "is first; every 20th request is held out (default: none, the templates' requests)",
    )
    p.add_argument(
        "--tokens",
        type=_positive(int),
        default=DEFAULT_TOKENS,
        help=f"training tokens at most (default: {DEFAULT_TOKENS})",
    )
    p.add_argument(
        "--epochs",
        type=_float_in(0.0, 100.0, low_open=True),
        default=None,
        help=f"passes over the data (default: 2; early-exit: {EXIT_EPOCHS:g})",
    )
    p.add_argument(
        "--batch",
        type=_positive(int),
        default=None,
        help=f"chains per update (default: 128); early-exit: whole windows per update (default: {EXIT_WINDOWS})",
    )
    p.add_argument(
        "--lr",
        type=_float_in(0.0, 1.0, low_open=True),
        default=None,
        help=f"learning rate (default: 0.001; early-exit, whose blocks start as the target's: {EXIT_LR})",
    )
    p.add_argument(
        "--vocab",
        type=_positive(int),
        default=8192,
        help="draft vocabulary size: the training data's tokens, then the target's lowest ids (default: 8192)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    _add_threads_flag(p)
    _add_torch_flags(p, auto_layout=True)
    p.set_defaults(exact=False)  # (the model flags' check reads it; training has no exact mode)


def cmd_train(args) -> int:
    from .. import load_model
    from ..train import conversations, features
    from ..train.trainer import TrainConfig, train

    kind = _kind(args.kind)
    why = writable_reason(args.out)
    if why:  # found now, not after the training
        raise SpecdecError(f"--out {args.out} cannot be written: {why}")
    source = args.data or ["self"]
    answers = source[0] == "self"
    if args.invented and not answers:
        raise SpecdecError("--invented is a share of --data self's requests; --data text has none")
    paths = source[1:] if source[0] in ("self", "text") else source
    requests = None
    if args.requests:  # read whole before anything loads: a bad line is found now, not an hour in
        if not answers:
            raise SpecdecError("--requests are asked of the target (--data self); --data text reads files instead")
        if paths:
            raise SpecdecError("--requests replaces the templates and their sources: give --data self without paths")
        requests = conversations.read_requests(args.requests)
    files = [] if requests else features.expand(paths) if paths else features.default_sources()
    # (a share of invented requests with --requests: refused here, before the load)
    corpus = (
        conversations.SelfCorpus(files, args.tokens, invented=args.invented, requests=requests) if answers else None
    )
    exit_kind = kind["kind"] == "early-exit"
    batch = args.batch or (EXIT_WINDOWS if exit_kind else 128)
    lr = args.lr or (EXIT_LR if exit_kind else 1e-3)
    epochs = args.epochs or (EXIT_EPOCHS if exit_kind else 2.0)
    config = TrainConfig(**kind, vocab=args.vocab, epochs=epochs, batch=batch, lr=lr)
    try:
        import torch  # noqa: F401  (before an hour of features: training needs it)
    except ImportError:
        raise SpecdecError("training a head needs torch: pip install -e '.[train]' (in specdec's checkout)") from None
    _check_device(args)  # a bad --device, --cache or --graphs before the load; --cache auto resolved
    torch_flags = dict(device=args.device, dtype=args.dtype, cache=args.cache, graphs=args.graphs)
    rows = args.rows or conversations.ROWS  # answers decoded together: more on a GPU
    if not args.rows and args.backend == "torch":
        from ..models.transformers import pick_device

        rows = conversations.GPU_ROWS if pick_device(args.device) != "cpu" else rows
    target = load_model(  # answering: rows that hold a request and its answers; text: one window
        args.target,
        backend=args.backend,
        n_ctx=conversations.N_CTX if answers else features.WINDOW,
        threads=args.threads,
        max_rows=rows if answers else 1,
        trees=False,  # a KV cache stream a row (llama.cpp): a step's attention reads only each row's own cells
        **(torch_flags if args.backend == "torch" else {}),
    )
    from ..models.base import HiddenStates

    if not isinstance(target, HiddenStates):
        raise SpecdecError(f"--backend {args.backend} does not give hidden states")
    exit_model = _exit_reference(target, config) if exit_kind else None  # checked before the features
    # a vocabulary of letters (a test model's) has few distinct tokens in any text: no table filter
    progress = not args.no_progress
    try:
        if answers:
            folder = conversations.collect(target, corpus, progress=progress, rows=rows)
        else:
            corpus = features.Corpus(files, args.tokens, features.MIN_DISTINCT if target.vocab_size >= 10_000 else 0.0)
            folder = features.collect(target, corpus, progress=progress)
        data = json.loads((folder / "data.json").read_text())
        if requests is not None and data["tokens"] < args.tokens:
            print(
                f"the {len(requests.chats)} requests of {args.requests} came to {data['tokens']} tokens, "
                f"under --tokens {args.tokens}: training on them all",
                file=sys.stderr,
            )
        loaded = features.load_features(folder, args.tokens)
        if exit_kind:
            from ..train.exit import exit_states, train_exit

            states = exit_states(exit_model, loaded, config.layers, folder / f"exit-{config.layers}", progress)
            info = train_exit(target, exit_model, loaded, config, states, args.out, data, progress=progress)
        else:
            info = train(target, loaded, config, args.out, data, progress=progress)
    except KeyboardInterrupt:
        print("specdec: interrupted; what was done is kept: run the same command to resume", file=sys.stderr)
        raise
    print(f"wrote {args.out}: {info.describe()}")
    held = info.held_out
    if held:
        print(
            f"held-out: {held['positions']} chains; estimated tokens a step at temperature 0: {held['tokens_per_step']}"
        )
    print(f"draft with it: specdec generate --target {args.target} --draft head:{args.out}")
    return 0


def _exit_reference(target, config):
    """The target's weights as the NumPy backend reads them (the target itself where it is one):
    early-exit training runs its first layers and starts its blocks from them."""
    from ..models.numpy_ref import NumpyModel, load_numpy_model

    path = getattr(target, "path", None)
    if not isinstance(target, NumpyModel) and (path is None or path.suffix != ".gguf"):
        raise SpecdecError("early-exit heads are built from a GGUF target: use --backend llama or numpy")
    model = target if isinstance(target, NumpyModel) else load_numpy_model(path, n_ctx=16)
    if config.layers + config.blocks >= model.n_layer:
        raise SpecdecError(
            f"early-exit:{config.layers}+{config.blocks}: {model.name} has {model.n_layer} layers; "
            f"L + B must be fewer, or the draft costs what the target does"
        )
    return model
