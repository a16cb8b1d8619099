"""GGUF models through llama.cpp's low-level C API (llama-cpp-python's ctypes bindings).

We drive `llama_decode` with our own batch so that logits are computed and copied only for the
tokens verification needs (a plain step: 1; a prefill: none; a speculative step: k + 1), and roll
the KV cache back with `llama_memory_seq_rm`.

Rows are llama.cpp sequences (seq_id 0 .. max_rows - 1) in one context, the way llama-server's
slots share theirs: one `llama_batch` carries every row's tokens at the row's own positions with
its seq_id, so a step over many rows is one `llama_decode`. Where trees are drafted (`trees`, the
default) the KV cache is unified: all rows draw cells from one pool of max_rows x n_ctx, so a
tree's nodes can share cells across the sequences of its leaves. Without trees each row has a
stream of n_ctx cells of its own, as llama-server's slots have: a step over many rows then reads
only each row's own cells, where in one pool every row's attention spans every row's cells
(llama-batched-bench, 8 rows 450 deep: 242 ms a step with streams, 272 in one pool).

The exact mode (exact=True) makes every row's logits from a forward of W tokens bit-identical to a
one-token forward's at the same position, alone or beside other rows, so speculative greedy IS plain
greedy. What differs otherwise, found op by op with the eval callback (docs/guide/exact.md):
  - ggml's tiled K-quant matmul takes over at 8 or more rows and sums a block's floats in another
    order than the one-row dot products; llamafile's sgemm multiplies the f16 attention matrices
    for 2 or more rows and ggml's dot products for one: a patched build
    (scripts/install_llama_cpp.py --exact) whose Q4_K/Q6_K dot products end each block as the
    tiled kernel does, without the sgemm, loaded through llama-cpp-python's LLAMA_CPP_LIB_PATH, so
    a process is exact or not from its first model on;
  - flash attention splits the cache across threads for one query row (deep contexts) and tiles
    64 or more: off, attention is a plain product and softmax per row;
  - the repacked weight buffers have their own one-row and many-row kernels: off;
  - in a unified cache a row's cells interleave with other rows', which changes the order of the
    attention sums: one cache stream per row instead (n_ctx cells each).
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from ..errors import BackendUnavailableError, ContextOverflowError, ModelLoadError, SpecdecError
from ..paths import specdec_home
from .base import (
    SavedRow,
    SingleRow,
    check_tree_fits,
    check_tree_path,
    file_sha256,
    packed,
    path_hidden,
    tree_depths,
    trim_hidden,
)
from .hugepages import HugePages

INSTALL_HINT = "install it built for this CPU with `python scripts/install_llama_cpp.py` (or `make setup`)"
EXACT_HINT = "build it once with `python scripts/install_llama_cpp.py --exact` (or `make exact`; about 8 minutes)"

# scripts/install_llama_cpp.py's EXACT_BUILD: which patch of the exact build this code expects
EXACT_BUILD = "tiled1"

# Sequence ids lent to tree forwards (forward_tree_rows): one per leaf of the trees in flight.
TREE_SEQS = 64

_llama = None  # the llama_cpp module, imported on first use
_exact: bool | None = None  # whether this process loaded the exact build (decided on first use)
_log_callback = None  # kept alive: llama.cpp holds a pointer to it


def exact_lib_dir() -> Path:
    """Where scripts/install_llama_cpp.py --exact puts the exact build of the installed version."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("llama-cpp-python")
    except PackageNotFoundError as exc:
        raise BackendUnavailableError(f"llama-cpp-python is not installed: {INSTALL_HINT}") from exc
    return specdec_home() / "llama-exact" / f"{installed}-{EXACT_BUILD}" / "lib"


