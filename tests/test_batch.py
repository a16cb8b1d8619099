"""Batched speculative generation on the torch backend (tiny random models): every row's greedy
output equals plain greedy decoding of that row alone, whatever the batch size, prompt lengths or
early stops; a seeded sampled batch equals its rows run one by one; sampled output follows the
target's distribution, end to end."""

from __future__ import annotations

import numpy as np
import pytest

from .conftest import needs_torch

needs_torch()

from specdec import GenerationConfig, SpeculativeDecoder  # noqa: E402
from specdec.models.transformers import TransformersModel  # noqa: E402

from . import tiny_hf  # noqa: E402
from .test_sampling import chi2_statistic, chi2_threshold, tv_threshold  # noqa: E402
from .toy import ToyLM, ToyTokenizer  # noqa: E402

PROMPTS = [
    "def add(a, b):",
    "The quick brown fox",
    "x",
    "class Point:\n    x: int\n    y: int\n\n",
    "Speculative decoding drafts tokens, and the target keeps",
    "lazy dog.",
    "def",
    "    return a",
]


@pytest.fixture(scope="module", params=tiny_hf.ARCHS)
def models(request, tokenizer):
    target, draft = tiny_hf.pair(request.param, len(tokenizer))
    return (
        TransformersModel(target, tokenizer, name=request.param),
        TransformersModel(draft, tokenizer, name=f"{request.param}-draft"),
    )


def plain_alone(target, prompts, config):
    decoder = SpeculativeDecoder(target)
    return [
        decoder.generate(p, config, seed=None if config.seed is None else config.seed + i).tokens
        for i, p in enumerate(prompts)
    ]


def with_an_early_stop(target, prompts, config):
    """Makes one token end-of-generation so that some rows stop early and others run to length."""
    base = set(target.tokenizer.eog_ids)
    runs = plain_alone(target, prompts, config)
    for token in runs[1][3:] + runs[2][3:]:
        target.tokenizer.eog_ids = frozenset(base | {token})
        ref = plain_alone(target, prompts, config)
        lengths = [len(r) for r in ref]
        if min(lengths) < config.max_new_tokens and max(lengths) == config.max_new_tokens:
            return ref
    raise AssertionError("no token stops some rows but not all")


@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_greedy_rows_equal_plain_decoding_alone(models, batch, drafter):
    target, draft = models
    saved = target.tokenizer.eog_ids
    config = GenerationConfig(max_new_tokens=40, chat=False)
    try:
        prompts = PROMPTS[:batch]
        ref = with_an_early_stop(target, PROMPTS, config)[:batch] if batch > 1 else plain_alone(target, prompts, config)
        decoder = SpeculativeDecoder(target, draft if drafter == "model" else "ngram", k=4)
        out = decoder.generate_batch(prompts, config)
    finally:
        target.tokenizer.eog_ids = saved
    assert [o.tokens for o in out] == ref
    assert [o.stats.generated_tokens for o in out] == [len(r) for r in ref]
    if batch > 1:
        assert {o.stats.finish_reason for o in out} == {"eog", "length"}
    if drafter == "model":  # the drafts were sometimes kept and sometimes not
        accepted = sum(o.stats.accepted for o in out)
        assert 0 < accepted < sum(o.stats.drafted for o in out)


def test_seeded_sampled_batch_equals_its_rows_one_by_one(models):
    target, draft = models
    config = GenerationConfig(max_new_tokens=32, temperature=0.8, top_k=40, top_p=0.95, min_p=0.02, seed=7, chat=False)
    decoder = SpeculativeDecoder(target, draft, k=3)
    batch = decoder.generate_batch(PROMPTS[:5], config)
    alone = [decoder.generate(p, config, seed=7 + i) for i, p in enumerate(PROMPTS[:5])]
    assert [b.tokens for b in batch] == [a.tokens for a in alone]
    assert [b.tokens for b in decoder.generate(PROMPTS[:5], config)] == [a.tokens for a in alone]
    assert [b.text for b in batch] == [a.text for a in alone]
    assert len({tuple(b.tokens) for b in batch}) == 5


