"""The row protocol every backend implements, and the Tokenizer it carries.

A *row* is one sequence being generated. A model holds several rows in its KV cache at once and
advances any subset of them in ONE forward: that is what lets the engine batch requests and
drafts together. Row ids are small integers the model hands out (`add_rows`) and takes back
(`drop_rows`); every other call names the rows it is about.

    rows = model.add_rows(2)                                  # two empty caches
    model.forward_rows({rows[0]: prompt_a, rows[1]: prompt_b})   # prefill: no logits asked
    logits = model.forward_rows({rows[0]: [last, *draft]}, {rows[0]: 1 + len(draft)})
    model.rollback_rows({rows[0]: n_kept})                    # cut a row back to what it kept
    model.drop_rows(rows)                                     # free their caches now

Capabilities, declared (RowModel's members, with their defaults in the two mixins below; the
engine reads them, it never probes with getattr or hasattr): `scores_trees` (forward_tree_rows
and keep_path_rows work), `tree_leaves` (the leaves the next tree forward may hold; None: no
limit), `keeps_idle_rows` (a row not fed costs the other rows nothing, so a finished row's cache
may stay for a later prompt that starts the same way: Engine's prefix_cache), and `saves_rows`
(`save_row(row) -> SavedRow` / `load_row(row, saved)` copy a row's cache to host memory and
back, so a kept row's cache outlives the row: Engine's host_cache).

Two mixins below give the rest for free:
- `SingleRow`: the one-sequence calls (forward / rollback / reset / n_past) as a batch of one,
  for backends whose cache is natively many rows (llama.cpp, torch);
- `SequentialRows`: the row protocol for a backend that computes one sequence at a time (the
  NumPy reference, test models): each row keeps its own cache state, swapped in for its turn.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Iterable, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np


@runtime_checkable
class Tokenizer(Protocol):
    eog_ids: frozenset[int]  # every end-of-generation token the model declares

    # add_special: the BOS (EOS) the model's encoding adds; special: text spelling a special token
    # (<|im_end|>) becomes it (False: it stays text, as a chat turn's content does)
    def encode(self, text: str, add_special: bool = True, special: bool = True) -> list[int]: ...
    def decode(self, tokens: Sequence[int]) -> str: ...
    def token_bytes(self, token: int) -> bytes: ...  # raw bytes of one token (UTF-8 may be split)
    def token_text(self, token: int) -> str: ...  # the vocabulary entry, for compatibility checks
    def apply_chat_template(
        self, messages: list[dict], tools: list | None = None
    ) -> str: ...  # ends with the assistant turn

    # The most bytes of UTF-8 text one token can stand for (a special token's spelling included),
    # so that a text of B bytes is at least ceil(B / it) tokens, known before tokenizing it; None
    # where no such bound holds (a normalizer that shrinks text, a token that swallows the
    # whitespace beside it, text the tokenizer drops). Worked out on first use, then kept.
    def max_token_bytes(self) -> int | None: ...


@runtime_checkable
class RowModel(Protocol):
    name: str  # for output: file name or model name
    vocab_size: int  # width of a logits row
    n_ctx: int  # context window of one row, in tokens
    max_rows: int  # rows the cache holds at once
    tokenizer: Tokenizer
    is_instruct: bool  # apply the chat template by default
    # capabilities (the module docstring)
    scores_trees: bool
    tree_leaves: int | None
    keeps_idle_rows: bool
    saves_rows: bool
    grows_trees: bool  # grow_tree_rows: a tree forward that adds nodes to the tree already fed
    exits_early: bool  # forward_rows(..., n_layers=L) stops after L of its n_layer layers (early exit)
    runs_exit_blocks: bool  # attach_exit_blocks: an early-exit head's blocks drafted through its own cache
    exact: bool  # every row's logits batch-invariant (llama.cpp's exact mode, docs/guide/exact.md)
    # llama.cpp's model handle, for a library that reads its vocabulary itself (grammar.py's
    # llguidance tokenizer: the tokens' attributes say which are control tokens); None elsewhere
    llama_model: object | None

    def add_rows(self, n: int = 1) -> list[int]:
        """n new empty rows; their ids."""
        ...

    def forward_rows(
        self, tokens: Mapping[int, Sequence[int]], n_logits: Mapping[int, int] | None = None
    ) -> dict[int, np.ndarray]:
        """Append tokens[r] to row r's cache, every row in ONE forward, and return for each row
        the logits of its last n_logits[r] tokens ([n, vocab] float32; rows not in n_logits: none).
        Asking only for the rows verification needs matters: every returned row costs output work."""
        ...

    def rollback_rows(self, keep: Mapping[int, int]) -> None:
        """Cut row r's cache to its first keep[r] tokens."""
        ...

    def drop_rows(self, rows: Iterable[int]) -> None:
        """Forget these rows and free their caches now."""
        ...

    def row_length(self, row: int) -> int:
        """Tokens held in a row's cache."""
        ...

    def passes(self, fed: Mapping[int, int]) -> list[int]:
        """The widths of the passes over the weights a forward feeding fed[row] tokens to each row
        makes (a cost curve prices each): one of their sum where rows are packed (NumPy,
        llama.cpp's pool), of rows x the longest where they are padded to one shape (torch);
        llama.cpp's per-row streams make one per equal split (llama_cpp.stream_passes)."""
        ...


