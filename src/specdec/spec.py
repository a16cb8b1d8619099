"""DraftSpec: the one parsed form of a drafter choice, its one parser and its one factory.

A drafter choice comes from the CLI (--draft, --draft-model, -k), from a bench method (ngram:8,
auto:nosuffix) or from a request's `speculative` object; each is parsed here, once, into a
DraftSpec, and every drafter is made from one (`make_drafter`; a whole decoder:
engine.SpeculativeDecoder.from_spec). A new drafter kind is one member of Kind, one branch of
`parse` and one of `make_drafter`.

    auto | none | ngram | suffix | early-exit:L | head:FILE | [string: | intersect:]<model name or path>

`auto` is not a drafter but a policy (the cost-aware controller over prompt lookup, the suffix
cache and a draft model); the engine builds it. A draft model of the target's vocabulary drafts
token ids directly (drafters.model.ModelDrafter); one of another vocabulary drafts across
tokenizers (drafters.cross_vocab.CrossVocabDrafter), string-level unless the name says
`intersect:`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Literal, get_args

from .drafters.cross_vocab import MODES as CROSS_VOCAB_MODES
from .errors import SpecdecError

Kind = Literal["auto", "none", "ngram", "suffix", "early-exit", "head", "model"]
KINDS: tuple[str, ...] = get_args(Kind)
DEFAULT_K = 4  # draft tokens a step of a fixed drafter when none is given
GRAMMAR = (
    "auto | none | ngram | suffix | early-exit:L | head:FILE (a head from `specdec train`) | a built-in "
    "model name or a .gguf path, for a "
    "model of another vocabulary optionally prefixed string: or intersect:"
)
# whether auto consults the suffix cache when not told (DraftSpec.suffix None)
# why: a fresh process, its cache empty, stays within 3% of auto without it; history: docs/provenance.md#auto_suffix
AUTO_SUFFIX = True
# the kinds whose drafter takes a tree width with each call (drafters.ngram, drafters.suffix), so
# one of it serves requests of different widths (a draft model or head drafts the shape it was built with)
WIDTH_PER_CALL = ("ngram", "suffix")
METHODS = (
    "plain, auto, auto:suffix, auto:nosuffix, draft:K, draft:KxW[/N] (a tree: W candidates a depth; /N: "
    "grown to its N likeliest nodes, W children a node), ngram:K, "
    "ngram:KxW (a tree: up to W continuations of the earlier occurrences), "
    "suffix:K, suffix:KxW[/N] (a tree: the cache's W likeliest continuations under each node), "
    "early-exit:L:K and early-exit:L:KxW[/N] (--backend numpy or torch), head:K:FILE, "
    "head:KxW[/N]:FILE (a head's tree), "
    "auto:head:FILE (auto with the head in the draft model's place)"
)


@dataclass(frozen=True)
class DraftSpec:
    kind: Kind
    k: int = DEFAULT_K  # a fixed drafter's draft tokens a step (auto picks its own)
    layers: int = 0  # early-exit: the target's first `layers` layers draft
    # model: the draft model ("": the one the caller gives, as bench's draft:K); auto: the draft
    # model it may use ("": none)
    model: str = ""
    vocab: str = ""  # a model's: "string" / "intersect" (across tokenizers); "": by vocabulary
    suffix: bool | None = None  # auto: consult the suffix cache (None: AUTO_SUFFIX)
    head: str = ""  # head: the head file (specdec train); auto: a head it drafts with, as with a draft model
    # model: candidates per draft position (> 1: a tree, drafters.model); suffix: continuations
    # under each node (> 1: a tree, drafters.suffix)
    width: int = 1
    nodes: int = 0  # a tree: the most probable paths' nodes it keeps (0: k x width)

    @property
    def is_auto(self) -> bool:
        return self.kind == "auto"

    @property
    def drafts(self) -> bool:
        """Whether it drafts at all (a fixed drafter with k = 0 is plain decoding)."""
        return self.is_auto or (self.kind != "none" and self.k > 0)

    @property
    def wants_suffix(self) -> bool:
        """Whether it drafts from a suffix cache: 'suffix', and auto unless told not to."""
        return self.kind == "suffix" or (self.is_auto and (AUTO_SUFFIX if self.suffix is None else self.suffix))

    @property
    def label(self) -> str:
        """'auto', 'none', or KIND:K ('ngram:4', 'model:4'; a tree KIND:KxW, 'suffix:16x4'), as the
        server reports a policy."""
        if self.kind in ("auto", "none"):
            return self.kind
        return f"{self.kind}:{self.k}" + (f"x{self.width}" if self.width > 1 else "")


def parse(
    text: str | None,
    backend: str | None = None,
    k: int = DEFAULT_K,
    draft_model: str | None = None,
    width: int = 1,
    nodes: int = 0,
) -> DraftSpec:
    """A drafter name (the grammar above) -> DraftSpec, validated before anything is loaded.
    `backend` is the target's, if known; `k` the draft tokens of a fixed drafter; `draft_model`
    (auto only) names the draft model auto may use ('none' or None: none); `width` a draft
    model's candidates per position, or the suffix cache's continuations per node (> 1: trees),
    and `nodes` how many of the k x width the tree keeps (0: all), chosen by their paths'
    probabilities (the draft model's, or the share of the cache's occurrences)."""
    if nodes and width < 2:
        raise SpecdecError(f"--draft-nodes {nodes} shapes a tree: give --draft-width 2 or more as well")
    if width > 1:
        spec = parse(text, backend, k, draft_model)
        if not (spec.kind == "model" and not spec.vocab) and spec.kind not in ("suffix", "head", "ngram", "early-exit"):
            raise SpecdecError(
                f"--draft-width {width} drafts trees from a draft model of the target's vocabulary, a "
                f"trained head, an early exit, the suffix cache or prompt lookup: give --draft suffix, "
                f"ngram, early-exit:L, a model name or path, or head:FILE (not {text or 'none'})"
            )
        if nodes and spec.kind == "ngram":
            raise SpecdecError(
                f"--draft-nodes {nodes}: prompt lookup's tree keeps every continuation it drafts "
                "(--draft-width alone shapes it)"
            )
        return replace(spec, width=width, nodes=nodes)
    text = (text or "").strip()
    if text in ("", "none"):
        return DraftSpec("none", k=0)
    if text == "auto":
        model = parse(draft_model) if draft_model else DraftSpec("none")
        if model.kind == "head":  # a trained head in the draft model's place: auto prices it alike
            return DraftSpec("auto", k=0, head=model.head)
        if model.kind not in ("none", "model"):
            raise SpecdecError(f"--draft-model {draft_model}: give a model name or path, head:FILE, or none")
        return DraftSpec("auto", k=0, model=model.model, vocab=model.vocab)
    if text in ("ngram", "suffix"):
        return DraftSpec(text, k=k)
    if text.startswith("early-exit"):
        try:
            layers = count(text.split(":", 1)[1])
        except (IndexError, ValueError):
            raise SpecdecError(f"draft {text!r}: write early-exit:L with L the number of layers") from None
        if layers < 1:
            raise SpecdecError(f"draft {text!r}: L must be >= 1")
        if backend is not None and backend not in ("numpy", "torch"):
            raise SpecdecError(
                f"draft {text}: early exit needs --backend numpy or torch (llama.cpp runs every layer of a forward)"
            )
        return DraftSpec("early-exit", k=k, layers=layers)
    if text.startswith("head:") or text == "head":
        path = text[5:].strip()
        if not path:
            raise SpecdecError(f"draft {text!r}: write head:FILE with FILE a head from `specdec train`")
        from .drafters.headfile import read_info

        read_info(path)  # a missing or broken head file fails before any model is loaded
        return DraftSpec("head", k=k, head=path)
    mode, sep, name = text.partition(":")
    if sep and mode in CROSS_VOCAB_MODES:
        if not name.strip():
            raise SpecdecError(f"draft {text!r}: write {mode}:MODEL with MODEL a built-in name or a .gguf path")
        return DraftSpec("model", k=k, model=name.strip(), vocab=mode)
    return DraftSpec("model", k=k, model=text)


def parse_method(method: str) -> DraftSpec | None:
    """One of our bench methods (METHODS) -> DraftSpec; None where it is not one of ours' form.
    `draft:K` drafts with the bench's draft model (model "")."""
    head, _, rest = method.partition(":")
    if method == "plain":
        return DraftSpec("none", k=0)
    if head == "auto" and rest in ("", "suffix", "nosuffix"):
        return DraftSpec("auto", k=0, suffix={"": None, "suffix": True, "nosuffix": False}[rest])
    if head == "auto" and rest.startswith("head:") and rest[5:]:  # auto with a head for its draft model
        return DraftSpec("auto", k=0, head=rest[5:])
    try:
        if head == "early-exit":  # early-exit:L:K; a tree, early-exit:L:KxW[/N]
            layers, _, shape = rest.partition(":")
            if count(layers) >= 1 and (kwn := parse_shape(shape)):
                k, width, nodes = kwn
                return DraftSpec("early-exit", k=k, layers=count(layers), width=width, nodes=nodes)
        elif head == "head":  # head:K:FILE; a head's tree, head:KxW[/N]:FILE
            shape, _, path = rest.partition(":")
            if (kwn := parse_shape(shape)) and path:
                k, width, nodes = kwn
                return DraftSpec("head", k=k, head=path, width=width, nodes=nodes)
        elif head in ("draft", "ngram", "suffix") and "x" not in rest and count(rest) >= 1:
            return DraftSpec("model" if head == "draft" else head, k=count(rest))
        elif head in ("draft", "suffix", "ngram") and "x" in rest and (kwn := parse_shape(rest)):
            k, width, nodes = kwn
            if not (head == "ngram" and nodes):  # prompt lookup's tree has no node budget
                return DraftSpec({"draft": "model"}.get(head, head), k=k, width=width, nodes=nodes)
    except ValueError:
        pass
    return None


