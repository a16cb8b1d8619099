"""Any Hugging Face causal LM through PyTorch: the GPU path, and the batched backend.

One object holds a batch of rows, each with its own KV cache inside one shared `DynamicCache`
tensor per layer ([rows, heads, columns, head_dim]). Rows advance at their own rate, so a column
means nothing by itself: every column carries the row's *position* of the token in it (or -1 for
padding), and the attention mask is built from positions, never from column numbers:

    query token at position i of row r may read column c  <=>  valid[r, c] and pos[r, c] <= i

Rollback of a row marks its rejected columns invalid (nothing moves); columns nobody uses are
cut off the end, and the cache is compacted when holes pile up. Rotary (or learned) positions are
applied from `position_ids`, so a row's result does not depend on where its columns sit: a row
in a batch computes what it would compute alone, up to floating-point summation order.

A tree of drafts (`forward_tree_rows`) takes columns like a chain, each node at the position of
its depth, and the mask of its new columns is the tree's ancestry instead of the position rule: a
node reads the row and its own ancestors, so each node's logits are those of a chain of its path.
`keep_path_rows` then marks the nodes off the kept path invalid, as a rollback marks rejected ones.

An early exit (`forward_rows(..., n_layers=L)`) runs the decoder with its first L layers only,
then the final norm and head, writing those layers' columns alone until the caller rolls them back;
an early-exit head's trained blocks (`attach_exit_blocks`) get cache layers after the model's, which
every full forward keeps up to date from layer L's output.

Rows join a running batch (`add_rows` appends empty rows along the batch axis) and leave it
(`drop_rows` selects the others), so the engine can batch requests that come and go. Row ids are
stable; `_ids` maps each to its index along the batch axis.

Two cache layouts (`cache=`):
- "dynamic" (default): each forward concatenates its columns onto the cache (transformers'
  DynamicCache), and attention reads exactly the columns in use;
- "static": every layer's keys and values live in one buffer allocated once, [rows, heads,
  capacity, head_dim]; a forward writes its columns in place and attention reads a prefix of the
  buffer rounded up to VIEW_BUCKET columns. Nothing moves between steps, so on CUDA the
  verification forward of each (rows, width, view) shape is captured once as a CUDA graph and
  replayed (`graphs=True`): one launch instead of hundreds of kernel launches from Python.
  With `compile=True` the forward inside each graph is first compiled by torch.compile (fused
  Triton kernels, as gpt-fast does for its fixed-shape step): fewer, larger kernels per layer.
  Each (rows, width, view) shape compiles once (tens of seconds on a GPU); prefill stays eager.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import io
import json
import os
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np

from ..errors import BackendUnavailableError, ContextOverflowError, ModelLoadError, SpecdecError
from .base import (
    SingleRow,
    check_tree_fits,
    check_tree_path,
    file_sha256,
    path_hidden,
    tree_ancestry,
    tree_depths,
    trim_hidden,
)
from .bpe import BYTE_TO_CHAR, CHAR_TO_BYTE  # GPT-2's byte-level table (bpe.py needs only the standard library)

INSTALL_HINT = (
    "install PyTorch and transformers: `make torch-deps`, or "
    "`pip install torch transformers gguf accelerate` (CPU: `pip install torch==2.13.0` first)"
)
DTYPES = ("auto", "float32", "bfloat16", "float16")
CACHES = ("dynamic", "static")
# Static cache: attention reads the buffer up to the used columns rounded up to this many, so a
# CUDA graph serves every depth in a 256-column band (a few graphs per generation), while a short
# context does not pay for reading the whole buffer.
VIEW_BUCKET = 256
# Forwards wider than this run eagerly even with graphs=True: prefill chunks (each width would be
# a graph of its own, used once); verification forwards are rows x (k + 1) <= 32 x 33 tokens.
GRAPH_MAX_WIDTH = 64

# end-of-turn tokens of the common chat formats; eog when the vocabulary has them
_EOG_TEXTS = (
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|end_of_text|>",
    "<end_of_turn>",
    "<|end|>",
    "<|return|>",
    "</s>",
)


def _torch():
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError as exc:
        raise BackendUnavailableError(f"the torch backend needs PyTorch and transformers: {INSTALL_HINT}") from exc
    return torch


def cuda_graph(run: Callable, pool=None):
    """(graph, output): `run` captured as a CUDA graph, warmed up first on a side stream as
    torch.cuda.graphs asks. Each graph.replay() reruns it on the tensors it captured, refilling its
    output (call under inference_mode when run computes with inference tensors)."""
    torch = _torch()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = run()
    return graph, out


def quiet_transformers():
    """A context in which transformers' GGUF loader draws no progress bar on stderr (it draws its
    own, past transformers' switch); SPECDEC_VERBOSE=1 shows it."""
    return contextlib.nullcontext() if os.environ.get("SPECDEC_VERBOSE") else contextlib.redirect_stderr(io.StringIO())


def check_layout(cache: str, graphs: bool, device: str, compile: bool = False) -> None:
    """The KV cache layout asked for is one this backend builds on `device` (a device name as
    pick_device returns it): checked before a model is loaded."""
    if cache not in CACHES:
        raise SpecdecError(f"unknown cache {cache!r}: use one of {', '.join(CACHES)}")
    if graphs and cache != "static":
        raise SpecdecError("CUDA graphs need the static cache (--cache static)")
    if graphs and not device.startswith("cuda"):
        raise SpecdecError(f"CUDA graphs need a CUDA device, and this model runs on {device}")
    if compile and not graphs:
        raise SpecdecError("compile needs graphs (the compiled forward is captured as a CUDA graph)")


def pick_device(device: str = "auto") -> str:
    torch = _torch()
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SpecdecError(f"--device {device}: this PyTorch sees no CUDA GPU; use --device cpu")
    return device


