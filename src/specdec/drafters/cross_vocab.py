"""A draft model of another vocabulary (Timor et al., ICML 2025, arXiv 2502.05202), two ways:

- "string": the draft model writes text with its own tokens; the target's tokenizer re-encodes that
  text after the target's last few tokens, and the re-encoded target tokens are verified as a
  one-hot draft (q None). The draft is a deterministic guess (the draft model's argmax), so the
  ordinary rule (accept x with probability p(x), else sample norm(max(0, p - onehot(x)))) keeps
  the output exactly the target's at any temperature.
- "intersect": the draft model's q restricted to the tokens both vocabularies share (the same
  bytes), renormalised and mapped to target ids; the draft token is sampled from that q and
  verified with it by the ordinary rejection rule (q is 0 outside the intersection; the residual
  max(p - q, 0) covers the rest). Greedy: the draft's argmax among shared tokens.

Both keep the draft model's context as *text*: every proposal first renders the target's context
to bytes (its special tokens as their vocabulary text, so the draft sees the turn structure),
compares them with the bytes of the draft tokens its cache holds, rolls the draft row back to the
last token inside the common prefix (less one, which may merge with what follows) and encodes the
rest with the draft's tokenizer. So a rejection, a correction token or a retokenisation all
resynchronise the same way, and `accept` has nothing to undo.

Boundaries: re-encoded text whose last target token could still grow with the next characters is
not proposed (only tokens followed by another one inside the draft text are stable); a UTF-8
character split across tokens (byte fallback, byte-level BPE) is held back until it is whole;
special tokens (control, end of generation, anything that prints nothing) are never proposed.
"""

from __future__ import annotations

import bisect
import codecs
from typing import Mapping, Sequence

import numpy as np

from ..models.base import RowModel
from ..sampling import SamplingParams, logits_to_probs, sample
from .base import Declared, Draft, lent_passes

MODES = ("string", "intersect")
DEFAULT_MODE = "string"
# Target tokens before the draft text that are re-encoded with it, so that the target's tokenizer
# sees the draft text in context (a word's leading space, a run of newlines). Enough for any
# pre-tokenizer rule we know of; more costs encoding time only.
ANCHOR_TOKENS = 4
# A string-level step drafts at most this many draft tokens per target token asked for (the
# vocabularies of a pair cut text at similar lengths; a draft that keeps producing text the target
# will not take as stable tokens is cut off).
DRAFT_TOKENS_PER_TARGET_TOKEN = 2


def special_tokens(tokenizer, vocab_size: int) -> frozenset[int]:
    """Tokens never proposed nor matched: end of generation, and every token that prints nothing
    (control tokens, padding, unused slots)."""
    return frozenset(tokenizer.eog_ids) | frozenset(t for t in range(vocab_size) if tokenizer.token_bytes(t) == b"")


def shared_tokens(draft: RowModel, target: RowModel) -> tuple[np.ndarray, np.ndarray]:
    """(draft ids, target ids) of the tokens whose bytes both vocabularies hold, special tokens
    excluded. Several draft tokens may print the same bytes (a byte-fallback token and an ordinary
    one): each maps to the target token of those bytes (the lowest id, if the target has several)."""
    t_special = special_tokens(target.tokenizer, target.vocab_size)
    d_special = special_tokens(draft.tokenizer, draft.vocab_size)
    by_bytes: dict[bytes, int] = {}
    for t in range(target.vocab_size - 1, -1, -1):  # downwards: the lowest id wins
        if t not in t_special:
            by_bytes[target.tokenizer.token_bytes(t)] = t
    pairs = [
        (d, by_bytes[b])
        for d in range(draft.vocab_size)
        if d not in d_special
        for b in [draft.tokenizer.token_bytes(d)]
        if b in by_bytes
    ]
    d_ids, t_ids = zip(*pairs) if pairs else ((), ())
    return np.array(d_ids, dtype=np.int64), np.array(t_ids, dtype=np.int64)