def count(text: str) -> int:
    """A count written in a draft's name: ASCII digits only (int() would also take "+3", " 3",
    "1_0" and other scripts' digits, so "draft:1_0x2" drafted 10 deep); ValueError otherwise."""
    if not (text.isascii() and text.isdigit()):
        raise ValueError(f"not a count: {text!r}")
    return int(text)


def parse_shape(text: str) -> tuple[int, int, int] | None:
    """A method's draft shape, K, KxW or KxW/N (a tree of the N most probable nodes) -> (k, width,
    nodes); None where a number is out of range (ValueError where one is not a count)."""
    k, x, shape = text.partition("x")
    width, slash, nodes = shape.partition("/") if x else ("1", "", "")
    k, width, nodes = count(k), count(width), count(nodes) if slash else 0
    return (k, width, nodes) if k >= 1 and width >= 1 and (not slash or (nodes >= 1 and width >= 2)) else None


def auto_drafters(target, draft_model=None, suffix=None, wants_suffix: bool = AUTO_SUFFIX) -> tuple:
    """auto's drafters for `target`: (prompt lookup, the suffix cache or None, the draft model's
    drafter or None). The suffix cache is `suffix` if it is one, else a new one where wanted
    (`suffix` True, or None and `wants_suffix`); `draft_model` is a loaded model or drafter."""
    from .drafters.base import Drafter
    from .drafters.ngram import NgramDrafter

    if not isinstance(suffix, Drafter):
        suffix = (
            make_drafter(DraftSpec("suffix"), target) if suffix is True or (suffix is None and wants_suffix) else None
        )
    model = make_drafter(DraftSpec("model"), target, draft=draft_model) if draft_model is not None else None
    if getattr(model, "width", 1) > 1:  # auto prices chains: a tree drafter's model drafts chains for it
        from .drafters.model import ModelDrafter

        model = ModelDrafter(model.model)
    return NgramDrafter(), suffix, model