def _maps_from(lib_dir: Path) -> bool:
    """Whether this process runs ggml's CPU kernels from lib_dir (Linux: /proc/self/maps; True
    where that cannot be read)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return True
    mapped = {line.split()[-1] for line in maps.splitlines() if "libggml-cpu" in line}
    return all(Path(m).parent == lib_dir for m in mapped)


def _lib(exact: bool | None = None):
    """llama_cpp, imported once per process: the exact build if the first caller asks for it.
    `exact` None: whichever build is loaded (the default one if none is yet)."""
    global _llama, _log_callback, _exact
    if _llama is not None:
        if exact is not None and exact != _exact:
            loaded = "the exact mode's build" if _exact else "the default build"
            raise SpecdecError(
                f"this process already loaded {loaded} of llama.cpp; exact and default models "
                f"cannot share a process: run the {'exact' if exact else 'default'} one in its own"
            )
        return _llama
    if exact:
        lib_dir = exact_lib_dir()
        if not (lib_dir / "libllama.so").is_file():
            raise BackendUnavailableError(
                f"the exact mode needs its own build of llama.cpp, and {lib_dir} has none: {EXACT_HINT}"
            )
        os.environ["LLAMA_CPP_LIB_PATH"] = str(lib_dir)
    try:
        import llama_cpp
    except ImportError as exc:
        raise BackendUnavailableError(f"llama-cpp-python is not installed: {INSTALL_HINT}") from exc
    if exact and not _maps_from(lib_dir):
        raise SpecdecError(
            "llama.cpp was loaded in this process before the exact mode asked for its own build: "
            "run the exact mode in a fresh process"
        )
    llama_cpp.llama_backend_init()
    if not os.environ.get("SPECDEC_VERBOSE"):
        # llama.cpp logs every tensor at load; keep stderr for our own messages.
        _log_callback = llama_cpp.llama_log_callback(lambda level, text, data: None)
        llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p())
    _llama, _exact = llama_cpp, bool(exact)
    return _llama


def default_threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS
        return max(1, os.cpu_count() or 1)


class _Handles:
    """What one loaded model holds in llama.cpp (the model with its vocabulary, the context with its
    cache, the batch), freed together and once: at LlamaCppModel.close(), else when the last
    Python object that points into them is gone. The model and its tokenizer both hold this, so a
    tokenizer kept after its model was dropped still works (the vocabulary it reads lives as long
    as it does), and anything used after close() raises a SpecdecError instead of reading freed
    memory (a segfault, exit 139)."""

    def __init__(self, name: str):
        self.name = name
        self.model = self.ctx = self.mem = self.batch = None
        self.closed = False

    def alive(self) -> None:
        if self.closed:
            raise SpecdecError(f"{self.name} was closed: load the model again to use it (or its tokenizer)")

    def free(self) -> None:
        if self.closed:
            return
        self.closed = True
        lib = _llama
        if lib is None:
            return
        if self.batch is not None:
            lib.llama_batch_free(self.batch)
        if self.ctx:
            lib.llama_free(self.ctx)
        if self.model:
            lib.llama_model_free(self.model)
        self.model = self.ctx = self.mem = self.batch = None

    def __del__(self):
        try:
            self.free()
        except Exception:
            pass


class LlamaTokenizer:
    """The GGUF's own vocabulary, through llama.cpp. It holds its model's handles (_Handles), so it
    stays usable however long it outlives the LlamaCppModel object, until that model's close()."""

    def __init__(self, handles: _Handles, vocab):
        self._lib = _lib()
        self._handles, self._vocab_ptr = handles, vocab
        self.n_vocab = self._lib.llama_vocab_n_tokens(vocab)
        self.eog_ids = frozenset(t for t in range(self.n_vocab) if self._lib.llama_vocab_is_eog(vocab, t))
        self._bytes: dict[int, bytes] = {}

    @property
    def _vocab(self):
        self._handles.alive()
        return self._vocab_ptr

    @property
    def _model(self):
        self._handles.alive()
        return self._handles.model

    def encode(self, text: str, add_special: bool = True, special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        size = len(data) + 16
        while True:
            buf = (self._lib.llama_token * size)()
            n = self._lib.llama_tokenize(self._vocab, data, len(data), buf, size, add_special, special)
            if n >= 0:
                return list(buf[:n])
            size = -n

    def token_bytes(self, token: int) -> bytes:
        piece = self._bytes.get(token)
        if piece is None:
            buf = ctypes.create_string_buffer(64)
            n = self._lib.llama_token_to_piece(self._vocab, token, buf, 64, 0, False)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = self._lib.llama_token_to_piece(self._vocab, token, buf, -n, 0, False)
            piece = self._bytes[token] = buf.raw[:n]
        return piece

    def decode(self, tokens: Sequence[int]) -> str:
        return b"".join(self.token_bytes(t) for t in tokens).decode("utf-8", errors="replace")

    def token_text(self, token: int) -> str:
        return self._lib.llama_vocab_get_text(self._vocab, token).decode("utf-8", errors="replace")

    def max_token_bytes(self) -> int | None:
        return self._longest_token

    @functools.cached_property
    def _longest_token(self) -> int | None:
        """Tokenizer.max_token_bytes. Byte-level BPE and SentencePiece only: llama.cpp's WordPiece
        and Unigram vocabularies normalize the text first (lowercase, NFKC), and a token that
        strips the whitespace beside it (LSTRIP / RSTRIP) swallows any amount of it. A special
        token stands for its spelling (parsed in text); any other for the bytes it prints, at
        most its vocabulary text's length (byte-level BPE writes a byte as one or two bytes,
        SentencePiece a space as three), so only the tokens whose text is longer than the
        longest print so far are printed: a few of 150 000, in about 0.2 s all told."""
        lib, vocab = self._lib, self._vocab
        if lib.llama_vocab_type(vocab) not in (lib.LLAMA_VOCAB_TYPE_BPE, lib.LLAMA_VOCAB_TYPE_SPM):
            return None
        strips = lib.LLAMA_TOKEN_ATTR_LSTRIP | lib.LLAMA_TOKEN_ATTR_RSTRIP
        special = lib.LLAMA_TOKEN_ATTR_CONTROL | lib.LLAMA_TOKEN_ATTR_USER_DEFINED | lib.LLAMA_TOKEN_ATTR_UNKNOWN
        longest, others = 0, []
        for token in range(self.n_vocab):
            attr = lib.llama_vocab_get_attr(vocab, token)
            if attr & strips:
                return None
            size = len(lib.llama_vocab_get_text(vocab, token))
            if attr & special:
                longest = max(longest, size)
            else:
                others.append((size, token))
        others.sort(reverse=True)
        for size, token in others:
            if size <= longest:
                break
            longest = max(longest, len(self.token_bytes(token)))
        return longest

    def apply_chat_template(self, messages: list[dict], tools: list | None = None) -> str:
        """The GGUF's own template, rendered as transformers and llama-server render it (models.chat)."""
        from .chat import render

        template = self._lib.llama_model_chat_template(self._model, None)
        if template is None:
            raise SpecdecError("this model has no chat template in its GGUF; use --no-chat")
        return render(template.decode("utf-8"), messages, *map(self._special_text, ("bos", "eos")), tools=tools)

    def _special_text(self, kind: str) -> str:
        token = getattr(self._lib, f"llama_vocab_{kind}")(self._vocab)
        return self.token_text(token) if token >= 0 else ""


class LlamaCppModel(SingleRow):
    """A GGUF model whose KV cache holds up to `max_rows` sequences. Implements models.base.RowModel.
    `huge_pages`: ask Linux for 2 MiB pages for the memory llama.cpp takes (hugepages.py): a
    longer load for a slightly faster token; the output is the same either way."""

    @property
    def llama_model(self):
        """llama.cpp's model handle (RowModel.llama_model)."""
        return self._h.model

    def __init__(
        self,
        path: str | os.PathLike,
        n_ctx: int = 4096,
        n_threads: int | None = None,
        n_batch: int = 512,
        n_gpu_layers: int = 0,
        max_rows: int = 1,
        exact: bool = False,
        trees: bool = True,
        huge_pages: bool = False,
    ):
        lib = _lib(exact)
        self.exact = exact
        self.exact_build = EXACT_BUILD if exact else None  # keys cached cost curves (costs._cache_file)
        # one pool of cells for every row, which trees need (module docstring); the exact mode and
        # a model told it will score no trees keep a stream per row instead
        pooled = trees and not exact
        self.scores_trees = pooled  # forward_tree_rows (rows' own streams share no cells)
        # a stream of its own per row: a finished row's cache can stay for a later prompt that
        # starts the same way (Engine prefix_cache) without taking cells from the running rows
        self.keeps_idle_rows = not pooled
        self.saves_rows = True  # save_row / load_row (llama_state_seq_*)
        self.grows_trees = True  # grow_tree_rows (a tree's new nodes on the cells of its earlier ones)
        self.path = Path(path)
        _check_gguf_header(self.path)
        self.name = self.path.name
        self.n_threads = n_threads or default_threads()
        if max_rows < 1:
            raise SpecdecError(f"a model needs room for at least one row, got max_rows={max_rows}")

        if n_gpu_layers and not lib.llama_supports_gpu_offload():
            raise SpecdecError(
                f"--gpu-layers {n_gpu_layers}: this llama-cpp-python was built for the CPU only; build it "
                "with CUDA (python scripts/install_llama_cpp.py --cuda, where nvcc is), or drop --gpu-layers"
            )
        self.n_gpu_layers = n_gpu_layers
        mparams = lib.llama_model_default_params()
        mparams.n_gpu_layers = n_gpu_layers
        if exact:
            mparams.use_extra_bufts = False  # no repacked weights: one kernel for any number of rows
        self.huge_pages = HugePages() if huge_pages else None
        if self.huge_pages is not None:  # mparams keeps the callback alive through the load
            mparams.progress_callback = self.huge_pages.progress_callback(lib)
        self._h = _Handles(self.name)
        self._h.model = lib.llama_model_load_from_file(str(self.path).encode(), mparams)
        if not self._h.model:
            raise ModelLoadError(
                f"llama.cpp could not load {self.path}: the GGUF file is corrupt, "
                f"truncated or of an unsupported architecture"
            )
        cparams = lib.llama_context_default_params()
        streams = max_rows + 1  # + the one-sequence calls' own (models.base.SingleRow)
        # not pooled: a stream of n_ctx cells per sequence, so a row's cells never interleave with
        # another's (the exact mode: the order of the attention sums stays a row's own)
        cparams.n_ctx = n_ctx * (max_rows if pooled else streams)
        cparams.n_batch = cparams.n_ubatch = min(n_batch, n_ctx)
        # a pool lends up to TREE_SEQS more sequence ids to trees (llama.cpp aborts where n_seq_max
        # exceeds n_batch); streams cannot share cells, so they have none
        tree_seqs = max(0, min(TREE_SEQS, cparams.n_batch - streams)) if pooled else 0
        cparams.n_seq_max = streams + tree_seqs
        cparams.kv_unified = pooled  # one pool of cells: a row is not limited to n_ctx / max_rows
        if exact:
            cparams.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cparams.n_threads = cparams.n_threads_batch = self.n_threads
        cparams.pooling_type = lib.LLAMA_POOLING_TYPE_NONE  # hidden states (keep_hidden) per token
        cparams.swa_full = True  # sliding-window layers (Gemma 3) must keep what rollback returns to
        self._h.ctx = lib.llama_init_from_model(self._model, cparams)
        if not self._h.ctx:
            self._h.free()
            raise ModelLoadError(
                f"llama.cpp could not create a context of {n_ctx} tokens x {max_rows} rows for {self.path}"
            )
        self._h.mem = lib.llama_get_memory(self._ctx)
        if self.huge_pages is not None:
            self.huge_pages.collapse()  # the KV cache and compute buffers, cleared as they were made
        # llama.cpp pads the context to a multiple of 256 (--ctx 32 would hold 256): honour what was asked
        self.n_ctx = min(n_ctx, lib.llama_n_ctx(self._ctx) // (max_rows if pooled else streams))
        self.max_rows = max_rows
        self.n_batch = cparams.n_batch
        self._h.batch = lib.llama_batch_init(self.n_batch, 0, max(1, tree_seqs))
        self._tree_free = list(range(streams + tree_seqs - 1, streams - 1, -1))
        self._trees: dict[int, tuple[int, tuple[int, ...], list[list[int]]]] = {}  # row -> forward_tree_rows
        vocab = lib.llama_model_get_vocab(self._model)
        self.tokenizer = LlamaTokenizer(self._h, vocab)
        self.vocab_size = self.tokenizer.n_vocab
        self._free = list(range(max_rows - 1, -1, -1))  # seq ids not in use, next one last
        self._len: dict[int, int] = {}  # row (seq id) -> tokens in its cache
        self.n_embd = lib.llama_model_n_embd(self._model)
        self._hidden: dict[int, tuple[int, np.ndarray]] | None = None  # row -> kept (keep_hidden)
        general_name = self.metadata("general.name") or self.name
        self.description = general_name
        self.is_instruct = any(w in general_name.lower() for w in ("instruct", "-it", " it", "chat"))

    def metadata(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(512)
        n = _lib().llama_model_meta_val_str(self._model, key.encode(), buf, 512)
        return buf.value.decode("utf-8", errors="replace") if n >= 0 else None

    # -- the row protocol ------------------------------------------------------------------

    def add_rows(self, n: int = 1) -> list[int]:
        if n > len(self._free):
            raise SpecdecError(
                f"{self.name} holds {self.max_rows} rows at once and {self.max_rows - len(self._free)} "
                f"are in use; load it with more rows (max_rows, --batch-size)"
            )
        # the lowest free seq ids: streams decode rows in one pass only while their seq ids run
        # without a gap (forward_rows)
        self._free.sort(reverse=True)
        rows = [self._free.pop() for _ in range(n)]
        for row in rows:
            self._len[row] = 0
        return rows

    def _new_solo_row(self) -> int:
        self._len[self.max_rows] = 0
        return self.max_rows

    def drop_rows(self, rows) -> None:
        for row in rows:
            self._end_tree(row)
            if self._hidden is not None:
                self._hidden.pop(row, None)
            if self._len.pop(row, None) is not None:
                _lib().llama_memory_seq_rm(self._mem, row, -1, -1)
                if row != self.max_rows:  # the reserved one-sequence row is not lent
                    self._free.append(row)

    def row_length(self, row: int) -> int:
        return self._len[row]

    def save_row(self, row: int) -> SavedRow:
        """The row's cells copied to host memory (llama_state_seq_get_data), as llama-server's
        prompt cache keeps a slot's."""
        lib = _lib()
        self._end_tree(row)
        size = lib.llama_state_seq_get_size(self._ctx, row)
        buf = (ctypes.c_uint8 * size)()
        if lib.llama_state_seq_get_data(self._ctx, buf, size, row) != size:
            raise SpecdecError(f"llama.cpp could not copy row {row}'s cache ({size} bytes)")
        return SavedRow(self._len[row], size, buf)

    def load_row(self, row: int, saved: SavedRow) -> None:
        """The row's cache becomes the saved one (llama_state_seq_set_data, into the row's own
        cells); where llama.cpp cannot place it, the row is left empty and SpecdecError says so."""
        lib = _lib()
        self._end_tree(row)
        if self._hidden is not None:
            self._hidden.pop(row, None)
        if lib.llama_state_seq_set_data(self._ctx, saved.data, saved.nbytes, row) == 0:
            lib.llama_memory_seq_rm(self._mem, row, -1, -1)
            self._len[row] = 0
            raise SpecdecError(f"llama.cpp could not restore a saved cache of {saved.length} tokens into row {row}")
        self._len[row] = saved.length

    def passes(self, fed: Mapping[int, int]) -> list[int]:
        return stream_passes(fed, self.n_batch) if not self.scores_trees else packed(fed)

    def forward_rows(self, tokens, n_logits=None) -> dict[int, np.ndarray]:
        n_logits = n_logits or {}
        if not self.scores_trees:
            # streams: llama.cpp splits a batch into passes at every seq id that is not the last
            # one + 1 (its split_equal, sequential), so rows go in seq id order; a pool takes any
            tokens = dict(sorted(tokens.items()))
        # every (row, position, token, wants logits) of the forward, row after row
        items = []
        for row, row_tokens in tokens.items():
            self._end_tree(row)
            past = self._len[row]
            if past + len(row_tokens) > self.n_ctx:
                raise ContextOverflowError(
                    f"{past + len(row_tokens)} tokens do not fit in the context of {self.n_ctx}; raise --ctx"
                )
            first_out = len(row_tokens) - min(n_logits.get(row, 0), len(row_tokens))
            items += [((row,), past + i, token, i >= first_out) for i, token in enumerate(row_tokens)]
        # streams: a forward longer than one call goes a pass of llama.cpp's split a call
        long = not self.scores_trees and len(items) > self.n_batch
        flat, states = self._decode(items, self._stream_calls(tokens) if long else None)
        for row, row_tokens in tokens.items():
            self._len[row] += len(row_tokens)
        result, at = {}, 0
        for row, row_tokens in tokens.items():  # outputs come in batch order: row after row
            n = min(n_logits.get(row, 0), len(row_tokens))
            if row in n_logits:
                result[row] = flat[at : at + n] if n else np.empty((0, self.vocab_size), np.float32)
            if n and states is not None:
                self._hidden[row] = (self._len[row] - n, states[at : at + n])
            at += n
        return result

    def _stream_calls(self, tokens: Mapping[int, Sequence[int]]) -> list[list[int]]:
        """The llama_decode calls (indices into forward_rows' items, row after row) of a forward over
        streams that does not fit one call of n_batch tokens: a call per pass of equal_splits, so
        that its passes are those one call of it all would make, as llama-server's are (cut into
        calls of n_batch tokens in row order, prompts of 330 and 345 tokens went as passes of 364,
        148 and 163 tokens, not 512, 148 and 15, and read 1.3% slower here)."""
        fed = {row: len(row_tokens) for row, row_tokens in tokens.items()}
        start, at = {}, 0
        for row, n in fed.items():
            start[row], at = at, at + n
        calls = []
        for split in equal_splits(fed, self.n_batch):
            calls.append([i for row, n in split for i in range(start[row], start[row] + n)])
            for row, n in split:
                start[row] += n
        return calls

    def _decode(self, items, calls: list[list[int]] | None = None) -> tuple[np.ndarray | None, np.ndarray | None]:
        """One forward of items (seq ids, position, token, wants logits), in `calls` (lists of item
        indices, each at most n_batch; by default n_batch items a call, in order): the logits of the
        tokens that want them, in the items' order, and their hidden states (keep_hidden)."""
        lib = _lib()
        outputs: list[np.ndarray] = []
        hidden: list[np.ndarray] = []
        order: list[np.ndarray] = []  # with planned calls: the item index of each output
        batch = self._batch
        planned = calls is not None
        if calls is None:
            n = len(items)
            calls = [range(start, min(start + self.n_batch, n)) for start in range(0, n, self.n_batch)]
        for call in calls:
            chunk = [items[i] for i in call]
            for i, (seqs, pos, token, wants) in enumerate(chunk):
                batch.token[i] = token
                batch.pos[i] = pos
                batch.n_seq_id[i] = len(seqs)
                for j, seq in enumerate(seqs):
                    batch.seq_id[i][j] = seq
                batch.logits[i] = wants
            batch.n_tokens = len(chunk)
            rc = lib.llama_decode(self._ctx, batch)
            if rc == 1:
                raise ContextOverflowError(
                    f"the KV cache of {self.max_rows} x {self.n_ctx} tokens is full "
                    f"({len(self._len)} rows hold {sum(self._len.values())}); raise --ctx"
                )
            if rc != 0:
                raise RuntimeError(f"llama_decode failed with code {rc} ({len(chunk)} tokens, {len(self._len)} rows)")
            wanted = np.array([wants for *_, wants in chunk], dtype=bool)
            if not wanted.any():
                continue
            # with embeddings on (keep_hidden), llama.cpp outputs every token of the batch (its
            # output_all) whatever batch.logits says: keep the rows asked for
            every = self._hidden is not None
            ptr = lib.llama_get_logits(self._ctx)
            logits = np.ctypeslib.as_array(ptr, shape=(len(chunk) if every else int(wanted.sum()), self.vocab_size))
            outputs.append(logits[wanted] if every else logits.copy())
            if every:
                ptr = lib.llama_get_embeddings(self._ctx)  # the final norm's output, per token
                hidden.append(np.ctypeslib.as_array(ptr, shape=(len(chunk), self.n_embd))[wanted])
            if planned:
                order.append(np.asarray(call)[wanted])
        flat = (np.concatenate(outputs) if len(outputs) > 1 else outputs[0]) if outputs else None
        states = np.concatenate(hidden) if hidden else None
        if len(order) > 1:  # calls interleave rows: back to the items' order
            back = np.argsort(np.concatenate(order), kind="stable")
            flat, states = flat[back], (states[back] if states is not None else None)
        return flat, states

    # -- trees: one forward over each row's tree of drafts (models.base.SequentialRows' calls) --

    def forward_tree_rows(self, trees) -> dict[int, np.ndarray]:
        """Each row's tree (tokens, parents: -1 under the row's last token, else an earlier node)
        in one llama_decode; every node's logits per row. Each leaf gets a sequence id of its own
        holding a copy of the row (llama.cpp shares the cells) and each node belongs to the
        sequences of the leaves below it, at the position of its depth: a node then attends to
        the row and its own ancestors, as a chain of its path would. keep_path_rows follows."""
        if not self.scores_trees:
            raise SpecdecError(
                "tree drafts need one pool of cache cells (the default build, loaded with trees=True): "
                "this model keeps one cache stream per row, and a tree's nodes share cells across sequences"
            )
        lib = _lib()
        plans = {}  # row -> (depth, leaves): every row checked before any id is lent or given back
        for row, (tokens, parents) in trees.items():
            depth = tree_depths(parents)
            check_tree_fits(tokens, parents, depth, self._len[row], self.n_ctx)
            plans[row] = (depth, sorted(set(range(len(tokens))) - set(parents)))
        held = sum(len(self._tree_ids(row)) for row in trees)
        free, wanted = len(self._tree_free) + held, sum(len(leaves) for _, leaves in plans.values())
        if wanted > free:  # the rows' own trees would come back: nothing else changed
            raise SpecdecError(f"trees in flight may have {free} more leaves; these have {wanted}")
        items, layout = [], []
        for row, (tokens, parents) in trees.items():
            self._end_tree(row)
            depth, leaves = plans[row]
            past = self._len[row]
            node_seqs: list[list[int]] = [[] for _ in tokens]
            for leaf in leaves:
                seq = self._tree_free.pop()
                lib.llama_memory_seq_rm(self._mem, seq, -1, -1)
                lib.llama_memory_seq_cp(self._mem, row, seq, -1, -1)
                node = leaf
                while node >= 0:
                    node_seqs[node].append(seq)
                    node = parents[node]
            self._trees[row] = (past, tuple(parents), node_seqs, None)
            items += [(tuple(node_seqs[i]), past + int(depth[i]), t, True) for i, t in enumerate(tokens)]
            layout.append((row, len(tokens)))
        flat, states = self._decode(items)
        out, at = {}, 0
        for row, n in layout:
            out[row] = flat[at : at + n]
            if states is not None:  # the nodes' states: keep_path_rows keeps its path's (heads read them)
                self._trees[row] = (*self._trees[row][:3], states[at : at + n])
            at += n
        return out

    def grow_tree_rows(self, trees) -> dict[int, np.ndarray]:
        """Each row's tree grown by new nodes (tokens, parents: -1 under the row's last token,
        else a node of the row's tree so far, numbered on from its last), in one llama_decode; the
        new nodes' logits per row. A row with no tree in flight starts one. Only the new nodes are
        computed: a drafter growing its tree best first (drafters.model) pays for each node once,
        where forward_tree_rows would score the whole tree again. A node gets the sequence id of
        its parent where it is the parent's first child (the root's children each a new one, the
        row's own id holds the context only), else a new id holding a copy of its parent's path
        (llama.cpp shares the cells); each id then holds the row and one path down the tree.
        keep_path_rows follows, as after forward_tree_rows."""
        if not self.scores_trees:
            raise SpecdecError("tree drafts need one pool of cache cells (the default build, loaded with trees=True)")
        lib = _lib()
        plans = {}  # row -> (past, parents, depth, the tree's node_seqs so far, which new nodes need an id)
        for row, (tokens, new_parents) in trees.items():
            past, parents, node_seqs, states = self._trees.get(row) or (self._len[row], (), [], None)
            if states is not None:
                raise SpecdecError("a tree with hidden states kept cannot grow (forward_tree_rows scores it whole)")
            parents = (*parents, *new_parents)
            depth = tree_depths(parents)
            check_tree_fits(tokens, new_parents, depth, past, self.n_ctx)
            has_child = {p for p in parents[: len(node_seqs)] if p >= 0}
            needs = []
            for parent in new_parents:  # a first child goes on down its parent's id; others take one
                needs.append(parent < 0 or parent in has_child)
                has_child.add(parent)
            plans[row] = (past, parents, depth, node_seqs, needs)
        wanted = sum(sum(plan[4]) for plan in plans.values())
        if wanted > len(self._tree_free):  # before any id is lent: nothing half-grown
            free = len(self._tree_free)
            raise SpecdecError(f"trees in flight may have {free} more sequence ids; these need {wanted}")
        items, layout = [], []
        for row, (tokens, _) in trees.items():
            past, parents, depth, node_seqs, needs = plans[row]
            node_seqs = [list(seqs) for seqs in node_seqs]
            first = len(node_seqs)
            for i, need in enumerate(needs):
                parent = parents[first + i]
                if not need:
                    seq = node_seqs[parent][0]
                else:
                    seq = self._tree_free.pop()
                    lib.llama_memory_seq_rm(self._mem, seq, -1, -1)
                    # the row and the parent's path (the cells of its id before the parent's children)
                    src, end = (row, -1) if parent < 0 else (node_seqs[parent][0], past + int(depth[parent]) + 1)
                    lib.llama_memory_seq_cp(self._mem, src, seq, -1, end)
                node_seqs.append([seq])
            self._trees[row] = (past, parents, node_seqs, None)
            items += [((node_seqs[first + i][0],), past + int(depth[first + i]), t, True) for i, t in enumerate(tokens)]
            layout.append((row, len(tokens)))
        flat = self._decode(items)[0] if items else None
        out, at = {}, 0
        for row, n in layout:
            out[row] = flat[at : at + n] if n else np.empty((0, self.vocab_size), np.float32)
            at += n
        return out

    @property
    def tree_leaves(self) -> int:
        """Leaves the next forward_tree_rows may hold over all its trees (a sequence id each)."""
        return len(self._tree_free) + sum(len(self._tree_ids(row)) for row in self._trees)

    def keep_path_rows(self, paths) -> None:
        """Per row, after forward_tree_rows: keep the row and the path's nodes (root first, each
        the parent of the next), which take the positions after the row's last token; the tree's
        other nodes and its sequence ids go."""
        lib = _lib()
        for row, path in paths.items():
            if row not in self._trees:
                raise ValueError(f"row {row} has no tree to keep a path of (keep_path_rows follows forward_tree_rows)")
            past, parents, node_seqs, states = self._trees[row]
            check_tree_path(parents, path)
            if path:
                leaf_seq = node_seqs[path[-1]][0]  # a leaf under the path's end: its sequence holds the path
                end = past + len(path)
                lib.llama_memory_seq_rm(self._mem, leaf_seq, end, -1)
                lib.llama_memory_seq_cp(self._mem, leaf_seq, row, past, end)
                self._len[row] = end
            self._end_tree(row)
            if self._hidden is not None:
                self._hidden[row] = path_hidden(self._hidden.get(row), states, past, path, self.n_embd)

    def _tree_ids(self, row: int) -> set[int]:
        """The sequence ids the row's tree in flight holds (none without one)."""
        tree = self._trees.get(row)
        return {seq for seqs in tree[2] for seq in seqs} if tree is not None else set()

    def _end_tree(self, row: int) -> None:
        """Give back the sequence ids of the row's tree, if it has one (its kept path is the row's)."""
        for seq in self._tree_ids(row):
            _lib().llama_memory_seq_rm(self._mem, seq, -1, -1)
            self._tree_free.append(seq)
        self._trees.pop(row, None)

    # -- hidden states (models.base.HiddenStates), for trained heads ------------------------

    @property
    def identity(self) -> str:
        return file_sha256(self.path)

    def keep_hidden(self) -> None:
        if self._hidden is None:
            lib = _lib()
            lib.llama_set_embeddings(self._ctx, True)  # pooling none: one vector per output token
            self._hidden = {}

    def hidden_rows(self, rows) -> dict[int, tuple[int, np.ndarray]]:
        kept = self._hidden or {}
        return {row: kept.get(row) or trim_hidden(None, self._len[row], self.n_embd) for row in rows}

    def head_weights(self, name: str, tokens: np.ndarray) -> np.ndarray:
        import gguf

        tensors = {t.name: t for t in gguf.GGUFReader(self.path).tensors}
        # a model whose output head is tied to its embedding has no output.weight
        key = "output.weight" if name == "output" and "output.weight" in tensors else "token_embd.weight"
        tensor = tensors[key]
        rows = np.asarray(tensor.data)[np.asarray(tokens)]  # [n, bytes or n_embd]: quantised rows stay packed
        return gguf.quants.dequantize(rows, tensor.tensor_type).astype(np.float32).reshape(len(tokens), self.n_embd)

    def rollback_rows(self, keep) -> None:
        for row, n_keep in keep.items():
            self._end_tree(row)
            if n_keep >= self._len[row]:
                continue
            if not _lib().llama_memory_seq_rm(self._mem, row, n_keep, -1):
                raise RuntimeError(f"llama.cpp could not cut row {row}'s KV cache to {n_keep} tokens")
            self._len[row] = n_keep
            if self._hidden:  # the cut positions' states go too: new tokens may take those positions
                self._hidden[row] = trim_hidden(self._hidden.get(row), n_keep, self.n_embd)

    # llama.cpp's objects, through the handles (_Handles): a SpecdecError once closed
    @property
    def _model(self):
        self._h.alive()
        return self._h.model

    @property
    def _ctx(self):
        self._h.alive()
        return self._h.ctx

    @property
    def _mem(self):
        self._h.alive()
        return self._h.mem

    @property
    def _batch(self):
        self._h.alive()
        return self._h.batch

    def close(self) -> None:
        """Free the model's memory now (else when it and its tokenizer are gone); any later use of
        either raises a SpecdecError."""
        handles = getattr(self, "_h", None)
        if handles is not None:
            handles.free()

    def __repr__(self) -> str:
        return f"LlamaCppModel({self.name!r}, n_ctx={self.n_ctx}, rows={self.max_rows}, threads={self.n_threads})"


def _check_gguf_header(path: Path) -> None:
    """Fail fast, and clearly, on what llama.cpp would reject with pages of log."""
    from ..errors import ModelNotFoundError

    if not path.is_file():
        raise ModelNotFoundError(f"model file not found: {path}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(f"{path} is not a GGUF file (it starts with {magic!r}, not b'GGUF')")


def stream_passes(fed: Mapping[int, int], n_batch: int) -> list[int]:
    """The widths of the passes llama.cpp makes of a forward over per-row streams (forward_rows feeds
    them as equal_splits plans them)."""
    return [sum(n for _, n in split) for split in equal_splits(fed, n_batch)]


def equal_splits(fed: Mapping[int, int], n_ubatch: int) -> list[list[tuple[int, int]]]:
    """llama.cpp's split_equal (sequential) of one llama_decode holding fed[row] tokens of each row,
    rows in seq id order: each pass takes the run of consecutive seq ids that starts at the first
    row with tokens left, and from each row of it the same count (the least any of them has left,
    at most n_ubatch / rows); a pass as [(row, tokens)]. So uneven rows cost more passes than their
    sum's width: 9,1,1,1 tokens are a pass of 4 and one of 8; rows 0, 1 and 3 a pass of 2 and one
    of 1; two rows of 450 two passes of 256 + 256 and 194 + 194, where two llama_decode calls of
    n_ubatch tokens each (450 + 62, then 388) would make three."""
    left = {row: n for row, n in sorted(fed.items()) if n > 0}
    out = []
    while left:
        rows = list(left)
        run = [rows[0]]
        for row in rows[1:]:
            if row == run[-1] + 1:
                run.append(row)
        each = max(1, min(min(left[row] for row in run), n_ubatch // len(run)))
        out.append([(row, each) for row in run])
        for row in run:
            left[row] -= each
            if left[row] == 0:
                del left[row]
    return out
