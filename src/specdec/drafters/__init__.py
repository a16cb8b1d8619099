"""Drafters: prompt lookup (ngram), the suffix cache (suffix), a draft model of the target's
vocabulary (model) or of another (cross_vocab), early exit (early_exit), and what the tests draft
with (synthetic). specdec.spec names them and makes them; the two helpers here build a draft
model's drafter and an empty suffix cache for a target.
"""

from __future__ import annotations


def model_drafter(model, target, vocab: str = "", width: int = 1, nodes: int = 0):
    """The drafter of a draft model for `target`: token ids directly when the vocabularies are the
    same (and `vocab` is ""), else across tokenizers, `vocab` saying how (default: string-level).
    `width` > 1 drafts trees (same vocabulary only), of the `nodes` most probable (0: all)."""
    from ..errors import VocabMismatchError
    from ..models.base import check_same_vocab
    from .cross_vocab import DEFAULT_MODE, CrossVocabDrafter
    from .model import ModelDrafter

    if not vocab:
        try:
            check_same_vocab(target, model)
            return ModelDrafter(model, width=width, nodes=nodes)  # checked just now
        except VocabMismatchError:
            vocab = DEFAULT_MODE
    if width > 1:
        from ..errors import SpecdecError

        raise SpecdecError(f"a draft tree (width {width}) needs a draft model of the target's vocabulary")
    return CrossVocabDrafter(model, target, vocab)


def new_suffix_cache(target, cap: int | None = None):
    """An empty suffix cache for `target`'s tokenizer (a saved cache is checked against it)."""
    from .suffix import DEFAULT_CAP, SuffixCacheDrafter, tokenizer_fingerprint

    return SuffixCacheDrafter(
        DEFAULT_CAP if cap is None else cap,
        fingerprint=tokenizer_fingerprint(target.tokenizer, target.vocab_size),
        vocab_size=target.vocab_size,
    )
