"""GPT-2's byte-level BPE tokenizer, read from a GGUF's vocabulary and merges, with the model's
pre-tokenizer regex and its special tokens: the NumPy backend's tokenizer (models/numpy_ref.py),
and GPT-2's byte table the transformers backend decodes with (models/transformers.py).

Needs nothing but the standard library (and the `regex` module when it is installed).
"""

from __future__ import annotations

import functools
import math
import re
import unicodedata
from typing import Sequence

from ..errors import ModelLoadError, SpecdecError

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # tokenizer.ggml.token_type

# Texts of end-of-generation tokens, as llama.cpp recognises them (FIM tokens included: a coder
# model that writes <|file_sep|> has finished the file).
EOG_TEXTS = frozenset(
    {
        "<|im_end|>",
        "<|endoftext|>",
        "<|eot_id|>",
        "<end_of_turn>",
        "<|end|>",
        "<|eom_id|>",
        "<|end_of_text|>",
        "<|fim_pad|>",
        "<|repo_name|>",
        "<|file_sep|>",
    }
)

# Pre-tokenizers (tokenizer.ggml.pre): text is cut into pieces with this regex, then each piece is
# BPE-encoded on its own. \p{L} = any letter, \p{N} = any number.
PRETOKENIZERS = {
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "gpt-2": r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",
}


def compile_pretokenizer(pattern: str) -> re.Pattern:
    """The `regex` module knows \\p{L} and \\p{N}; Python's `re` does not, so without it we spell
    them out as character classes listing every letter / number code point (see unicode_class)."""
    try:
        import regex

        return regex.compile(pattern)
    except ImportError:
        pass
    letters, numbers = unicode_class("L"), unicode_class("N")
    pattern = (
        pattern.replace(r"[^\r\n\p{L}\p{N}]", f"[^\\r\\n{letters}{numbers}]")
        .replace(r"[^\s\p{L}\p{N}]", f"[^\\s{letters}{numbers}]")
        .replace(r"\p{L}", f"[{letters}]")
        .replace(r"\p{N}", f"[{numbers}]")
    )
    return re.compile(pattern)


@functools.lru_cache(maxsize=None)
def unicode_class(category: str) -> str:
    """The inside of a regex character class matching every code point whose Unicode category
    starts with `category` ("L": letters, "N": numbers), as ranges \\U0000XXXX-\\U0000YYYY.
    Built from Python's unicodedata (~0.1 s); llama.cpp's tables may be a Unicode version apart."""
    ranges, start = [], None
    for cp in range(0x110000 + 1):
        inside = cp < 0x110000 and unicodedata.category(chr(cp)).startswith(category)
        if inside and start is None:
            start = cp
        elif not inside and start is not None:
            ranges.append(f"\\U{start:08x}-\\U{cp - 1:08x}")
            start = None
    return "".join(ranges)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable characters: printable Latin-1
    bytes map to themselves, the others (space, control bytes ...) to chr(256 + n). So a space
    is 'Ġ' and a newline 'Ċ' in the vocabulary."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, n = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + n)
            n += 1
    return table


BYTE_TO_CHAR = bytes_to_unicode()
CHAR_TO_BYTE = {c: b for b, c in BYTE_TO_CHAR.items()}


