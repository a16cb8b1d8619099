"""A head file of random weights for any model that gives hidden states (no GGUF writer needed:
the torch backend's head tests import it on machines without gguf)."""

from __future__ import annotations

import numpy as np

from specdec.drafters import headfile


def random_head(model, kind: str, path, steps: int = 3, seed: int = 0, scale: float = 0.05, vocab: int = 0):
    """A head file of random weights for `model` (what training starts from, plus noise), drafting
    from `vocab` of its tokens (0: all of them)."""
    rng = np.random.default_rng(seed)
    d = model.n_embd
    vocab = rng.permutation(model.vocab_size)[: vocab or model.vocab_size].astype(np.int32)

    def rand(*shape):
        return (rng.normal(size=shape) * scale).astype(np.float16)

    if kind == "early-exit":  # the NumPy target's layer 1 plus noise, after its first layer
        tensors = {
            f"blk.1.{n}": (w + rng.normal(size=w.shape) * scale).astype(np.float16) for n, w in model.layers[1].items()
        }
        info = headfile.HeadInfo(kind, model.identity, model.name, d, model.vocab_size, steps, layers=1, blocks=1)
        headfile.save(path, info, tensors)
        return path
    tensors = {"vocab": vocab, "lm_head": model.head_weights("output", vocab).astype(np.float16)}
    n_head = n_ff = 0
    if kind == "medusa":
        for i in range(steps):
            tensors[f"medusa.{i}.weight"], tensors[f"medusa.{i}.bias"] = rand(d, d), rand(d)
    else:
        n_head, n_ff = 4, 16
        fuse = np.concatenate([np.eye(d), np.zeros((d, d))], 1) + rng.normal(size=(d, 2 * d)) * scale
        tensors.update(
            {"fuse.weight": fuse.astype(np.float16), "step": rand(steps, d), "w_down": rand(d, n_ff)},
            embed=np.concatenate([model.head_weights("embedding", vocab), np.zeros((1, d))]).astype(np.float16),
            attn_norm=np.ones(d, np.float16),
            ffn_norm=np.ones(d, np.float16),
            wq=rand(d, d) * 10,
            wk=rand(d, d) * 10,
            wv=rand(d, d) * 10,
            wo=rand(d, d),
            w_gate=rand(n_ff, d) * 10,
            w_up=rand(n_ff, d) * 10,
        )
    info = headfile.HeadInfo(kind, model.identity, model.name, d, model.vocab_size, steps, n_head, n_ff)
    headfile.save(path, info, tensors)
    return path
