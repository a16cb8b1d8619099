"""A suffix cache across requests: continue what followed the same tokens in earlier requests.

Agents, code assistants and RAG pipelines send the same or nearly the same work again and again
(SuffixDecoding, arXiv 2411.04975, reports up to 5x on agentic workloads; llama.cpp's ngram-cache
keeps static and dynamic caches for the same reason). Prompt lookup only sees the live row's own
context; this drafter also remembers every prompt and output this process has seen (added when a
row ends), an optional corpus file, and a cache saved to and loaded from disk.

How it finds a draft. Every stored sequence is indexed by its n-grams (n in KEY_LENGTHS) -> the
positions just after each occurrence. For the live row, the longest key length whose last n
tokens occurred before gives the candidates (the most recent `candidates` occurrences in the
cache and in the row's own context); each is extended backwards, up to DEPTH tokens, to the
length its match really spans. The occurrences that share the longest match are the node of a
suffix tree at that depth; below it, the continuations form a tree of candidates, which is
reduced to one chain greedily: at every position the token most of the surviving occurrences
continue with (the most recent one breaking ties), keeping only those occurrences, until the
chain is as long as the match or too few occurrences still agree (MIN_SHARE). The match
length and the vote behind the first token, ("match": m, "votes": (chosen, total)), are the
evidence the cost-aware controller predicts acceptance from, as it does for prompt lookup.

With `width` > 1 the tree is kept instead (`suffix:KxW`, `suffix:KxW/N`): under every node the
`width` tokens most of its occurrences continue with, grown best first by the share of occurrences
that agree with the whole path, to at most `nodes` nodes (k x width without a count), no deeper
than k or the match, none below MIN_SHARE. Where earlier answers parted (a file rewritten with
different changes, an answer whose greedy text moved), the target then scores both sides in one
forward instead of the majority's alone. A tree that never branches goes as a chain.

Memory is bounded by `cap` tokens stored. Past it, the oldest sequences (not the corpus) are
dropped until the store is at EVICT_TO of the cap, and the index is rebuilt from what remains,
so the rebuild's cost is paid once per (1 - EVICT_TO) x cap new tokens (0.8 s at the default
cap on the 2-core development machine: a pause of the row that ends then, not a cost per step).
"""

from __future__ import annotations

import hashlib
import heapq
import io
import itertools
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from ..errors import SpecdecError
from ..paths import read_text, write_atomically
from ..sampling import SamplingParams
from .base import Declared, Draft, tree_shape

# n-gram lengths the index keys on. The longest present narrows the candidates to occurrences that
# already match that far (a 16-token key finds a repeated prompt among thousands of "    return"s);
# the shorter ones still find a 1-token match when nothing longer exists, as prompt lookup does.
KEY_LENGTHS = (1, 2, 4, 8, 16)
DEPTH = 128  # the longest match measured: twice the widest draft (63) the controller times
CANDIDATES = 64  # occurrences of the key compared per store, the most recent first
# A chain stops where it is unlikely to be accepted anyway (what a fixed k would otherwise draft):
# past as many tokens as its match spans (a 1-token match earns a 1-token draft, as SuffixDecoding
# also caps drafts by match length), or when the share of occurrences agreeing with it all the way,
# a rough P(accepted so far), falls below MIN_SHARE.
MIN_SHARE = 0.1
DEFAULT_CAP = 200_000  # tokens stored: about 400 bytes a token in CPython (measured), so ~80 MB
EVICT_TO = 0.8  # after eviction the store holds at most this fraction of the cap
FORMAT = "specdec-suffix-cache/1"


