"""Early-exit self-speculation on the NumPy backend: lossless, and the shared cache stays right."""

from __future__ import annotations

import numpy as np
import pytest

from specdec import GenerationConfig, SpeculativeDecoder
from specdec.drafters.base import Drafter
from specdec.drafters.early_exit import EarlyExitDrafter
from specdec.errors import SpecdecError
from specdec.models.numpy_ref import load_numpy_model
from specdec.sampling import SamplingParams

from ..conftest import require_module
from ..models.test_numpy_ref import numpy_builtin, write_tiny_gguf
from ..toy import Solo, ToyLM

require_module("gguf", "pip install -e .")

PROMPT = "the cat in a hat, then the end"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random gpt2 model with 4 layers: its shallow exits disagree with it often."""
    path = tmp_path_factory.mktemp("tiny") / "tiny-gpt2-4.gguf"
    write_tiny_gguf(path, "gpt2", seed=3, n_layer=4)
    return load_numpy_model(path)


def cache_state(model, n: int) -> list[np.ndarray]:
    """Copies of every layer's K and V for the first n positions."""
    return [c[:, :n].copy() for c in model.k_cache + model.v_cache]


def check_cache_mid_run(model, decoder, prompt, config) -> None:
    """Run `decoder` on the prompt and, a few tokens before the end, check the cache of its row
    (check_cache_matches_a_fresh_pass)."""
    engine = decoder.engine
    request = engine.add(decoder.prompt_tokens(prompt, config), config)
    while request.stats.generated_tokens < config.max_new_tokens - 4:
        engine.step()
        assert not request.done
    with model.use_row(request.row):
        check_cache_matches_a_fresh_pass(model, request.context)
    engine.cancel(request)


def check_cache_matches_a_fresh_pass(model, tokens: list[int]) -> None:
    """The cache after a speculative run holds what one plain pass over the same tokens writes,
    in every layer (the early layers included, which the drafts also wrote)."""
    model.rollback(len(tokens) - 1)
    assert model.n_past == model.n_full == len(tokens) - 1
    after_run = cache_state(model, len(tokens) - 1)
    logits_after_run = model.forward(tokens[-1:])  # [1, vocab]
    model.reset()
    model.forward(tokens[:-1], n_rows=0)
    fresh = cache_state(model, len(tokens) - 1)
    for ours, theirs in zip(after_run, fresh):
        np.testing.assert_allclose(ours, theirs, atol=1e-4)
    np.testing.assert_allclose(logits_after_run, model.forward(tokens[-1:]), atol=1e-4)


@pytest.mark.parametrize("n_layers", [1, 2, 3, 4])
def test_greedy_speculative_equals_plain_tiny(tiny, n_layers):
    config = GenerationConfig(max_new_tokens=48, chat=False)
    plain = SpeculativeDecoder(tiny).generate(PROMPT, config)
    drafter = EarlyExitDrafter(tiny, n_layers)
    assert isinstance(drafter, Drafter) and drafter.name == f"early-exit:{n_layers}"
    spec = SpeculativeDecoder(tiny, drafter=drafter, k=3).generate(PROMPT, config)
    assert spec.tokens == plain.tokens
    stats = spec.stats
    if n_layers == tiny.n_layer:  # the full model drafting for itself: every draft is kept
        assert stats.accepted == stats.drafted
    elif n_layers == 1:  # the exit after one layer of a random model: many rejections
        assert stats.accepted < stats.drafted
    check_cache_mid_run(tiny, SpeculativeDecoder(tiny, drafter=EarlyExitDrafter(tiny, n_layers), k=3), PROMPT, config)


def test_propose_leaves_the_cache_as_it_found_it(tiny):
    context = tiny.tokenizer.encode(PROMPT)
    tiny.reset()
    for cache in tiny.k_cache + tiny.v_cache:
        cache[:] = 0.0  # so that every written slot shows
    tiny.forward(context[:-1], n_rows=0)
    before = cache_state(tiny, tiny.n_ctx)
    drafter = Solo(EarlyExitDrafter(tiny, 2))
    draft = drafter.propose(context, 5)
    assert len(draft.tokens) == 5 and draft.q is None
    assert tiny.n_past == tiny.n_full == len(context) - 1
    after = cache_state(tiny, tiny.n_ctx)
    n = len(context) - 1
    for ours, theirs in zip(after, before):
        np.testing.assert_array_equal(ours[:, :n], theirs[:, :n])  # the verified tokens: untouched
    # the drafts' K/V went to the free slots of the first 2 layers only: [last, d1 .. d4]
    k_after = after[: tiny.n_layer]
    assert all(np.abs(k_after[i][:, n : n + 5]).min() > 0 for i in (0, 1))
    assert all(np.abs(k_after[i][:, n:]).max() == 0 for i in (2, 3))
    assert np.abs(k_after[0][:, n + 5 :]).max() == 0  # the last draft is not fed
    # and the drafts are the exit's own greedy continuation
    tiny.rollback(n)
    expected = []
    for token in [context[-1], *draft.tokens[:-1]]:
        expected.append(int(tiny.forward([token], n_layers=2)[0].argmax()))
    assert draft.tokens == expected