@dataclass(frozen=True)
class SavedRow:
    """A row's cache copied out of the model (save_row): `length` tokens, `nbytes` of host memory
    (what a host cache counts against its budget), `data` the backend's own."""

    length: int
    nbytes: int
    data: object


@runtime_checkable
class HiddenStates(Protocol):
    """What a trained head drafts from (drafters.head): the target's final hidden state, after the
    final norm (the vector its output head turns into logits), kept for the tokens a forward
    returns logits for. A backend keeps them only once asked (`keep_hidden`): a plain run pays
    nothing. Implemented by llama.cpp (its embeddings output), the NumPy reference and torch (a hook
    on the final norm)."""

    n_embd: int  # width of a hidden state
    identity: str  # what a head file names its target by: the GGUF's sha256

    def keep_hidden(self) -> None:
        """From now on, keep the hidden states of every token a forward returns logits for."""
        ...

    def hidden_rows(self, rows: Iterable[int]) -> dict[int, tuple[int, np.ndarray]]:
        """Per row, (first position, [n, n_embd] float32): the kept hidden states of its last
        forward that returned logits, less any a rollback cut since (n may be 0)."""
        ...

    def head_weights(self, name: str, tokens: np.ndarray) -> np.ndarray:
        """Rows `tokens` of the output head ("output") or the input embedding ("embedding"),
        [len(tokens), n_embd] float32."""
        ...


def file_sha256(path) -> str:
    """The sha256 of a model file (what a head file names its target by), hashed once a process."""
    import os
    from pathlib import Path

    from ..catalog import file_sha256 as digest

    stat = os.stat(path)
    key = (os.fspath(path), stat.st_size, stat.st_mtime_ns)
    if key not in _SHA256:
        _SHA256[key] = digest(Path(path))
    return _SHA256[key]


_SHA256: dict[tuple, str] = {}


def trim_hidden(kept: tuple[int, np.ndarray] | None, length: int, n_embd: int) -> tuple[int, np.ndarray]:
    """A row's kept hidden states (first position, [n, n_embd]) cut to a cache of `length` tokens."""
    if kept is None:
        return length, np.zeros((0, n_embd), np.float32)
    first, states = kept
    return first, states[: max(0, length - first)]


def path_hidden(kept, tree_states: np.ndarray | None, past: int, path: Sequence[int], n_embd: int):
    """A row's kept hidden states after keep_path: the path's nodes' states (tree_states [T, n_embd],
    the tree's nodes in order) at the positions the path now holds after the `past` tokens before
    the tree; without a path or the nodes' states, those before the tree."""
    if len(path) and tree_states is not None:
        return past, tree_states[list(path)]
    return trim_hidden(kept, past, n_embd)


def tree_depths(parents: Sequence[int]) -> np.ndarray:
    """Each node's depth in a tree given by parents (-1: under the cache's last token, depth 0;
    else an earlier node): [T] int64. A parent that is not -1 or an earlier node is a ValueError."""
    depth = np.zeros(len(parents), dtype=np.int64)
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise ValueError(f"node {i}'s parent {parent} must be -1 or an earlier node")
        depth[i] = 0 if parent < 0 else depth[parent] + 1
    return depth