def intersect_q(
    q_draft: np.ndarray, d_ids: np.ndarray, t_ids: np.ndarray, target_vocab: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """The draft's distribution ([draft vocab], after the sampling filters) restricted to the shared
    tokens and renormalised: (over the shared list [n_shared], over target ids [target vocab]);
    None when the draft puts no mass on any shared token."""
    restricted = q_draft[d_ids]  # [n_shared]
    mass = restricted.sum()
    if not mass > 0:
        return None
    restricted = restricted / mass
    return restricted, np.bincount(t_ids, weights=restricted, minlength=target_vocab)  # [target vocab]


def whole_utf8(data: bytes) -> tuple[str, int]:
    """The text of `data` up to an incomplete character at its end, and how many bytes that held
    back (0 when data ends on a character boundary). Invalid bytes elsewhere become U+FFFD."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    text = decoder.decode(data, final=False)
    return text, len(decoder.getstate()[0])


def _starts_mid_character(data: bytes, at: int) -> bool:
    return 0 < at < len(data) and data[at] & 0xC0 == 0x80


def retokenize(
    tokenizer, anchor: Sequence[int], anchor_bytes: bytes, text: bytes, special: frozenset[int]
) -> list[int]:
    """The target tokens of draft `text` written after the target's `anchor` tokens, stable ones
    only: re-encoded together with the anchor when that reproduces the anchor's tokens (the usual
    case), else on its own (the text merges with the anchor: its first token starts where the
    target's context ends anyway). The last token is dropped (more text could still merge into
    it), as is everything from the first special token on (never proposed)."""
    whole, _ = whole_utf8(anchor_bytes + text)
    tokens = tokenizer.encode(whole, add_special=False)
    if list(tokens[: len(anchor)]) == list(anchor) and anchor:
        tokens = tokens[len(anchor) :]
    else:
        if _starts_mid_character(anchor_bytes + text, len(anchor_bytes)):
            return []
        tokens = tokenizer.encode(whole_utf8(text)[0], add_special=False)
    tokens = list(tokens[:-1])
    for i, token in enumerate(tokens):
        if token in special:
            return tokens[:i]
    return tokens


class _Row:
    def __init__(self, params: SamplingParams, rng: np.random.Generator):
        self.model_row: int | None = None  # the draft model's row, made at the first proposal
        self.params, self.rng = params, rng
        self.fed: list[int] = []  # draft tokens in the model row's cache
        self.ends: list[int] = []  # byte offset where each fed token's text ends
        self.fed_bytes = bytearray()  # their text
        self.head = 0  # leading fed tokens that print nothing (BOS)
        self.rendered = bytearray()  # the target context's text, rendered for the draft
        self.n_rendered = 0  # target tokens rendered into it
        self.context: list[int] = []  # those tokens
        # valid UTF-8 only: a character split across target tokens waits here until it is whole,
        # a stray byte becomes U+FFFD (the draft reads text, never broken bytes)
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.synced = 0  # target tokens the draft row holds the text of


class CrossVocabDrafter(Declared):
    """A draft model whose token ids mean something else than the target's (module docstring).
    Implements drafters.base.Drafter; `model` and `lag` serve the cost-aware controller as a
    same-vocabulary ModelDrafter's do."""

    takes = frozenset()  # propose's keywords beyond (contexts, ks, leaves): Drafter.takes

    def __init__(self, model: RowModel, target: RowModel, mode: str = DEFAULT_MODE):
        if mode not in MODES:
            raise ValueError(f"cross-vocabulary mode {mode!r}: use one of {', '.join(MODES)}")
        self.model, self.target, self.mode = model, target, mode
        self.name, self.kind = f"draft:{model.name}", "draft"
        self.target_special = special_tokens(target.tokenizer, target.vocab_size)
        self.draft_special = special_tokens(model.tokenizer, model.vocab_size)
        # the draft's logits row is masked to what it may propose: [draft vocab], 0 or -inf
        allowed = np.zeros(model.vocab_size, dtype=bool)
        if mode == "intersect":
            self.d_ids, self.t_ids = shared_tokens(model, target)
            allowed[self.d_ids] = True
        else:
            allowed[:] = True
            allowed[list(self.draft_special)] = False
        self._mask = np.where(allowed, 0.0, -np.inf).astype(np.float32)
        self._rows: dict[int, _Row] = {}

    # -- the Drafter verbs ---------------------------------------------------------------------

    def begin(self, row: int, prompt: Sequence[int], params: SamplingParams, rng: np.random.Generator) -> None:
        self.end([row])
        self._rows[row] = _Row(params, rng)

    def end(self, rows: Sequence[int]) -> None:
        states = [self._rows.pop(row) for row in rows if row in self._rows]
        made = [state.model_row for state in states if state.model_row is not None]
        if made:
            self.model.drop_rows(made)

    def lag(self, row: int, context: Sequence[int]) -> int:
        """Target tokens of the context the draft row has not seen (about the draft tokens its next
        proposal feeds first: the two vocabularies cut text at similar lengths)."""
        return len(context) - self._rows[row].synced

    def passes(self, fed: Mapping[int, int]) -> list[int]:
        return lent_passes(self.model, self._rows, fed)

    def accept(self, n_accepted: Mapping[int, int]) -> None:
        # The next proposal resynchronises on the text; only the lag estimate learns the outcome.
        for row, n in n_accepted.items():
            state = self._rows.get(row)
            if state is not None:
                state.synced += n

    def propose(
        self, contexts: Mapping[int, Sequence[int]], ks: Mapping[int, int], leaves: Mapping[int, int] | None = None
    ) -> dict[int, Draft]:
        model = self.model
        drafts = {row: Draft([]) for row in ks}
        live = {row: self._rows[row] for row, k in ks.items() if k > 0}
        if not live:
            return drafts
        new = [s for s in live.values() if s.model_row is None]
        for state, model_row in zip(new, model.add_rows(len(new)) if new else []):
            state.model_row = model_row
        # 1. catch up: every drafting row's cache is made to hold the target context's text
        keep, feed, ready = {}, {}, {}
        for row, state in live.items():
            n_keep, tokens, whole = self._sync(state, contexts[row])
            keep[state.model_row] = n_keep
            if tokens:
                feed[state.model_row] = tokens
            ready[row] = whole
        model.rollback_rows(keep)
        logits = model.forward_rows(feed, {r: 1 for r in feed}) if feed else {}  # per row [1, draft vocab]
        # drafting budget per row, in draft tokens; a row whose context ends inside a character
        # does not draft (its draft text would not follow the target's bytes)
        budget = {}
        for row, state in live.items():
            room = model.n_ctx - len(state.fed)
            k = ks[row] * (DRAFT_TOKENS_PER_TARGET_TOKEN if self.mode == "string" else 1)
            budget[row] = max(0, min(k, room)) if ready[row] else 0
        # 2. one draft-model forward per draft position over the rows still drafting
        if self.mode == "string":
            out = self._draft_string(live, contexts, ks, budget, logits)
        else:
            out = self._draft_intersect(live, ks, budget, logits)
        drafts.update(out)
        return drafts

    # -- keeping the draft row on the target's text ----------------------------------------------

    def _render(self, state: _Row, context: Sequence[int]) -> tuple[bytes, int]:
        """The target context as the draft reads it, and the bytes of a split character held back:
        each token's bytes; a special token, which prints nothing, as its vocabulary text (the turn
        markers of a chat template)."""
        tok = self.target.tokenizer
        if list(context[: state.n_rendered]) != state.context[: state.n_rendered]:
            state.rendered, state.n_rendered, state.context = bytearray(), 0, []  # not a continuation
            state.decoder.reset()
        state.context += context[state.n_rendered :]
        for token in context[state.n_rendered :]:
            piece = tok.token_bytes(token)
            if not piece and token in self.target_special:
                piece = tok.token_text(token).encode("utf-8")
            state.rendered += state.decoder.decode(piece).encode("utf-8")
        state.n_rendered = len(context)
        return bytes(state.rendered), len(state.decoder.getstate()[0])

    def _sync(self, state: _Row, context: Sequence[int]) -> tuple[int, list[int], bool]:
        """(draft tokens to keep, draft tokens to feed, whether the fed text ends on a character
        boundary) that make the row's cache hold the rendered context: roll back to the last fed
        token inside the common prefix, less one (it may merge with the text that follows), and
        encode the rest. At least one token is fed: the forward must give the next logits."""
        want, held = self._render(state, context)
        limit = min(len(want), len(state.fed_bytes))
        differ = np.flatnonzero(np.frombuffer(want, np.uint8, limit) != np.frombuffer(state.fed_bytes, np.uint8, limit))
        common = int(differ[0]) if differ.size else limit
        n = bisect.bisect_right(state.ends, common)
        n = max(state.head, n - 1) if n else 0
        tok = self.model.tokenizer
        while True:
            start = state.ends[n - 1] if n else 0
            if n > state.head and _starts_mid_character(want, start):
                n -= 1
                continue
            text = want[start:].decode("utf-8")
            tokens = tok.encode(text, add_special=(n == 0)) if text or n == 0 else []
            if tokens or n == 0:
                break
            n -= 1  # nothing new to feed: feed the last kept token again
        del state.fed[n:], state.ends[n:]
        del state.fed_bytes[start:]
        if n + len(tokens) >= self.model.n_ctx:  # the draft's context is full: it stops drafting
            return n, [], False
        self._feed(state, tokens)
        if n == 0:
            state.head = next((i for i, e in enumerate(state.ends) if e > 0), len(state.ends))
        state.synced = len(context)
        return n, tokens, held == 0 and bool(tokens)

    def _feed(self, state: _Row, tokens: Sequence[int]) -> None:
        """Book draft tokens as fed (their text appended)."""
        for token in tokens:
            state.fed.append(int(token))
            state.fed_bytes += self.model.tokenizer.token_bytes(int(token))
            state.ends.append(len(state.fed_bytes))

    # -- the two ways of drafting ----------------------------------------------------------------

    def _draft_string(self, live, contexts, ks, budget, logits) -> dict[int, Draft]:
        """Greedy draft tokens until their text re-encodes to ks[row] stable target tokens."""
        tok = self.target.tokenizer
        anchors = {}
        for row in live:
            context = contexts[row]
            n = 0
            while n < min(ANCHOR_TOKENS, len(context)) and context[-1 - n] not in self.target_special:
                n += 1
            anchor = list(context[len(context) - n :])
            anchors[row] = (anchor, b"".join(tok.token_bytes(t) for t in anchor))
        text = {row: bytearray() for row in live}
        proposal = {row: [] for row in live}
        drafting = {row for row in live if budget[row] > 0}
        step = 0
        while drafting:
            feed = {}
            for row in sorted(drafting):
                state = live[row]
                token = int(np.argmax(logits[state.model_row][0] + self._mask))
                if token in self.draft_special:  # every token masked: nothing to say
                    drafting.discard(row)
                    continue
                text[row] += self.model.tokenizer.token_bytes(token)
                anchor, anchor_bytes = anchors[row]
                stable = retokenize(tok, anchor, anchor_bytes, bytes(text[row]), self.target_special)
                proposal[row] = stable  # the latest reading: more text may undo an earlier cut
                if len(stable) >= ks[row] or step + 1 >= budget[row]:
                    drafting.discard(row)
                else:
                    feed[state.model_row] = [token]
                    self._feed(state, [token])
            step += 1
            if feed:
                logits = self.model.forward_rows(feed, {r: 1 for r in feed})
            else:
                break
        return {row: Draft(proposal[row][: ks[row]]) for row in live}

    def _draft_intersect(self, live, ks, budget, logits) -> dict[int, Draft]:
        """Draft tokens from q restricted to the shared tokens, sampled (or the argmax when greedy),
        proposed as the target tokens of the same bytes with that q."""
        tokens = {row: [] for row in live}
        qs = {row: [] for row in live}
        drafting = {row for row in live if budget[row] > 0}
        while drafting:
            feed = {}
            for row in sorted(drafting):
                state = live[row]
                row_logits = logits[state.model_row][0]
                if state.params.greedy:
                    masked = row_logits + self._mask
                    d = int(np.argmax(masked))
                    if not np.isfinite(masked[d]):
                        drafting.discard(row)
                        continue
                    t = int(self.t_ids[np.searchsorted(self.d_ids, d)])
                else:
                    shared = intersect_q(
                        logits_to_probs(row_logits, state.params), self.d_ids, self.t_ids, self.target.vocab_size
                    )
                    if shared is None:  # no mass on a shared token: stop this row's draft here
                        drafting.discard(row)
                        continue
                    over_shared, over_target = shared
                    j = sample(over_shared, state.rng)
                    d, t = int(self.d_ids[j]), int(self.t_ids[j])
                    qs[row].append(over_target)
                tokens[row].append(t)
                if len(tokens[row]) >= budget[row]:
                    drafting.discard(row)
                else:  # the last draft token need not be fed: nothing reads its logits
                    feed[state.model_row] = [d]
                    self._feed(state, [d])
            if feed:
                logits = self.model.forward_rows(feed, {r: 1 for r in feed})
            else:
                break
        return {row: Draft(tokens[row], np.stack(qs[row]) if qs[row] else None) for row in live}
