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
from .drafters.base import MAX_DRAFT_TOKENS, Drafter
from .config import GenerationConfig
from .errors import ContextOverflowError, SpecdecError
from .models.base import CausalLM
from .sampling import verify
from .stats import GenerationStats


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
        if not 0 <= k <= MAX_DRAFT_TOKENS:
            raise SpecdecError(f"k (draft tokens per step) must be in 0..{MAX_DRAFT_TOKENS}, got {k}")
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

    def generate(self, prompt: str | Sequence[int] | Sequence[str | Sequence[int]],
                 config: GenerationConfig | None = None, **overrides) -> GenerationResult | list[GenerationResult]:
        """One prompt (text or token ids) -> GenerationResult; a list of prompts (texts or token
        lists) -> a list of GenerationResult, as generate_batch."""
        if isinstance(prompt, (list, tuple)) and prompt and not isinstance(prompt[0], (int, np.integer)):
            return self.generate_batch(prompt, config, **overrides)
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
            emitted, stats.finish_reason = _emit([*draft_tokens[:n], next_token], eog,
                                                 config.max_new_tokens - generated)
            generated += len(emitted)
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
        stats = GenerationStats()
        text = _Detokenizer(self.target.tokenizer, config.stop)
        for emitted in self.steps(prompt_tokens, config, stats):
            stopped = text.add(emitted)
            piece = text.ready()
            if piece:
                yield piece
            if stopped:
                stats.finish_reason = "stop"
                break
        piece = text.finish()
        if piece:
            yield piece
        stats.generated_tokens = len(text.tokens)
        return GenerationResult(text=text.text, tokens=text.tokens, prompt_tokens=prompt_tokens, stats=stats)

    # -- batches ----------------------------------------------------------------------------

    def generate_batch(self, prompts: Sequence[str | Sequence[int]], config: GenerationConfig | None = None,
                       **overrides) -> list[GenerationResult]:
        """Generates for every prompt; row i is what generate(prompts[i], seed=seed + i) gives.

        On a target with a batched cache (the torch backend) the rows run together: each drafts,
        verifies and accepts on its own, rows that accept more move ahead, and finished rows leave
        the batch. Other backends run the rows one after the other."""
        config = replace(config or GenerationConfig(), **overrides)
        rows = [self.prompt_tokens(p, config) for p in prompts]
        configs = [config if config.seed is None else replace(config, seed=config.seed + i)
                   for i in range(len(rows))]
        if not rows:
            return []
        if len(rows) == 1 or not hasattr(self.target, "forward_rows"):
            return [self.generate(r, c) for r, c in zip(rows, configs)]
        return _BatchRun(self, rows, configs).run()


class _Detokenizer:
    """Tokens -> text, whole UTF-8 characters at a time, cut at the first stop string; text that
    could still grow into a stop string is held back until it cannot."""

    def __init__(self, tokenizer, stop: Sequence[str]):
        self._tokenizer, self._stop = tokenizer, stop
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.tokens: list[int] = []
        self.text = ""               # all text so far
        self._sent = 0               # how much of it ready() has handed out
        self.stopped = False

    def add(self, tokens: Sequence[int]) -> bool:
        """Append tokens; True when a stop string ended the text (later tokens are dropped)."""
        for token in tokens:
            self.tokens.append(token)
            self.text += self._decoder.decode(self._tokenizer.token_bytes(token))
            cut = _find_stop(self.text, self._stop, max(0, self._sent - self._hold))
            if cut is not None:
                self.text = self.text[:cut]
                self.stopped = True
                return True
        return False

    def ready(self) -> str:
        """The new text that is final."""
        safe = len(self.text) - self._hold if self._stop and not self.stopped else len(self.text)
        if safe <= self._sent:
            return ""
        piece, self._sent = self.text[self._sent:safe], safe
        return piece

    def finish(self) -> str:
        """The rest, once generation is over."""
        if not self.stopped:
            self.text += self._decoder.decode(b"", final=True)
        piece, self._sent = self.text[self._sent:], len(self.text)
        return piece