def pick_dtype(dtype: str, device: str):
    torch = _torch()
    if dtype not in DTYPES:
        raise SpecdecError(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    if dtype == "auto":  # bfloat16 where the hardware has it; float32 on CPU, where it is fastest
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return getattr(torch, dtype)


class HFTokenizer:
    """Our Tokenizer protocol over a transformers tokenizer."""

    def __init__(self, tokenizer, extra_eog: Sequence[int] = ()):
        self.hf = tokenizer
        vocab = tokenizer.get_vocab()
        eog = {int(t) for t in extra_eog if t is not None}
        if tokenizer.eos_token_id is not None:
            eog.add(int(tokenizer.eos_token_id))
        self._special = {int(i) for i in getattr(tokenizer, "all_special_ids", [])}
        self._special.update(int(i) for i in getattr(tokenizer, "added_tokens_decoder", {}))
        # only as special tokens: "</s>" is plain text in some vocabularies (Qwen2's)
        eog.update(vocab[t] for t in _EOG_TEXTS if vocab.get(t) in self._special)
        self.eog_ids = frozenset(eog)
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = "ByteLevel" in repr(decoder)
        self._bytes: dict[int, bytes] = {}

    def encode(self, text: str, add_special: bool = True, special: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special, split_special_tokens=not special))

    def token_text(self, token: int) -> str:
        return self.hf.convert_ids_to_tokens(int(token)) or ""

    def token_bytes(self, token: int) -> bytes:
        piece = self._bytes.get(token)
        if piece is None:
            text = self.token_text(token)
            if token in self._special:
                piece = text.encode()
            elif self._byte_level and all(c in CHAR_TO_BYTE for c in text):
                piece = bytes(CHAR_TO_BYTE[c] for c in text)
            elif len(text) == 6 and text.startswith("<0x") and text.endswith(">"):  # SentencePiece byte
                piece = bytes([int(text[3:5], 16)])
            elif "\u2581" in text:  # SentencePiece word
                piece = text.replace("\u2581", " ").encode()
            else:
                piece = self.hf.decode([token]).encode()
            self._bytes[token] = piece
        return piece

    def decode(self, tokens: Sequence[int]) -> str:
        return b"".join(self.token_bytes(t) for t in tokens).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict], tools: list | None = None) -> str:
        if not getattr(self.hf, "chat_template", None):
            raise SpecdecError("this model has no chat template; pass --no-chat")
        return self.hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)

    def max_token_bytes(self) -> int | None:
        return self._longest_token

    @functools.cached_property
    def _longest_token(self) -> int | None:
        """Tokenizer.max_token_bytes, read from the fast tokenizer's own description (its JSON):
        only a BPE model whose normalizer and pre-tokenizer keep every byte of the text
        (_keeps_text), that has a token for every byte (byte-level or byte fallback: no unknown
        token standing for a run of text, nothing dropped), and no added token that strips the
        whitespace beside it. A token then stands for at most the bytes of its vocabulary text
        (a byte-level text holds one character a byte; SentencePiece's "\u2581" is three bytes
        for a space), an added token for its spelling. Anything else: None (a slow tokenizer,
        Unicode normalization, WordPiece, Unigram)."""
        backend = getattr(self.hf, "backend_tokenizer", None)
        if backend is None:
            return None
        spec = json.loads(backend.to_str())
        model, steps = spec.get("model") or {}, (spec.get("normalizer"), spec.get("pre_tokenizer"))
        added = spec.get("added_tokens") or []
        if model.get("type") != "BPE" or not all(_keeps_text(step) for step in steps):
            return None
        if any(token.get("lstrip") or token.get("rstrip") for token in added):
            return None
        vocab = self.hf.get_vocab()  # added tokens included
        byte_level = any(_has_step(step, "ByteLevel") for step in steps)
        if model.get("byte_fallback"):
            every_byte = all(f"<0x{b:02X}>" in vocab for b in range(256))
        else:
            every_byte = byte_level and all(c in vocab for c in BYTE_TO_CHAR.values())
        if not every_byte:
            return None
        spelled = {token["content"] for token in added}
        return max(
            len(text)
            if byte_level and text not in spelled and all(c in CHAR_TO_BYTE for c in text)
            else len(text.encode())
            for text in vocab
        )


def _keeps_text(step: dict | None) -> bool:
    """A normalizer or pre-tokenizer (a tokenizers JSON node) that neither shrinks nor drops any of
    the text: a Replace of a string by one no shorter, a Split or Punctuation that keeps what it
    splits on, Prepend, ByteLevel, Metaspace, Digits, or a Sequence of them (NFC, Lowercase,
    Strip, a regex Replace and the whitespace splitters may lose bytes)."""
    if step is None:
        return True
    kind = step.get("type")
    if kind == "Sequence":
        return all(_keeps_text(s) for s in step.get("normalizers", step.get("pretokenizers", [])))
    if kind == "Replace":
        pattern = (step.get("pattern") or {}).get("String")
        return pattern is not None and len(str(step.get("content", "")).encode()) >= len(pattern.encode())
    if kind in ("Split", "Punctuation"):
        return step.get("behavior") != "Removed"
    return kind in ("Prepend", "ByteLevel", "Metaspace", "Digits")


def _has_step(step: dict | None, kind: str) -> bool:
    if step is None:
        return False
    return step.get("type") == kind or any(
        _has_step(s, kind) for s in step.get("normalizers", step.get("pretokenizers", []))
    )


