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

Rows join a running batch (`add_rows` appends empty rows along the batch axis) and leave it
(`drop_rows` selects the others), so the engine can batch requests that come and go. Row ids are
stable; `_ids` maps each to its index along the batch axis.
"""
from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from ..errors import BackendUnavailableError, ContextOverflowError, ModelLoadError, SpecdecError
from .base import SingleRow
from .numpy_ref import CHAR_TO_BYTE   # GPT-2's byte-level table (numpy_ref imports only numpy)

INSTALL_HINT = ("install PyTorch and transformers: `make torch-deps`, or "
                "`pip install torch transformers gguf accelerate` (CPU: `pip install torch==2.13.0` first)")
DTYPES = ("auto", "float32", "bfloat16", "float16")

# end-of-turn tokens of the common chat formats; eog when the vocabulary has them
_EOG_TEXTS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>",
              "<|end|>", "<|return|>", "</s>")


def _torch():
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError as exc:
        raise BackendUnavailableError(f"the torch backend needs PyTorch and transformers: {INSTALL_HINT}") from exc
    return torch


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
    if dtype == "auto":   # bfloat16 where the hardware has it; float32 on CPU, where it is fastest
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

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special))

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
            elif len(text) == 6 and text.startswith("<0x") and text.endswith(">"):   # SentencePiece byte
                piece = bytes([int(text[3:5], 16)])
            elif "\u2581" in text:                                                   # SentencePiece word
                piece = text.replace("\u2581", " ").encode()
            else:
                piece = self.hf.decode([token]).encode()
            self._bytes[token] = piece
        return piece

    def decode(self, tokens: Sequence[int]) -> str:
        return b"".join(self.token_bytes(t) for t in tokens).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        if not getattr(self.hf, "chat_template", None):
            raise SpecdecError("this model has no chat template; pass --no-chat")
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


class TransformersModel(SingleRow):
    """Implements models.base.RowModel over a transformers causal LM."""

    max_rows = 1 << 16

    def __init__(self, model, tokenizer, name: str = "transformers", n_ctx: int | None = None,
                 is_instruct: bool | None = None):
        torch = _torch()
        self._torch = torch
        self.model = model.eval()
        self.config = model.config
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        if not hasattr(tokenizer, "eog_ids"):      # a transformers tokenizer: wrap it
            gen = getattr(model, "generation_config", None)
            extra = getattr(gen, "eos_token_id", None) or getattr(model.config, "eos_token_id", None)
            tokenizer = HFTokenizer(tokenizer, extra if isinstance(extra, (list, tuple)) else [extra])
        self.tokenizer = tokenizer
        self.name = name
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        limit = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)
        self.n_ctx = min(n_ctx or limit or 4096, limit or n_ctx or 4096)
        self.is_instruct = (bool(getattr(getattr(tokenizer, "hf", None), "chat_template", None))
                            if is_instruct is None else is_instruct)
        text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        types = getattr(text, "layer_types", None) or []
        self._sliding = getattr(text, "sliding_window", None) if "sliding_attention" in types else None
        self._mask_keys = sorted(set(types)) if self._sliding else None
        self._clear()

    def _clear(self) -> None:
        from transformers import DynamicCache

        torch = self._torch
        self._cache = DynamicCache()   # full layers only: sliding windows are applied by the mask
        self._valid = torch.zeros((0, 0), dtype=torch.bool, device=self.device)   # [rows, columns]
        self._pos = torch.zeros((0, 0), dtype=torch.long, device=self.device)     # [rows, columns]
        self._past: list[int] = []     # [rows] tokens in each row's cache
        self._ids: list[int] = []      # [rows] the row id at each batch index
        self._index: dict[int, int] = {}   # row id -> batch index
        self._next_id = 0

    # -- the row protocol ------------------------------------------------------------------

    def add_rows(self, n: int = 1) -> list[int]:
        """n empty rows appended along the batch axis (the running rows keep their caches)."""
        torch = self._torch
        ids = list(range(self._next_id, self._next_id + n))
        self._next_id += n
        L = self._valid.shape[1]
        self._valid = torch.cat([self._valid, torch.zeros((n, L), dtype=torch.bool, device=self.device)])
        self._pos = torch.cat([self._pos, torch.full((n, L), -1, dtype=torch.long, device=self.device)])
        for layer in self._layers():
            pad = lambda t: torch.cat([t, t.new_zeros((n, *t.shape[1:]))])   # noqa: E731
            layer.keys, layer.values = pad(layer.keys), pad(layer.values)
        self._past += [0] * n
        self._ids += ids
        self._index = {row: i for i, row in enumerate(self._ids)}
        return ids

    def drop_rows(self, rows) -> None:
        gone = set(rows)
        keep = [i for i, row in enumerate(self._ids) if row not in gone]
        if len(keep) == len(self._ids):
            return
        if not keep:
            next_id = self._next_id
            self._clear()
            self._next_id = next_id
            return
        index = self._torch.tensor(keep, dtype=self._torch.long, device=self.device)
        if self._valid.shape[1]:
            self._cache.batch_select_indices(index)
        self._valid, self._pos = self._valid[index], self._pos[index]
        self._past = [self._past[i] for i in keep]
        self._ids = [self._ids[i] for i in keep]
        self._index = {row: i for i, row in enumerate(self._ids)}
        self._trim()

    def row_length(self, row: int) -> int:
        return self._past[self._index[row]]

    def width(self, lengths: Sequence[int]) -> int:
        # the rows go through the forward padded to the longest
        return len(lengths) * max(lengths, default=0)

    @property
    def n_rows(self) -> int:
        return len(self._ids)

    def forward_rows(self, tokens, n_logits=None) -> dict[int, np.ndarray]:
        """One padded forward over every row of the batch: row r appends tokens[r] (rows not in
        `tokens` append nothing) and returns the logits of its last n_logits[r] tokens."""
        torch = self._torch
        n_logits = n_logits or {}
        B = self.n_rows
        index = self._index
        lengths = [0] * B
        wants = [0] * B
        for row, row_tokens in tokens.items():
            i = index[row]
            lengths[i] = len(row_tokens)
            wants[i] = min(n_logits.get(row, 0), lengths[i])
            if self._past[i] + lengths[i] > self.n_ctx:
                raise ContextOverflowError(f"the context holds {self.n_ctx} tokens; row {row} would need "
                                           f"{self._past[i] + lengths[i]}")
        empty = np.zeros((0, self.vocab_size), np.float32)
        W = max(lengths, default=0)
        if W == 0:
            return {row: empty for row in n_logits if row in tokens}
        ids = torch.zeros((B, W), dtype=torch.long)                     # [rows, W], right-padded
        pos = torch.full((B, W), -1, dtype=torch.long)                  # [rows, W], -1 = padding
        for row, row_tokens in tokens.items():
            i = index[row]
            if row_tokens:
                ids[i, :len(row_tokens)] = torch.tensor([int(t) for t in row_tokens])
                pos[i, :len(row_tokens)] = torch.arange(self._past[i], self._past[i] + len(row_tokens))
        ids, pos = ids.to(self.device), pos.to(self.device)
        new_valid = pos >= 0
        L = self._valid.shape[1]
        valid = torch.cat([self._valid, new_valid], dim=1)              # [rows, L + W]
        kv_pos = torch.cat([self._pos, pos], dim=1)                     # [rows, L + W]
        # padding queries see only themselves (a fully masked row would give NaN in the cache)
        position_ids = torch.where(new_valid, pos, 0).clamp(max=self.n_ctx - 1)
        mask = self._mask(valid, kv_pos, pos, L)
        # logits only for the columns some row asks for
        need = sorted({c for i in range(B) for c in range(lengths[i] - wants[i], lengths[i])})
        keep = torch.tensor(need or [W - 1], device=self.device)
        with torch.inference_mode():
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=position_ids,
                             past_key_values=self._cache, use_cache=True, logits_to_keep=keep)
        self._cache = out.past_key_values
        self._valid, self._pos = valid, kv_pos
        for i in range(B):
            self._past[i] += lengths[i]
        result = {row: empty for row in n_logits if row in tokens}
        if not need:
            return result
        col = {c: j for j, c in enumerate(need)}
        pairs = [(i, col[c]) for i in range(B) for c in range(lengths[i] - wants[i], lengths[i])]
        index_r = torch.tensor([i for i, _ in pairs], device=self.device)
        index_c = torch.tensor([c for _, c in pairs], device=self.device)
        flat = out.logits[index_r, index_c].float().cpu().numpy()      # [sum(wants), vocab]
        start = 0
        for i in range(B):
            if wants[i]:
                result[self._ids[i]] = flat[start:start + wants[i]]
                start += wants[i]
        return result

    def _mask(self, valid, kv_pos, q_pos, L: int):
        """Additive attention mask [rows, 1, W, L + W] from positions (see the module docstring)."""
        torch = self._torch
        W = q_pos.shape[1]
        allowed = valid[:, None, :] & (kv_pos[:, None, :] <= q_pos[:, :, None])     # [rows, W, L + W]
        diagonal = torch.zeros((W, L + W), dtype=torch.bool, device=self.device)
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
        """Cut row r's cache to its first keep[r] tokens."""
        torch = self._torch
        cut = list(self._past)
        for row, n in keep.items():
            i = self._index[row]
            cut[i] = min(cut[i], n)
        if cut == self._past:
            return
        limit = torch.tensor(cut, device=self.device)
        self._valid &= self._pos < limit[:, None]
        self._past = cut
        self._trim()

    def _layers(self):
        return [layer for layer in self._cache.layers if getattr(layer, "keys", None) is not None
                and layer.keys.numel()]

    def _trim(self) -> None:
        """Drop columns at the end that no row uses; compact when holes take over the cache."""
        torch = self._torch
        used = self._valid.any(dim=0).nonzero()
        end = int(used.max()) + 1 if used.numel() else 0
        if end < self._valid.shape[1]:
            for layer in self._layers():
                layer.keys, layer.values = layer.keys[..., :end, :], layer.values[..., :end, :]
            self._valid, self._pos = self._valid[:, :end], self._pos[:, :end]
        longest = max(self._past, default=0)
        if self._valid.shape[1] > 2 * longest + 64:
            # each row's valid columns first, in order; the rest is padding
            order = torch.sort((~self._valid).to(torch.int8), dim=1, stable=True).indices[:, :longest]
            for layer in self._layers():
                index = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
                layer.keys = torch.gather(layer.keys, 2, index)
                layer.values = torch.gather(layer.values, 2, index)
            self._valid = torch.gather(self._valid, 1, order)
            self._pos = torch.where(self._valid, torch.gather(self._pos, 1, order), -1)

    def cached_keys_values(self, row: int | None = None):
        """The (keys, values) of each layer for a row's valid tokens in position order; for tests."""
        row = self._index[self._solo if row is None else row]
        order = self._pos[row].masked_fill(~self._valid[row], 1 << 60).argsort()[: self._past[row]]
        return [(layer.keys[row][:, order], layer.values[row][:, order]) for layer in self._layers()]


