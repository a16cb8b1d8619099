"""SpeculativeDecoder: the Python API over one Engine (engine.py), built from a drafter, a model,
a name or a DraftSpec by build.py; and the one-call `generate`."""

from __future__ import annotations

from dataclasses import replace
from typing import Iterator, Sequence

import numpy as np

from .build import Drafters, build, make_drafter
from .build import controller as policy
from .config import GenerationConfig
from .drafters.base import MAX_DRAFT_TOKENS, Drafter
from .engine import Engine, GenerationResult, Request
from .errors import SpecdecError
from .models.base import RowModel
from .request import prepare
from .spec import DEFAULT_K, GRAMMAR, DraftSpec, parse


class GenerationStream:
    """Iterates over text pieces as they are produced (whole UTF-8 characters only); `result`
    holds the GenerationResult once the iteration is over. Streams on one decoder share its
    engine: iterating one steps them all, and each keeps its own text until it is read.
    Leaving the iteration early cancels the request."""

    def __init__(self, engine: Engine, request: Request):
        self.engine, self.request = engine, request
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[str]:
        request = self.request
        try:
            while True:
                piece = request.read()
                if piece:
                    yield piece
                if request.done:
                    piece = request.read()
                    if piece:
                        yield piece
                    break
                self.engine.step()
        finally:
            if not request.done:
                self.engine.cancel(request)
            self.result = request.result


