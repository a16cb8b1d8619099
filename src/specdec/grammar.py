"""Constrained decoding: JSON schemas, JSON mode, Lark and GBNF grammars, through llguidance.

The target's distribution under a grammar is the constrained one: at every position p is masked
to the tokens the grammar allows after the prefix, then renormalised (greedy: the argmax of the
masked logits). The engine masks every position of a draft with the grammar advanced through
the draft before it (Constraint.masks) and rolls it back to what was kept, so every verification
rule checks the draft against that masked p. The grammar is also a drafter of its own: the
tokens it forces (llguidance's fast-forward tokens) are drafted at no cost (Constraint.extend).

Why llguidance: measured on this CPU with Qwen2.5's 151,936-token vocabulary, it compiles a
typical extraction schema in about 1 ms and computes a token mask in 0.012-0.017 ms (median),
is 3.1 MB with no dependencies, and llama.cpp and vLLM use it; xgrammar pulled 2.9 GB of
dependencies (torch among them) into a CPU install (docs/guide/structured.md).
"""

from __future__ import annotations

import hashlib
import json
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .errors import FieldError, SpecdecError

COMPILE_SECONDS = 5.0  # a grammar that takes longer to compile is refused (a 400), never waited on
# the grammars compiled per tokenizer, each a matcher to copy for every request that asks for it
CACHE_SIZE = 64
# JSON as clients expect it from OpenAI: compact separators, so that a schema's keys, their quotes
# and colons are one forced run instead of a choice of whitespace at every turn
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_JSON = {"type": "object"}  # response_format {"type": "json_object"}: any JSON object
# A Hermes tool call's tags (tools.py). In a tool-call grammar (kind "tool_lark") they stand as
# these marks, written at compile time as the model's tokenizer has them: a special token (Lark's
# <tool_call>, Qwen2.5's) or text ("<tool_call>")
TOOL_TAGS = ("<tool_call>", "</tool_call>")
TAG_MARKS = ("\x00open\x00", "\x00close\x00")


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise SpecdecError(
            "constrained decoding needs llguidance: pip install -e '.[serve]' in this checkout "
            "(or pip install llguidance)"
        ) from None
    return llguidance


@dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to: kind "json_schema" (text: the schema as JSON),
    "lark" or "gbnf" (text: the grammar), or "tool_lark" (a Lark grammar of tool calls, its tags
    as TAG_MARKS)."""

    kind: str
    text: str

    @classmethod
    def json_schema(cls, schema: Any, field: str = "json_schema") -> "GrammarSpec":
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise FieldError(f"{field} is not valid JSON ({e})", field) from None
        if not isinstance(schema, dict):
            raise FieldError(f"{field} must be a JSON object (a JSON Schema), got {type(schema).__name__}", field)
        return cls("json_schema", json.dumps(schema))  # key order kept: it is the output's

    def grammar(self, special_tags: bool = False) -> str:
        """llguidance's grammar text for this spec (nothing compiled yet); `special_tags`: a
        tool-call grammar's tags are special tokens of the model's."""
        ll = _llguidance()
        if self.kind == "tool_lark":
            text = self.text
            for mark, tag in zip(TAG_MARKS, TOOL_TAGS):
                text = text.replace(mark, tag if special_tags else json.dumps(tag))
            return ll.LLMatcher.grammar_from_lark(text)
        if self.kind == "json_schema":
            return ll.LLMatcher.grammar_from_json_schema(self.text, overrides=JSON_OPTIONS)
        if self.kind == "gbnf":
            from llguidance.gbnf_to_lark import gbnf_to_lark

            try:
                return ll.LLMatcher.grammar_from_lark(gbnf_to_lark(self.text))
            except Exception as e:  # the converter's own parse errors
                raise FieldError(f"grammar is not valid GBNF ({e})", "grammar") from None
        return ll.LLMatcher.grammar_from_lark(self.text)

    @property
    def key(self) -> str:
        return hashlib.sha256(f"{self.kind}\0{self.text}".encode()).hexdigest()


def constraint_spec(response_format: Any = None, grammar: Any = None) -> GrammarSpec | None:
    """The GrammarSpec of OpenAI's response_format and/or a grammar (a GrammarSpec, or a GBNF
    string as llama-server takes it); None where the output is free text."""
    if grammar is not None and response_format not in (None, {"type": "text"}):
        raise FieldError("give response_format or grammar, not both", "grammar")
    if grammar is not None:
        if isinstance(grammar, GrammarSpec):
            return grammar
        if not isinstance(grammar, str) or not grammar.strip():
            raise FieldError("grammar must be a non-empty string (GBNF, as llama.cpp takes it)", "grammar")
        return GrammarSpec("gbnf", grammar)
    if response_format is None:
        return None
    field = "response_format"
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec.json_schema(ANY_JSON, field)
    if kind == "json_schema":
        inner = response_format.get("json_schema")
        if not isinstance(inner, dict) or "schema" not in inner:
            raise FieldError('response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}', field)
        return GrammarSpec.json_schema(inner["schema"], field)
    raise FieldError(
        f"response_format type must be text, json_object or json_schema, got {kind!r}"
        if kind is not None
        else 'response_format must be an object with a "type"',
        field,
    )


def _tokenizer_for(model):
    """llguidance's tokenizer for a model: built once per model (about a second for 152k tokens).
    A llama.cpp model's vocabulary is read through llama.cpp itself (its token attributes say
    which tokens are control tokens); any other through the Tokenizer protocol's token_bytes,
    the end-of-generation tokens and the <|...|> entries as special."""
    cached = getattr(model, "_llg_tokenizer", None)
    if cached is not None:
        return cached
    ll = _llguidance()
    tok = model.tokenizer
    eos = sorted(tok.eog_ids)
    handle = model.llama_model
    if handle is not None:
        import llama_cpp
        from llguidance.llamacpp import lltokenizer_from_vocab

        with warnings.catch_warnings():  # llguidance reads each token's attributes by a deprecated name
            warnings.simplefilter("ignore", DeprecationWarning)
            lt = lltokenizer_from_vocab(
                llama_cpp.llama_model_get_vocab(handle), n_vocab=model.vocab_size, eos_token=eos
            )
    else:
        lt = ll.LLTokenizer(_Wrapper(tok, model.vocab_size, eos), n_vocab=model.vocab_size, eos_token=eos)
    model._llg_tokenizer = lt
    return lt


class _Wrapper:
    """The Tokenizer protocol as llguidance's TokenizerWrapper wants it."""

    def __init__(self, tok, vocab_size: int, eos: Sequence[int]):
        self.eos_token_id = eos[0] if eos else None
        self.bos_token_id = None
        special = set(eos)
        tokens = []
        for i in range(vocab_size):
            try:
                piece = tok.token_bytes(i)
            except Exception:  # an id past the tokenizer's table (a model's padded rows)
                piece = b""
            if i not in special and piece.startswith(b"<|") and piece.endswith(b"|>"):
                special.add(i)
            tokens.append(b"\xff" + piece if i in special else piece)
        self.tokens = tokens
        self.special_token_ids = sorted(special)
        self._tok = tok
        self._by_bytes: dict[bytes, int] | None = None
        self.is_tokenizer_wrapper = True

    def __call__(self, text: bytes | str) -> list[int]:
        """The tokenizer's own tokens for `text` where they spell it; else the longest tokens
        that do, left to right (a tokenizer whose encode and token_bytes disagree, a test's toy)."""
        data = text if isinstance(text, bytes) else text.encode()
        ids = self._tok.encode(data.decode("utf-8", errors="replace"), add_special=False, special=False)
        if all(0 <= i < len(self.tokens) for i in ids) and b"".join(self.tokens[i] for i in ids) == data:
            return ids
        if self._by_bytes is None:
            self._by_bytes = {}
            for i, piece in enumerate(self.tokens):
                if piece and not piece.startswith(b"\xff"):
                    self._by_bytes.setdefault(piece, i)
        longest = max(map(len, self._by_bytes), default=1)
        out, at = [], 0
        while at < len(data):
            for n in range(min(longest, len(data) - at), 0, -1):
                if data[at : at + n] in self._by_bytes:
                    out.append(self._by_bytes[data[at : at + n]])
                    at += n
                    break
            else:
                at += 1  # a byte no token spells: the grammar cannot force it anyway
        return out


class Grammars:
    """Compiled grammars for one model, keyed by their spec's hash: compiled off the caller's
    thread with a time limit (COMPILE_SECONDS), so a pathological schema never stalls the engine
    or the other streams; each request copies the cached matcher."""

    def __init__(self, model, seconds: float = COMPILE_SECONDS):
        self.model, self.seconds = model, seconds
        self._cache: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specdec-grammar")

    def constraint(self, spec: GrammarSpec) -> "Constraint":
        with self._lock:
            matcher = self._cache.get(spec.key)
        if matcher is None:
            future = self._pool.submit(self._compile, spec)
            try:
                matcher = future.result(timeout=self.seconds)
            except FutureTimeout:
                raise FieldError(
                    f"the {_what(spec)} took over {self.seconds:g} s to compile; simplify it", _field(spec)
                ) from None
            with self._lock:
                if len(self._cache) >= CACHE_SIZE:
                    self._cache.pop(next(iter(self._cache)))
                self._cache[spec.key] = matcher
        return Constraint(matcher.deep_copy(), self.model.vocab_size, self.model.tokenizer.eog_ids)

    def _compile(self, spec: GrammarSpec):
        ll = _llguidance()
        tokenizer = _tokenizer_for(self.model)
        try:
            grammar = spec.grammar(spec.kind == "tool_lark" and _special_tags(self.model, tokenizer))
        except ValueError as e:
            raise FieldError(f"the {_what(spec)} is not valid ({e})", _field(spec)) from None
        error, messages = ll.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if error and "Unimplemented keys" in messages[0]:  # llguidance's word for keywords it lacks
            raise FieldError(
                f"the {_what(spec)} uses keywords the grammar engine does not support: {_first_line(messages[0])}",
                _field(spec),
                "unsupported_value",
            )
        if error:
            raise FieldError(f"the {_what(spec)} is not valid: {_first_line(messages[0])}", _field(spec))
        matcher = ll.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise FieldError(f"the {_what(spec)} is not valid: {_first_line(matcher.get_error())}", _field(spec))
        if not matcher.compute_bitmask().strip(b"\0") or matcher.is_error():  # no token can begin it
            raise FieldError(f"the {_what(spec)} accepts no output at all", _field(spec))
        return matcher