def check_tree_fits(tokens: Sequence[int], parents: Sequence[int], depth: np.ndarray, past: int, n_ctx: int) -> None:
    """A tree a backend is asked to score after `past` tokens: a parent per token (else a
    ValueError) and its deepest node within the context (else a ContextOverflowError)."""
    from ..errors import ContextOverflowError

    if len(tokens) != len(parents):
        raise ValueError(f"a tree needs a parent per token: {len(tokens)} tokens, {len(parents)} parents")
    if past + int(depth.max(initial=-1)) + 1 > n_ctx:
        raise ContextOverflowError(f"a tree of depth {int(depth.max()) + 1} after {past} tokens does not fit")


def tree_ancestry(parents: Sequence[int]) -> np.ndarray:
    """[T, T] bool: node i reads node j (j is i or one of its ancestors): a tree's attention
    among its own nodes. parents as tree_depths takes them (tree_depths checks them)."""
    above = np.eye(len(parents), dtype=bool)
    for i, parent in enumerate(parents):
        if parent >= 0:
            above[i] |= above[parent]
    return above


def check_tree_path(parents: Sequence[int], path: Sequence[int]) -> None:
    """A path kept from a tree: root first (a node whose parent is -1), each node the parent of
    the next; empty keeps no node. Else a ValueError."""
    above = -1
    for node in path:
        if not 0 <= node < len(parents) or parents[node] != above:
            raise ValueError(f"{list(path)} is not a path down a tree of {len(parents)} nodes from its root")
        above = node


class SingleRow:
    """The one-sequence calls on top of the row protocol: a row made on first use.

    logits = model.forward(tokens, n_rows=1)    # [1, vocab]
    model.rollback(n_keep); model.reset(); model.n_past
    """

    _solo: int | None = None
    # the declared capabilities' defaults (the module docstring); a backend sets what it has
    scores_trees = False
    tree_leaves: int | None = None
    keeps_idle_rows = False
    saves_rows = False
    grows_trees = False
    exits_early = False
    runs_exit_blocks = False
    exact = False
    llama_model = None  # (RowModel.llama_model)

    def _solo_row(self) -> int:
        if self._solo is None:
            self._solo = self._new_solo_row()
        return self._solo

    def _new_solo_row(self) -> int:
        """The row the one-sequence calls use (a backend with a fixed number of rows reserves one,
        so that these calls never take a row from the engine)."""
        return self.add_rows(1)[0]

    @property
    def n_past(self) -> int:
        return 0 if self._solo is None else self.row_length(self._solo)

    def forward(self, tokens: Sequence[int], n_rows: int | None = None) -> np.ndarray:
        """Append tokens and return the logits of the last n_rows of them (all when None)."""
        row = self._solo_row()
        n = len(tokens) if n_rows is None else min(n_rows, len(tokens))
        return self.forward_rows({row: tokens}, {row: n})[row]

    def rollback(self, n_keep: int) -> None:
        self.rollback_rows({self._solo_row(): n_keep})

    def reset(self) -> None:
        """Forget the sequence (its row is given back)."""
        if self._solo is not None:
            self.drop_rows([self._solo])
            self._solo = None