def make_drafter(spec: DraftSpec | str, target, load: Callable[[str], object] | None = None, suffix=None, draft=None):
    """The Drafter a spec names, for `target` (None for 'none'). A model is loaded with `load`, or
    is `draft` (a loaded model or drafter) where the spec names none; 'suffix' is `suffix` if given
    (a SuffixCacheDrafter set up from the flags), else a new one."""
    from .drafters import model_drafter, new_suffix_cache
    from .drafters.base import Drafter
    from .drafters.early_exit import EarlyExitDrafter
    from .drafters.ngram import NgramDrafter

    spec = parse(spec) if isinstance(spec, str) else spec
    if spec.kind == "none":
        return None
    if spec.kind == "ngram":
        return NgramDrafter(width=spec.width)
    if spec.kind == "suffix":  # the cache given (shared, loaded from the flags) drafts this spec's shape
        cache = suffix if suffix is not None else new_suffix_cache(target)
        cache.shape(spec.width, spec.nodes)
        return cache
    if spec.kind == "early-exit":
        return EarlyExitDrafter(target, spec.layers, width=spec.width, nodes=spec.nodes)
    if spec.kind == "head":
        from .drafters.head import HeadDrafter
        from .drafters.headfile import read_info

        info = read_info(spec.head)
        if info.kind == "early-exit" and hasattr(target, "attach_exit_blocks"):
            from .drafters.early_exit import exit_head_drafter

            # a chain or a tree through the torch target's own cache
            return exit_head_drafter(target, spec.head, spec.width, spec.nodes)
        if info.kind == "early-exit":  # drafts as a draft model of its own
            from .drafters.early_exit import exit_model_path

            model = load_like(target, exit_model_path(target, spec.head), trees=spec.nodes > 0)
            model.name = f"early-exit:{info.layers}+{info.blocks}"
            return model_drafter(model, target, None, spec.width, spec.nodes)
        return HeadDrafter(target, spec.head, spec.width, spec.nodes)
    if spec.kind == "model":
        if not spec.model and draft is not None:
            shape = (getattr(draft, "width", spec.width), getattr(draft, "nodes", spec.nodes))
            if isinstance(draft, Drafter) and shape != (spec.width, spec.nodes):
                from .drafters.model import ModelDrafter

                # the caller's draft model, drafting this spec's tree (or chain) shape
                return ModelDrafter(draft.model, width=spec.width, nodes=spec.nodes)
            if isinstance(draft, Drafter) and spec.width > 1 and not hasattr(draft, "width"):
                raise SpecdecError(f"a draft tree (width {spec.width}) needs a draft model of the target's vocabulary")
            return (
                draft
                if isinstance(draft, Drafter)
                else model_drafter(draft, target, spec.vocab, spec.width, spec.nodes)
            )
        if load is None:
            raise SpecdecError(f"draft {spec.model}: no loader given for a draft model")
        return model_drafter(load(spec.model), target, spec.vocab, spec.width, spec.nodes)
    raise SpecdecError(f"'{spec.kind}' is a policy, not a drafter: use SpeculativeDecoder(target, 'auto')")


def load_like(target, path, trees: bool = False):
    """A draft model at `path` on the target's backend with the target's context, threads and rows
    (an early-exit head's GGUF: the target's first layers, so it runs where the target runs);
    `trees`: one that scores its own trees (it grows them: drafters.model, `nodes`)."""
    from .models.llama_cpp import LlamaCppModel
    from .models.numpy_ref import NumpyModel, load_numpy_model
    from .models.transformers import TransformersModel, load_transformers_model

    if isinstance(target, LlamaCppModel):
        return LlamaCppModel(
            path, n_ctx=target.n_ctx, n_threads=target.n_threads, max_rows=target.max_rows, trees=trees
        )
    if isinstance(target, NumpyModel):
        return load_numpy_model(path, n_ctx=target.n_ctx)
    if isinstance(target, TransformersModel):  # dequantised by transformers, on the target's device and dtype
        dtype = str(next(target.model.parameters()).dtype).removeprefix("torch.")
        layout = dict(cache="static" if target.static else "dynamic", graphs=target.graphs)
        return load_transformers_model(path, device=str(target.device), dtype=dtype, n_ctx=target.n_ctx, **layout)
    raise SpecdecError(f"an early-exit head drafts as a GGUF draft model, which {type(target).__name__} cannot load")