class NumpyTokenizer:
    """Byte-level BPE ('gpt2' tokenizer model) from GGUF metadata. Implements models.base.Tokenizer."""

    def __init__(self, meta: dict):
        model = meta.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise ModelLoadError(
                f"the NumPy tokenizer reads byte-level BPE vocabularies ('gpt2'), "
                f"not {model!r}; use the llama.cpp backend for this model"
            )
        pre = meta.get("tokenizer.ggml.pre", "gpt-2")
        if pre not in PRETOKENIZERS:
            raise ModelLoadError(
                f"the NumPy tokenizer knows the pre-tokenizers {', '.join(PRETOKENIZERS)}, "
                f"not {pre!r}; use the llama.cpp backend for this model"
            )
        self.tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
        self.token_type: list[int] = list(meta.get("tokenizer.ggml.token_type", [NORMAL] * len(self.tokens)))
        self.ids = {text: i for i, text in enumerate(self.tokens)}
        # merge rank: the lower, the earlier BPE learned it, the sooner it applies
        self.merge_rank = {tuple(m.split(" ", 1)): rank for rank, m in enumerate(meta.get("tokenizer.ggml.merges", []))}
        self.pretokenizer = compile_pretokenizer(PRETOKENIZERS[pre])
        self.ignore_merges = pre == "llama-bpe"  # Llama 3: a pre-token in the vocabulary is one token
        # special tokens are matched literally, longest first, before any BPE
        kinds = list(zip(self.tokens, self.token_type))
        special = sorted((t for t, kind in kinds if kind in (CONTROL, USER_DEFINED)), key=len, reverse=True)
        self.special = re.compile("|".join(map(re.escape, special))) if special else None
        self.bos_id = meta.get("tokenizer.ggml.bos_token_id")
        self.eos_id = meta.get("tokenizer.ggml.eos_token_id")
        self.add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and self.bos_id is not None
        self.add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and self.eos_id is not None
        declared = {meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")} - {None}
        self.eog_ids = frozenset(int(t) for t in declared) | frozenset(
            i for i, (t, kind) in enumerate(kinds) if kind == CONTROL and t in EOG_TEXTS
        )
        self.chat_template: str | None = meta.get("tokenizer.chat_template")
        self._bpe_cache: dict[str, list[str]] = {}

    def bpe(self, word: str) -> list[str]:
        """Merge the characters of one pre-token: repeatedly join the adjacent pair with the lowest
        merge rank (the leftmost on ties) until no pair is a known merge."""
        parts = self._bpe_cache.get(word)
        if parts is not None:
            return parts
        parts = list(word)
        while len(parts) > 1:
            pairs = list(zip(parts, parts[1:]))
            best = min(range(len(pairs)), key=lambda j: self.merge_rank.get(pairs[j], math.inf))
            if pairs[best] not in self.merge_rank:
                break
            parts[best : best + 2] = [parts[best] + parts[best + 1]]
        self._bpe_cache[word] = parts
        return parts

    def _encode_text(self, text: str) -> list[int]:
        """Plain text (no special tokens): pre-tokenize, map bytes to characters, BPE, look up."""
        ids = []
        for piece in self.pretokenizer.findall(text):
            word = "".join(BYTE_TO_CHAR[b] for b in piece.encode("utf-8"))
            if self.ignore_merges and word in self.ids:
                ids.append(self.ids[word])
                continue
            for part in self.bpe(word):
                if part in self.ids:
                    ids.append(self.ids[part])
                else:  # a merge result missing from the vocabulary: fall back to its characters
                    ids.extend(self.ids[c] for c in part)
        return ids

    def encode(self, text: str, add_special: bool = True, special: bool = True) -> list[int]:
        ids = [self.bos_id] if add_special and self.add_bos else []
        start = 0
        for match in self.special.finditer(text) if self.special and special else ():
            ids += self._encode_text(text[start : match.start()])
            ids.append(self.ids[match.group()])
            start = match.end()
        ids += self._encode_text(text[start:])
        if add_special and self.add_eos:
            ids.append(self.eos_id)
        return ids

    def token_bytes(self, token: int) -> bytes:
        """Normal tokens: their characters mapped back to bytes. User-defined tokens: their text.
        Control and unused tokens print nothing (as llama.cpp renders them without `special`)."""
        kind, text = self.token_type[token], self.tokens[token]
        if kind == NORMAL:
            if all(c in CHAR_TO_BYTE for c in text):
                return bytes(CHAR_TO_BYTE[c] for c in text)
            return text.encode("utf-8")  # not byte-level text (rare): as written
        if kind == USER_DEFINED:
            return text.encode("utf-8")
        return b""

    def decode(self, tokens: Sequence[int]) -> str:
        return b"".join(self.token_bytes(t) for t in tokens).decode("utf-8", errors="replace")

    def token_text(self, token: int) -> str:
        return self.tokens[token]

    def max_token_bytes(self) -> int | None:
        return self._longest_token

    @functools.cached_property
    def _longest_token(self) -> int:
        """Tokenizer.max_token_bytes: no normalizer, every byte of the text reaches BPE (each
        pre-tokenizer's regex ends in \\s+ and matches any character), a special token stands
        for its spelling and any other for the bytes it prints."""
        return max(
            len(text.encode()) if kind in (CONTROL, USER_DEFINED) else len(self.token_bytes(token))
            for token, (text, kind) in enumerate(zip(self.tokens, self.token_type))
        )

    def apply_chat_template(self, messages: list[dict], tools: list | None = None) -> str:
        """The GGUF's own template, rendered as the llama.cpp backend renders it (models.chat)."""
        from .chat import render

        if not self.chat_template:
            raise SpecdecError("this model has no chat template in its GGUF; use --no-chat")
        ids = (self.bos_id, self.eos_id)
        special = [self.tokens[i] if i is not None and 0 <= i < len(self.tokens) else "" for i in ids]
        return render(self.chat_template, messages, *special, tools=tools)
