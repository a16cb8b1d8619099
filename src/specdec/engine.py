"""The decode loop: propose -> score -> verify -> rollback -> emit.

Plain decoding is the same loop with k = 0: the target scores [last] alone and verification
degenerates to sampling (or argmax) from p. One code path means the comparison between the two
measures speculation and nothing else.
"""
from __future__ import annotations

import codecs
import time
from dataclasses import dataclass, field, replace
from typing import Iterator, Sequence

import numpy as np

from .controller import FixedController
from .drafters.base import Drafter
from .errors import ContextOverflowError, SpecdecError
from .models.base import CausalLM
from .sampling import SamplingParams, verify
from .stats import GenerationStats


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 256           # stop after this many generated tokens
    temperature: float = 0.0            # 0 = greedy: output is exactly the target's argmax path
    top_k: int = 0                      # 0 = off
    top_p: float = 1.0                  # 1.0 = off
    min_p: float = 0.0                  # 0.0 = off
    seed: int | None = None             # seeds the numpy Generator behind every random draw
    stop: tuple[str, ...] = ()          # stop strings; the text ends before the first one found
    chat: bool | None = None            # apply the chat template; None = when the target is instruct
    system: str | None = None           # system message for the chat template

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise SpecdecError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        object.__setattr__(self, "stop", tuple(s for s in self.stop if s))
        self.sampling  # validates temperature / top-k / top-p / min-p

    @property
    def sampling(self) -> SamplingParams:
        try:
            return SamplingParams(self.temperature, self.top_k, self.top_p, self.min_p)
        except ValueError as exc:
            raise SpecdecError(str(exc)) from None


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]                   # generated tokens (the stop string's tokens included)
    prompt_tokens: list[int]
    stats: GenerationStats = field(default_factory=GenerationStats)

    def to_dict(self) -> dict:
        return {"text": self.text, "tokens": self.tokens, "prompt_tokens": len(self.prompt_tokens),
                "stats": self.stats.to_dict()}


class GenerationStream:
    """Iterates over text pieces as they are produced (whole UTF-8 characters only);
    `result` holds the GenerationResult once the iteration is over."""

    def __init__(self, pieces: Iterator[str]):
        self._pieces = pieces
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[str]:
        self.result = yield from self._pieces


