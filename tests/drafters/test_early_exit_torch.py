"""Early exit on the torch backend: the target's first layers draft through the target's own KV
cache (no second model, no second cache), for every row of a batch in one forward; greedy output
is plain greedy output and the cache after a run is a fresh pass's, in both cache layouts."""

from __future__ import annotations

import numpy as np
import pytest

from ..conftest import needs_torch

needs_torch()
import torch  # noqa: E402

from specdec import GenerationConfig, SpeculativeDecoder  # noqa: E402
from specdec.drafters.early_exit import EarlyExitDrafter  # noqa: E402
from specdec.errors import SpecdecError  # noqa: E402
from specdec.models.transformers import TransformersModel  # noqa: E402

from .. import tiny_hf  # noqa: E402

ATOL = 1e-4  # float32 summation order differs between batch shapes
PROMPTS = ["def add(a, b):\n", "The quick brown fox", "class Point:\n    x: int", "Speculative decoding"]


@pytest.fixture(scope="module", params=tiny_hf.CASES, ids=lambda p: "-".join(p))
def pair(request, tokenizer):
    """(the 2-layer target, its first layer alone as a model: what the exit after layer 1 is)."""
    arch, layout = request.param
    target, first = tiny_hf.pair(arch, len(tokenizer))
    return tiny_hf.wrap(target, tokenizer, arch, layout), TransformersModel(first, tokenizer, name=f"{arch}-first")


def tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, 300, n).tolist()


def test_an_exit_forward_is_the_first_layers_then_the_head(pair):
    """Logits of a forward through layer 0 alone equal the one-layer model's (the target's first
    block, norm and head), in a batch of rows of different lengths, and the deeper layer's cache
    is not written: after the rollback the target reads on as if the exit never ran."""
    model, first = pair
    model.reset()
    prompts = [tokens(1, 9), tokens(2, 4), tokens(3, 13)]
    rows = model.add_rows(3)
    model.forward_rows(dict(zip(rows, prompts)))
    step = {rows[0]: tokens(4, 1), rows[2]: tokens(5, 3)}  # row 1 waits
    exits = model.forward_rows(step, {row: len(t) for row, t in step.items()}, n_layers=1)
    for row, prompt in zip(rows, prompts):
        if row in step:
            first.reset()
            expected = first.forward(prompt + step[row])[-len(step[row]) :]
            np.testing.assert_allclose(exits[row], expected, atol=ATOL)
    assert [model.row_length(r) for r in rows] == [10, 4, 16]
    model.rollback_rows({rows[0]: 9, rows[2]: 13})
    after = model.forward_rows({row: tokens(6, 2) for row in rows}, {row: 2 for row in rows})
    for row, prompt in zip(rows, prompts):
        model.reset()
        np.testing.assert_allclose(after[row], model.forward(prompt + tokens(6, 2))[-2:], atol=ATOL)
    model.drop_rows(rows)


def test_a_full_forward_after_an_exit_needs_the_rollback_first(pair):
    model, _ = pair
    model.reset()
    model.forward(tokens(7, 6), n_rows=0)
    model.forward_rows({model._solo_row(): tokens(8, 1)}, {}, n_layers=1)
    with pytest.raises(RuntimeError, match="rollback"):
        model.forward(tokens(9, 1))  # the deeper layer lacks the exit's token
    with pytest.raises(RuntimeError, match="rollback"):
        model.forward_tree_rows({model._solo_row(): (tokens(9, 2), [-1, -1])})
    model.rollback(6)
    assert model.forward(tokens(9, 1)).shape == (1, model.vocab_size)
    with pytest.raises(ValueError, match="n_layers"):
        model.forward_rows({model._solo_row(): tokens(9, 1)}, {}, n_layers=3)
    model.reset()