def load_transformers_model(path: str | os.PathLike, device: str = "auto", dtype: str = "auto",
                            n_ctx: int | None = 4096, threads: int | None = None,
                            name: str | None = None) -> TransformersModel:
    """A local transformers folder (config.json + safetensors + tokenizer) or a GGUF file
    (dequantised by transformers' GGUF loader), on `device` in `dtype`."""
    torch = _torch()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import transformers

    if not os.environ.get("SPECDEC_VERBOSE"):   # keep stderr for our own messages
        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    path = Path(path)
    device = pick_device(device)
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
    # the GGUF loader draws its own progress bar on stderr; SPECDEC_VERBOSE=1 shows it
    quiet = contextlib.nullcontext() if os.environ.get("SPECDEC_VERBOSE") else contextlib.redirect_stderr(io.StringIO())
    try:
        with quiet:
            tokenizer = AutoTokenizer.from_pretrained(where, local_files_only=True, **extra)
            model = AutoModelForCausalLM.from_pretrained(where, local_files_only=True, dtype=torch_dtype,
                                                         attn_implementation="sdpa", **extra)
    except ImportError as exc:
        raise BackendUnavailableError(f"loading {path.name}: {exc}") from None
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"transformers could not load {path}: {first}") from None
    model.to(device)
    return TransformersModel(model, tokenizer, name=name or path.name, n_ctx=n_ctx)
