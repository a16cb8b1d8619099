"""What a request asks for: GenerationConfig, validated once, here."""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from .errors import FieldError, SpecdecError
from .grammar import constraint_spec
from .sampling import VERIFICATION_RULES, SamplingParams
from .tools import check_choice, check_tools
from .tools import grammar as tools_grammar

MAX_LOGPROBS = 20  # the most likely tokens a generated token's log-probability may come with (OpenAI's bound)


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 256  # stop after this many generated tokens
    temperature: float = 0.0  # 0 = greedy: output is exactly the target's argmax path
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    min_p: float = 0.0  # 0.0 = off
    seed: int | None = None  # seeds the numpy Generator behind every random draw
    stop: tuple[str, ...] = ()  # stop strings; the text ends before the first one found
    chat: bool | None = None  # apply the chat template; None = when the target is instruct
    system: str | None = None  # system message for the chat template
    # log-probabilities of each generated token under the target (None = off), with this many of
    # the most likely tokens beside it (0 = the chosen token's alone): sampling.TokenLogprob
    logprobs: int | None = None
    # a chat turn's text may spell the model's special tokens ("<|im_end|>") and become them: off,
    # they stay text (special tokens come from the template alone); on, the old behaviour
    special_in_turns: bool = False
    # sampling by position: the token at each position is drawn with noise fixed by (seed,
    # position) (sampling.verify_at), so a seeded request gives the same text with any drafter,
    # cache or batch (bit for bit in the exact mode; elsewhere rounding may flip a near-tie)
    reproducible: bool = False
    # how a sampled draft with a real q (a draft model, a head) is verified: "block" (block
    # verification: never fewer tokens kept in expectation; a tree by its form for trees,
    # sampling.tree_block_cuts) or "token" (token by token; a tree node by node);
    # sampling.VERIFICATION_RULES. Greedy rows, one-hot drafts and reproducible rows are unaffected.
    verification: str = "block"
    # constrained output (grammar.py): OpenAI's response_format ({"type": "json_object"} or
    # {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}) or a grammar (a
    # grammar.GrammarSpec, or a string: llama.cpp's GBNF); at most one of them
    response_format: dict | None = None
    grammar: object = None
    # tools (function calling, tools.py): OpenAI's tools, rendered by the model's chat template;
    # tool_choice "none", "auto" (default with tools), "required" or {"type": "function",
    # "function": {"name"}}; parallel_tool_calls: more than one call in a turn
    tools: list | None = None
    tool_choice: object = None
    parallel_tool_calls: bool = True

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise SpecdecError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.seed is not None:  # numpy's generators take 0 <= seed < 2**64
            if not isinstance(self.seed, numbers.Integral) or not 0 <= self.seed < 2**64:
                raise SpecdecError(f"seed must be an integer in [0, 2**64), got {self.seed!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise SpecdecError(f"logprobs must be in 0..{MAX_LOGPROBS}, got {self.logprobs}")
        if self.verification not in VERIFICATION_RULES:
            raise SpecdecError(
                f"verification must be one of {', '.join(VERIFICATION_RULES)}, got {self.verification!r}"
            )
        if any(not s for s in self.stop):
            raise SpecdecError("an empty stop string would end every generation at once; drop it")
        object.__setattr__(self, "stop", tuple(self.stop))
        _ = self.sampling  # validates temperature / top-k / top-p / min-p
        spec = constraint_spec(self.response_format, self.grammar)
        tools = check_tools(self.tools)
        choice = check_choice(self.tool_choice, tools)
        calls = tools_grammar(tools, choice, self.parallel_tool_calls)
        if calls is not None and spec is not None:
            raise FieldError(
                'give tools or a response_format/grammar, not both (unless tool_choice is "none")', "tools"
            )
        object.__setattr__(self, "_constraint", calls or spec)
        object.__setattr__(self, "_tool_choice", choice)

    @property
    def tool_choice_word(self) -> str:
        """tool_choice as a word: none, auto, required, or the one function's name."""
        return self._tool_choice

    @property
    def template_tools(self) -> list | None:
        """The tools the chat template renders (None: none, also for tool_choice "none")."""
        return self.tools if self.tools and self._tool_choice != "none" else None

    @property
    def constraint(self):
        """The grammar.GrammarSpec the output is constrained to (None: free text)."""
        return self._constraint

    @property
    def sampling(self) -> SamplingParams:
        try:
            return SamplingParams(self.temperature, self.top_k, self.top_p, self.min_p)
        except ValueError as exc:
            raise SpecdecError(str(exc)) from None