def test_stop_strings_end_a_row(models, tokenizer):
    target, draft = models
    config = GenerationConfig(max_new_tokens=40, chat=False)
    first = SpeculativeDecoder(target).generate(PROMPTS[0], config)
    stop = first.text[10:13]
    out = SpeculativeDecoder(target, draft, k=4).generate_batch(PROMPTS[:3], config, stop=(stop,))
    assert out[0].stats.finish_reason == "stop" and out[0].text == first.text[: first.text.find(stop)]
    alone = [SpeculativeDecoder(target).generate(p, config, stop=(stop,)).text for p in PROMPTS[:3]]
    assert [o.text for o in out] == alone


def test_backends_without_a_batched_cache_run_rows_one_by_one():
    target = ToyLM(seed=3)
    draft = ToyLM(seed=4, noise_from=target, noise=0.5)
    decoder = SpeculativeDecoder(target, draft, k=3)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    out = decoder.generate_batch(prompts, max_new_tokens=20, temperature=1.0, seed=3)
    assert [o.tokens for o in out] == [
        decoder.generate(p, max_new_tokens=20, temperature=1.0, seed=3 + i).tokens for i, p in enumerate(prompts)
    ]


# -- sampled output follows p, end to end -----------------------------------------------------

V = 8
ROWS, PER_BATCH = 24_000, 4_000


def tiny_vocab_models(damp):
    target, draft = tiny_hf.pair("llama", V, seed=3, damp=damp)
    tok = ToyTokenizer(V, eog=())
    return TransformersModel(target, tok, name="t"), TransformersModel(draft, tok, name="d")


def exact_two_tokens(target, prompt, params):
    """P(first two tokens) under the target alone, from its own logits: [V * V]."""
    from specdec.sampling import logits_to_probs

    target.reset()
    p1 = logits_to_probs(target.forward(prompt, n_rows=1)[0], params)
    table = np.zeros((V, V))
    for t in range(V):
        target.reset()
        table[t] = p1[t] * logits_to_probs(target.forward(prompt + [t], n_rows=1)[0], params)
    return table.reshape(-1)


def sampled_two_tokens(target, draft, prompt, config):
    counts = np.zeros(V * V)
    decoder = SpeculativeDecoder(target, draft, k=3)
    for start in range(0, ROWS, PER_BATCH):
        out = decoder.generate_batch([prompt] * PER_BATCH, config, seed=1000 + start)
        for o in out:
            counts[o.tokens[0] * V + o.tokens[1]] += 1
    return counts


@pytest.mark.parametrize("filters", [dict(temperature=1.0), dict(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05)])
def test_sampled_batch_output_follows_the_target(filters):
    target, draft = tiny_vocab_models(damp=1.0)  # a draft that is often wrong
    prompt = [1, 2, 3, 4]
    config = GenerationConfig(max_new_tokens=2, **filters)
    expected = exact_two_tokens(target, prompt, config.sampling)
    counts = sampled_two_tokens(target, draft, prompt, config)
    assert counts.sum() == ROWS
    assert counts[expected == 0].sum() == 0
    chi2, df = chi2_statistic(counts, expected * ROWS)
    assert chi2 < chi2_threshold(df), (chi2, df)
    assert 0.5 * np.abs(counts / ROWS - expected).sum() < tv_threshold(expected, ROWS)


def test_the_end_to_end_check_catches_a_lossy_verifier(monkeypatch):
    """Power: a verifier that keeps every draft token gives the drafter's distribution, and fails."""
    import specdec.sampling as sampling
    from specdec.sampling import verify

    def keep_all(logits, tokens, q, params, rng, rule="block"):
        n, bonus = verify(logits, tokens, q, params, rng, rule)
        return len(tokens), (bonus if n == len(tokens) else tokens[-1])

    target, draft = tiny_vocab_models(damp=1.0)
    prompt = [1, 2, 3, 4]
    config = GenerationConfig(max_new_tokens=2, temperature=1.0)
    expected = exact_two_tokens(target, prompt, config.sampling)
    monkeypatch.setattr(sampling, "verify", keep_all)
    counts = sampled_two_tokens(target, draft, prompt, config)
    chi2, df = chi2_statistic(counts, expected * ROWS)
    assert chi2 > 10 * chi2_threshold(df), (chi2, df)