class _BatchRun:
    """One batched generation (see SpeculativeDecoder.generate_batch). The step is the one of
    SpeculativeDecoder.steps, done for every live row at once: one batched draft, one batched
    target pass over each row's [last, *draft], verification row by row with the row's own
    random stream, one batched rollback."""

    def __init__(self, decoder: SpeculativeDecoder, prompts: list[list[int]], configs: list[GenerationConfig]):
        self.decoder, self.prompts, self.configs = decoder, prompts, configs

    def _drafter(self):
        from .drafters.batch import BatchModelDrafter, PerRowDrafters
        from .drafters.model import ModelDrafter
        from .drafters.ngram import NgramDrafter

        d = self.decoder
        if d.auto:   # the cost-aware controller is single-sequence: the draft model if given, else lookup
            source = d.model_drafter if d.model_drafter is not None else d.ngram
        else:
            source = d.drafter
        if source is None or d.k == 0:
            return None
        if isinstance(source, NgramDrafter):
            return PerRowDrafters(lambda: NgramDrafter(source.n_max, source.n_min, source.candidates,
                                                       source.match_cap))
        if isinstance(source, ModelDrafter):
            if not hasattr(source.model, "forward_rows"):
                raise SpecdecError(f"the draft model {source.model.name} has no batched cache; batches "
                                   f"need a torch draft model (--backend torch), or --draft ngram")
            return BatchModelDrafter(source.model)
        raise SpecdecError(f"{source.name} cannot draft for a batch; use --draft ngram or a torch draft model")

    def run(self) -> list[GenerationResult]:
        d = self.decoder
        target, config = d.target, self.configs[0]
        params, k = config.sampling, d.k
        B = len(self.prompts)
        rngs = [np.random.default_rng(c.seed) for c in self.configs]
        drafter = self._drafter()
        if drafter is not None:
            drafter.begin(self.prompts, params, rngs)
        eog = target.tokenizer.eog_ids
        stats = [GenerationStats(prompt_tokens=len(p)) for p in self.prompts]
        texts = [_Detokenizer(target.tokenizer, config.stop) for _ in range(B)]

        t0 = time.perf_counter()
        target.start(B)
        target.forward_rows([p[:-1] for p in self.prompts], [0] * B)   # last prompt tokens open step one
        prefill = time.perf_counter() - t0
        for s in stats:
            s.prefill_seconds = s.target_seconds = prefill
        t_decode = time.perf_counter()

        live = list(range(B))                     # the original index of each row still in the batch
        contexts = [list(p) for p in self.prompts]
        while live:
            ks = [min(k, target.n_ctx - len(contexts[i]) - 1) for i in live]
            done = {i for i, room in zip(live, ks) if room < 0}
            for i in done:
                stats[i].finish_reason = "context"
            ks = [max(kk, 0) for kk in ks]
            # 1-2. every row drafts up to its k
            t = time.perf_counter()
            drafts = (drafter.propose([contexts[i] for i in live], ks) if drafter is not None
                      else [None] * len(live))
            t_draft = time.perf_counter() - t
            draft_tokens = [dr.tokens if dr is not None else [] for dr in drafts]
            # 3. one target pass: row r scores [last, *draft]
            t = time.perf_counter()
            inputs = [[] if i in done else [contexts[i][-1], *tokens]
                      for i, tokens in zip(live, draft_tokens)]
            logits = target.forward_rows(inputs)                          # per row [k + 1, vocab]
            t_target = time.perf_counter() - t
            # 4. verify each row with its own random stream
            accepted, nexts = [], []
            for r, i in enumerate(live):
                tokens = draft_tokens[r]
                if i in done:
                    accepted.append(0)
                    nexts.append(None)
                    continue
                q = drafts[r].q if drafts[r] is not None else None
                n, token = verify(logits[r], tokens, q, params, rngs[i])
                accepted.append(n)
                nexts.append(token)
            # 5. roll every row back to what it kept
            t = time.perf_counter()
            target.rollback_rows([len(contexts[i]) + n for i, n in zip(live, accepted)])
            t_target += time.perf_counter() - t
            if drafter is not None:
                t = time.perf_counter()
                drafter.accept(accepted)
                t_draft += time.perf_counter() - t
            # 6. emit per row; finished rows leave the batch
            now = time.perf_counter()
            keep = []
            for r, i in enumerate(live):
                s = stats[i]
                s.draft_seconds += t_draft
                s.target_seconds += t_target
                if i in done:
                    continue
                tokens = draft_tokens[r]
                s.record_step(len(tokens), accepted[r], drafter.name.split(":")[0] if drafter else "plain")
                emitted, s.finish_reason = _emit([*tokens[:accepted[r]], nexts[r]], eog,
                                                 self.configs[i].max_new_tokens - s.generated_tokens)
                contexts[i] += emitted
                s.generated_tokens += len(emitted)
                s.decode_seconds = now - t_decode
                if texts[i].add(emitted):
                    s.finish_reason = "stop"
                if not s.finish_reason:
                    keep.append(r)
            if len(keep) < len(live):
                live = [live[r] for r in keep]
                if live:
                    target.keep_rows(keep)
                    if drafter is not None:
                        drafter.keep_rows(keep)
        results = []
        for prompt, text, s in zip(self.prompts, texts, stats):
            text.finish()
            s.generated_tokens = len(text.tokens)
            results.append(GenerationResult(text=text.text, tokens=text.tokens, prompt_tokens=prompt, stats=s))
        return results


def _emit(tokens: Sequence[int], eog, budget: int) -> tuple[list[int], str]:
    """What a step emits of the tokens it kept: up to an end-of-generation token (not emitted) or
    until `budget` new tokens are spent, and why generation ends there ("eog", "length"; "" if
    it goes on)."""
    emitted = []
    for token in tokens:
        if token in eog:
            return emitted, "eog"
        emitted.append(token)
        if len(emitted) >= budget:
            return emitted, "length"
    return emitted, ""


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
