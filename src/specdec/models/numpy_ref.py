"""A transformer in plain NumPy that runs the GGUF models: the reference backend to read.

Everything a forward pass does is on this page, in the order it happens:

    tokens -> embedding -> n_layer x [norm -> attention -> residual -> norm -> MLP -> residual]
           -> final norm -> output head -> logits

Two families are supported, chosen by the GGUF's `general.architecture`:

    llama, qwen2   RMSNorm, rotary position embeddings, grouped-query attention (qwen2 adds
                   biases to q, k and v), SwiGLU MLP
    gpt2           LayerNorm, learned position embeddings, one fused q|k|v matrix, GELU MLP,
                   biases everywhere

Weights. The GGUF stores most matrices quantised (Q4_K, Q5_0, Q6_K, Q8_0 ...). We dequantise each
tensor once, at load, with `gguf.quants.dequantize`, reading the file one tensor at a time and
dequantising a few MB of rows at a time, so that the whole file is never in memory twice. A matrix
is kept as [out, in] (the GGUF's ne0 = in is the fastest dimension) and a linear layer is
`x @ w.T`. Two storage formats:

    float32    exact dequantised values; a matmul is one BLAS call.
    bfloat16   the top 16 bits of each float32, as uint16: half the memory, ~3 significant
               digits (the 4-to-8-bit quantisation already lost more). A matmul widens a block of
               rows back to float32 (a 16-bit shift) in a scratch buffer that stays in the CPU
               cache, then multiplies it: ~1.4x the time of float32 for one token.

`dtype="auto"` keeps float32 when the matrices need at most 3 GiB that way (the 0.5B: 2.1 GB) and
bfloat16 otherwise (the 1.5B: 3.2 GB instead of 6.3 GB). The token embedding is not dequantised
at all: a forward dequantises only the rows of its tokens.

KV cache. Per layer, K and V arrays of [n_head_kv, n_ctx, head_dim], allocated once (np.zeros:
the OS hands out pages only as they are written). Position p of the sequence lives in slot p.
`n_past` says how many slots are valid, so rollback is `n_past = n_keep`: the slots after it are
dead and the next forward overwrites them.

Early exit (drafters/early_exit.py) runs only the first layers: `forward(..., n_layers=L)` writes
the K/V of layers < L only. So each layer counts its own valid slots (`layer_len`), and a forward
refuses to start when a layer it needs lags behind `n_past`: roll back first.

Tokenizer. `NumpyTokenizer` (models/bpe.py) is GPT-2's byte-level BPE read from the GGUF's
vocabulary and merges, with the model's pre-tokenizer regex and its special tokens.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from ..errors import BackendUnavailableError, ContextOverflowError, ModelLoadError, ModelNotFoundError, SpecdecError
from .base import (
    SavedRow,
    SequentialRows,
    check_tree_path,
    file_sha256,
    path_hidden,
    tree_ancestry,
    tree_depths,
    trim_hidden,
)

# the tokenizer moved to bpe.py; its names stay importable from here
from .bpe import BYTE as BYTE
from .bpe import BYTE_TO_CHAR as BYTE_TO_CHAR
from .bpe import CHAR_TO_BYTE as CHAR_TO_BYTE
from .bpe import CONTROL as CONTROL
from .bpe import EOG_TEXTS as EOG_TEXTS
from .bpe import NORMAL as NORMAL
from .bpe import PRETOKENIZERS as PRETOKENIZERS
from .bpe import UNKNOWN as UNKNOWN
from .bpe import UNUSED as UNUSED
from .bpe import USER_DEFINED as USER_DEFINED
from .bpe import NumpyTokenizer as NumpyTokenizer
from .bpe import bytes_to_unicode as bytes_to_unicode
from .bpe import compile_pretokenizer as compile_pretokenizer
from .bpe import unicode_class as unicode_class

FLOAT32_BUDGET = 3 << 30  # dtype="auto": float32 weights up to this many bytes, else bfloat16
CHUNK_ELEMENTS = 1 << 20  # weights dequantised / widened per block: 4 MB of float32
BATCH = 256  # tokens per pass through the layers (bounds the attention scores' memory)


# --------------------------------------------------------------------------------------------
# The architecture: hyperparameters from the GGUF metadata
# --------------------------------------------------------------------------------------------

# arch -> (norm, positions, mlp)
ARCHS = {
    "llama": ("rms", "rope", "swiglu"),  # rope rotates adjacent pairs (2i, 2i + 1)
    "qwen2": ("rms", "rope-neox", "swiglu"),  # rope rotates pairs (i, i + head_dim / 2)
    "gpt2": ("layer", "learned", "gelu"),
}


@dataclass(frozen=True)
class Config:
    arch: str  # general.architecture: a key of ARCHS
    n_layer: int  # transformer blocks
    n_embd: int  # width of the residual stream
    n_head: int  # query heads
    n_head_kv: int  # key/value heads (fewer than n_head: grouped-query attention)
    head_dim: int  # n_embd // n_head
    n_ctx_train: int  # the context the model was trained for (gpt2: its position table)
    norm_eps: float  # epsilon inside RMSNorm / LayerNorm
    rope_base: float  # rotary embedding frequency base (unused by gpt2)

    @property
    def norm(self) -> str:
        return ARCHS[self.arch][0]

    @property
    def positions(self) -> str:
        return ARCHS[self.arch][1]

    @property
    def mlp(self) -> str:
        return ARCHS[self.arch][2]


def config_from_metadata(meta: dict) -> Config:
    arch = meta.get("general.architecture")
    if arch not in ARCHS:
        raise ModelLoadError(
            f"the NumPy backend runs {', '.join(ARCHS)} models, not {arch!r}; use the llama.cpp backend for this one"
        )
    n_embd = int(meta[f"{arch}.embedding_length"])
    n_head = int(meta[f"{arch}.attention.head_count"])
    head_dim = n_embd // n_head
    if int(meta.get(f"{arch}.rope.dimension_count", head_dim)) != head_dim:
        raise ModelLoadError(f"{arch}: partial rotary embeddings are not supported by the NumPy backend")
    if meta.get(f"{arch}.rope.scaling.type", "none") != "none":
        raise ModelLoadError(f"{arch}: rope scaling is not supported by the NumPy backend")
    eps = meta.get(
        f"{arch}.attention.layer_norm_rms_epsilon",  # RMSNorm models
        meta.get(f"{arch}.attention.layer_norm_epsilon"),
    )  # LayerNorm models
    return Config(
        arch=arch,
        n_layer=int(meta[f"{arch}.block_count"]),
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=int(meta.get(f"{arch}.attention.head_count_kv", n_head)),
        head_dim=head_dim,
        n_ctx_train=int(meta[f"{arch}.context_length"]),
        norm_eps=float(eps if eps is not None else 1e-5),
        rope_base=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
    )


# --------------------------------------------------------------------------------------------
# The math: pure functions on arrays
# --------------------------------------------------------------------------------------------


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x [T, n_embd] scaled to unit root-mean-square per row, times weight [n_embd]."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    """x [T, n_embd] to zero mean and unit variance per row, then weight * x + bias."""
    mean = np.mean(x, axis=-1, keepdims=True)  # [T, 1]
    var = np.mean((x - mean) ** 2, axis=-1, keepdims=True)  # [T, 1]
    return (x - mean) / np.sqrt(var + eps) * weight + bias


def silu(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x); sigmoid written with tanh, which cannot overflow as exp(-x) can."""
    return x * (0.5 + 0.5 * np.tanh(0.5 * x))


