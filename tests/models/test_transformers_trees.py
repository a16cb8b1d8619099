"""Tree attention on the torch backend, on tiny random models: one forward scores every node of
each row's tree as a chain of its own path would (every cache layout and architecture;
SPECDEC_TEST_DEVICE=cuda adds CUDA graphs), keeping a path leaves the row as that chain's prefill
would, and a tree no path was kept of goes."""

from __future__ import annotations

import numpy as np
import pytest

from ..conftest import needs_torch

needs_torch()
import torch  # noqa: E402

from specdec.errors import ContextOverflowError  # noqa: E402
from specdec.models.transformers import TransformersModel  # noqa: E402

from .. import tiny_hf  # noqa: E402
from ..trees import TREE_PARENTS, TREE_TOKENS  # noqa: E402
from ..trees import tree_path as _tree_path  # noqa: E402
from .test_transformers import ATOL, full_logits, tokens  # noqa: E402


@pytest.fixture(
    scope="module",
    params=[(arch, "dynamic") for arch in tiny_hf.ARCHS]
    + [(a, c) for a in ("qwen2", "gpt2") for c in tiny_hf.LAYOUTS[1:]],
    ids=lambda p: "-".join(p),
)
def model(request, tokenizer):
    arch, layout = request.param
    target, _ = tiny_hf.pair(arch, len(tokenizer))
    return TransformersModel(target, tokenizer, name=arch, cache=layout.split("+")[0], graphs="graphs" in layout)


def _path_tokens(node):
    return [TREE_TOKENS[i] for i in _tree_path(node)]


def test_every_node_is_scored_as_its_own_chain(model):
    prefix = tokens(11, 9)
    model.reset()
    row = model._solo_row()
    model.forward(prefix, n_rows=0)
    scores = model.forward_tree_rows({row: (TREE_TOKENS, TREE_PARENTS)})[row]
    assert scores.shape == (len(TREE_TOKENS), model.vocab_size)
    assert model.row_length(row) == len(prefix)  # the tree is not the row's until a path is kept
    for node in range(len(TREE_TOKENS)):
        want = full_logits(model, prefix + _path_tokens(node))[-1]
        np.testing.assert_allclose(scores[node], want, atol=ATOL, err_msg=f"node {node}")
    # the power of that: siblings (nodes 1 and 3 share a parent and a token) and a node that would
    # see its sibling under the position rule differ by far more than the tolerance
    assert np.abs(scores[1] - scores[2]).max() > 100 * ATOL
    chain = full_logits(model, prefix + TREE_TOKENS[:3])[-1]  # node 2 reading node 1 as a chain would
    assert np.abs(scores[2] - chain).max() > 100 * ATOL


@pytest.mark.parametrize("leaf", [4, 3, 7, None])
def test_a_kept_path_continues_as_a_chain(model, leaf):
    prefix, after = tokens(12, 6), tokens(13, 4)
    path = [] if leaf is None else _tree_path(leaf)
    model.reset()
    row = model._solo_row()
    model.forward(prefix, n_rows=0)
    model.forward_tree_rows({row: (TREE_TOKENS, TREE_PARENTS)})
    model.keep_path_rows({row: path})
    assert model.row_length(row) == len(prefix) + len(path) and not model._trees
    kept = prefix + [TREE_TOKENS[i] for i in path]
    np.testing.assert_allclose(model.forward(after), full_logits(model, kept + after)[-len(after) :], atol=ATOL)
    fresh = TransformersModel(model.model, model.tokenizer, name="fresh")
    fresh.forward(kept + after, n_rows=0)
    for (k1, v1), (k2, v2) in zip(model.cached_keys_values(), fresh.cached_keys_values(), strict=True):
        assert k1.shape == k2.shape
        torch.testing.assert_close(k1, k2, atol=ATOL, rtol=0)
        torch.testing.assert_close(v1, v2, atol=ATOL, rtol=0)


def test_trees_of_two_rows_beside_a_row_that_waits(model):
    model.reset()
    a, b, c = model.add_rows(3)
    prompts = {a: tokens(14, 5), b: tokens(15, 11), c: tokens(16, 3)}
    model.forward_rows(prompts, {})
    scores = model.forward_tree_rows({a: (TREE_TOKENS, TREE_PARENTS), b: (TREE_TOKENS[:3], TREE_PARENTS[:3])})
    assert set(scores) == {a, b} and scores[a].shape[0] == len(TREE_TOKENS) and scores[b].shape[0] == 3
    for row, node in ((a, 7), (a, 5), (b, 2)):
        want = full_logits(model, prompts[row] + _path_tokens(node))[-1]
        np.testing.assert_allclose(scores[row][node], want, atol=ATOL)
    model.keep_path_rows({a: [6, 7], b: []})  # b keeps nothing of its tree
    assert [model.row_length(r) for r in (a, b, c)] == [len(prompts[a]) + 2, len(prompts[b]), len(prompts[c])]
    nxt = {a: [42], b: [43, 44], c: [45]}
    out = model.forward_rows(nxt, {a: 1, b: 2, c: 1})
    for row, history in ((a, prompts[a] + _path_tokens(7)), (b, prompts[b]), (c, prompts[c])):
        want = full_logits(model, history + nxt[row])[-len(nxt[row]) :]
        np.testing.assert_allclose(out[row], want, atol=ATOL)
    model.drop_rows([a, b, c])


def test_a_path_survives_a_compaction_while_its_tree_waits(model):
    """A rollback of another row may compact the cache before keep_path_rows: the tree's columns
    move with it."""
    model.reset()
    a, b = model.add_rows(2)
    long_prompt, short = tokens(17, 40), tokens(18, 4)
    model.forward_rows({a: short, b: long_prompt}, {})
    model.forward_tree_rows({a: (TREE_TOKENS, TREE_PARENTS)})
    model.rollback_rows({b: 2})  # b's columns become holes
    model._compact()
    model.keep_path_rows({a: _tree_path(5)})
    got = model.forward_rows({a: [9]}, {a: 1})[a]
    np.testing.assert_allclose(got, full_logits(model, short + _path_tokens(5) + [9])[-1:], atol=ATOL)
    model.drop_rows([a, b])


def test_a_rollback_or_a_forward_ends_a_tree(model):
    prefix = tokens(19, 5)
    model.reset()
    row = model._solo_row()
    model.forward(prefix, n_rows=0)
    model.forward_tree_rows({row: (TREE_TOKENS, TREE_PARENTS)})
    model.rollback_rows({row: len(prefix)})
    with pytest.raises(ValueError, match="no tree"):
        model.keep_path_rows({row: [0]})
    np.testing.assert_allclose(model.forward([7]), full_logits(model, prefix + [7])[-1:], atol=ATOL)
    model.forward_tree_rows({row: ([4, 5], [-1, 0])})
    with pytest.raises(ValueError, match="not a path down a tree"):
        model.keep_path_rows({row: [1]})
    np.testing.assert_allclose(model.forward([8]), full_logits(model, prefix + [7, 8])[-1:], atol=ATOL)
    with pytest.raises(ValueError, match="a parent per token"):
        model.forward_tree_rows({row: ([1, 2], [-1])})
    with pytest.raises(ValueError, match="must be -1 or an earlier node"):
        model.forward_tree_rows({row: ([1, 2], [-1, 1])})
    deep = list(range(-1, model.n_ctx - len(prefix) - 2))
    with pytest.raises(ContextOverflowError):
        model.forward_tree_rows({row: ([3] * len(deep), deep)})