def test_propose_catches_up_a_cache_behind_the_context(tiny):
    context = tiny.tokenizer.encode(PROMPT)
    drafter = Solo(EarlyExitDrafter(tiny, 3))
    tiny.reset()
    behind = drafter.propose(context, 4)  # the cache was empty: feeds context[:-1] first
    tiny.reset()
    tiny.forward(context[:-1], n_rows=0)
    assert drafter.propose(context, 4).tokens == behind.tokens
    assert tiny.n_past == len(context) - 1


def test_sampled_drafts_carry_q(tiny):
    context = tiny.tokenizer.encode(PROMPT)
    drafter = Solo(EarlyExitDrafter(tiny, 2), params=SamplingParams(temperature=0.8, top_k=20))
    tiny.reset()
    draft = drafter.propose(context, 4)
    assert draft.q.shape == (4, tiny.vocab_size)
    np.testing.assert_allclose(draft.q.sum(-1), 1.0)
    assert all(draft.q[i, t] > 0 for i, t in enumerate(draft.tokens))
    # a seeded sampled generation runs and repeats
    config = GenerationConfig(max_new_tokens=24, temperature=0.8, top_k=20, seed=7, chat=False)
    one = SpeculativeDecoder(tiny, drafter=EarlyExitDrafter(tiny, 2), k=3).generate(PROMPT, config)
    two = SpeculativeDecoder(tiny, drafter=EarlyExitDrafter(tiny, 2), k=3).generate(PROMPT, config)
    assert one.tokens == two.tokens and len(one.tokens) > 0


def test_a_forward_refuses_a_half_written_cache(tiny):
    tiny.reset()
    tiny.forward([1, 2, 3], n_rows=0)
    tiny.forward([4], n_layers=2)
    assert (tiny.n_past, tiny.n_full, tiny.layer_len) == (4, 3, [4, 4, 3, 3])
    tiny.forward([5], n_layers=2)  # the same early exit may go on
    with pytest.raises(RuntimeError, match="rollback"):
        tiny.forward([6])  # layers 2 and 3 lack tokens 4 and 5
    with pytest.raises(RuntimeError, match="rollback"):
        tiny.forward([6], n_layers=3)
    tiny.rollback(3)
    assert tiny.forward([4]).shape == (1, tiny.vocab_size)
    assert tiny.layer_len == [4] * 4
    with pytest.raises(ValueError):
        tiny.forward([5], n_layers=0)


def test_bad_arguments(tiny):
    with pytest.raises(SpecdecError):
        EarlyExitDrafter(tiny, 0)
    with pytest.raises(SpecdecError):
        EarlyExitDrafter(tiny, tiny.n_layer + 1)
    with pytest.raises(SpecdecError, match="NumPy"):
        EarlyExitDrafter(ToyLM(), 1)


@pytest.mark.real_models
def test_greedy_speculative_equals_plain_real():
    """The 0.5B (24 layers) drafting with its first 12."""
    model = numpy_builtin("qwen2.5-coder-0.5b")
    config = GenerationConfig(max_new_tokens=20, chat=False)
    prompt = "def fibonacci(n):\n"
    plain = SpeculativeDecoder(model).generate(prompt, config)
    spec = SpeculativeDecoder(model, drafter=EarlyExitDrafter(model, 12), k=3).generate(prompt, config)
    assert spec.tokens == plain.tokens
    assert 0 < spec.stats.accepted < spec.stats.drafted
    check_cache_mid_run(model, SpeculativeDecoder(model, drafter=EarlyExitDrafter(model, 12), k=3), prompt, config)


def test_auto_drafts_the_exits_trees_where_width_is_cheap(tmp_path):
    """In the draft model's place in auto (where an early-exit head goes), the exit drafts a tree
    where the target scores trees and width costs nearly nothing (a flat curve, on a virtual clock);
    greedy output is plain greedy output."""
    from specdec.costs import CostTable

    from ..toy import on_virtual_clock

    write_tiny_gguf(tmp_path / "tiny.gguf", "gpt2", seed=3, n_layer=4)
    tiny = load_numpy_model(tmp_path / "tiny.gguf")  # its forwards go on a virtual clock
    config = GenerationConfig(max_new_tokens=48, chat=False)
    plain = SpeculativeDecoder(tiny).generate(PROMPT, config).tokens
    flat = CostTable({w: 0.01 for w in range(1, 17)})
    auto = SpeculativeDecoder(
        tiny, "auto", draft_model=EarlyExitDrafter(tiny, 3), suffix=False, costs=(flat, CostTable({1: 0.001}))
    )
    assert auto.controller().tree_widths[-1] > 1
    auto.engine.clock = on_virtual_clock(tiny, flat.measured)
    assert auto.generate(PROMPT, config).tokens == plain
    trees = [key for key in auto.controller().decisions if key.startswith("draft:") and "x" in key]
    assert trees, auto.controller().decisions
