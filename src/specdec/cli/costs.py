"""`specdec costs`: time the target's (and the draft's) forward over widths, rows and cache depths,
print the curves and save them as JSON."""

from __future__ import annotations

import json
import os
import sys

from .. import catalog
from ..costs import DEEP, SHALLOW
from ..errors import SpecdecError
from ..paths import writable_reason, write_atomically
from .flags import _add_model_flags
from .loading import _check_device, _model_loader
from .options import _positive


def _add_costs_parser(sub) -> None:
    p = sub.add_parser(
        "costs",
        help="time the target's (and draft's) forward: the cost curve",
        description="Time a forward of 1..16 tokens per row (and 24..64), for the torch "
        "backend also in batches of B rows, at a few cache depths; print the "
        "curves and save them as JSON (device, dtype, model shape, versions). "
        "`scripts/replay_controller.py replay --curve FILE` predicts speedups "
        "from it.",
    )
    _add_model_flags(
        p,
        target_help=f"built-in name, .gguf path or (torch) model folder (default: {catalog.DEFAULT_TARGET})",
        draft_default=None,
        draft_help="also time this draft model (default: none)",
        backend_help="the backend whose forward is timed: llama (GGUF through llama.cpp), numpy or torch",
        ctx=(4096, "context window in tokens (default: 4096)"),
        after={"--dtype": lambda: _add_costs_flags(p)},
    )
    p.add_argument("--out", default=None, metavar="FILE.json", help="save the curves here (default: print them only)")


def _add_costs_flags(p) -> None:
    """costs' own flags: what to build, and where and how to time it."""
    p.add_argument(
        "--random-weights",
        metavar="CONFIG.json",
        default=None,
        help="torch backend: build the target from a Hugging Face config with random weights "
        "instead of loading --target (e.g. benchmarks/configs/qwen2.5-coder-7b.json; default: none, load --target)",
    )
    p.add_argument(
        "--draft-random-weights",
        metavar="CONFIG.json",
        default=None,
        help="torch backend: the draft likewise (default: none, load the draft model)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch backend on CUDA: torch.compile the forward inside each graph (needs --graphs; "
        "each width compiles once, tens of seconds)",
    )
    p.add_argument(
        "--rows",
        type=_positive(int),
        nargs="+",
        default=[1],
        metavar="B",
        help="rows per forward, each of W tokens (default: 1)",
    )
    p.add_argument(
        "--depths",
        type=_positive(int),
        nargs="+",
        default=[SHALLOW, DEEP],
        metavar="D",
        help=f"tokens already in each row's cache (default: {SHALLOW} {DEEP}, the depths auto times: "
        "it takes a forward's cost as linear in the depth between and past them)",
    )
    p.add_argument(
        "--repeats", type=_positive(int), default=5, help="timings per point; the fastest counts (default: 5)"
    )


def _costs_models(args):
    """(target, draft or None) as the costs flags ask; every flag is checked before a load."""
    from ..costs import WIDE

    if args.backend != "torch":
        for flag, value in (
            ("--random-weights", args.random_weights),
            ("--draft-random-weights", args.draft_random_weights),
            ("--compile", args.compile),
        ):
            if value:
                raise SpecdecError(f"{flag} needs --backend torch")
    _check_device(args)  # --cache and --graphs, and the device
    if args.compile and not args.graphs:
        raise SpecdecError("--compile needs --graphs (the compiled forward is captured as a CUDA graph)")
    if args.draft and args.draft_random_weights:
        raise SpecdecError("give --draft or --draft-random-weights, not both")
    deepest = max(args.depths) + WIDE[-1]
    if deepest > args.ctx:
        raise SpecdecError(
            f"--depths {max(args.depths)} needs --ctx >= {deepest} (depth + the widest forward, {WIDE[-1]} tokens)"
        )
    if args.out and not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
        raise SpecdecError(f"--out {args.out}: no such folder")
    why = writable_reason(args.out) if args.out else None
    if why:  # found now, not after the timing
        raise SpecdecError(f"--out {args.out} cannot be written: {why}")
    load_by_name = _model_loader(args, max(args.rows))

    def load(name, config):
        if config:
            from ..models.transformers import load_random_weights

            return load_random_weights(
                config,
                device=args.device,
                dtype=args.dtype,
                n_ctx=args.ctx,
                threads=args.threads,
                cache=args.cache,
                graphs=args.graphs,
                compile=args.compile,
            )
        model = load_by_name(name)  # (over --cache, with --graphs)
        if args.compile:  # a loaded torch model: rebuild it with the compiled forward
            from ..models.transformers import TransformersModel

            model = TransformersModel(
                model.model,
                model.tokenizer,
                model.name,
                model.n_ctx,
                model.is_instruct,
                cache=args.cache,
                graphs=args.graphs,
                compile=args.compile,
            )
        return model

    target = load(args.target, args.random_weights)
    wants_draft = args.draft or args.draft_random_weights
    return target, (load(args.draft, args.draft_random_weights) if wants_draft else None)


def _model_facts(model, backend: str) -> dict:
    """What the report says about a model: its shape, and where and how it ran."""
    facts = {"name": model.name, "backend": backend, "vocab": model.vocab_size}
    if backend == "torch":
        config = model.config.get_text_config()
        facts.update(
            device=str(model.device),
            dtype=str(model.dtype).replace("torch.", ""),
            cache=model.layout,
            layers=config.num_hidden_layers,
            hidden=config.hidden_size,
            heads=config.num_attention_heads,
            kv_heads=getattr(config, "num_key_value_heads", config.num_attention_heads),
            parameters=sum(p.numel() for p in model.model.parameters()),
        )
        if model.device.type == "cuda":
            import torch

            facts["gpu"] = torch.cuda.get_device_name(model.device)
    else:
        facts["threads"] = getattr(model, "n_threads", None)
        facts["exact"] = getattr(model, "exact", False)  # the exact mode's kernels have their own curve
    return facts


def cmd_costs(args) -> int:
    import platform

    from ..costs import cost_report, format_curves

    target, draft = _costs_models(args)
    report = {
        "command": "specdec costs " + " ".join(sys.argv[2:]),
        "machine": platform.processor() or platform.machine(),
        "versions": _versions(args.backend),
    }
    for role, model in (("target", target), ("draft", draft)):
        if model is None:
            continue
        curves = cost_report(model, args.rows, args.depths, args.repeats)
        report[role] = {**_model_facts(model, args.backend), "curves": curves}
        print(format_curves(f"{role} {model.name}: seconds of one forward of W tokens per row", curves))
        print()
    if args.out:
        try:
            write_atomically(args.out, json.dumps(report, indent=1).encode())
        except OSError as exc:
            raise SpecdecError(f"cannot write --out {args.out}: {exc.strerror}") from None
        print(f"wrote {args.out}")
    return 0


def _versions(backend: str) -> dict:
    import platform

    versions = {"python": platform.python_version(), "specdec": __import__("specdec").__version__}
    if backend == "torch":
        import torch
        import transformers

        versions.update(torch=torch.__version__, transformers=transformers.__version__, cuda=torch.version.cuda)
    return versions