class SequentialRows:
    """The row protocol for a model that holds one sequence (`forward(tokens, n_rows)`,
    `rollback(n_keep)`, `n_past`): every row keeps its own cache state, and a forward over several
    rows runs them one after another, each with its state swapped in. The subclass says what its
    state is: `_new_state()` (an empty cache), `_get_state()`, `_set_state(state)`."""

    max_rows = 1 << 16
    keeps_idle_rows = True  # a row not fed costs the others nothing (Engine prefix_cache)
    saves_rows = True  # save_row / load_row below
    scores_trees = False  # a subclass with forward_tree sets it (the module docstring)
    tree_leaves: int | None = None  # no limit
    grows_trees = False
    exits_early = False  # a subclass whose forward takes n_layers sets it
    runs_exit_blocks = False
    exact = False
    llama_model = None  # (RowModel.llama_model)

    def _row_states(self) -> dict:
        if "_states" not in self.__dict__:
            self._states, self._next_row, self._current = {}, 0, None
        return self._states

    def add_rows(self, n: int = 1) -> list[int]:
        states = self._row_states()
        ids = list(range(self._next_row, self._next_row + n))
        self._next_row += n
        for r in ids:
            states[r] = self._new_state()
        return ids

    @contextlib.contextmanager
    def use_row(self, row: int):
        """Within the block, the single-sequence calls act on this row (None: the model's own
        sequence, the one the single-sequence calls use outside any row)."""
        states = self._row_states()
        if row is None:
            yield
            return
        if row not in states:
            raise KeyError(f"no row {row}")
        if self._current == row:
            yield
            return
        outer, outer_state = self._current, self._get_state()
        self._set_state(states[row])
        self._current = row
        try:
            yield
        finally:
            states[row] = self._get_state()
            self._set_state(outer_state)
            self._current = outer

    def forward_rows(
        self,
        tokens: Mapping[int, Sequence[int]],
        n_logits: Mapping[int, int] | None = None,
        n_layers: int | None = None,  # an early exit, where the subclass's forward takes one
    ) -> dict[int, np.ndarray]:
        n_logits = n_logits or {}
        exit = {} if n_layers is None else {"n_layers": n_layers}
        out = {}
        for row, row_tokens in tokens.items():
            with self.use_row(row):
                logits = self.forward(row_tokens, n_rows=n_logits.get(row, 0), **exit) if row_tokens else None
            if row in n_logits:
                out[row] = logits if logits is not None else np.zeros((0, self.vocab_size), np.float32)
        return out

    def rollback_rows(self, keep: Mapping[int, int]) -> None:
        for row, n in keep.items():
            with self.use_row(row):
                self.rollback(n)

    def forward_tree_rows(self, trees: Mapping[int, tuple[Sequence[int], Sequence[int]]]) -> dict[int, np.ndarray]:
        """Each row's tree (tokens, parents) in one pass (the subclass's forward_tree); every
        node's logits per row."""
        out = {}
        for row, (tokens, parents) in trees.items():
            with self.use_row(row):
                out[row] = self.forward_tree(tokens, parents)
        return out

    def keep_path_rows(self, paths: Mapping[int, Sequence[int]]) -> None:
        """Per row, after forward_tree_rows: keep the cache before the tree and the path's nodes."""
        for row, path in paths.items():
            with self.use_row(row):
                self.keep_path(path)

    def drop_rows(self, rows: Iterable[int]) -> None:
        states = self._row_states()
        for row in rows:
            states.pop(row, None)

    def row_length(self, row: int) -> int:
        with self.use_row(row):
            return self.n_past

    def save_row(self, row: int) -> SavedRow:
        """A copy of the row's cache state (its arrays' bytes counted)."""
        state = copy.deepcopy(self._row_states()[row] if self._current != row else self._get_state())
        return SavedRow(self.row_length(row), _nbytes(state), state)

    def load_row(self, row: int, saved: SavedRow) -> None:
        """The row's cache becomes a copy of the saved one."""
        state = copy.deepcopy(saved.data)
        if self._current == row:
            self._set_state(state)
        else:
            self._row_states()[row] = state

    def passes(self, fed: Mapping[int, int]) -> list[int]:
        return packed(fed)


def _nbytes(state) -> int:
    """The bytes a state's arrays hold (nested in tuples, lists and dicts), or 8 a plain value."""
    if isinstance(state, np.ndarray):
        return state.nbytes
    if isinstance(state, (tuple, list)):
        return sum(_nbytes(x) for x in state)
    if isinstance(state, dict):
        return sum(_nbytes(x) for x in state.values())
    return 8


def check_same_vocab(target: RowModel, draft: RowModel) -> None:
    """Refuse a draft whose token ids mean something else: same size and same token texts."""
    from ..errors import VocabMismatchError

    hint = "pick a draft of the same model family, or use --draft ngram (or --draft-model none)"
    if draft.vocab_size != target.vocab_size:
        raise VocabMismatchError(
            f"draft {draft.name} has {draft.vocab_size} tokens but target {target.name} has {target.vocab_size}", hint
        )
    t, d = target.tokenizer, draft.tokenizer
    for token in range(target.vocab_size):
        if t.token_text(token) != d.token_text(token):
            raise VocabMismatchError(
                f"draft {draft.name} and target {target.name} disagree on token {token} "
                f"({t.token_text(token)!r} vs {d.token_text(token)!r})",
                hint,
            )


def packed(fed: Mapping[int, int]) -> list[int]:
    """The passes of a forward whose rows are packed into one: one, of every row's tokens."""
    total = sum(fed.values())
    return [total] if total else []
