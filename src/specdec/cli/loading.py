"""What the model flags ask for, loaded: the --threads check, the one model loader generate, compare,
demo, serve and costs load through, the decoder of generate, compare and demo, and the suffix cache
(its flags checked before a load, loaded, and saved at exit)."""

from __future__ import annotations

import sys

from .. import catalog
from ..errors import SpecdecError, VocabMismatchError
from ..paths import writable_reason


def _check_threads(args) -> None:
    """--threads above the cores this process may use only slows every step down (the threads
    wait on each other): use them all, and say so."""
    from ..models.llama_cpp import default_threads

    cores = default_threads()
    if args.threads is not None and args.threads > cores:
        print(
            f"specdec: warning: --threads {args.threads} is more than the {cores} cores this process "
            f"may use; using {cores}",
            file=sys.stderr,
        )
        args.threads = cores


def _model_loader(args, rows: int):
    """load(name, backend=--backend, trees=True): a model as the model flags ask (--ctx, --threads,
    --device, --dtype, on torch --cache and --graphs, and serve's --no-huge-pages), with room for
    `rows` sequences at once (`trees`: it will score tree drafts, load_model's); every command that
    loads models through the model flags loads them here."""
    from .. import load_model

    def load(name, backend=args.backend, trees=True):
        layout = {"cache": args.cache, "graphs": args.graphs} if backend == "torch" else {}
        return load_model(
            name,
            backend=backend,
            n_ctx=args.ctx,
            threads=args.threads,
            device=args.device,
            dtype=args.dtype,
            max_rows=rows,
            exact=args.exact,
            trees=trees,
            huge_pages=getattr(args, "huge_pages", False),  # serve's, on unless --no-huge-pages
            gpu_layers=getattr(args, "gpu_layers", 0),
            **layout,
        )

    return load


def torch_layout(args) -> tuple[str, bool]:
    """(cache, graphs) for a torch model: --cache auto (specdec train's) is the static cache with
    CUDA graphs on a GPU (there its answering ran at 1 353 tokens/s, 64 rows, against the dynamic
    cache's 315 at 16: docs/results/heads.md, "a million tokens on a GPU"), and the dynamic cache elsewhere."""
    if args.cache != "auto":
        return args.cache, args.graphs
    from ..models.transformers import pick_device

    if pick_device(args.device).startswith("cuda"):
        return "static", True
    return ("static" if args.graphs else "dynamic"), args.graphs  # --graphs: the device check's error


def _check_device(args) -> None:
    """A bad --device, --cache or --graphs fails before a long load, when the target or the draft
    runs on torch (and --exact on another backend than llama, or a torch flag where no model runs
    on torch, before that: they need no torch to be told)."""
    from ..models.load import check_exact

    draft_backend = getattr(args, "draft_backend", None)
    for backend in (args.backend, draft_backend or args.backend):  # the draft's: the target's unless told
        check_exact(backend, args.exact)
    on_torch = "torch" in (args.backend, draft_backend)
    if on_torch and args.cache == "auto":
        args.cache, args.graphs = torch_layout(args)
    for flag, value in (("--cache static", args.cache == "static"), ("--graphs", args.graphs)):
        if value and not on_torch:
            raise SpecdecError(f"{flag} needs --backend torch")
    if args.graphs and args.cache != "static":
        raise SpecdecError("--graphs needs --cache static")
    if on_torch:
        from ..models.transformers import pick_device

        device = pick_device(args.device)
        if args.graphs and not device.startswith("cuda"):
            raise SpecdecError(f"--graphs needs a CUDA device (--device cuda); this one is {device}")


def _decoder(args):
    """The SpeculativeDecoder the flags ask for."""
    from ..decoder import SpeculativeDecoder
    from ..spec import parse

    rows = getattr(args, "batch_size", None) or 1
    load = _model_loader(args, rows)
    draft_model = args.draft_model if args.draft_model is not None else catalog.default_draft(args.target)
    # a bad --draft fails before a long load
    spec = parse(
        args.draft,
        args.backend,
        args.draft_tokens,
        draft_model=draft_model or "none",
        width=getattr(args, "draft_width", 1),
        nodes=getattr(args, "draft_nodes", 0),
    )
    _check_suffix_flags(args, spec.kind)  # so do bad suffix cache flags
    _check_device(args)  # and a bad --device
    if args.costs and not spec.is_auto:
        raise SpecdecError(f"--costs is auto's cost curves: give --draft auto (this run drafts with {args.draft})")
    report = _read_costs(args)  # and a bad --costs
    target = load(args.target)
    suffix = _suffix_cache(args, target) if spec.kind in ("suffix", "auto") else False
    # a draft model of another vocabulary drafts across tokenizers (drafters.model_drafter)
    try:
        decoder = SpeculativeDecoder.from_spec(
            target, spec, lambda name: load(name, args.draft_backend or args.backend), max_rows=rows, suffix=suffix
        )
    except VocabMismatchError as exc:
        if not spec.is_auto:
            raise
        raise VocabMismatchError(
            f"--draft-model {draft_model}: {exc.reason}; give --draft-model none (prompt "
            f"lookup only) or a draft model of the target's family"
        ) from None
    if report is not None:
        decoder.costs = _report_costs(args, report, target, decoder.model_drafter)
    if (spec.width > 1 or spec.nodes) and not target.scores_trees:
        why = "--exact keeps a cache stream per row, and " if args.exact else ""
        note = (
            f"{target.name} verifies no trees here ({why}a tree's nodes share cache cells): each tree of "
            f"--draft-width {spec.width} is drafted as its chain"
        )
        decoder.notes.append(note)
        print(f"specdec: note: {note}", file=sys.stderr)
    return decoder


