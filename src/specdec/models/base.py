"""The CausalLM protocol every backend implements, and the Tokenizer it carries."""
from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import numpy as np


@runtime_checkable
class Tokenizer(Protocol):
    eog_ids: frozenset[int]                    # every end-of-generation token the model declares

    def encode(self, text: str, add_special: bool = True) -> list[int]: ...
    def decode(self, tokens: Sequence[int]) -> str: ...
    def token_bytes(self, token: int) -> bytes: ...   # raw bytes of one token (UTF-8 may be split)
    def token_text(self, token: int) -> str: ...      # the vocabulary entry, for compatibility checks
    def apply_chat_template(self, messages: list[dict[str, str]]) -> str: ...  # ends with the assistant turn


@runtime_checkable
class CausalLM(Protocol):
    name: str                                   # for output: file name or model name
    vocab_size: int                             # width of a logits row
    n_ctx: int                                  # context window in tokens
    n_past: int                                 # tokens held in the KV cache
    tokenizer: Tokenizer
    is_instruct: bool                           # apply the chat template by default

    def forward(self, tokens: Sequence[int], n_rows: int | None = None) -> np.ndarray:
        """Append `tokens` to the cache and return logits for the last `n_rows` of them
        ([n_rows, vocab]; all of them when None; [0, vocab] for a pure prefill). Asking only for
        the rows you use matters: every returned row costs a copy and, in llama.cpp, output work."""
        ...

    def rollback(self, n_keep: int) -> None:
        """Cut the cache to its first n_keep tokens."""
        ...

    def reset(self) -> None: ...


def check_same_vocab(target: CausalLM, draft: CausalLM) -> None:
    """Refuse a draft whose token ids mean something else: same size and same token texts."""
    from ..errors import VocabMismatchError

    if draft.vocab_size != target.vocab_size:
        raise VocabMismatchError(
            f"draft {draft.name} has {draft.vocab_size} tokens but target {target.name} has "
            f"{target.vocab_size}; pick a draft of the same model family, or use --draft ngram"
        )
    t, d = target.tokenizer, draft.tokenizer
    for token in range(target.vocab_size):
        if t.token_text(token) != d.token_text(token):
            raise VocabMismatchError(
                f"draft {draft.name} and target {target.name} disagree on token {token} "
                f"({t.token_text(token)!r} vs {d.token_text(token)!r}); pick a draft of the same "
                f"model family, or use --draft ngram"
            )
