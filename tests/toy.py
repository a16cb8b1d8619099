"""A tiny deterministic causal LM in pure numpy, for testing the engine without real weights.

Its next-token logits depend on the last two tokens (a random trigram table), so a cache that
was rolled back wrongly shows up as different output.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from specdec.costs import CostTable
from specdec.models.base import SequentialRows, check_tree_path, tree_depths


def frozen(curve) -> CostTable:
    """A cost curve that does not learn from live timing (CostTable.observe): a test's decisions then
    follow the curve it names however busy the machine is. A learning target curve drifts to this
    machine's real timing while the draft's stays as named, and a busy CI run once turned auto's near
    tie between prompt lookup and the draft model the other way."""
    table = CostTable.of(curve)
    table.observe = lambda *args, **kwargs: None
    return table


class ToyTokenizer:
    def __init__(self, vocab_size: int, eog: Sequence[int] = (0,)):
        self.eog_ids = frozenset(eog)
        # token i prints as a letter; tokens 1 and 2 are the two halves of "é" (UTF-8 c3 a9)
        self._bytes = [bytes([97 + (i % 26)]) for i in range(vocab_size)]
        self._bytes[1], self._bytes[2] = b"\xc3", b"\xa9"
        for t in eog:
            self._bytes[t] = b""

    def encode(self, text: str, add_special: bool = True, special: bool = True) -> list[int]:
        return [3 + (b % 20) for b in text.encode()]

    def token_bytes(self, token: int) -> bytes:
        return self._bytes[token]

    def decode(self, tokens: Sequence[int]) -> str:
        return b"".join(self._bytes[t] for t in tokens).decode("utf-8", errors="replace")

    def token_text(self, token: int) -> str:
        return self._bytes[token].decode("latin-1")

    def apply_chat_template(self, messages):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def max_token_bytes(self) -> int:
        return 1  # encode: a token a byte


class ToyLM(SequentialRows):
    """Implements specdec.models.base.RowModel (rows in turn, each its own token list as cache)."""

    def __init__(
        self,
        vocab_size: int = 32,
        seed: int = 0,
        n_ctx: int = 512,
        sharpness: float = 3.0,
        eog: Sequence[int] = (0,),
        noise_from: "ToyLM | None" = None,
        noise: float = 0.0,
    ):
        rng = np.random.default_rng(seed)
        self.name = f"toy-{seed}"
        self.vocab_size, self.n_ctx = vocab_size, n_ctx
        self.table = rng.normal(size=(vocab_size, vocab_size, vocab_size)) * sharpness  # [prev2, prev, vocab]
        if noise_from is not None:  # a "draft" that mostly agrees with another toy model
            self.table = noise_from.table + rng.normal(size=self.table.shape) * noise
        self.table[:, :, list(eog)] -= 4.0  # end-of-generation is rare
        self.tokenizer = ToyTokenizer(vocab_size, eog)
        self.is_instruct = False
        self.cache: list[int] = []
        self.forward_calls: list[int] = []  # rows asked per forward, for tests

    def _new_state(self):
        return []

    def _get_state(self):
        return self.cache

    def _set_state(self, state) -> None:
        self.cache = state

    @property
    def n_past(self) -> int:
        return len(self.cache)

    def forward(self, tokens: Sequence[int], n_rows: int | None = None) -> np.ndarray:
        assert len(self.cache) + len(tokens) <= self.n_ctx, "context overflow"
        rows = []
        for t in tokens:
            self.cache.append(int(t))
            prev2 = self.cache[-2] if len(self.cache) > 1 else 0
            rows.append(self.table[prev2, self.cache[-1]])
        n_rows = len(tokens) if n_rows is None else n_rows
        self.forward_calls.append(len(tokens))
        return np.array(rows[len(rows) - n_rows :], dtype=np.float32).reshape(n_rows, self.vocab_size)

    def rollback(self, n_keep: int) -> None:
        del self.cache[n_keep:]
        self.__dict__.setdefault("_trees", {}).pop(self.__dict__.get("_current"), None)

    def reset(self) -> None:
        self.cache.clear()

    scores_trees = True

    def forward_tree(self, tokens: Sequence[int], parents: Sequence[int]) -> np.ndarray:
        """Every node's logits as a chain of its path would give them (a trigram reads its path's
        last two tokens); the row's cache holds the tree's base until keep_path."""
        tree_depths(parents)  # a ValueError for a bad tree
        rows = []
        for i in range(len(tokens)):
            path, node = [], i
            while node >= 0:
                path.append(int(tokens[node]))
                node = parents[node]
            seq = self.cache + path[::-1]
            rows.append(self.table[seq[-2] if len(seq) > 1 else 0, seq[-1]])
        self.forward_calls.append(len(tokens))
        self.__dict__.setdefault("_trees", {})[self.__dict__.get("_current")] = (tuple(parents), list(tokens))
        return np.array(rows, dtype=np.float32).reshape(len(tokens), self.vocab_size)

    def keep_path(self, path: Sequence[int]) -> None:
        parents, tokens = self.__dict__.setdefault("_trees", {}).pop(self.__dict__.get("_current"))
        check_tree_path(parents, path)
        self.cache += [int(tokens[node]) for node in path]


class Solo:
    """One row of a row-indexed drafter, driven as a single sequence: propose(context, k) -> Draft,
    with prompt lookup's evidence as last_match_length / last_votes. Row None is the model's own
    sequence (SequentialRows.use_row(None))."""

    def __init__(self, drafter, row=None, params=None, rng=None):
        from specdec.sampling import SamplingParams

        self.drafter, self.row = drafter, row
        drafter.begin(row, [], params or SamplingParams(), rng or np.random.default_rng(0))

    def propose(self, context, k):
        draft = self.drafter.propose({self.row: context}, {self.row: k})[self.row]
        self.last_match_length = draft.evidence.get("match", 0)
        self.last_votes = draft.evidence.get("votes", (0, 0))
        return draft

    def accept(self, n):
        self.drafter.accept({self.row: n})


class PieceTokenizer:
    """A vocabulary of byte strings, encoded by greedy longest match (so neighbouring pieces merge
    the way BPE merges them: "a" then "b" may re-encode as "ab"). Pieces that print nothing are
    special: `eog` ends generation, `bos` opens an encoding with add_special. Bytes no piece covers
    are dropped. The text of a special piece's name (`names`) encodes to it, as llama.cpp parses
    special tokens in text. Implements specdec.models.base.Tokenizer."""

    def __init__(
        self,
        pieces: Sequence[bytes],
        eog: Sequence[int] = (0,),
        bos: int | None = None,
        names: dict[int, str] | None = None,
    ):
        self.pieces = [bytes(p) for p in pieces]
        self.eog_ids = frozenset(eog)
        self.bos = bos
        self.names = dict(names or {})  # vocabulary text of the special pieces
        self._longest = max(len(p) for p in self.pieces)
        self._index: dict[bytes, int] = {}
        for i, piece in enumerate(self.pieces):
            if piece:
                self._index.setdefault(piece, i)  # a duplicate piece is never produced by encode

    def encode(self, text: str, add_special: bool = True, special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        ids = [self.bos] if add_special and self.bos is not None else []
        i = 0
        names = {name.encode(): token for token, name in self.names.items()} if special else {}
        while i < len(data):
            name = next((name for name in names if data.startswith(name, i)), None)
            if name is not None:
                ids.append(names[name])
                i += len(name)
                continue
            for n in range(min(self._longest, len(data) - i), 0, -1):
                token = self._index.get(data[i : i + n])
                if token is not None:
                    ids.append(token)
                    i += n
                    break
            else:
                i += 1
        return ids

    def token_bytes(self, token: int) -> bytes:
        return self.pieces[token]

    def decode(self, tokens: Sequence[int]) -> str:
        return b"".join(self.pieces[t] for t in tokens).decode("utf-8", errors="replace")

    def token_text(self, token: int) -> str:
        return self.names.get(token) or self.pieces[token].decode("latin-1")

    def apply_chat_template(self, messages):
        return "".join(m["content"] for m in messages)

    def max_token_bytes(self) -> int | None:
        """The longest piece or special name, where every byte has a piece; else None: a byte no
        piece covers is dropped, so a text's length bounds nothing."""
        if any(bytes([b]) not in self._index for b in range(256)):
            return None
        return max([self._longest] + [len(name.encode()) for name in self.names.values()])


def piece_lm(pieces: Sequence[bytes], seed: int, **kw) -> ToyLM:
    """A ToyLM over a PieceTokenizer of these pieces (keyword arguments: the tokenizer's)."""
    model = ToyLM(vocab_size=len(pieces), seed=seed, eog=kw.get("eog", (0,)))
    model.name = f"pieces-{seed}"
    model.tokenizer = PieceTokenizer(pieces, **kw)
    return model


def on_virtual_clock(model, curve) -> "Callable[[], float]":
    """Makes each of `model`'s forwards take curve(width) seconds of a virtual clock, and returns
    that clock (for Engine(clock=...)): the costs a controller learns live are then the curve's
    own, so its decisions never depend on the machine's load. (An early exit's forwards, which
    take n_layers, are charged as whole ones.)"""
    import functools

    now = [0.0]
    forward_rows = model.forward_rows

    @functools.wraps(forward_rows)  # its signature stays the model's (an early exit reads it)
    def timed(tokens, n_logits=None, **exit):
        now[0] += sum(curve(w) for w in model.passes({row: len(t) for row, t in tokens.items()}))
        return forward_rows(tokens, n_logits, **exit)

    model.forward_rows = timed
    return lambda: now[0]