@pytest.mark.parametrize("n_layers", [1, 2])
def test_greedy_with_an_early_exit_is_plain_greedy_alone_and_batched(pair, n_layers):
    model, _ = pair
    config = GenerationConfig(max_new_tokens=24, chat=False)
    plain = [SpeculativeDecoder(model).generate(p, config).tokens for p in PROMPTS]
    decoder = SpeculativeDecoder(model, drafter=EarlyExitDrafter(model, n_layers), k=3)
    alone = decoder.generate(PROMPTS[0], config)
    assert alone.tokens == plain[0]
    if n_layers == model.n_layer:  # the whole model drafting for itself: every draft is kept
        assert alone.stats.accepted == alone.stats.drafted > 0
    else:
        assert alone.stats.drafted > 0
    batched = decoder.generate_batch(PROMPTS, config)
    assert [r.tokens for r in batched] == plain


def test_the_cache_after_a_run_is_a_fresh_pass(pair):
    """Mid-run, the row's cache in every layer (the first included, which the drafts also wrote)
    holds what one plain pass over the same tokens writes."""
    model, _ = pair
    config = GenerationConfig(max_new_tokens=24, chat=False)
    decoder = SpeculativeDecoder(model, drafter=EarlyExitDrafter(model, 1), k=4)
    engine = decoder.engine
    request = engine.add(decoder.prompt_tokens(PROMPTS[1], config), config)
    while request.stats.generated_tokens < config.max_new_tokens - 4:
        engine.step()
    assert request.stats.drafted > 0
    context = list(request.context)
    assert model.row_length(request.row) == len(context) - 1
    kept = model.cached_keys_values(request.row)
    fresh = TransformersModel(model.model, model.tokenizer, name="fresh")
    fresh.forward(context[:-1], n_rows=0)
    for (k1, v1), (k2, v2) in zip(kept, fresh.cached_keys_values(), strict=True):
        torch.testing.assert_close(k1, k2, atol=ATOL, rtol=0)
        torch.testing.assert_close(v1, v2, atol=ATOL, rtol=0)
    engine.cancel(request)


def test_an_exit_deeper_than_the_model_is_an_error(pair):
    model, _ = pair
    with pytest.raises(SpecdecError, match="pick 1..2"):
        EarlyExitDrafter(model, 3)


# -- an early-exit head's trained blocks, attached after the first layers --------------------------


def with_own_block(tokenizer, layout: str, arch: str = "qwen2"):
    """The 2-layer target with a copy of its own layer 1 attached as the exit block after layer 1:
    the exit plus the block computes what the whole model computes, exactly where the block's
    cache holds what layer 1's does."""
    import copy

    target, _ = tiny_hf.pair(arch, len(tokenizer))
    model = tiny_hf.wrap(target, tokenizer, arch, layout)
    model.attach_exit_blocks(1, [copy.deepcopy(model._decoder_layers()[1])])
    return model


@pytest.mark.parametrize("layout", tiny_hf.LAYOUTS)
def test_exit_blocks_keep_their_cache_through_prompts_verifications_and_trees(tokenizer, layout):
    model = with_own_block(tokenizer, layout)
    rows = model.add_rows(2)
    prompts = {rows[0]: tokens(11, 20), rows[1]: tokens(12, 7)}
    model.forward_rows(prompts)
    # a verification of 4 tokens, 2 kept; a tree on the other row, one path kept
    model.forward_rows({rows[0]: tokens(13, 4)}, {rows[0]: 4})
    model.rollback_rows({rows[0]: 22})
    model.forward_tree_rows({rows[1]: (tokens(14, 3), [-1, -1, 0])})
    model.keep_path_rows({rows[1]: [0, 2]})  # nodes 0 and 2: a path of two
    step = {rows[0]: tokens(15, 2), rows[1]: tokens(16, 3)}
    exits = model.forward_rows(step, {r: len(t) for r, t in step.items()}, n_layers=1, blocks=True)
    model.rollback_rows({rows[0]: 22, rows[1]: 9})
    full = model.forward_rows(step, {r: len(t) for r, t in step.items()})
    for row in rows:
        np.testing.assert_allclose(exits[row], full[row], atol=ATOL)
    with pytest.raises(ValueError, match="no trained blocks"):
        model.forward_rows(step, {}, n_layers=2, blocks=True)