class TransformersModel(SingleRow):
    """Implements models.base.RowModel over a transformers causal LM."""

    max_rows = 1 << 16
    scores_trees = True  # forward_tree_rows: a tree's ancestry is its new columns' mask
    exits_early = True  # forward_rows(..., n_layers=L): the first L layers (drafters.early_exit)
    runs_exit_blocks = True  # attach_exit_blocks

    def __init__(
        self,
        model,
        tokenizer,
        name: str = "transformers",
        n_ctx: int | None = None,
        is_instruct: bool | None = None,
        cache: str = "dynamic",
        graphs: bool = False,
        compile: bool = False,
    ):
        torch = _torch()
        self._torch = torch
        self.model = model.eval()
        # the cache argument's name: `cache` in transformers 5.x's newer releases (the old name,
        # past_key_values, warns there and goes in 5.40), past_key_values before them
        self._cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.config = model.config
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        if not hasattr(tokenizer, "eog_ids"):  # a transformers tokenizer: wrap it
            gen = getattr(model, "generation_config", None)
            extra = getattr(gen, "eos_token_id", None) or getattr(model.config, "eos_token_id", None)
            tokenizer = HFTokenizer(tokenizer, extra if isinstance(extra, (list, tuple)) else [extra])
        self.tokenizer = tokenizer
        self.name = name
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        limit = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)
        self.n_ctx = min(n_ctx or limit or 4096, limit or n_ctx or 4096)
        self.is_instruct = (
            bool(getattr(getattr(tokenizer, "hf", None), "chat_template", None)) if is_instruct is None else is_instruct
        )
        text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        types = getattr(text, "layer_types", None) or []
        self._sliding = getattr(text, "sliding_window", None) if "sliding_attention" in types else None
        self._mask_keys = sorted(set(types)) if self._sliding else None
        check_layout(cache, graphs, str(self.device), compile)
        self.static = cache == "static"
        self.graphs = graphs
        self._forward = self.model
        if compile:
            import torch._dynamo

            # one layer class, but each layer's index is an int attribute: let it vary
            torch._dynamo.config.allow_unspec_int_on_nn_module = True
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
            self._forward = torch.compile(self.model, dynamic=False)
        self.compiled = compile
        # a row holds n_ctx tokens; a forward adds at most n_ctx columns after a compaction
        self._capacity = 2 * self.n_ctx
        self._n_layers = int(text.num_hidden_layers)
        self.n_embd = int(text.hidden_size)
        # what a head file names this model by (models.base.HiddenStates): set by the loaders
        # (a GGUF's sha256, as llama.cpp's; a folder's weight files'); else the name and config
        self._identity: str | None = None
        self._identity_of: Callable[[], str] = lambda: _digest(f"{name}\0{model.config.to_json_string()}")
        # row -> (first position, [n, n_embd]) once keep_hidden is called; the final norm's output
        # of the last forward, which a hook on the norm leaves in _normed
        self._hidden: dict[int, tuple[int, np.ndarray]] | None = None
        self._tree_states: dict[int, np.ndarray] = {}  # row -> its tree nodes' states (keep_hidden)
        self._normed = None
        # an early-exit head's trained blocks: (the layers before them, the blocks), and layer L's
        # output of the last forward, which a hook leaves (attach_exit_blocks)
        self._blocks: tuple[int, object] | None = None
        self._exit_state = None
        # with graphs, an early exit's forwards are captured too (benchmarks/gpu_exit.py times both)
        self.graph_exits = True
        self._clear()

    def _clear(self) -> None:
        from transformers import DynamicCache

        torch = self._torch
        self._graph_cache: dict[tuple, _Graph] = {}
        self._graph_pool = None
        if self.static:
            from transformers.cache_utils import Cache

            self._slot = _Slot()
            self._slot.capacity = self._capacity
            self._cache = Cache(layers=[_static_layer(self._slot) for _ in range(self._n_layers)])
            C = self._capacity
            self._valid_buf = torch.zeros((0, C), dtype=torch.bool, device=self.device)  # [rows, capacity]
            self._pos_buf = torch.full((0, C), -1, dtype=torch.long, device=self.device)  # [rows, capacity]
            self._set_end(0)
            self._parked = 0  # rows the buffers hold while no row is live (see _park)
        else:
            self._cache = DynamicCache()  # full layers only: sliding windows are applied by the mask
            self._valid = torch.zeros((0, 0), dtype=torch.bool, device=self.device)  # [rows, columns]
            self._pos = torch.zeros((0, 0), dtype=torch.long, device=self.device)  # [rows, columns]
        self._past: list[int] = []  # [rows] tokens in each row's cache
        # row -> (tokens in the row before its tree, the tree's parents, the tree's columns): trees
        # scored by forward_tree_rows whose path keep_path_rows has not kept yet
        self._trees: dict[int, tuple[int, tuple[int, ...], list[int]]] = {}
        self._ids: list[int] = []  # [rows] the row id at each batch index
        self._index: dict[int, int] = {}  # row id -> batch index
        self._next_id = 0
        # an early exit's forwards so far (forward_rows' n_layers): (the deepest of their layers,
        # row -> its length before the first), until every row is rolled back to that length
        self._exit: tuple[int, dict[int, int]] | None = None

    # -- the row protocol ------------------------------------------------------------------

    def add_rows(self, n: int = 1) -> list[int]:
        """n empty rows appended along the batch axis (the running rows keep their caches)."""
        torch = self._torch
        ids = list(range(self._next_id, self._next_id + n))
        self._next_id += n
        if self.static and not self._ids and self._parked != n:
            next_id = self._next_id
            self._clear()  # parked buffers of another row count: start afresh
            self._next_id = next_id
        if self.static and not self._ids and self._parked == n:
            # the buffers (and the graphs captured over them) of the last batch of n rows
            self._parked = 0
            self._past, self._ids = [0] * n, ids
            self._index = {row: i for i, row in enumerate(self._ids)}
            return ids
        if self.static:
            C = self._capacity
            self._valid_buf = torch.cat([self._valid_buf, torch.zeros((n, C), dtype=torch.bool, device=self.device)])
            self._pos_buf = torch.cat([self._pos_buf, torch.full((n, C), -1, dtype=torch.long, device=self.device)])
            self._set_end(self._end)
            self._drop_graphs()  # the buffers moved: captured graphs point at the old ones
        else:
            L = self._valid.shape[1]
            self._valid = torch.cat([self._valid, torch.zeros((n, L), dtype=torch.bool, device=self.device)])
            self._pos = torch.cat([self._pos, torch.full((n, L), -1, dtype=torch.long, device=self.device)])
        for layer in self._layers():
            pad = lambda t: torch.cat([t, t.new_zeros((n, *t.shape[1:]))])  # noqa: E731
            layer.keys, layer.values = pad(layer.keys), pad(layer.values)
        self._past += [0] * n
        self._ids += ids
        self._index = {row: i for i, row in enumerate(self._ids)}
        return ids

    def drop_rows(self, rows) -> None:
        gone = set(rows)
        for row in gone:
            self._trees.pop(row, None)
            self._tree_states.pop(row, None)
            if self._hidden is not None:
                self._hidden.pop(row, None)
        keep = [i for i, row in enumerate(self._ids) if row not in gone]
        if len(keep) == len(self._ids):
            return
        if not keep:
            if self.static:
                self._park()
                return
            next_id = self._next_id
            self._clear()
            self._next_id = next_id
            return
        index = self._torch.tensor(keep, dtype=self._torch.long, device=self.device)
        if self._layers():
            self._cache.batch_select_indices(index)
        if self.static:
            self._valid_buf, self._pos_buf = self._valid_buf[index], self._pos_buf[index]
            self._set_end(self._end)
            self._drop_graphs()
        else:
            self._valid, self._pos = self._valid[index], self._pos[index]
        self._past = [self._past[i] for i in keep]
        self._ids = [self._ids[i] for i in keep]
        self._index = {row: i for i, row in enumerate(self._ids)}
        self._trim()

    def row_length(self, row: int) -> int:
        return self._past[self._index[row]]

    def passes(self, fed: Mapping[int, int]) -> list[int]:
        # the rows go through the forward padded to the longest
        fed = [n for n in fed.values() if n]
        return [len(fed) * max(fed)] if fed else []

    @property
    def layout(self) -> str:
        """The KV cache layout: "dynamic", "static" or "static+graphs"."""
        if not self.static:
            return "dynamic"
        return "static+graphs+compile" if self.compiled else "static+graphs" if self.graphs else "static"

    @property
    def n_rows(self) -> int:
        return len(self._ids)

    def forward_rows(
        self, tokens, n_logits=None, n_layers: int | None = None, blocks: bool = False
    ) -> dict[int, np.ndarray]:
        """One padded forward over every row of the batch: row r appends tokens[r] (rows not in
        `tokens` append nothing) and returns the logits of its last n_logits[r] tokens. A row's
        tree that no path was kept of goes.

        With n_layers (an early exit, drafters/early_exit.py) only the first n_layers layers run,
        then the final norm and output head, and only their K/V are written: the deeper layers
        lack those columns, so until every row is rolled back to where it was before the first
        such forward, only forwards through the same or fewer layers may follow. With `blocks`
        too, the trained blocks attached after those layers (attach_exit_blocks) run between them
        and the final norm."""
        for row, row_tokens in tokens.items():
            if self._past[self._index[row]] + len(row_tokens) > self.n_ctx:
                raise ContextOverflowError(
                    f"the context holds {self.n_ctx} tokens; row {row} would need "
                    f"{self._past[self._index[row]] + len(row_tokens)}"
                )
        layers = self._n_layers if n_layers is None else n_layers
        if not 1 <= layers <= self._n_layers:
            raise ValueError(f"n_layers must be in 1..{self._n_layers}, got {n_layers}")
        if blocks and (self._blocks is None or self._blocks[0] != layers):
            raise ValueError(f"no trained blocks are attached after layer {layers} (attach_exit_blocks)")
        self._check_exit(layers)
        self._end_trees(tokens)
        if layers == self._n_layers:
            return self._forward_batch(tokens, n_logits or {}, {})
        if self._exit is None:  # what each row held before the early exit's first forward
            self._exit = (layers, {row: self._past[i] for row, i in self._index.items()})
        self._exit = (max(self._exit[0], layers), self._exit[1])
        with self._first_layers(layers, self._blocks[1] if blocks else ()):
            return self._forward_batch(tokens, n_logits or {}, {}, partial=(layers, blocks))

    def attach_exit_blocks(self, layers: int, blocks) -> None:
        """Trained transformer blocks (an early-exit head's, `specdec train early-exit:L+B`: decoder
        layers of this model's own shape) that draft after this model's first `layers` layers.
        They get cache layers of their own after the model's (each block its index there), kept
        up to date by every full forward: a hook keeps layer `layers`' output, and the blocks run
        over it with the forward's mask, so every column a row holds has the blocks' keys and
        values too, whatever the forward (a prompt's chunk, a verification, a tree). An early exit
        with `blocks` (forward_rows) then reads them and writes its own, which its rollback drops
        as it drops the first layers'. Rows already held get zeros there (their drafts are worse,
        the output is the same)."""
        torch = self._torch
        if self._sliding:
            raise SpecdecError(f"{self.name}: trained exit blocks on a model with sliding-window layers are not built")
        if not 1 <= layers < self._n_layers:
            raise ValueError(f"exit blocks go after layer 1..{self._n_layers - 1}, got {layers}")
        blocks = torch.nn.ModuleList(blocks).to(device=self.device, dtype=self.dtype).eval()
        for j, block in enumerate(blocks):
            attention = getattr(block, "self_attn", None)
            if attention is None or not hasattr(attention, "layer_idx"):
                raise SpecdecError(f"{self.name}: an exit block is not a decoder layer this backend knows")
            attention.layer_idx = self._n_layers + j  # its own cache layer, after the model's
        if self._blocks is None:

            def hook(module, inputs, output):
                self._exit_state = output[0] if isinstance(output, tuple) else output

            self._decoder_layers()[layers - 1].register_forward_hook(hook)
        elif self._blocks[0] != layers:
            raise SpecdecError(f"{self.name} already has exit blocks after layer {self._blocks[0]}")
        self._blocks = (layers, blocks)
        self._block_cache()
        self._drop_graphs()  # captured without the hook: captured again with it

    @property
    def n_layer(self) -> int:
        """The model's layers (an early exit runs the first few: forward_rows' n_layers)."""
        return self._n_layers

    def _check_exit(self, layers: int) -> None:
        """Refuse a forward through deeper layers than an early exit left written (forward_rows)."""
        if self._exit is not None and layers > self._exit[0]:
            behind = {row: n for row, n in self._exit[1].items() if row in self._index}
            raise RuntimeError(
                f"an early exit wrote only the first {self._exit[0]} layers of the last tokens: "
                f"rollback_rows({behind}) first"
            )

    def _decoder(self):
        """The model's decoder (its layers and final norm, without the output head)."""
        return self.model.get_decoder() if hasattr(self.model, "get_decoder") else self.model

    def _decoder_layers(self, replace=None):
        """The decoder's list of layers; with `replace`, a list put in its place, and the old one."""
        torch = self._torch
        decoder = self._decoder()
        name = next(
            (a for a in ("layers", "h", "blocks") if isinstance(getattr(decoder, a, None), torch.nn.ModuleList)), None
        )
        if name is None:
            raise SpecdecError(f"{self.name}: its layer list is not one this backend knows, so no early exit")
        every = getattr(decoder, name)
        if replace is not None:
            setattr(decoder, name, replace)
        return every

    @contextlib.contextmanager
    def _first_layers(self, n: int, blocks=()):
        """Within the block the model's decoder has only its first n layers, then `blocks` (its
        final norm and output head stay): a forward is an early exit. Each layer keeps its index,
        so it writes its own slot of the cache."""
        every = self._decoder_layers()
        self._decoder_layers(self._torch.nn.ModuleList([*every[:n], *blocks]))
        try:
            yield
        finally:
            self._decoder_layers(every)
            self._exit_state = None  # (the hook saw the early exit's own layer)

    def _block_cache(self) -> None:
        """The exit blocks' cache layers, after the model's: zeros shaped like the first layer's
        where it holds columns and theirs do not (yet), so that every layer holds the same columns."""
        if self._blocks is None:
            return
        from transformers.cache_utils import DynamicLayer

        layers = self._cache.layers
        end = self._n_layers + len(self._blocks[1])
        while self.static and len(layers) < end:  # (a static cache's layers are made with it)
            layers.append(_static_layer(self._slot))
        first = layers[0] if layers else None
        if first is None or getattr(first, "keys", None) is None or not first.keys.numel():
            return  # nothing cached yet: the first forward makes every layer, the blocks' too
        for idx in range(self._n_layers, end):
            while len(layers) <= idx:
                layers.append(DynamicLayer())
            layer = layers[idx]
            if getattr(layer, "keys", None) is None or not layer.keys.numel():
                layer.keys, layer.values = (
                    first.keys.new_zeros(first.keys.shape),
                    first.values.new_zeros(first.values.shape),
                )
                layer.dtype, layer.device, layer.is_initialized = first.keys.dtype, first.keys.device, True

    def _run_blocks(self, mask, position_ids) -> None:
        """After a full forward: the exit blocks over layer L's output of its columns (the hook's),
        with its mask and positions, writing their cache layers' columns (attach_exit_blocks)."""
        state, self._exit_state = self._exit_state, None
        decoder = self._decoder()
        with self._torch.inference_mode():
            rotary = decoder.rotary_emb(state, position_ids)
            for block in self._blocks[1]:
                out = block(
                    state,
                    attention_mask=mask,
                    position_embeddings=rotary,
                    position_ids=position_ids,
                    use_cache=True,
                    **{self._cache_kw: self._cache},
                )
                state = out[0] if isinstance(out, tuple) else out

    def forward_tree_rows(self, trees) -> dict[int, np.ndarray]:
        """Each row's tree (tokens, parents: -1 under the row's last token, else an earlier node)
        in one padded forward with the rest of the batch appending nothing; every node's logits
        per row. The tree is not the row's (row_length stays) until keep_path_rows keeps a path."""
        shapes = {}
        for row, (tokens, parents) in trees.items():
            depth, above = _tree_shape(tuple(parents))
            check_tree_fits(tokens, parents, depth, self._past[self._index[row]], self.n_ctx)
            shapes[row] = (tuple(parents), depth, above)
        self._check_exit(self._n_layers)
        self._end_trees(trees)
        tokens = {row: tokens for row, (tokens, _) in trees.items()}
        return self._forward_batch(tokens, {row: len(t) for row, t in tokens.items()}, shapes)

    def keep_path_rows(self, paths) -> None:
        """Per row, after forward_tree_rows: keep the row and the path's nodes (root first, each
        the parent of the next), which sit at the positions after the row's last token; the
        tree's other nodes' columns become invalid."""
        for row, path in paths.items():
            if row not in self._trees:
                raise ValueError(f"row {row} has no tree to keep a path of (keep_path_rows follows forward_tree_rows)")
            check_tree_path(self._trees[row][1], path)
        drop = []
        for row, path in paths.items():
            past, _, cols = self._trees.pop(row)
            kept = set(path)
            drop += [(self._index[row], c) for node, c in enumerate(cols) if node not in kept]
            self._past[self._index[row]] = past + len(path)
            states = self._tree_states.pop(row, None)
            if self._hidden is not None:
                self._hidden[row] = path_hidden(self._hidden.get(row), states, past, path, self.n_embd)
        self._invalidate(drop)
        self._trim()

    def _end_trees(self, rows) -> None:
        """The trees of these rows that no path was kept of: their columns become invalid."""
        trees = [(self._index[row], self._trees.pop(row)) for row in rows if row in self._trees]
        for row in rows:
            self._tree_states.pop(row, None)
        self._invalidate([(i, c) for i, (_, _, cols) in trees for c in cols])

    def _invalidate(self, cells: list[tuple[int, int]]) -> None:
        """Mark these (row index, column) cells invalid, in one indexing op (one copy to a GPU)."""
        if cells:
            at = self._torch.tensor(cells, device=self.device).T
            self._valid[at[0], at[1]] = False  # in place (the static cache's _valid is a view)
            self._pos[at[0], at[1]] = -1

    def _forward_batch(self, tokens, n_logits, trees, partial: tuple | None = None) -> dict[int, np.ndarray]:
        """forward_rows' and forward_tree_rows' forward; trees: row -> (parents, depths [T],
        ancestry [T, T]) for the rows whose tokens are a tree: they sit at their depths'
        positions and read their ancestors. partial: an early exit's (its layers, whether the
        exit blocks run; no states kept)."""
        torch = self._torch
        B = self.n_rows
        index = self._index
        lengths = [0] * B
        wants = [0] * B
        for row, row_tokens in tokens.items():
            i = index[row]
            lengths[i] = len(row_tokens)
            wants[i] = min(n_logits.get(row, 0), lengths[i])
        empty = np.zeros((0, self.vocab_size), np.float32)
        W = max(lengths, default=0)
        if W == 0:
            for row in trees:  # empty trees: a path of none is kept
                self._trees[row] = (self._past[index[row]], trees[row][0], [])
            return {row: empty for row in n_logits if row in tokens}
        ids = torch.zeros((B, W), dtype=torch.long)  # [rows, W], right-padded
        pos = torch.full((B, W), -1, dtype=torch.long)  # [rows, W], -1 = padding
        new_allowed = None  # [rows, W, W]: which new columns each new token reads, besides the position rule
        if trees:
            new_allowed = np.broadcast_to(np.tri(W, dtype=bool), (B, W, W)).copy()
        for row, row_tokens in tokens.items():
            i = index[row]
            if row_tokens:
                ids[i, : len(row_tokens)] = torch.tensor([int(t) for t in row_tokens])
                offsets = trees[row][1] if row in trees else np.arange(len(row_tokens))
                pos[i, : len(row_tokens)] = torch.from_numpy(self._past[i] + offsets)
            if row in trees:
                T = len(row_tokens)
                new_allowed[i, :T, :T] = trees[row][2]
        ids, pos = ids.to(self.device), pos.to(self.device)
        if new_allowed is not None:
            new_allowed = torch.from_numpy(new_allowed).to(self.device)
        new_valid = pos >= 0
        # padding queries see only themselves (a fully masked row would give NaN in the cache)
        position_ids = torch.where(new_valid, pos, 0).clamp(max=self.n_ctx - 1)
        # logits only for the columns some row asks for
        need = sorted({c for i in range(B) for c in range(lengths[i] - wants[i], lengths[i])})
        self._block_cache()
        if self.static:
            L, logits = self._forward_static(ids, pos, new_valid, position_ids, need, new_allowed, partial)
        else:
            L = self._valid.shape[1]
            valid = torch.cat([self._valid, new_valid], dim=1)  # [rows, L + W]
            kv_pos = torch.cat([self._pos, pos], dim=1)  # [rows, L + W]
            mask = self._mask(valid, kv_pos, pos, L, new_allowed)
            out = self._call(ids, mask, position_ids, torch.tensor(need or [W - 1], device=self.device))
            self._cache = out[self._cache_kw]
            self._valid, self._pos = valid, kv_pos
            logits = out.logits  # [rows, len(need), vocab]
            if self._blocks is not None and not partial:
                self._run_blocks(mask, position_ids)
        for row, row_tokens in tokens.items():
            i = index[row]
            if row in trees:  # the tree's columns, not yet the row's
                self._trees[row] = (self._past[i], trees[row][0], list(range(L, L + len(row_tokens))))
            else:
                self._past[i] += lengths[i]
        if self._hidden is not None and not partial:
            self._keep_states(tokens, trees, lengths, wants)
        self._normed = None if partial else self._normed  # an early exit's states are not the model's
        result = {row: empty for row in n_logits if row in tokens}
        if not need:
            return result
        col = {c: j for j, c in enumerate(need)}
        pairs = [(i, col[c]) for i in range(B) for c in range(lengths[i] - wants[i], lengths[i])]
        index_r = torch.tensor([i for i, _ in pairs], device=self.device)
        index_c = torch.tensor([c for _, c in pairs], device=self.device)
        flat = self._to_host(logits[index_r, index_c])  # [sum(wants), vocab]
        start = 0
        for i in range(B):
            if wants[i]:
                result[self._ids[i]] = flat[start : start + wants[i]]
                start += wants[i]
        return result

    def _to_host(self, logits) -> np.ndarray:
        """Logits as float32 NumPy. From a GPU through page-locked memory: a plain .cpu() goes
        through pageable memory, which cost the H100 and H200 0.4 ms a token of a 152k vocabulary
        past ~50 tokens (a 64-token verification 29 ms instead of 8)."""
        logits = logits.float()
        if logits.device.type != "cuda":
            return logits.numpy()
        host = self._torch.empty(logits.shape, dtype=logits.dtype, pin_memory=True)  # torch caches these
        host.copy_(logits, non_blocking=True)
        self._torch.cuda.current_stream(logits.device).synchronize()
        return host.numpy()

    # -- hidden states (models.base.HiddenStates) ------------------------------------------------

    @property
    def identity(self) -> str:
        if self._identity is None:
            self._identity = self._identity_of()
        return self._identity

    def keep_hidden(self) -> None:
        if self._hidden is not None:
            return
        decoder = self._decoder()
        norm = next((getattr(decoder, n) for n in ("norm", "ln_f", "final_layernorm") if hasattr(decoder, n)), None)
        if norm is None:
            raise SpecdecError(f"{self.name}: its final norm is not one this backend knows, so no hidden states")

        def hook(module, inputs, output):
            self._normed = output  # [rows, W, n_embd]: what the output head reads

        norm.register_forward_hook(hook)
        self._hidden = {}
        self._drop_graphs()  # captured without the hook: captured again with it

    def _keep_states(self, tokens, trees, lengths: list[int], wants: list[int]) -> None:
        """The last forward's states of the tokens each row asked logits for (a tree's nodes':
        aside, until keep_path_rows keeps its path's)."""
        normed, self._normed = self._normed, None
        for row in tokens:
            i = self._index[row]
            if not wants[i]:
                continue
            states = self._to_host(normed[i, lengths[i] - wants[i] : lengths[i]])
            if row in trees:
                self._tree_states[row] = states
            else:
                self._hidden[row] = (self._past[i] - wants[i], states)

    def hidden_rows(self, rows) -> dict[int, tuple[int, np.ndarray]]:
        kept = self._hidden or {}
        return {row: kept.get(row) or trim_hidden(None, self._past[self._index[row]], self.n_embd) for row in rows}

    def head_weights(self, name: str, tokens: np.ndarray) -> np.ndarray:
        layer = {"output": self.model.get_output_embeddings, "embedding": self.model.get_input_embeddings}[name]()
        index = self._torch.as_tensor(np.asarray(tokens, np.int64), device=self.device)
        with self._torch.inference_mode():
            return layer.weight[index].float().cpu().numpy()

    # -- the static cache ----------------------------------------------------------------------

    def _set_end(self, end: int) -> None:
        """Columns [0, end) of the buffers are in use; _valid and _pos are views of them."""
        self._end = end
        self._valid, self._pos = self._valid_buf[:, :end], self._pos_buf[:, :end]

    def _park(self) -> None:
        """Every row left: keep the buffers and the captured graphs for the next batch of as many
        rows (one prompt after another, with graphs, would otherwise capture again every time)."""
        self._parked = len(self._ids)
        self._exit = None
        self._valid_buf.fill_(False)
        self._pos_buf.fill_(-1)
        self._set_end(0)
        self._past, self._ids, self._index = [], [], {}

    def _forward_static(self, ids, pos, new_valid, position_ids, need: list[int], new_allowed=None, partial=None):
        """Write the new columns at [L, L + W) of the buffers and run the model over a view of
        VIEW_BUCKET-rounded width: eagerly, or as a replayed CUDA graph (an early exit's too,
        unless graph_exits is off). Returns (L, logits) with logits [rows, len(need), vocab]
        (graphs: [rows, W, vocab], the columns in `need` picked)."""
        torch = self._torch
        B, W = ids.shape
        if self._end + W > self._capacity:
            self._compact()
        L = self._end
        if L + W > self._capacity:
            raise ContextOverflowError(
                f"the static cache holds {self._capacity} columns; this forward "
                f"needs {L + W} (rows {max(self._past)} tokens, width {W})"
            )
        view = min(self._capacity, -(-(L + W) // VIEW_BUCKET) * VIEW_BUCKET)
        self._valid_buf[:, L : L + W] = new_valid
        self._pos_buf[:, L : L + W] = pos
        self._set_end(L + W)
        mask = self._mask(self._valid_buf[:, :view], self._pos_buf[:, :view], pos, L, new_allowed)  # [rows, 1, W, view]
        self._slot.view = view
        graphed = self.graphs and W <= GRAPH_MAX_WIDTH and not self._sliding and self._layers()
        if graphed and (not partial or self.graph_exits):
            # (the exit blocks' pass over a full forward is in its graph: _replay)
            logits = self._replay(ids, position_ids, mask, L, view, partial)  # [rows, W, vocab]
            logits = logits[:, need] if need else logits[:, :0]
            return L, logits
        self._slot.cols = torch.arange(L, L + W, device=self.device)
        logits = self._call(ids, mask, position_ids, torch.tensor(need or [W - 1], device=self.device)).logits
        if self._blocks is not None and not partial:
            self._run_blocks(mask, position_ids)
        return L, logits

    def _call(self, ids, mask, position_ids, keep):
        """The model over the cache, eagerly, keeping the logits of the `keep` columns: its output."""
        with self._torch.inference_mode():
            return self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=position_ids,
                use_cache=True,
                logits_to_keep=keep,
                **{self._cache_kw: self._cache},
            )

    def _drop_graphs(self) -> None:
        """Forget the captured graphs, and their memory pool with them: a pool whose graphs are
        all gone is freed, and capturing into it again fails inside torch."""
        self._graph_cache.clear()
        self._graph_pool = None

    def _replay(self, ids, position_ids, mask, L: int, view: int, partial: tuple | None = None):
        """The forward as a CUDA graph: captured once per (rows, width, view, early exit), then its
        inputs are copied into the graph's own tensors and it is replayed. A full forward's graph
        runs the exit blocks over its columns too (attach_exit_blocks), so they cost no launches
        of their own; an early exit's runs the layers _first_layers left (uncompiled: the
        compiled forward was traced through every layer)."""
        torch = self._torch
        B, W = ids.shape
        key = (B, W, view, partial)
        graph = self._graph_cache.get(key)
        if graph is None:
            graph = _Graph(ids.clone(), position_ids.clone(), mask.clone(), torch.arange(L, L + W, device=self.device))
            self._slot.cols = graph.cols

            def run():
                logits = (self.model if partial else self._forward)(
                    input_ids=graph.ids,
                    attention_mask=graph.mask,
                    position_ids=graph.position_ids,
                    use_cache=True,
                    logits_to_keep=0,
                    **{self._cache_kw: self._cache},
                ).logits
                if self._blocks is not None and not partial:
                    self._run_blocks(graph.mask, graph.position_ids)
                return logits

            with torch.inference_mode():
                # (the warm-up's writes land on the columns this very forward is about to write anyway)
                graph.graph, graph.logits = cuda_graph(run, self._graph_pool)
                # a replay runs no hook, but the final norm's output, which the hook saw during
                # the capture, is the graph's own tensor: each replay refills it
                graph.normed = self._normed
            self._graph_pool = graph.graph.pool()
            self._graph_cache[key] = graph
        else:
            graph.ids.copy_(ids)
            graph.position_ids.copy_(position_ids)
            graph.mask.copy_(mask)
            graph.cols.copy_(torch.arange(L, L + W, device=self.device))
        graph.graph.replay()
        self._normed = graph.normed
        return graph.logits

    def _compact(self) -> None:
        """Each row's valid columns first, in order, the rest padding (see _trim)."""
        torch = self._torch
        longest = max(self._past, default=0) + max((len(cols) for _, _, cols in self._trees.values()), default=0)
        order = torch.sort((~self._valid).to(torch.int8), dim=1, stable=True).indices[:, :longest]
        for row, (past, parents, cols) in self._trees.items():  # valid columns keep their order
            moved = (self._valid[self._index[row]].cumsum(0) - 1)[cols].tolist()
            self._trees[row] = (past, parents, moved)
        # the caches are inference tensors (made under inference_mode): changed under it alone
        with torch.inference_mode():
            for layer in self._layers():
                index = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
                if self.static:  # in place: the buffers keep their addresses (captured graphs read them)
                    layer.keys[:, :, :longest] = torch.gather(layer.keys, 2, index)
                    layer.values[:, :, :longest] = torch.gather(layer.values, 2, index)
                else:
                    layer.keys = torch.gather(layer.keys, 2, index)
                    layer.values = torch.gather(layer.values, 2, index)
        valid = torch.gather(self._valid, 1, order)
        pos = torch.where(valid, torch.gather(self._pos, 1, order), -1)
        if self.static:
            self._valid_buf[:, :longest], self._pos_buf[:, :longest] = valid, pos
            self._valid_buf[:, longest:] = False
            self._pos_buf[:, longest:] = -1
            self._set_end(longest)
        else:
            self._valid, self._pos = valid, pos

    def _mask(self, valid, kv_pos, q_pos, L: int, new_allowed=None):
        """Additive attention mask [rows, 1, W, columns] from positions (see the module docstring);
        the W new columns start at L (columns = L + W, or more with a static cache's view), and
        new_allowed [rows, W, W] (trees) narrows which of them each new token reads."""
        torch = self._torch
        W = q_pos.shape[1]
        allowed = valid[:, None, :] & (kv_pos[:, None, :] <= q_pos[:, :, None])  # [rows, W, L + W]
        if new_allowed is not None:
            allowed[:, :, L : L + W] &= new_allowed
        diagonal = torch.zeros((W, valid.shape[1]), dtype=torch.bool, device=self.device)
        diagonal[torch.arange(W), L + torch.arange(W)] = True
        full = self._additive(allowed | diagonal)
        if not self._sliding:
            return full
        near = (q_pos[:, :, None] - kv_pos[:, None, :]) < self._sliding
        masks = {"full_attention": full, "sliding_attention": self._additive((allowed & near) | diagonal)}
        return {key: masks.get(key, full) for key in self._mask_keys}

    def _additive(self, allowed):
        torch = self._torch
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
        mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        return mask[:, None]

    def rollback_rows(self, keep) -> None:
        """Cut row r's cache to its first keep[r] tokens (a tree no path was kept of goes)."""
        torch = self._torch
        self._end_trees(keep)
        cut = list(self._past)
        for row, n in keep.items():
            i = self._index[row]
            cut[i] = min(cut[i], n)
            if self._hidden:  # the cut positions' states go too
                self._hidden[row] = trim_hidden(self._hidden.get(row), cut[i], self.n_embd)
        if self._exit is not None and all(cut[i] <= self._exit[1].get(row, 0) for row, i in self._index.items()):
            self._exit = None  # every layer holds every row's tokens again
        if cut == self._past:
            return
        # rows not cut keep every column (a waiting tree's sit past the row's length)
        limit = torch.tensor([n if n < past else 1 << 62 for n, past in zip(cut, self._past)], device=self.device)
        self._valid &= self._pos < limit[:, None]
        self._past = cut
        self._trim()

    def _layers(self):
        return [
            layer for layer in self._cache.layers if getattr(layer, "keys", None) is not None and layer.keys.numel()
        ]

    def _trim(self) -> None:
        """Drop columns at the end that no row uses; compact when holes take over the cache."""
        used = self._valid.any(dim=0).nonzero()
        end = int(used.max()) + 1 if used.numel() else 0
        if end < self._valid.shape[1]:
            if self.static:  # the columns past the end are free again: nothing reads them
                self._valid_buf[:, end:] = False
                self._pos_buf[:, end:] = -1
                self._set_end(end)
            else:
                for layer in self._layers():
                    layer.keys, layer.values = layer.keys[..., :end, :], layer.values[..., :end, :]
                self._valid, self._pos = self._valid[:, :end], self._pos[:, :end]
        longest = max(self._past, default=0)
        if self._valid.shape[1] > 2 * longest + 64 and self._exit is None:  # (an exit's layers differ in length)
            self._compact()

    def cached_keys_values(self, row: int | None = None):
        """The (keys, values) of each layer for a row's valid tokens in position order; for tests."""
        row = self._index[self._solo if row is None else row]
        order = self._pos[row].masked_fill(~self._valid[row], 1 << 60).argsort()[: self._past[row]]
        return [(layer.keys[row][:, order], layer.values[row][:, order]) for layer in self._layers()]


def _digest(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()


def _folder_sha256(path: Path) -> str:
    """A transformers folder's identity: the sha256 of its weight files' (name, sha256)."""
    weights = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin") and p.is_file())
    return _digest("".join(f"{p.name}\0{file_sha256(p)}\0" for p in weights))


@functools.lru_cache(maxsize=256)
def _tree_shape(parents: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """A tree's depths [T] and ancestry [T, T] (node i reads node j: an ancestor, or itself);
    cached, since a drafter's trees repeat their shapes across rows and steps."""
    depth, above = tree_depths(parents), tree_ancestry(parents)
    depth.flags.writeable = above.flags.writeable = False
    return depth, above


class _Slot:
    """Where a static-cache forward writes and how far attention reads: set before each forward,
    read by every layer."""

    capacity = 0  # columns of every buffer
    cols = None  # [W] long tensor: the buffer columns of the forward's tokens
    view = 0  # attention reads columns [0, view)


_STATIC_LAYER = None


def _static_layer(slot: _Slot):
    """A cache layer over one preallocated buffer per keys and values [rows, heads, capacity,
    head_dim], allocated at its first update (the model tells heads, head_dim and dtype). One
    class for every layer, made once (transformers is imported lazily): torch.compile guards on
    the layer's type, and a class per layer would compile the attention once per layer."""
    global _STATIC_LAYER
    if _STATIC_LAYER is None:
        from transformers.cache_utils import DynamicLayer

        class StaticRowsLayer(DynamicLayer):
            def __init__(self, slot: _Slot):
                super().__init__()
                self.slot = slot

            def update(self, key_states, value_states, *args, **kwargs):
                slot = self.slot
                if not self.is_initialized or self.keys.numel() == 0:
                    B, H, _, D = key_states.shape
                    C = slot.capacity
                    self.dtype, self.device = key_states.dtype, key_states.device
                    self.keys = key_states.new_zeros((B, H, C, D))
                    self.values = value_states.new_zeros((B, H, C, value_states.shape[-1]))
                    self.is_initialized = True
                self.keys.index_copy_(2, slot.cols, key_states)
                self.values.index_copy_(2, slot.cols, value_states)
                return self.keys[:, :, : slot.view], self.values[:, :, : slot.view]

            def get_seq_length(self) -> int:
                return self.slot.view

        _STATIC_LAYER = StaticRowsLayer
    return _STATIC_LAYER(slot)


class _Graph:
    """A captured verification forward: its own input tensors, the graph and its output."""

    def __init__(self, ids, position_ids, mask, cols):
        self.ids, self.position_ids, self.mask, self.cols = ids, position_ids, mask, cols
        self.graph = None
        self.logits = None  # [rows, W, vocab], rewritten by every replay
        self.normed = None  # [rows, W, n_embd]: the final norm's output, where hidden states are kept


class ByteTokenizer:
    """The Tokenizer protocol for a model with random weights: token t < 256 is the byte t, every
    other token a placeholder "<t>"; the config's end-of-sequence token ends generation. Enough to
    feed prompts and count tokens when only the shape of the model matters (timing)."""

    def __init__(self, vocab_size: int, eos_token_id: int | None = None):
        self.vocab_size = vocab_size
        self.eog_ids = frozenset([] if eos_token_id is None else [int(eos_token_id)])

    def encode(self, text: str, add_special: bool = True, special: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def token_text(self, token: int) -> str:
        return chr(token) if token < 256 else f"<{token}>"

    def token_bytes(self, token: int) -> bytes:
        return bytes([token]) if token < 256 else f"<{token}>".encode()

    def decode(self, tokens: Sequence[int]) -> str:
        return b"".join(self.token_bytes(t) for t in tokens).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict], tools: list | None = None) -> str:
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "

    def max_token_bytes(self) -> int:
        return 1  # encode: a token a byte


def read_config(path: str | os.PathLike) -> dict:
    """A Hugging Face config.json as a dict (keys starting with "_" are our notes, dropped)."""
    import json

    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ModelLoadError(f"cannot read the config {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise ModelLoadError(f"{path} is not JSON: {exc}") from None
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise ModelLoadError(f'{path} is not a Hugging Face config: it needs a "model_type"')
    return {k: v for k, v in raw.items() if not k.startswith("_")}


def load_random_weights(
    config_path: str | os.PathLike,
    device: str = "auto",
    dtype: str = "auto",
    n_ctx: int | None = 4096,
    seed: int = 0,
    threads: int | None = None,
    cache: str = "dynamic",
    graphs: bool = False,
    compile: bool = False,
) -> TransformersModel:
    """A model of the architecture and shape a Hugging Face config.json describes, with random
    weights (the config's initializer) and a ByteTokenizer: for timing any model's forward on any
    device without its weights. Built directly on the device, so a 7B needs no host copy."""
    torch = _torch()
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    if not os.environ.get("SPECDEC_VERBOSE"):
        transformers.logging.set_verbosity_error()
    values = read_config(config_path)
    device = pick_device(device)
    torch_dtype = pick_dtype(dtype, device)
    if threads is not None and device == "cpu":
        torch.set_num_threads(threads)
    try:
        config = AutoConfig.for_model(values.pop("model_type"), **values)
    except (ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"transformers cannot build {config_path}: {exc}") from None
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype, attn_implementation="sdpa")
    name = Path(config_path).stem
    tokenizer = ByteTokenizer(int(model.get_output_embeddings().weight.shape[0]), config.eos_token_id)
    loaded = TransformersModel(
        model,
        tokenizer,
        name=f"{name} (random weights)",
        n_ctx=n_ctx,
        is_instruct=False,
        cache=cache,
        graphs=graphs,
        compile=compile,
    )
    loaded._identity_of = lambda: _digest(f"random {seed}\0{json.dumps(values, sort_keys=True)}")
    return loaded


def load_transformers_model(
    path: str | os.PathLike,
    device: str = "auto",
    dtype: str = "auto",
    n_ctx: int | None = 4096,
    threads: int | None = None,
    name: str | None = None,
    cache: str = "dynamic",
    graphs: bool = False,
) -> TransformersModel:
    """A local transformers folder (config.json + safetensors + tokenizer) or a GGUF file
    (dequantised by transformers' GGUF loader), on `device` in `dtype`, over the `cache` layout
    (with `graphs`, its forwards replayed as CUDA graphs: TransformersModel)."""
    torch = _torch()
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not os.environ.get("SPECDEC_VERBOSE"):  # keep stderr for our own messages
        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    path = Path(path)
    device = pick_device(device)
    check_layout(cache, graphs, device)
    torch_dtype = pick_dtype(dtype, device)
    if threads is not None and device == "cpu":
        torch.set_num_threads(threads)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} has no config.json: give a transformers model folder or a .gguf file")
        where, extra = str(path), {}
    elif path.is_file():
        where, extra = str(path.parent), {"gguf_file": path.name}
    else:
        raise ModelLoadError(f"{path}: no such file or folder")
    try:
        with quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(where, local_files_only=True, **extra)
            model = AutoModelForCausalLM.from_pretrained(
                where, local_files_only=True, dtype=torch_dtype, attn_implementation="sdpa", **extra
            )
    except ImportError as exc:
        raise BackendUnavailableError(f"loading {path.name}: {exc}") from None
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"transformers could not load {path}: {first}") from None
    model.to(device)
    loaded = TransformersModel(model, tokenizer, name=name or path.name, n_ctx=n_ctx, cache=cache, graphs=graphs)
    loaded.path = path  # (an early-exit head's draft model is built from a GGUF target's file)
    # a GGUF is named by its sha256, as llama.cpp names it: a head trained on either serves both
    loaded._identity_of = (lambda: _folder_sha256(path)) if path.is_dir() else (lambda: file_sha256(path))
    return loaded