class SpeculativeDecoder:
    """Generates with `target`, drafting with `drafter`:

    - None: plain decoding;
    - "ngram": prompt lookup, k tokens a step;
    - a CausalLM of the same vocabulary (or any Drafter): k tokens a step;
    - "auto": the cost-aware controller picks prompt lookup, `draft_model` (if given) or a plain
      step, and k, every step (controller.CostAwareController); `k` is then ignored.
    """

    def __init__(self, target: CausalLM, drafter: Drafter | CausalLM | str | None = None, k: int = 4,
                 draft_model: CausalLM | Drafter | None = None):
        if k < 0:
            raise SpecdecError(f"k (draft tokens per step) must be >= 0, got {k}")
        self.target = target
        self.k = k
        self.auto = drafter == "auto"
        if self.auto:
            from .drafters.ngram import NgramDrafter
            self.ngram = NgramDrafter()
            self.model_drafter = _as_drafter(draft_model, target)
            self.drafter = None
            self._auto_controller = None
        else:
            self.drafter = _as_drafter(drafter, target)

    def drafters(self) -> list[Drafter]:
        if self.auto:
            return [d for d in (self.ngram, self.model_drafter) if d is not None]
        return [self.drafter] if self.drafter is not None else []

    def controller(self):
        """The policy for the next generation. The cost-aware one is built once, so what it learned
        (costs, acceptance) carries over from one generation to the next."""
        if not self.auto:
            return FixedController(self.drafter, self.k if self.drafter else 0)
        if self._auto_controller is None:
            from .controller import CostAwareController, measure_forward_costs
            costs = measure_forward_costs(self.target)
            draft_costs = None
            if self.model_drafter is not None and hasattr(self.model_drafter, "model"):
                draft_costs = measure_forward_costs(self.model_drafter.model)
            self._auto_controller = CostAwareController(self.ngram, self.model_drafter,
                                                        costs, draft_costs)
        return self._auto_controller

    # -- public API -------------------------------------------------------------------------

    def generate(self, prompt: str | Sequence[int], config: GenerationConfig | None = None,
                 **overrides) -> GenerationResult:
        stream = self.stream(prompt, config, **overrides)
        for _ in stream:
            pass
        return stream.result

    def stream(self, prompt: str | Sequence[int], config: GenerationConfig | None = None,
               **overrides) -> GenerationStream:
        config = replace(config or GenerationConfig(), **overrides)
        prompt_tokens = self.prompt_tokens(prompt, config)
        return GenerationStream(self._text_pieces(prompt_tokens, config))

    def prompt_tokens(self, prompt: str | Sequence[int], config: GenerationConfig) -> list[int]:
        """Token ids of the prompt, with the chat template applied when asked (or by default
        for instruct models)."""
        if not isinstance(prompt, str):
            tokens = [int(t) for t in prompt]
        else:
            tok = self.target.tokenizer
            chat = self.target.is_instruct if config.chat is None else config.chat
            if chat:
                messages = ([{"role": "system", "content": config.system}] if config.system else [])
                prompt = tok.apply_chat_template(messages + [{"role": "user", "content": prompt}])
            tokens = tok.encode(prompt, add_special=True)
        if not tokens:
            raise SpecdecError("the prompt is empty")
        if len(tokens) >= self.target.n_ctx:
            raise ContextOverflowError(
                f"the prompt has {len(tokens)} tokens but the context holds {self.target.n_ctx}; "
                f"raise --ctx or shorten the prompt")
        return tokens

    # -- the loop ---------------------------------------------------------------------------

    def steps(self, prompt_tokens: list[int], config: GenerationConfig,
              stats: GenerationStats) -> Iterator[list[int]]:
        """Yields the tokens each step emits, until a stop rule fires. The stop rules that need
        text (stop strings) are applied by the caller, which simply stops iterating."""
        target, params = self.target, config.sampling
        rng = np.random.default_rng(config.seed)
        controller = self.controller()
        for drafter in self.drafters():
            drafter.begin(prompt_tokens, params, rng)
        controller.begin(prompt_tokens)
        eog = target.tokenizer.eog_ids
        stats.prompt_tokens = len(prompt_tokens)

        t0 = time.perf_counter()
        target.reset()
        target.forward(prompt_tokens[:-1], n_rows=0)   # the last prompt token opens step one
        stats.prefill_seconds = time.perf_counter() - t0
        stats.target_seconds = stats.prefill_seconds
        t_decode = time.perf_counter()

        context = list(prompt_tokens)
        generated = 0
        while True:
            room = target.n_ctx - len(context) - 1   # k + 1 rows must fit in the context window
            if room < 0:
                stats.finish_reason = "context"
                break
            # 1-2. the controller picks the drafter and k (0 = a plain step), and drafts
            t = time.perf_counter()
            drafter, draft = controller.draft(context, room)
            draft_tokens = draft.tokens if draft is not None else []
            t_draft = time.perf_counter() - t
            # 3. score [last, *draft] in one target pass: k + 1 rows
            t = time.perf_counter()
            logits = target.forward([context[-1], *draft_tokens])          # [k + 1, vocab]
            t_target = time.perf_counter() - t
            # 4. verify: how many drafts the target keeps, and the token that follows them
            q = draft.q[:len(draft_tokens)] if draft is not None and draft.q is not None else None
            n, next_token = verify(logits, draft_tokens, q, params, rng)
            # 5. roll both caches back to what was kept
            t = time.perf_counter()
            target.rollback(len(context) + n)
            t_target += time.perf_counter() - t
            if drafter is not None:
                t = time.perf_counter()
                drafter.accept(n)
                t_draft += time.perf_counter() - t
            stats.draft_seconds += t_draft
            stats.target_seconds += t_target
            stats.record_step(len(draft_tokens), n, drafter.name.split(":")[0] if drafter else "plain")
            # 6. emit, honouring end-of-generation tokens and the token budget
            emitted = []
            for token in [*draft_tokens[:n], next_token]:
                if token in eog:
                    stats.finish_reason = "eog"
                    break
                emitted.append(token)
                generated += 1
                if generated >= config.max_new_tokens:
                    stats.finish_reason = "length"
                    break
            controller.observe(drafter, draft, n, emitted, t_draft, t_target)
            context += emitted
            stats.generated_tokens = generated
            stats.decode_seconds = time.perf_counter() - t_decode
            if hasattr(controller, "speedups"):
                stats.predicted_speedup, stats.measured_speedup = controller.speedups(stats.tokens_per_second)
            if emitted:
                yield emitted
            if stats.finish_reason:
                break

    def _text_pieces(self, prompt_tokens: list[int], config: GenerationConfig):
        """Turns steps into text: whole UTF-8 characters only, cut at the first stop string.
        Text that could still become a stop string is held back until it cannot."""
        tok = self.target.tokenizer
        stats = GenerationStats()
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        hold = max((len(s) for s in config.stop), default=1) - 1
        tokens: list[int] = []
        text, sent = "", 0           # all text so far; how much of it was yielded
        for emitted in self.steps(prompt_tokens, config, stats):
            for token in emitted:
                tokens.append(token)
                text += decoder.decode(tok.token_bytes(token))
                cut = _find_stop(text, config.stop, max(0, sent - hold))
                if cut is not None:
                    text = text[:cut]
                    stats.finish_reason = "stop"
                    break
            if stats.finish_reason == "stop":
                break
            safe = len(text) - hold if config.stop else len(text)
            if safe > sent:
                yield text[sent:safe]
                sent = safe
        if stats.finish_reason != "stop":
            text += decoder.decode(b"", final=True)
        if len(text) > sent:
            yield text[sent:]
        stats.generated_tokens = len(tokens)
        return GenerationResult(text=text, tokens=tokens, prompt_tokens=prompt_tokens, stats=stats)


def _find_stop(text: str, stops: Sequence[str], start: int) -> int | None:
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(hits) if hits else None


def _as_drafter(drafter, target: CausalLM) -> Drafter | None:
    from .drafters.model import ModelDrafter
    from .drafters.ngram import NgramDrafter

    if drafter is None or isinstance(drafter, Drafter):
        return drafter
    if drafter == "ngram":
        return NgramDrafter()
    if isinstance(drafter, CausalLM):
        return ModelDrafter(drafter, target)
    raise SpecdecError(f"unknown drafter {drafter!r}: give None, 'ngram', a model, or a Drafter")


def generate(target: CausalLM, prompt: str | Sequence[int], drafter=None, k: int = 4,
             **config) -> GenerationResult:
    """One-call API: generate(target, "def fib(n):", drafter=draft_model, max_new_tokens=64)."""
    return SpeculativeDecoder(target, drafter, k).generate(prompt, **config)