def gelu(x: np.ndarray) -> np.ndarray:
    """GPT-2's GELU, the tanh approximation (as llama.cpp computes it)."""
    return 0.5 * x * (1.0 + np.tanh(np.float32(np.sqrt(2.0 / np.pi)) * (x + np.float32(0.044715) * x**3)))


def softmax(x: np.ndarray) -> np.ndarray:
    """Softmax over the last axis; -inf entries get probability 0."""
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def rope(x: np.ndarray, positions: np.ndarray, base: float, neox: bool) -> np.ndarray:
    """Rotary position embedding of x [T, n_heads, head_dim] at positions [T].

    Dimension pair i turns by the angle position * base^(-2i / head_dim). NEOX style (qwen2) pairs
    dimension i with i + head_dim/2; the original style (llama, whose q/k weights the GGUF
    converter permuted to match) pairs 2i with 2i + 1.
    """
    half = x.shape[-1] // 2
    inv_freq = base ** (-np.arange(half) / half)  # [half] float64
    angle = positions[:, None] * inv_freq[None, :]  # [T, half]
    cos = np.cos(angle).astype(np.float32)[:, None, :]  # [T, 1, half]
    sin = np.sin(angle).astype(np.float32)[:, None, :]  # [T, 1, half]
    if neox:
        x1, x2 = x[..., :half], x[..., half:]  # [T, n_heads, half] each
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]  # [T, n_heads, half] each
    out = np.empty_like(x)  # [T, n_heads, head_dim]
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x2 * cos + x1 * sin
    return out


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, pos0: int, visible: np.ndarray | None = None) -> np.ndarray:
    """Causal grouped-query attention.

    q [T, n_head, head_dim]: the queries of cache slots pos0 .. pos0 + T - 1.
    k, v [n_head_kv, S, head_dim]: keys and values of slots 0 .. S - 1 (S = pos0 + T).
    visible [T, S] bool, optional: which slots each query reads (a tree's mask: the prefix and the
    node's ancestors); by default each reads the slots up to its own (causal).
    Query head h reads kv head h // group, group = n_head // n_head_kv (as llama.cpp does).
    Returns [T, n_head * head_dim].
    """
    T, n_head, head_dim = q.shape
    n_head_kv, S, _ = k.shape
    group = n_head // n_head_kv
    # the `group` query heads that share a kv head become one batch of group * T rows
    q = q.reshape(T, n_head_kv, group, head_dim).transpose(1, 2, 0, 3)  # [n_head_kv, group, T, head_dim]
    q = q.reshape(n_head_kv, group * T, head_dim)  # [n_head_kv, group*T, head_dim]
    scores = q @ k.transpose(0, 2, 1) / np.float32(np.sqrt(head_dim))  # [n_head_kv, group * T, S]
    scores = scores.reshape(n_head_kv, group, T, S)  # [n_head_kv, group, T, S]
    if visible is None:
        visible = np.arange(S)[None, :] <= pos0 + np.arange(T)[:, None]  # [T, S] key not after query
    scores[:, :, ~visible] = -np.inf
    probs = softmax(scores).reshape(n_head_kv, group * T, S)  # [n_head_kv, group * T, S]
    out = (probs @ v).reshape(n_head_kv, group, T, head_dim)  # [n_head_kv, group, T, head_dim]
    return out.transpose(2, 0, 1, 3).reshape(T, n_head * head_dim)  # [T, n_head * head_dim]