@pytest.mark.parametrize("layout", tiny_hf.LAYOUTS)
def test_greedy_with_exit_blocks_is_plain_greedy_and_a_perfect_block_is_always_kept(tokenizer, layout):
    model = with_own_block(tokenizer, layout)
    config = GenerationConfig(max_new_tokens=24, chat=False)
    plain = [SpeculativeDecoder(model).generate(p, config).tokens for p in PROMPTS]
    decoder = SpeculativeDecoder(model, drafter=EarlyExitDrafter(model, 1, blocks=1), k=4)
    alone = decoder.generate(PROMPTS[2], config)
    assert alone.tokens == plain[2]
    assert alone.stats.accepted == alone.stats.drafted > 0  # the block's cache is layer 1's
    batched = decoder.generate_batch(PROMPTS, config)
    assert [r.tokens for r in batched] == plain
    assert all(r.stats.accepted == r.stats.drafted for r in batched)


@pytest.mark.parametrize("layout", tiny_hf.LAYOUTS)
def test_a_perfect_blocks_tree_keeps_its_chain_through_the_shared_cache(tokenizer, layout):
    """An early-exit head's tree through the target's own cache (the exit and its block, the
    block's cache filled by every full forward, trees included): with the block a copy of the last
    layer every chain token is the target's, so each step keeps its whole depth, and the siblings
    beside it are scored, never kept."""
    model = with_own_block(tokenizer, layout)
    config = GenerationConfig(max_new_tokens=24, chat=False)
    plain = [SpeculativeDecoder(model).generate(p, config).tokens for p in PROMPTS]
    decoder = SpeculativeDecoder(model, drafter=EarlyExitDrafter(model, 1, blocks=1, width=2), k=4)
    batched = decoder.generate_batch(PROMPTS, config)
    assert [r.tokens for r in batched] == plain
    for r in batched:
        assert r.stats.accepted == sum(r.stats.drafted_at) > 0  # every depth's chain token
        assert r.stats.drafted == 2 * sum(r.stats.drafted_at)  # and a sibling beside each


@pytest.mark.parametrize("layout", tiny_hf.LAYOUTS)
def test_rows_held_before_the_blocks_came_draft_on(tokenizer, layout):
    """Blocks attached while the model holds rows: their block cache is zeros (their drafts are
    worse), their forwards as before; a row that comes after drafts exactly."""
    import copy

    target, _ = tiny_hf.pair("llama", len(tokenizer))
    model = tiny_hf.wrap(target, tokenizer, "llama", layout)
    old = model.add_rows(2)
    model.forward_rows({old[0]: tokens(21, 9), old[1]: tokens(22, 5)})
    model.attach_exit_blocks(1, [copy.deepcopy(model._decoder_layers()[1])])
    new = model.add_rows(1)[0]
    model.forward_rows({new: tokens(23, 6)})
    step = {old[0]: tokens(24, 1), new: tokens(25, 1)}
    exits = model.forward_rows(step, {r: 1 for r in step}, n_layers=1, blocks=True)
    model.rollback_rows({old[0]: 9, new: 6})
    full = model.forward_rows(step, {r: 1 for r in step})
    np.testing.assert_allclose(exits[new], full[new], atol=ATOL)
    assert exits[old[0]].shape == full[old[0]].shape
    model.rollback_rows({old[0]: 9, new: 6})
    model.drop_rows([old[1]])  # a row leaves: every layer, the blocks' too, drops it
    again = model.forward_rows(step, {r: 1 for r in step})
    for row in step:
        np.testing.assert_allclose(again[row], full[row], atol=ATOL)
