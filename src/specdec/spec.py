"""DraftSpec: the one parsed form of a drafter choice, and its one parser.

A drafter choice comes from the CLI (--draft, --draft-model, -k), from a bench method (ngram:8,
auto:nosuffix) or from a request's `speculative` object; each is parsed here, once, into a
DraftSpec (`parse`, `parse_method`, `parse_request`), and everything that drafts is built from one
(build.py; a whole decoder: decoder.SpeculativeDecoder.from_spec). A new drafter kind is one member
of Kind, one branch of `parse` and one of build.make_drafter.

    auto | none | ngram | suffix | early-exit:L | head:FILE | [string: | intersect:]<model name or path>

`auto` is not a drafter but a policy (the cost-aware controller over prompt lookup, the suffix
cache and a draft model); the engine builds it. A draft model of the target's vocabulary drafts
token ids directly (drafters.model.ModelDrafter); one of another vocabulary drafts across
tokenizers (drafters.cross_vocab.CrossVocabDrafter), string-level unless the name says
`intersect:`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal, get_args

from .drafters.base import MAX_DRAFT_TOKENS, MAX_DRAFT_WIDTH
from .drafters.cross_vocab import MODES as CROSS_VOCAB_MODES
from .errors import FieldError, SpecdecError

Kind = Literal["auto", "none", "ngram", "suffix", "early-exit", "head", "model"]
KINDS: tuple[str, ...] = get_args(Kind)
DEFAULT_K = 4  # draft tokens a step of a fixed drafter when none is given
GRAMMAR = (
    "auto | none | ngram | suffix | early-exit:L | head:FILE (a head from `specdec train`) | a built-in "
    "model name or a .gguf path, for a "
    "model of another vocabulary optionally prefixed string: or intersect:"
)
# whether auto consults the suffix cache when not told (DraftSpec.suffix None)
# why: a fresh process, its cache empty, stays within 3% of auto without it;
# history: docs/results/provenance.md#auto_suffix
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


def parse_request(v, draft_names: dict[str, str]) -> DraftSpec | None:
    """The request's own speculation: {"draft": "auto" | "ngram" | "suffix" | "none" | <loaded draft model>,
    "k": 1..MAX_DRAFT_TOKENS, "width": 1..MAX_DRAFT_WIDTH (ngram and suffix: a tree of that many
    continuations under a node; whether the target scores trees is the service's to check)}.
    `v` is the request's `speculative` object (None: the server's default, returned as None);
    `draft_names` maps the names this server offers to a DraftSpec kind. A request can only pick
    among what the server loaded: it never names a file to load."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise FieldError(f'\'speculative\' must be an object like {{"draft": "auto"}}, got {v!r}', "speculative")
    unknown = sorted(set(v) - {"draft", "k", "width"})
    if unknown:
        raise FieldError(
            f"'speculative' has unknown field(s) {', '.join(unknown)}: it takes draft, k and width",
            f"speculative.{unknown[0]}",
        )
    draft = v.get("draft", "auto")
    offered = ", ".join(draft_names)
    if not isinstance(draft, str) or draft not in draft_names:
        raise FieldError(
            f"'speculative.draft' must be one of {offered}; got {draft!r}", "speculative.draft", "unsupported_value"
        )
    kind = draft_names[draft]
    k = _request_int(v, "k", MAX_DRAFT_TOKENS)
    if kind in ("auto", "none") and k is not None:
        raise FieldError(
            f"'speculative.k' applies to a fixed drafter (ngram, suffix, a draft model or a head); "
            f"{draft!r} {'chooses k itself' if kind == 'auto' else 'drafts nothing'}",
            "speculative.k",
        )
    width = _request_int(v, "width", MAX_DRAFT_WIDTH)
    if width is not None and kind not in WIDTH_PER_CALL:
        why = {"auto": "chooses its trees itself", "none": "drafts nothing"}.get(
            kind, "drafts the shape the server loaded it with (--draft-width)"
        )
        raise FieldError(
            f"'speculative.width' shapes prompt lookup's and the suffix cache's trees (ngram, suffix); {draft!r} {why}",
            "speculative.width",
        )
    if kind in ("ngram", "suffix", "model", "head"):
        return DraftSpec(kind, k=k if k is not None else DEFAULT_K, width=width or 1)
    return DraftSpec(kind, k=0)


def _request_int(v: dict, name: str, high: int) -> int | None:
    """speculative[name], an integer in [1, high], or None where it is absent."""
    if name not in v:
        return None
    n, field = v[name], f"speculative.{name}"
    if n is None:
        raise FieldError(f"'{field}' must be an integer", field)
    if not isinstance(n, int) or isinstance(n, bool):
        raise FieldError(f"'{field}' must be an integer, got {n!r}", field)
    if not 1 <= n <= high:
        raise FieldError(f"'{field}' must be in [1, {high}], got {n}", field)
    return n