def _read_costs(args) -> dict | None:
    """--costs: the `specdec costs` report, read and checked before any model loads (None: none)."""
    import json
    from pathlib import Path

    from ..paths import reason

    if not args.costs:
        return None
    try:
        report = json.loads(Path(args.costs).read_text(encoding="utf-8"))
    except OSError as exc:
        raise SpecdecError(f"--costs {args.costs}: cannot read it: {reason(exc)}") from None
    except (ValueError, UnicodeDecodeError):
        raise SpecdecError(f"--costs {args.costs}: not JSON; give a `specdec costs --out FILE` report") from None
    from ..costs import cost_table

    try:
        for role in ("target", "draft") if isinstance(report, dict) and report.get("draft") else ("target",):
            cost_table(report, role)
            if not isinstance(report[role]["name"], str):  # _report_costs checks it against the model's
                raise TypeError(role)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError):
        raise SpecdecError(
            f"--costs {args.costs}: not a `specdec costs --out FILE` report (no one-row curve of a named target)"
        ) from None
    return report


def _report_costs(args, report: dict, target, draft) -> tuple:
    """(the target's cost table, the draft model's or None: timed) from a --costs report, once it
    is known to be of this target (name, backend, exact mode) and of this draft model (`draft`:
    auto's draft model, loaded, or its drafter; None: none)."""
    from ..costs import cost_table
    from ..drafters.base import Drafter, DraftModel

    facts = report["target"]
    ran = (facts.get("name"), facts.get("backend"), bool(facts.get("exact", False)))
    if ran != (target.name, args.backend, bool(args.exact)):
        raise SpecdecError(
            f"--costs {args.costs} timed {ran[0]} on --backend {ran[1]}{' --exact' if ran[2] else ''}, not "
            f"{target.name} on --backend {args.backend}{' --exact' if args.exact else ''}: give a report "
            f"of this target (specdec costs --target {args.target} --out FILE)"
        )
    if isinstance(draft, Drafter):  # a draft model's drafter holds it; a head or early exit times itself
        draft = draft.model if isinstance(draft, DraftModel) else None
    timed = report.get("draft")
    if timed is None or draft is None:
        return cost_table(report, "target"), None
    if timed.get("name") != draft.name:
        raise SpecdecError(
            f"--costs {args.costs} timed the draft model {timed.get('name')}, not {draft.name}: give a report "
            f"with this one (specdec costs --draft ...), or one without a draft model (its curve is timed)"
        )
    return cost_table(report, "target"), cost_table(report, "draft")


def _check_suffix_flags(args, kind: str) -> None:
    """The suffix flags agree with --draft (kind: its DraftSpec.kind); checked before a load."""
    from pathlib import Path

    given = [
        flag for flag, value in (("--draft-corpus", args.draft_corpus), ("--suffix-cache", args.suffix_cache)) if value
    ]
    if kind == "suffix" and args.suffix_cap == 0:
        raise SpecdecError("--draft suffix needs a cache: give --suffix-cap >= 1")
    if given and kind not in ("suffix", "auto"):
        raise SpecdecError(f"{given[0]} is for the suffix cache: give --draft suffix or auto")
    if given and args.suffix_cap == 0:
        raise SpecdecError(f"{given[0]} needs the suffix cache, which --suffix-cap 0 turns off")
    _check_draft_corpus(args)
    cache = args.suffix_cache
    if cache and (Path(cache).is_dir() or not Path(cache).resolve().parent.is_dir()):
        raise SpecdecError(f"--suffix-cache {cache}: not a file in an existing folder")
    why = writable_reason(cache) if cache else None
    if why:  # found now, not at exit after the work
        raise SpecdecError(f"--suffix-cache {cache} cannot be written: {why}")


def _check_draft_corpus(args) -> None:
    from pathlib import Path

    if args.draft_corpus and not Path(args.draft_corpus).is_file():
        raise SpecdecError(f"--draft-corpus {args.draft_corpus}: no such file")


def _suffix_cache(args, target):
    """The suffix cache the flags ask for, loaded (corpus and saved cache); False: none (auto
    without it)."""
    from ..build import suffix_cache

    return suffix_cache(target, args.suffix_cap, args.draft_corpus, args.suffix_cache)


def _save_suffix(args, decoder) -> None:
    """--suffix-cache: what this run added to the cache, saved for the next."""
    cache = decoder.suffix_cache()
    if args.suffix_cache and cache is not None:
        cache.save(args.suffix_cache)