def to_bfloat16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounded to nearest even: the top half of the
    float32 (sign, 8 exponent bits, 7 mantissa bits), i.e. about 3 significant digits."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    bits = bits + (np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1)))  # round the dropped half
    return (bits >> 16).astype(np.uint16)


def as_float32(w: np.ndarray) -> np.ndarray:
    """Weights as float32: bfloat16 bits (uint16) widened, anything else converted (not copied
    where it already is float32)."""
    return from_bfloat16(w) if w.dtype == np.uint16 else np.asarray(w, np.float32)


def from_bfloat16(w: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32 (exact: the bits become a float32's top half)."""
    return (w.astype(np.uint32) << 16).view(np.float32)


def matmul(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x [T, in] float32 times w [out, in] transposed -> [T, out] float32.

    w is float32, or bfloat16 bits (uint16): then it is widened a block of rows at a time into a
    float32 scratch buffer small enough to stay in the CPU cache, and multiplied block by block.
    """
    if w.dtype != np.uint16:
        return x @ w.T
    n_out, n_in = w.shape
    out = np.empty((x.shape[0], n_out), dtype=np.float32)  # [T, out]
    rows = max(1, CHUNK_ELEMENTS // n_in)
    scratch = np.empty((min(rows, n_out), n_in), dtype=np.uint32)  # [rows, in]
    for start in range(0, n_out, rows):
        block = w[start : start + rows]  # [<= rows, in] bfloat16
        bits = scratch[: len(block)]
        bits[:] = block  # the 16 bits in the low half of each uint32 ...
        bits <<= 16  # ... moved to the high half: now they are a float32's bits
        out[:, start : start + len(block)] = x @ bits.view(np.float32).T
    return out


# --------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------


class NumpyModel(SequentialRows):
    """A GGUF transformer in NumPy. Its forward computes one sequence; several rows each keep
    their own KV cache and take turns (models.base.SequentialRows). Implements models.base.RowModel.

    weights: "token_embd.weight" (quantised rows, see `embed`), "output_norm.weight" (and .bias),
    "output.weight" [vocab, n_embd], "position_embd.weight" (gpt2); layers[i]: the tensors of
    block i without the "blk.{i}." prefix, e.g. layers[i]["attn_q.weight"] [n_head * head_dim, n_embd].
    """

    def __init__(
        self,
        config: Config,
        weights: dict,
        layers: list[dict],
        token_embd_type,
        tokenizer: "NumpyTokenizer",
        name: str,
        n_ctx: int,
        is_instruct: bool = False,
    ):
        self.config = config
        self.weights, self.layers = weights, layers
        self.token_embd_type = token_embd_type  # the GGML quantisation type of token_embd rows
        self.tokenizer = tokenizer
        self.name = name
        self.description = name  # general.name, set by load_numpy_model
        self.vocab_size = weights["output.weight"].shape[0]
        self.n_ctx = n_ctx
        self.n_layer = config.n_layer
        self.is_instruct = is_instruct
        self.load_seconds = 0.0  # set by load_numpy_model
        self.path: Path | None = None  # set by load_numpy_model
        self.n_embd = config.n_embd
        self._hidden: dict | None = None  # row (None: the solo sequence) -> kept states (keep_hidden)
        self._set_state(self._new_state())

    # -- the cache of one row (models.base.SequentialRows swaps these per row) -----------

    def _new_state(self):
        # per layer: [n_head_kv, n_ctx, head_dim]; slot p holds the key (value) of position p.
        # np.zeros: the OS hands out pages only as they are written.
        shape = (self.config.n_head_kv, self.n_ctx, self.config.head_dim)
        return (
            [np.zeros(shape, dtype=np.float32) for _ in range(self.n_layer)],
            [np.zeros(shape, dtype=np.float32) for _ in range(self.n_layer)],
            0,  # n_past: tokens in the cache = the position of the next one
            [0] * self.n_layer,  # layer_len: slots 0 .. layer_len[i] - 1 of layer i are valid
            None,  # tree: (n_past before it, parents, nodes' states) after forward_tree, until keep_path or rollback
        )

    def _get_state(self):
        return self.k_cache, self.v_cache, self.n_past, self.layer_len, self.tree

    def _set_state(self, state) -> None:
        self.k_cache, self.v_cache, self.n_past, self.layer_len, self.tree = state

    def save_row(self, row: int) -> SavedRow:
        """A copy of the row's valid slots only (its arrays are n_ctx long; the engine's host_cache)."""
        with self.use_row(row):
            k = [a[:, :n].copy() for a, n in zip(self.k_cache, self.layer_len)]
            v = [a[:, :n].copy() for a, n in zip(self.v_cache, self.layer_len)]
            n_past, layer_len = self.n_past, list(self.layer_len)
        return SavedRow(n_past, sum(a.nbytes for a in k + v), (k, v, n_past, layer_len))

    def load_row(self, row: int, saved: SavedRow) -> None:
        k_saved, v_saved, n_past, layer_len = saved.data
        k, v, *_ = self._new_state()
        for layer, (a, b) in enumerate(zip(k_saved, v_saved)):
            k[layer][:, : a.shape[1]] = a
            v[layer][:, : b.shape[1]] = b
        with self.use_row(row):
            self._set_state((k, v, n_past, list(layer_len), None))

    @property
    def n_full(self) -> int:
        """Tokens held by every layer (fewer than n_past after an early-exit pass)."""
        return min(self.layer_len)

    @property
    def weight_bytes(self) -> int:
        arrays = list(self.weights.values()) + [w for layer in self.layers for w in layer.values()]
        return sum(a.nbytes for a in arrays)

    # -- one sequence (the row protocol runs rows through these in turn) -----------------

    def forward(self, tokens: Sequence[int], n_rows: int | None = None, n_layers: int | None = None) -> np.ndarray:
        """Append `tokens` to the cache and return the logits of the last n_rows of them
        ([n_rows, vocab] float32; all when None). With n_layers, only the first n_layers blocks run
        (then the final norm and head: an early exit) and only their caches are written."""
        n = len(tokens)
        n_rows = n if n_rows is None else min(n_rows, n)
        n_layers = self.n_layer if n_layers is None else n_layers
        if not 1 <= n_layers <= self.n_layer:
            raise ValueError(f"n_layers must be in 1..{self.n_layer}, got {n_layers}")
        if self.n_past + n > self.n_ctx:
            raise ContextOverflowError(
                f"{self.n_past + n} tokens do not fit in the context of {self.n_ctx}; raise --ctx"
            )
        stale = min(self.layer_len[:n_layers])
        if stale < self.n_past:  # an early exit skipped layers this pass needs
            raise RuntimeError(
                f"layers below {n_layers} hold only {stale} of the {self.n_past} "
                f"tokens (an early-exit pass); rollback({stale}) first"
            )
        first_row = n - n_rows  # tokens from this index on give a logits row
        self.tree = None  # a forward after a tree: the tree's nodes are now just cache slots
        hidden = []
        for start in range(0, n, BATCH):
            chunk = np.asarray(tokens[start : start + BATCH], dtype=np.int64)  # [t]
            x = self.embed(chunk, self.n_past)  # [t, n_embd]
            for i in range(n_layers):
                x = self.block(i, x, self.n_past)  # [t, n_embd]
                self.layer_len[i] = self.n_past + len(chunk)
            self.n_past += len(chunk)
            hidden.append(x[max(0, first_row - start) :])  # [rows wanted, n_embd]
        if n_rows == 0:
            return np.empty((0, self.vocab_size), dtype=np.float32)
        x = self.norm(np.concatenate(hidden), self.weights, "output_norm")  # [n_rows, n_embd]
        if self._hidden is not None and n_layers == self.n_layer:
            self._hidden[self.__dict__.get("_current")] = (self.n_past - n_rows, x)
        return matmul(x, self.weights["output.weight"])  # [n_rows, vocab]

    scores_trees = True  # forward_tree_rows / keep_path_rows (engine: tree drafts)
    exits_early = True  # forward(..., n_layers=L): the first L layers (drafters.early_exit)

    def forward_tree(self, tokens: Sequence[int], parents: Sequence[int]) -> np.ndarray:
        """Append a tree of draft nodes in one pass and return every node's logits [T, vocab].

        parents[i] is node i's parent: -1 for a node that follows the cache's last token, else an
        earlier node (j < i). Node i takes cache slot n_past + i but the position of its depth
        (n_past + the number of its ancestors), and attends to the cache before the tree and to
        its own ancestors only, so its logits are what a chain forward of its root-to-node path
        gives at its last token. Follow with `keep_path`, which keeps one branch."""
        T = len(tokens)
        depth = tree_depths(parents)
        if T > BATCH:
            raise ValueError(f"a tree of {T} nodes is more than one pass of {BATCH}")
        if self.n_past + T > self.n_ctx:
            raise ContextOverflowError(
                f"{self.n_past + T} tokens do not fit in the context of {self.n_ctx}; raise --ctx"
            )
        if self.n_full < self.n_past:
            raise RuntimeError(f"an early-exit pass left {self.n_full} of {self.n_past} tokens; rollback first")
        pos0 = self.n_past
        visible = np.zeros((T, pos0 + T), dtype=bool)  # [T, S]
        visible[:, :pos0] = True
        visible[:, pos0:] = tree_ancestry(parents)
        positions = pos0 + depth  # [T]
        x = self.embed(np.asarray(tokens, dtype=np.int64), pos0, positions)  # [T, n_embd]
        for i in range(self.n_layer):
            x = self.block(i, x, pos0, positions, visible)  # [T, n_embd]
            self.layer_len[i] = pos0 + T
        self.n_past = pos0 + T
        normed = self.norm(x, self.weights, "output_norm")  # [T, n_embd]
        # heads read states by position, which a tree's slots are not: keep_path keeps its path's
        self.tree = (pos0, tuple(parents), normed if self._hidden is not None else None)
        if self._hidden:
            row = self.__dict__.get("_current")
            self._hidden[row] = trim_hidden(self._hidden.get(row), pos0, self.n_embd)
        return matmul(normed, self.weights["output.weight"])  # [T, vocab]

    def keep_path(self, path: Sequence[int]) -> None:
        """After `forward_tree`: keep the cache before the tree and the nodes `path` (root first,
        each the parent of the next), moved to follow it; the other nodes' slots become free. A
        chain continues from there as if it had been forwarded."""
        if self.tree is None:
            raise ValueError("keep_path follows forward_tree")
        base, parents, states = self.tree
        check_tree_path(parents, path)
        for j, node in enumerate(path):  # node >= j: every move reads a slot no earlier move wrote
            if node != j:
                for cache in (*self.k_cache, *self.v_cache):
                    cache[:, base + j] = cache[:, base + node]
        self.rollback(base + len(path))
        if self._hidden is not None:
            row = self.__dict__.get("_current")
            self._hidden[row] = path_hidden(self._hidden.get(row), states, base, path, self.n_embd)

    def rollback(self, n_keep: int) -> None:
        """Cut the cache to its first n_keep tokens: the slots after them become free."""
        if n_keep < 0:
            raise ValueError(f"n_keep must be >= 0, got {n_keep}")
        self.n_past = min(self.n_past, n_keep)
        self.layer_len = [min(length, n_keep) for length in self.layer_len]
        self.tree = None
        if self._hidden:  # the cut positions' states go too: new tokens may take those positions
            row = self.__dict__.get("_current")
            self._hidden[row] = trim_hidden(self._hidden.get(row), n_keep, self.n_embd)

    def reset(self) -> None:
        self.rollback(0)

    # -- hidden states (models.base.HiddenStates), for trained heads ----------------------

    @property
    def identity(self) -> str:
        if self.path is None:
            raise SpecdecError(f"{self.name} was not loaded from a file: it has no identity for a head")
        return file_sha256(self.path)

    def keep_hidden(self) -> None:
        if self._hidden is None:
            self._hidden = {}

    def drop_rows(self, rows) -> None:
        rows = list(rows)
        for row in rows:
            (self._hidden or {}).pop(row, None)
        super().drop_rows(rows)

    def hidden_rows(self, rows) -> dict:
        kept = self._hidden or {}
        return {row: kept.get(row) or trim_hidden(None, self.row_length(row), self.n_embd) for row in rows}

    def head_weights(self, name: str, tokens: np.ndarray) -> np.ndarray:
        tokens = np.asarray(tokens)
        if name == "embedding":
            return self.token_embeddings(tokens)
        w = self.weights["output.weight"][tokens]
        return as_float32(w)

    # -- the pieces of a forward pass ----------------------------------------------------

    def embed(self, tokens: np.ndarray, pos0: int, positions: np.ndarray | None = None) -> np.ndarray:
        """Token embeddings (+ learned position embeddings for gpt2) -> [T, n_embd]; positions
        pos0 .. pos0 + T - 1 unless given (a tree's depths)."""
        x = self.token_embeddings(tokens)
        if self.config.positions == "learned":
            positions = np.arange(pos0, pos0 + len(tokens)) if positions is None else positions
            x = x + self.weights["position_embd.weight"][positions]
        return x

    def token_embeddings(self, tokens: np.ndarray) -> np.ndarray:
        """Rows of the token embedding, dequantising only those: [T, bytes per row] -> [T, n_embd]."""
        import gguf

        return gguf.quants.dequantize(self.weights["token_embd.weight"][tokens], self.token_embd_type).astype(
            np.float32
        )

    def norm(self, x: np.ndarray, w: dict, name: str) -> np.ndarray:
        if self.config.norm == "rms":
            return rms_norm(x, w[f"{name}.weight"], self.config.norm_eps)
        return layer_norm(x, w[f"{name}.weight"], w[f"{name}.bias"], self.config.norm_eps)

    @staticmethod
    def linear(x: np.ndarray, w: dict, name: str) -> np.ndarray:
        """x @ weight.T (+ bias, when the model has one) -> [T, out]."""
        y = matmul(x, w[f"{name}.weight"])
        bias = w.get(f"{name}.bias")
        return y if bias is None else y + bias

    def block(
        self, i: int, x: np.ndarray, pos0: int, positions: np.ndarray | None = None, visible: np.ndarray | None = None
    ) -> np.ndarray:
        """Transformer block i on x [T, n_embd] in cache slots pos0 .. pos0 + T - 1, at those
        positions unless `positions` says otherwise, attending causally unless `visible` [T, S]
        says otherwise (a tree: see forward_tree); writes the block's K/V cache slots."""
        c, w = self.config, self.layers[i]
        T = x.shape[0]
        # 1. attention: project, rotate, cache, attend
        h = self.norm(x, w, "attn_norm")  # [T, n_embd]
        if "attn_qkv.weight" in w:  # gpt2 stores q|k|v as one matrix
            q, k, v = np.split(self.linear(h, w, "attn_qkv"), 3, axis=-1)  # [T, n_embd] each
        else:
            q = self.linear(h, w, "attn_q")  # [T, n_head * head_dim]
            k = self.linear(h, w, "attn_k")  # [T, n_head_kv * head_dim]
            v = self.linear(h, w, "attn_v")  # [T, n_head_kv * head_dim]
        q = q.reshape(T, c.n_head, c.head_dim)  # [T, n_head, head_dim]
        k = k.reshape(T, c.n_head_kv, c.head_dim)  # [T, n_head_kv, head_dim]
        v = v.reshape(T, c.n_head_kv, c.head_dim)  # [T, n_head_kv, head_dim]
        if c.positions.startswith("rope"):
            positions = np.arange(pos0, pos0 + T) if positions is None else positions  # [T]
            q = rope(q, positions, c.rope_base, neox=c.positions == "rope-neox")
            k = rope(k, positions, c.rope_base, neox=c.positions == "rope-neox")
        # overwrite, not append: slots pos0.. may hold a rolled-back or early-exit draft's K/V
        self.k_cache[i][:, pos0 : pos0 + T] = k.transpose(1, 0, 2)  # [n_head_kv, T, head_dim]
        self.v_cache[i][:, pos0 : pos0 + T] = v.transpose(1, 0, 2)
        S = pos0 + T
        a = attention(q, self.k_cache[i][:, :S], self.v_cache[i][:, :S], pos0, visible)  # [T, n_head * head_dim]
        x = x + self.linear(a, w, "attn_output")  # [T, n_embd]
        # 2. MLP
        h = self.norm(x, w, "ffn_norm")  # [T, n_embd]
        if c.mlp == "swiglu":
            h = silu(self.linear(h, w, "ffn_gate")) * self.linear(h, w, "ffn_up")  # [T, n_ff]
        else:
            h = gelu(self.linear(h, w, "ffn_up"))  # [T, n_ff]
        return x + self.linear(h, w, "ffn_down")  # [T, n_embd]

    def __repr__(self) -> str:
        kind = "bfloat16" if self.weights["output.weight"].dtype == np.uint16 else "float32"
        return (
            f"NumpyModel({self.name!r}, {self.config.arch}, {self.n_layer} layers, {kind} "
            f"weights {self.weight_bytes / 1e9:.2f} GB, n_ctx={self.n_ctx})"
        )


# --------------------------------------------------------------------------------------------
# Loading a GGUF
# --------------------------------------------------------------------------------------------


def _gguf():
    try:
        import gguf
    except ImportError as exc:
        raise BackendUnavailableError(
            "the NumPy backend reads GGUF files with the gguf package: pip install gguf"
        ) from exc
    return gguf


def read_metadata(reader) -> dict:
    """The GGUF's key/value metadata as Python values (strings, numbers, lists)."""
    return {key: field.contents() for key, field in reader.fields.items()}


def _read_tensor(f, dtype, shape, offset: int) -> np.ndarray:
    """One tensor's bytes, read from the open file (not through the reader's memory map, so that
    pages of the file do not pile up in this process): [rows, bytes per row] uint8 for quantised
    types, [rows, cols] float32 / float16 for plain ones."""
    f.seek(offset)
    return np.fromfile(f, dtype=dtype, count=int(np.prod(shape))).reshape(shape)


def _dequantize(raw: np.ndarray, qtype, dtype: str) -> np.ndarray:
    """Quantised rows [rows, bytes per row] -> [rows, cols] float32 or bfloat16 bits, a few MB
    of rows at a time (dequantising a whole 150k-row head at once would need GBs of temporaries)."""
    gguf = _gguf()
    if raw.ndim == 1:  # norms and biases: small, always float32
        return gguf.quants.dequantize(raw, qtype).astype(np.float32)
    cols = gguf.quants.dequantize(raw[:1], qtype).shape[-1]
    out = np.empty((raw.shape[0], cols), dtype=np.float32 if dtype == "float32" else np.uint16)
    rows = max(1, CHUNK_ELEMENTS // cols)
    for start in range(0, raw.shape[0], rows):
        part = gguf.quants.dequantize(raw[start : start + rows], qtype)  # [rows, cols] float32
        out[start : start + rows] = part if dtype == "float32" else to_bfloat16(part)
    return out


def load_numpy_model(path: str | os.PathLike, n_ctx: int = 4096, dtype: str = "auto") -> NumpyModel:
    """Load a GGUF file into a NumpyModel. dtype: "float32", "bfloat16" or "auto" (float32 when
    its matrices need at most FLOAT32_BUDGET bytes). Prints nothing; the time taken is in
    `model.load_seconds`."""
    t0 = time.perf_counter()
    path = Path(path)
    if not path.is_file():
        raise ModelNotFoundError(f"model file not found: {path}")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelLoadError(f"{path} is not a GGUF file")
    if dtype not in ("auto", "float32", "bfloat16"):
        raise SpecdecError(f"dtype must be 'auto', 'float32' or 'bfloat16', got {dtype!r}")
    gguf = _gguf()
    try:
        reader = gguf.GGUFReader(path)  # parses the header; tensor data stays on disk
    except Exception as exc:  # noqa: BLE001 - any parse error means a bad file
        raise ModelLoadError(f"cannot read {path} as GGUF ({exc}); the file is corrupt or truncated") from exc
    meta = read_metadata(reader)
    # what we need of each tensor: name, quantisation type, numpy dtype and shape of its bytes,
    # offset in the file. Then drop the reader: its parsed fields take ~0.5 GB for a 150k vocabulary.
    tensors = [(t.name, t.tensor_type, t.data.dtype, t.data.shape, t.data_offset) for t in reader.tensors]
    matrix_sizes = {t.name: int(t.n_elements) for t in reader.tensors if len(t.shape) == 2}
    del reader
    try:
        config = config_from_metadata(meta)
    except KeyError as exc:
        raise ModelLoadError(f"{path} lacks the metadata key {exc}: not a complete GGUF model") from None
    tokenizer = NumpyTokenizer(meta)
    tied = "output.weight" not in matrix_sizes  # gpt2 and small llamas: the head is token_embd
    if not tied:
        matrix_sizes.pop("token_embd.weight", None)  # kept quantised, never dequantised whole
    if dtype == "auto":
        dtype = "float32" if 4 * sum(matrix_sizes.values()) <= FLOAT32_BUDGET else "bfloat16"
    if any(name == "rope_freqs.weight" for name, *_ in tensors):
        raise ModelLoadError(f"{path}: rope frequency factors (Llama 3.1) are not supported by the NumPy backend")

    weights: dict[str, np.ndarray] = {}
    layers: list[dict[str, np.ndarray]] = [{} for _ in range(config.n_layer)]
    token_embd_type = None
    with open(path, "rb") as f:
        for name, qtype, raw_dtype, raw_shape, offset in tensors:
            raw = _read_tensor(f, raw_dtype, raw_shape, offset)
            if name == "token_embd.weight":
                weights[name] = raw  # kept quantised: [vocab, bytes per row]
                token_embd_type = qtype
                if tied:
                    weights["output.weight"] = _dequantize(raw, qtype, dtype)
            elif name == "position_embd.weight":  # gpt2; small, looked up by row
                weights[name] = _dequantize(raw, qtype, "float32")
            elif name.startswith("blk."):
                _, i, key = name.split(".", 2)  # "blk.3.attn_q.weight" -> 3, "attn_q.weight"
                layers[int(i)][key] = _dequantize(raw, qtype, dtype)
            else:
                weights[name] = _dequantize(raw, qtype, dtype)

    if "output.weight" not in weights or token_embd_type is None:
        raise ModelLoadError(f"{path} has no token embedding: not a complete language model")
    if weights["output.weight"].shape[0] != len(tokenizer.tokens):
        raise ModelLoadError(
            f"{path}: the output head has {weights['output.weight'].shape[0]} rows "
            f"but the vocabulary {len(tokenizer.tokens)} tokens"
        )
    general_name = str(meta.get("general.name") or path.name)
    model = NumpyModel(
        config,
        weights,
        layers,
        token_embd_type,
        tokenizer,
        name=path.name,
        n_ctx=min(n_ctx, config.n_ctx_train),
        is_instruct="instruct" in general_name.lower(),
    )
    model.description = general_name
    model.load_seconds = time.perf_counter() - t0
    model.path = path
    return model