def _special_tags(model, tokenizer) -> bool:
    """Whether the model's tokenizer has the tool-call tags as special tokens (one each)."""
    for tag in TOOL_TAGS:
        ids = model.tokenizer.encode(tag, add_special=False, special=True)
        if len(ids) != 1 or not tokenizer.is_special_token(ids[0]):
            return False
    return True


def _field(spec: GrammarSpec) -> str:
    return {"json_schema": "response_format", "tool_lark": "tools"}.get(spec.kind, "grammar")


def _what(spec: GrammarSpec) -> str:
    return {"json_schema": "JSON schema", "tool_lark": "tools' schema"}.get(spec.kind, f"{spec.kind.upper()} grammar")


def _first_line(message: str) -> str:
    return " ".join(message.split())[:300]


class Constraint:
    """One request's grammar state: the matcher advanced through the tokens emitted so far."""

    def __init__(self, matcher, vocab_size: int, eog=frozenset()):
        # eog: the end-of-generation tokens, never consumed on trial (llguidance's rollback does
        # not count a stop token: rolled back, it would take an earlier token with it)
        self.m, self.vocab_size, self.eog = matcher, vocab_size, frozenset(eog)

    def allowed(self) -> np.ndarray:
        """The tokens allowed next, a bool per vocabulary entry."""
        bits = np.frombuffer(self.m.compute_bitmask(), dtype=np.uint8)
        return np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool)

    def valid(self, tokens: Sequence[int]) -> int:
        """How many of `tokens` the grammar accepts in turn from here."""
        return self.m.validate_tokens(list(map(int, tokens))) if len(tokens) else 0

    def extend(
        self, tokens: Sequence[int], most: int, guesses: int | None = None, lookup=None
    ) -> tuple[list[int], int]:
        """A draft's free part, a function of the context alone: `tokens` (the drafter's proposal)
        cut at their first token the grammar refuses, then the tokens the grammar forces there,
        and, with `lookup` (a function of the draft so far and a count, giving a continuation:
        prompt lookup on the context and the draft), its continuation after them, cut and forced
        in turn; at most `guesses` tokens in all that the grammar does not force (default: the
        proposal's length) and `most` in all. Returns the draft and how many of it are the
        proposal's own (its first tokens)."""
        guesses = len(tokens) if guesses is None else guesses
        out: list[int] = []
        fed = own = 0
        pending, first = list(tokens), True
        try:
            while len(out) < most:
                take = pending[: min(self.valid(pending), most - len(out), guesses)]
                guesses -= len(take)
                end = next((i for i, t in enumerate(take) if t in self.eog), None)
                if end is not None:  # nothing follows an end
                    out += take[: end + 1]
                    own = own if not first else len(out)
                    break
                self._feed(take)
                fed += len(take)
                out += take
                if first:
                    own, first = len(take), False
                forced = self.m.compute_ff_tokens()[: most - len(out)]
                forced = forced[: next((i for i, t in enumerate(forced) if t in self.eog), len(forced))]
                if not forced:
                    break
                self._feed(forced)
                fed += len(forced)
                out += forced
                if lookup is None or guesses <= 0 or len(out) >= most:
                    break
                pending = list(lookup(out, min(guesses, most - len(out))))
                if not pending:
                    break
        finally:
            if fed:
                self.m.rollback(fed)
        return out, own

    def _feed(self, tokens: Sequence[int]) -> None:
        if tokens and not self.m.consume_tokens(list(map(int, tokens))):
            raise SpecdecError(f"the grammar refused tokens it had allowed: {self.m.get_error()}")

    def masks(self, tokens: Sequence[int]) -> np.ndarray:
        """[len(tokens) + 1, vocab] the allowed tokens at each position of a chain draft: before
        it and after each of its tokens, the grammar rolled back after; past a token the grammar
        refuses (or after an end of generation), the last position's mask again (those positions
        are never reached: the refused token has probability 0 under the masked target, so every
        rule rejects it; nothing after an end is emitted)."""
        rows = [self.allowed()]
        fed = 0
        for t in tokens:
            if fed == len(rows) - 1 and rows[-1][t] and t not in self.eog and self.m.consume_token(int(t)):
                fed += 1
                rows.append(self.allowed())
            else:
                rows.append(rows[-1])
        if fed:
            self.m.rollback(fed)
        return np.stack(rows)

    def consume(self, tokens: Sequence[int]) -> None:
        """Advance through emitted tokens (each allowed: they were verified under the masks)."""
        if tokens and not self.m.consume_tokens(list(map(int, tokens))):
            raise SpecdecError(f"the grammar refused an emitted token: {self.m.get_error()}")

    @property
    def stopped(self) -> bool:
        return self.m.is_stopped()