class SpeculativeDecoder:
    """Generates with `target`, drafting with `drafter`:

    - None: plain decoding;
    - "ngram": prompt lookup, k tokens a step;
    - "suffix": the suffix cache across requests (drafters/suffix.py), k tokens a step;
    - a model (or any Drafter): k tokens a step; a model of another vocabulary drafts across
      tokenizers, string-level (drafters.model_drafter, drafters.cross_vocab);
    - "auto": the cost-aware controller picks prompt lookup, the suffix cache, `draft_model` (if
      given) or a plain step, and k, for every row and step (controller.CostAwareController); `k`
      is then ignored.

    `suffix` is the suffix cache auto consults (None: a new empty one, False: none); it lives as
    long as the decoder, so every request it serves feeds it. `costs` are auto's cost curves,
    (the target's, the draft model's), each a CostTable or {width: seconds} (None, or None for the
    draft model's where there is one: timed, and cached, at first use: costs.measure_cost_table).
    A fixed policy given `costs` steps by the target's curve as auto does (Engine: its forwards
    split where that is cheaper, joining prompts' chunks sized); without, one forward a step.
    It owns one Engine: every generate / stream / generate_batch call adds rows to it.

    `drafter` may also be a DraftSpec (built by build.build, its draft model `draft_model`) or
    build.Drafters (what build.build made: from_spec's way); a name is parsed once, here, and
    built as its DraftSpec.
    """

    def __init__(
        self,
        target: RowModel,
        drafter: Drafters | DraftSpec | Drafter | RowModel | str | None = None,
        k: int = DEFAULT_K,
        draft_model: RowModel | Drafter | None = None,
        max_rows: int | None = None,
        suffix: Drafter | bool | None = None,
        costs: tuple | None = None,
    ):
        if not 0 <= k <= MAX_DRAFT_TOKENS:
            raise SpecdecError(f"k (draft tokens per step) must be in 0..{MAX_DRAFT_TOKENS}, got {k}")
        self.target = target
        self.max_rows = max_rows  # rows generated at once (None: as many as the models hold)
        self.costs = costs
        # what the run should know of how it was built (the CLI prints them and puts them in --json)
        self.notes: list[str] = []
        if isinstance(drafter, Drafters):
            self.built = drafter
        elif isinstance(drafter, (str, DraftSpec)):  # a name is parsed here, once
            spec = parse(drafter, k=k) if isinstance(drafter, str) else drafter
            self.built = build(target, spec, draft=draft_model, suffix=suffix)
        elif isinstance(drafter, RowModel):  # another vocabulary: drafts across tokenizers
            self.built = Drafters(None, fixed=make_drafter(DraftSpec("model"), target, draft=drafter), k=k)
        elif drafter is None or isinstance(drafter, Drafter):
            self.built = Drafters(None, fixed=drafter, k=k)
        else:
            raise SpecdecError(
                f"unknown drafter {drafter!r}: give None, a drafter name ({GRAMMAR}), a model, or a Drafter"
            )
        self.k = self.built.k if not self.built.auto else k
        self._engine: Engine | None = None

    @classmethod
    def from_spec(
        cls,
        target: RowModel,
        spec: DraftSpec,
        load=None,
        draft=None,
        max_rows: int | None = None,
        suffix: Drafter | bool | None = None,
        costs: tuple | None = None,
    ) -> "SpeculativeDecoder":
        """The decoder a DraftSpec names (spec.parse, spec.parse_method), built by build.build: a
        draft model is loaded with `load(name)`, or is `draft` (a loaded model or drafter) where the
        spec names none; `suffix` is the suffix cache (as for __init__), unless the spec turns it off."""
        built = build(target, spec, load, draft=draft, suffix=suffix)
        return cls(target, built, built.k, max_rows=max_rows, costs=costs)

    @property
    def auto(self) -> bool:
        return self.built.auto

    @property
    def drafter(self) -> Drafter | None:
        """A fixed policy's drafter (None: plain, or auto)."""
        return self.built.fixed

    @property
    def ngram(self) -> Drafter | None:
        return self.built.ngram

    @property
    def suffix(self) -> Drafter | None:
        return self.built.suffix

    @property
    def model_drafter(self) -> Drafter | None:
        """auto's draft model's drafter (None: none)."""
        return self.built.model

    def free_drafters(self) -> list[Drafter]:
        """The drafters auto consults every step because they cost nothing: prompt lookup first."""
        return self.built.free

    def suffix_cache(self) -> Drafter | None:
        """The suffix cache this decoder feeds (auto's, or the fixed drafter if it is one)."""
        from .drafters.suffix import SuffixCacheDrafter

        if self.auto:
            return self.suffix
        return self.drafter if isinstance(self.drafter, SuffixCacheDrafter) else None

    def drafters(self) -> list[Drafter]:
        return self.built.all()

    def controller(self):
        """The policy. The cost-aware one is built once, so what it learned (costs, acceptance)
        carries over from one generation to the next."""
        return self.engine.controller

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            # without a curve, joining rows prefill fixed chunks, and a step is one forward
            controller, costs = policy(self.target, self.built, self.costs)
            self._engine = Engine(self.target, controller, self.drafters(), self.max_rows, costs=costs)
        return self._engine

    # -- public API -------------------------------------------------------------------------

    def generate(
        self,
        prompt: str | Sequence[int] | Sequence[str | Sequence[int]],
        config: GenerationConfig | None = None,
        **overrides,
    ) -> GenerationResult | list[GenerationResult]:
        """One prompt (text or token ids) -> GenerationResult; a list of prompts (texts or token
        lists) -> a list of GenerationResult, as generate_batch."""
        if isinstance(prompt, (list, tuple)) and prompt and not isinstance(prompt[0], (int, np.integer)):
            return self.generate_batch(prompt, config, **overrides)
        config = replace(config or GenerationConfig(), **overrides)
        request = self.engine.add(self.prompt_tokens(prompt, config), config)
        self.engine.run([request])
        return request.result

    def stream(
        self, prompt: str | Sequence[int], config: GenerationConfig | None = None, **overrides
    ) -> GenerationStream:
        config = replace(config or GenerationConfig(), **overrides)
        prompt_tokens = self.prompt_tokens(prompt, config)
        return GenerationStream(self.engine, self.engine.add(prompt_tokens, config))

    def generate_batch(
        self, prompts: Sequence[str | Sequence[int]], config: GenerationConfig | None = None, **overrides
    ) -> list[GenerationResult]:
        """Generates for every prompt; row i is what generate(prompts[i], seed=seed + i) gives.
        The rows run together as far as the models hold rows (their max_rows); the others wait
        and join as rows finish. Each row drafts, verifies and accepts on its own."""
        requests = self.add_batch(prompts, replace(config or GenerationConfig(), **overrides))
        self.engine.run(requests)
        return [r.result for r in requests]

    def add_batch(self, prompts: Sequence[str | Sequence[int]], config: GenerationConfig) -> list[Request]:
        """Every prompt added to the engine's queue, row i seeded seed + i (so that row i is what
        generate(prompts[i], seed=seed + i) gives); run them with engine.run."""
        tokens = [self.prompt_tokens(p, config) for p in prompts]
        return [
            self.engine.add(t, config if config.seed is None else replace(config, seed=config.seed + i))
            for i, t in enumerate(tokens)
        ]

    def prompt_tokens(self, prompt: str | Sequence[int], config: GenerationConfig) -> list[int]:
        """Token ids of the prompt, with the chat template applied when asked (or by default
        for instruct models); request.prepare's, as every caller's."""
        return prepare(self.target, prompt, config)[0]


def generate(
    target: RowModel, prompt: str | Sequence[int], drafter=None, k: int = DEFAULT_K, **config
) -> GenerationResult:
    """One-call API: generate(target, "def fib(n):", drafter=draft_model, max_new_tokens=64)."""
    return SpeculativeDecoder(target, drafter, k).generate(prompt, **config)
