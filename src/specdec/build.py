"""The one builder: a DraftSpec (parsed by spec.py) and the loaded models -> the drafters that run
it, by role (Drafters), and the controller over them.

SpeculativeDecoder, the CLI's commands, `specdec serve`, `specdec bench` and the vLLM proposer all
build here, so a drafter kind is made in one place: a new kind is one member of spec.Kind, one
branch of spec.parse and one branch of `make_drafter`.

    build(target, spec, load, draft, suffix)  -> Drafters      (a decoder: one policy)
    serving(target, spec, draft_spec, load)    -> what a server loads for its flags (server.build_service
                                                   builds every drafter a request may name from it)
    controller(target, drafters, costs)        -> the policy    (auto's cost-aware controller, or
                                                                 a fixed one)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .controller import FixedController, auto_controller
from .costs import CostTable
from .drafters import model_drafter, new_suffix_cache
from .drafters.base import Drafter
from .errors import SpecdecError
from .spec import AUTO_SUFFIX, WIDTH_PER_CALL, DraftSpec, parse


@dataclass
class Drafters:
    """What a decoder or a server drafts with. `policy`: what a request gets when it asks for no
    policy of its own (auto, none, or a fixed kind with its k and width); `fixed`: a fixed policy's
    drafter (None for auto and plain); `ngram`, `suffix`, `model`: auto's free drafters and the
    draft model it prices (a server's requests may also name each); `head`: a trained head that a
    server's requests may name ('head')."""

    policy: DraftSpec | None  # None: a drafter given as an object (fixed, at `k`)
    fixed: Drafter | None = None
    k: int = 0  # the fixed drafter's draft tokens a step
    ngram: Drafter | None = None
    suffix: Drafter | None = None
    model: Drafter | None = None
    head: Drafter | None = None

    @property
    def auto(self) -> bool:
        return self.policy is not None and self.policy.is_auto

    @property
    def free(self) -> list[Drafter]:
        """The drafters auto consults every step because they cost nothing: prompt lookup first."""
        return [d for d in (self.ngram, self.suffix) if d is not None]

    def all(self) -> list[Drafter]:
        """Every drafter, each once (a head may be auto's draft model too)."""
        found = (self.fixed, self.ngram, self.suffix, self.model, self.head)
        return list(dict.fromkeys(d for d in found if d is not None))


def build(target, spec: DraftSpec, load: Callable[[str], object] | None = None, draft=None, suffix=None) -> Drafters:
    """The drafters a DraftSpec names, for `target`. A draft model is loaded with `load(name)`, or
    is `draft` (a loaded model or drafter) where the spec names none; `suffix` is the suffix cache
    (a SuffixCacheDrafter set up from the flags; True or None: a new one where the spec wants one;
    False: none), unless the spec turns it off."""
    if spec.is_auto:
        if spec.head:  # a trained head where a draft model would be
            model = make_drafter(DraftSpec("head", head=spec.head), target)
        elif spec.model or draft is not None:
            model = make_drafter(DraftSpec("model", model=spec.model, vocab=spec.vocab), target, load, draft=draft)
        else:
            model = None
        ngram, cache, model = pool(target, model, suffix if spec.wants_suffix else False, spec.wants_suffix)
        return Drafters(spec, ngram=ngram, suffix=cache, model=model)
    if not spec.drafts:
        return Drafters(DraftSpec("none", k=0))
    cache = suffix if isinstance(suffix, Drafter) else None
    return Drafters(spec, fixed=make_drafter(spec, target, load, suffix=cache, draft=draft), k=spec.k)


def pool(target, draft_model=None, suffix=None, wants_suffix: bool = AUTO_SUFFIX) -> tuple:
    """auto's drafters for `target`: (prompt lookup, the suffix cache or None, the draft model's
    drafter or None). The suffix cache is `suffix` if it is one, else a new one where wanted
    (`suffix` True, or None and `wants_suffix`); `draft_model` is a loaded model or drafter."""
    from .drafters.ngram import NgramDrafter

    if not isinstance(suffix, Drafter):
        suffix = (
            make_drafter(DraftSpec("suffix"), target) if suffix is True or (suffix is None and wants_suffix) else None
        )
    model = make_drafter(DraftSpec("model"), target, draft=draft_model) if draft_model is not None else None
    if model is not None and model.width > 1:  # auto prices chains: a tree drafter's model drafts chains for it
        from .drafters.model import ModelDrafter

        model = ModelDrafter(model.model)
    return NgramDrafter(), suffix, model


def suffix_cache(target, cap: int, corpus: str | None = None, saved: str | None = None):
    """The suffix cache of `cap` tokens for `target`, with a corpus's text and a saved cache loaded
    (paths, or None); False where cap is 0 (none: auto without it)."""
    if cap == 0:
        return False
    cache = new_suffix_cache(target, cap)
    if corpus:
        cache.load_corpus(corpus, target.tokenizer)
    if saved:
        cache.load(saved)
    return cache


def serving(target, spec: DraftSpec, draft_spec: DraftSpec, load: Callable) -> tuple[DraftSpec, object, object]:
    """What a server loads and builds from its flags: `spec` is --draft (its default policy),
    `draft_spec` --draft-model (the draft model auto and the requests that name it draft with, or
    a head in its place); `load(name, trees=...)` loads a draft model. Returns (the default policy:
    a kind with its k and, for prompt lookup and the suffix cache, its width; the draft model,
    loaded, or its drafter, or None; a trained head's drafter or None), for server.build_service,
    which builds auto's drafters over them (`pool`). `draft_spec` is --draft itself where that
    names a draft model."""
    head_spec = spec if spec.kind == "head" else draft_spec if draft_spec.kind == "head" else None
    draft = None
    if draft_spec.kind == "model":  # a draft model that grows its own trees scores them (--draft-nodes)
        draft = load(draft_spec.model, trees=spec.kind == "model" and spec.nodes > 0)
    # across tokenizers, or the default --draft's trees (a head's tree leaves the draft model chains)
    if draft is not None and (draft_spec.vocab or (spec.kind == "model" and spec.width > 1)):
        draft = model_drafter(draft, target, draft_spec.vocab, spec.width, spec.nodes)
    head = None
    if head_spec is not None:  # requests may then ask for it by name ('head'); auto may use it
        head = make_drafter(head_spec, target)
        if draft is None and spec.is_auto:  # --draft-model head:FILE: auto drafts with the head
            draft = head
    # prompt lookup's and the suffix cache's trees: the policy's width, a request's own if it asks
    policy = DraftSpec(
        spec.kind,
        k=spec.k if spec.kind in ("ngram", "suffix", "model", "head") else 0,
        width=spec.width if spec.kind in WIDTH_PER_CALL else 1,
    )
    return policy, draft, head


def for_vllm(policy: str, vocab_size: int, k: int, curve=None, stops=frozenset(), reach: float | None = None):
    """What specdec.vllm's proposers draft with inside vLLM, which holds the model and its tokenizer:
    prompt lookup and a suffix cache over token ids alone, and over them auto's controller (`curve`:
    the target's cost curve, timed or a prior; `reach`: its cap on free drafts) or, for 'ngram' and
    'suffix', a fixed one at vLLM's k. Returns (the Drafters, the controller)."""
    from .controller import CostAwareController
    from .drafters.ngram import NgramDrafter
    from .drafters.suffix import DEFAULT_CAP, SuffixCacheDrafter

    spec = DraftSpec(policy, k=0 if policy == "auto" else k)
    ngram, cache = NgramDrafter(), SuffixCacheDrafter(DEFAULT_CAP, vocab_size=vocab_size)
    if policy == "auto":
        drafters = Drafters(spec, ngram=ngram, suffix=cache)
        return drafters, CostAwareController(drafters.free, None, curve, stops=stops, reach=reach)
    drafters = Drafters(spec, fixed=ngram if policy == "ngram" else cache, ngram=ngram, suffix=cache, k=k)
    return drafters, FixedController(drafters.fixed, k)


def controller(target, drafters: Drafters, costs: tuple | None = None):
    """The policy over a decoder's `drafters`: auto's cost-aware controller (`cost_aware`), or a
    fixed one at the policy's k. Returns (the controller, the target's cost table or None: what
    the engine sizes joining prompts' chunks by)."""
    if drafters.auto:
        auto = cost_aware(target, drafters, costs)
        return auto, auto.target_cost
    k = drafters.k if drafters.fixed is not None else 0
    return FixedController(drafters.fixed, k), CostTable.of(costs[0]) if costs is not None else None


def cost_aware(target, drafters: Drafters, costs: tuple | None = None, **options):
    """auto's controller over `drafters`' free drafters and draft model (controller.auto_controller:
    `costs`, its cost curves; `options`, its objective and long-step share)."""
    return auto_controller(target, drafters.free, drafters.model, costs, **options)


def make_drafter(spec: DraftSpec | str, target, load: Callable[[str], object] | None = None, suffix=None, draft=None):
    """The Drafter a spec names, for `target` (None for 'none'). A model is loaded with `load`, or
    is `draft` (a loaded model or drafter) where the spec names none; 'suffix' is `suffix` if given
    (a SuffixCacheDrafter set up from the flags), else a new one."""
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
        return _head(spec, target)
    if spec.kind == "model":
        if not spec.model and draft is not None:
            return _given_model(spec, target, draft)
        if load is None:
            raise SpecdecError(f"draft {spec.model}: no loader given for a draft model")
        return model_drafter(load(spec.model), target, spec.vocab, spec.width, spec.nodes)
    raise SpecdecError(f"'{spec.kind}' is a policy, not a drafter: use SpeculativeDecoder(target, 'auto')")


def _head(spec: DraftSpec, target):
    """A trained head's drafter: medusa and prophet heads draft from the target's hidden states;
    an early-exit head through the torch target's own cache, or elsewhere as a draft model of its
    own (the target's first layers, built from the target's GGUF)."""
    from .drafters.head import HeadDrafter
    from .drafters.headfile import read_info

    info = read_info(spec.head)
    if info.kind == "early-exit" and target.runs_exit_blocks:
        from .drafters.early_exit import exit_head_drafter

        # a chain or a tree through the torch target's own cache
        return exit_head_drafter(target, spec.head, spec.width, spec.nodes)
    if info.kind == "early-exit":  # drafts as a draft model of its own
        from .drafters.early_exit import exit_model_path
        from .models.load import load_like

        model = load_like(target, exit_model_path(target, spec.head), trees=spec.nodes > 0)
        model.name = f"early-exit:{info.layers}+{info.blocks}"
        return model_drafter(model, target, None, spec.width, spec.nodes)
    return HeadDrafter(target, spec.head, spec.width, spec.nodes)


def _given_model(spec: DraftSpec, target, draft):
    """The caller's draft model (a loaded model, or a drafter of one) drafting this spec's shape."""
    from .drafters.model import ModelDrafter

    if not isinstance(draft, Drafter):
        return model_drafter(draft, target, spec.vocab, spec.width, spec.nodes)
    if (draft.width, draft.nodes) == (spec.width, spec.nodes):
        return draft
    if isinstance(draft, ModelDrafter):  # the caller's draft model, drafting this spec's tree (or chain) shape
        return ModelDrafter(draft.model, width=spec.width, nodes=spec.nodes)
    if spec.width > 1:
        raise SpecdecError(f"a draft tree (width {spec.width}) needs a draft model of the target's vocabulary")
    raise SpecdecError(f"{draft.name} drafts trees of its own shape: it cannot draft this one's chains")