def tokenizer_fingerprint(tokenizer, vocab_size: int) -> str:
    """What a saved cache must agree with: the vocabulary size and the bytes of 512 tokens spread
    over it (token ids mean nothing under another tokenizer)."""
    h = hashlib.sha256(str(vocab_size).encode())
    for token in range(0, vocab_size, max(1, vocab_size // 512)):
        try:
            h.update(tokenizer.token_bytes(token) + b"\x00")
        except Exception:  # a token without bytes (a special one) still counts by its place
            h.update(b"?\x00")
    return h.hexdigest()[:16]


class _Store:
    """Token sequences one after another, each ended by SEP, and for every n-gram that has a
    token after it, the positions of those tokens (oldest first)."""

    SEP = -1

    def __init__(self):
        self.tokens: list[int] = []
        # hash of an n-gram -> the position just after it, or a list of them when it recurs (most
        # n-grams of length 4 and more occur once: an int instead of a list saves a third of the memory)
        self.index: dict[int, int | list[int]] = {}
        self.start = 0  # where the open sequence begins

    def extend(self, tokens: Sequence[int]) -> None:
        """Append to the open sequence, indexing every n-gram that the new tokens follow."""
        seq, index, start = self.tokens, self.index, self.start
        for token in tokens:
            end = len(seq)
            for n in KEY_LENGTHS:
                if end - n < start:
                    break
                h = hash(tuple(seq[end - n : end]))
                old = index.get(h)
                if old is None:
                    index[h] = end
                elif type(old) is int:
                    index[h] = [old, end]
                else:
                    old.append(end)
            seq.append(token)

    def close(self) -> None:
        """End the open sequence: no match or continuation runs across it."""
        self.tokens.append(self.SEP)
        self.start = len(self.tokens)

    def candidates(self, key: tuple[int, ...], context: Sequence[int], limit: int) -> list[tuple[int, int]]:
        """(position after the occurrence, match length) of the `limit` most recent occurrences
        of the context's last len(key) tokens, each match extended backwards up to DEPTH."""
        ends = self.index.get(hash(key))
        if ends is None:
            return []
        if type(ends) is int:
            ends = [ends]
        seq, n, out = self.tokens, len(key), []
        ctx_len = len(context)
        for end in reversed(ends[-limit:]):
            if tuple(seq[end - n : end]) != key:  # a hash collision
                continue
            m, cap = n, min(DEPTH, end, ctx_len)
            # whole blocks first (C-speed slice compares), then token by token
            step = 8
            while m + step <= cap and seq[end - m - step : end - m] == list(context[ctx_len - m - step : ctx_len - m]):
                m += step
            while m < cap and seq[end - 1 - m] == context[ctx_len - 1 - m]:
                m += 1
            out.append((end, m))
        return out


@dataclass
class _Row:
    prompt: list[int]
    store: _Store = field(default_factory=_Store)  # the row's own context, as prompt lookup sees it
    context: Sequence[int] | None = None  # the engine's live context list, last seen


class SuffixCacheDrafter(Declared):
    """Proposes the most frequent continuation of the longest suffix match in everything this
    process has seen (module docstring). One instance serves every row and every request."""

    takes = frozenset({"widths"})  # propose's keywords beyond (contexts, ks, leaves): Drafter.takes

    def __init__(
        self,
        cap: int = DEFAULT_CAP,
        candidates: int = CANDIDATES,
        fingerprint: str = "",
        vocab_size: int = 0,
        width: int = 1,
        nodes: int = 0,
    ):
        if cap < 1 or candidates < 1:
            raise ValueError(f"need cap >= 1 and candidates >= 1, got {cap}, {candidates}")
        self.name = self.kind = "suffix"
        self.cap, self.limit = cap, candidates
        self.shape(width, nodes)
        self.fingerprint = fingerprint  # the tokenizer's, checked when a cache is loaded
        self.vocab_size = vocab_size  # a loaded cache's ids must lie in [0, vocab_size) (0: unchecked)
        self._static: list[list[int]] = []  # corpus sequences: never evicted, never saved
        self._seqs: list[list[int]] = []  # sequences seen, oldest first
        self._store = _Store()
        self._rows: dict[int, _Row] = {}

    def shape(self, width: int = 1, nodes: int = 0) -> None:
        """What it drafts from now on: a chain (width 1), or a tree of the `width` most frequent
        continuations under each node, at most `nodes` nodes (0: k x width)."""
        tree_shape(width, nodes)
        self.width, self.nodes = width, nodes

    # -- what it holds ----------------------------------------------------------------------------

    @property
    def tokens_stored(self) -> int:
        return sum(map(len, self._static)) + sum(map(len, self._seqs))

    def add(self, tokens: Sequence[int], static: bool = False) -> None:
        """Remember a sequence (a finished row's context, a corpus document); evict past the cap."""
        tokens = [int(t) for t in tokens]
        if not tokens:
            return
        if static:
            if sum(map(len, self._static)) + len(tokens) > self.cap:
                raise SpecdecError(
                    f"the draft corpus has {sum(map(len, self._static)) + len(tokens)} tokens, "
                    f"more than the suffix cache holds ({self.cap}); raise --suffix-cap"
                )
            self._static.append(tokens)
        else:
            if len(tokens) > self.cap:  # a sequence longer than the whole cache: its end
                tokens = tokens[-self.cap :]
            self._seqs.append(tokens)
        if self.tokens_stored > self.cap:
            self._evict()
        else:
            self._store.extend(tokens)
            self._store.close()

    def _evict(self) -> None:
        """Drop the oldest sequences until the store is at EVICT_TO of the cap, and rebuild."""
        budget = int(EVICT_TO * self.cap) - sum(map(len, self._static))
        kept, total = [], 0
        for seq in reversed(self._seqs):  # newest first
            if total + len(seq) > budget:
                if not kept and budget > 0:  # the newest alone is too long: keep its end
                    kept.append(seq[-budget:])
                break
            kept.append(seq)
            total += len(seq)
        self._seqs = kept[::-1]
        self._store = _Store()
        for seq in [*self._static, *self._seqs]:
            self._store.extend(seq)
            self._store.close()

    # -- the Drafter verbs ------------------------------------------------------------------------

    def begin(self, row: int, prompt: Sequence[int], params: SamplingParams, rng: np.random.Generator) -> None:
        self._rows[row] = _Row(list(prompt))

    def end(self, rows: Sequence[int]) -> None:
        """The rows' contexts join the cache. The engine hands `propose` each row's live context
        list, which grows in place, so what was last seen holds every emitted token."""
        for row in rows:
            state = self._rows.pop(row, None)
            if state is not None:
                self.add(state.context if state.context is not None else state.prompt)

    def accept(self, n_accepted: Mapping[int, int]) -> None:
        pass  # nothing to roll back: the row's index follows the context it is given

    def propose(
        self,
        contexts: Mapping[int, Sequence[int]],
        ks: Mapping[int, int],
        widths: Mapping[int, int] | None = None,
        leaves: Mapping[int, int] | None = None,
    ) -> dict[int, Draft]:
        """Up to ks[r] tokens deep for every row asked; widths[r] (else the cache's shape): row r's
        tree of that many continuations under each node, at most ks[r] x widths[r] nodes (1: a
        chain). The cache is shared, so a caller's width never changes what others get. `leaves`
        is not read: a tree of fixed candidates may be cut to its first branch after drafting
        (Engine._fitted)."""
        out = {}
        widths = widths or {}
        for row, k in ks.items():
            state = self._rows.get(row)
            if state is None:  # a row nobody began: its context is its prompt
                state = self._rows[row] = _Row(list(contexts[row]))
            state.context = contexts[row]
            out[row] = self.propose_one(state, contexts[row], k, widths.get(row))
        return out

    def propose_one(self, state: _Row, context: Sequence[int], k: int, width: int | None = None) -> Draft:
        width, nodes = (self.width, self.nodes) if width is None else (width, 0)
        if k <= 0 or not context:
            return Draft([])
        own = state.store
        n_own = len(own.tokens)
        if n_own > len(context) or (n_own and (own.tokens[-1] != context[n_own - 1] or own.tokens[0] != context[0])):
            state.store = own = _Store()  # not an extension of what it indexed: start over
        own.extend(context[len(own.tokens) :])
        stores = (self._store, own)
        for n in reversed(KEY_LENGTHS):
            if n > len(context):
                continue
            key = tuple(context[-n:])
            found = [(s, end, m) for s in stores for end, m in s.candidates(key, context, self.limit)]
            if found:
                return self._tree(found, k, width, nodes or k * width)
        return Draft([])

    @staticmethod
    def _tree(found: list[tuple[_Store, int, int]], k: int, width: int, budget: int) -> Draft:
        """The occurrences sharing the longest match, as a tree of at most `budget` nodes: under each
        node the `width` tokens most of the occurrences reaching it continue with (the most recent
        first in a tie), taken best first by the share of all occurrences that agree with the whole
        path. As deep as the match, at most k; the first node always, then none below MIN_SHARE
        (every later one would be lower still). At width 1 it is the chain: the majority's token at
        every position, while the share agreeing with it all the way stays at MIN_SHARE or above."""
        best = max(m for _, _, m in found)
        alive = [(s.tokens, end) for s, end, m in found if m == best]  # most recent first per store
        deepest = min(k, best)
        tokens: list[int] = []
        parents: list[int] = []
        votes = (0, 0)
        order = itertools.count()  # heap ties: the earlier pushed first (a parent's order among its children)
        # (-share of the path, order, parent node, depth, token, its occurrences one further on, vote)
        heap: list = []

        def expand(parent: int, depth: int, share: float, occurrences) -> None:
            if depth >= deepest:
                return
            groups: dict[int, list] = {}
            for seq, pos in occurrences:
                if pos < len(seq) and seq[pos] != _Store.SEP:
                    groups.setdefault(seq[pos], []).append((seq, pos + 1))
            total = sum(map(len, groups.values()))
            for token in sorted(groups, key=lambda t: len(groups[t]), reverse=True)[:width]:  # stable: ties by recency
                n = len(groups[token])
                heapq.heappush(
                    heap, (-share * n / total, next(order), parent, depth + 1, token, groups[token], (n, total))
                )

        expand(-1, 0, 1.0, alive)
        while heap and len(tokens) < budget:
            neg_share, _, parent, depth, token, occurrences, vote = heapq.heappop(heap)
            if tokens and -neg_share < MIN_SHARE:
                break
            if not tokens:
                votes = vote
            tokens.append(token)
            parents.append(parent)
            expand(len(tokens) - 1, depth, -neg_share, occurrences)
        if not tokens:
            return Draft([])
        evidence = {"match": best, "votes": votes}
        if parents == list(range(-1, len(tokens) - 1)):  # it never branched: a chain
            return Draft(tokens, evidence=evidence)
        return Draft(tokens, evidence=evidence, parents=parents)

    # -- on disk ----------------------------------------------------------------------------------

    def load_corpus(self, path: str | Path, tokenizer) -> int:
        """Add a text file, tokenized by the target's tokenizer, as a static sequence; its tokens."""
        text = read_text(path, f"--draft-corpus {path}")
        tokens = tokenizer.encode(text, add_special=False)
        self.add(tokens, static=True)
        return len(tokens)

    def save(self, path: str | Path) -> None:
        """Write the sequences seen (not the corpus) to `path` atomically: a temporary file in the
        same folder, then a rename, so a crash leaves the old cache or the new one, never half."""
        path = Path(path)
        lengths = np.array([len(s) for s in self._seqs], dtype=np.int64)
        flat = np.array([t for s in self._seqs for t in s], dtype=np.int64)
        header = np.frombuffer(f"{FORMAT}\n{self.fingerprint}".encode(), dtype=np.uint8)
        buffer = io.BytesIO()
        np.savez_compressed(buffer, header=header, lengths=lengths, tokens=flat)
        try:
            write_atomically(path, buffer.getvalue())
        except OSError as exc:
            raise SpecdecError(f"cannot write --suffix-cache {path}: {exc.strerror}") from None

    def load(self, path: str | Path) -> int:
        """Add the sequences of a saved cache (oldest first, as if seen now); the tokens added.
        A missing file is an empty cache (the first run creates it); a corrupt one, or one written
        under another tokenizer, is a user error."""
        path = Path(path)
        if not path.exists():
            return 0
        bad = f"--suffix-cache {path} is not a specdec suffix cache or is damaged; delete it or give another file"
        try:
            with np.load(path, allow_pickle=False) as data:
                header = bytes(data["header"]).decode()
                lengths, flat = data["lengths"], data["tokens"]
        except OSError as exc:
            raise SpecdecError(f"cannot read --suffix-cache {path}: {exc.strerror}") from None
        except (ValueError, KeyError, EOFError, UnicodeDecodeError, zipfile.BadZipFile, zlib.error):
            raise SpecdecError(bad) from None
        fmt, _, fingerprint = header.partition("\n")
        if (
            fmt != FORMAT
            or lengths.ndim != 1
            or flat.ndim != 1
            or int(lengths.sum()) != len(flat)
            or (lengths < 0).any()
        ):
            raise SpecdecError(bad)
        if self.fingerprint and fingerprint != self.fingerprint:
            raise SpecdecError(
                f"--suffix-cache {path} was written for another tokenizer; delete it or give another file"
            )
        if len(flat) and (flat.min() < 0 or (self.vocab_size and flat.max() >= self.vocab_size)):
            raise SpecdecError(
                f"--suffix-cache {path} holds token ids outside the vocabulary (0..{self.vocab_size - 1}), so it is "
                "damaged; delete it or give another file"
            )
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        for a, b in zip(offsets[:-1], offsets[1:]):
            self.add(flat[a:b].tolist())
        return len(flat)
