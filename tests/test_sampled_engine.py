"""Sampled output follows the target's distribution through the whole engine, for every drafter kind:
the draft model (a real q; and its trees, siblings drawn without replacement), prompt lookup and the
suffix cache (one-hot drafts; the cache's trees, fixed candidates), `auto` (all of them, chosen per
step), and drafts from a model of another vocabulary (string-level and intersected). Drafts run up
to 4 tokens, rows run in batches that share the suffix cache, the target's end-of-generation token
ends rows early, and sampling filters cut p and q alike.

The check: the first N emitted tokens of many seeded rows against their exact probability under the
target alone, enumerated from the target's own logits (chi-square with small cells pooled and a
total-variation bound, at the 1e-4 level of tests/test_sampling.py). Each harness has a power check:
the same run with a verifier that samples the recovered token from p instead of the residual
norm(max(0, p - q)) must fail it by far (for the suffix cache's trees, fixed candidates: a rule
that leaves the rejected candidates in).

What this harness can see: 4 000 rows over up to 243 outcomes detect a shift of about TV 0.06 (the
chi-square at 1e-4 with 80% power; its TV bound, ~0.1, alone could never fail), so it catches gross
bugs on every backend and drafter kind, real batches, end-of-generation and filters, but not the
small biases a rule mixture makes (the tree fallback of 0af4022: TV 2e-3 to 3e-2). Those are
tests/test_exact_engine.py's: every random decision of the engine enumerated with its probability,
exact to 1e-9, with that fallback, a head's misreported q and a batch sharing one row's
parameters among its mutants."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from specdec import GenerationConfig, SpeculativeDecoder
from specdec.costs import CostTable
from specdec.drafters.cross_vocab import CrossVocabDrafter
from specdec.drafters.model import ModelDrafter
from specdec.drafters.ngram import NgramDrafter
from specdec.drafters.suffix import SuffixCacheDrafter
from specdec.sampling import VERIFICATION_RULES, SamplingParams, logits_to_probs

from .drafters.test_cross_vocab import draft_lm, target_lm
from .test_sampling import chi2_statistic, chi2_threshold, tv_threshold
from .toy import ToyLM, on_virtual_clock

EOG = -1  # an outcome's marker: generation ended there
N = 5  # tokens per row: the first step may draft N - 1 = 4
ROWS, PER_BATCH = 4_000, 2_000
# a flat cost curve (a GPU's) up to 64 tokens: auto drafts long for batches of 8 rows (on a
# batch of 2 000 a curve past its widest width rises, and speculation rightly stops paying)
FLAT = {w: 0.01 for w in (*range(1, 17), 32, 64)}
AUTO_BATCH = 8
FILTERS = {
    "t1-top3": dict(temperature=1.0, top_k=3),
    "t0.7-top4-p0.9-minp": dict(temperature=0.7, top_k=4, top_p=0.9, min_p=0.05),
}


def exact_outcomes(target, prompt, params: SamplingParams, n: int, allowed=None) -> dict[tuple, float]:
    """P(first n emitted tokens) under the target alone, by enumeration: an outcome is the tokens
    emitted, ended by EOG where the target's end-of-generation token came first. `allowed(prefix)`
    (a bool per token) masks the target's logits after each prefix, as a grammar does."""
    eog = target.tokenizer.eog_ids
    out: dict[tuple, float] = {}

    def walk(prefix: tuple, prob: float) -> None:
        if len(prefix) == n:
            out[prefix] = prob
            return
        target.reset()
        logits = target.forward(list(prompt) + list(prefix), n_rows=1)[0]
        if allowed is not None:
            logits = np.where(allowed(prefix), logits, -np.inf)
        p = logits_to_probs(logits, params)  # [vocab]
        for token in np.flatnonzero(p):
            if int(token) in eog:
                out[prefix + (EOG,)] = prob * p[token]
            else:
                walk(prefix + (int(token),), prob * p[token])

    walk((), 1.0)
    target.reset()
    return out


def sampled_outcomes(
    decoder: SpeculativeDecoder,
    prompt,
    config: GenerationConfig,
    rows: int = ROWS,
    per_batch: int | None = None,
    seed: int = 10_000,
) -> Counter:
    """The outcomes of `rows` seeded rows, in batches (batch_size's unless given)."""
    counts: Counter = Counter()
    per_batch = per_batch or batch_size(decoder)
    for start in range(0, rows, per_batch):
        for result in decoder.generate_batch([prompt] * per_batch, config, seed=seed + start):
            counts[tuple(result.tokens) + ((EOG,) if result.stats.finish_reason == "eog" else ())] += 1
    return counts


def batch_size(decoder: SpeculativeDecoder) -> int:
    return AUTO_BATCH if decoder.auto else PER_BATCH


def distance(counts: Counter, expected: dict[tuple, float], rows: int = ROWS) -> tuple[float, float, float, float]:
    """(chi-square, its 1e-4 threshold, total variation, its bound); outcomes the target cannot
    produce fail at once."""
    impossible = {o: c for o, c in counts.items() if o not in expected}
    assert not impossible, f"outcomes the target never produces: {dict(list(impossible.items())[:3])}"
    keys = list(expected)
    probs = np.array([expected[o] for o in keys])
    observed = np.array([counts.get(o, 0) for o in keys], dtype=np.float64)
    n = observed.sum()
    assert n == rows
    chi2, df = chi2_statistic(observed, probs * n)
    tv = 0.5 * np.abs(observed / n - probs).sum()
    return chi2, chi2_threshold(df), tv, tv_threshold(probs, n)


# -- the toy harness: a trigram target over the pieces of tests/drafters/test_cross_vocab.py ------------


def toy_target():
    """Token 0 ends generation. The prompt is a path the target samples itself, given twice, so
    prompt lookup proposes tokens the target likes (drafts are kept, not only rejected)."""
    target = target_lm(seed=1)
    target.path = None
    plain = SpeculativeDecoder(target)
    path = next(
        tokens
        for seed in range(100)
        if len(tokens := plain.generate([1], max_new_tokens=8, temperature=1.0, top_k=3, seed=seed).tokens) == 8
    )  # no early end
    return target, [1, *path, 1, *path[:4]]


def same_vocab_draft(target):
    draft = ToyLM(vocab_size=target.vocab_size, seed=5, noise_from=target, noise=0.7)
    draft.tokenizer, draft.name, draft.path = target.tokenizer, "toy-draft", None
    return draft


def toy_decoder(kind: str, target) -> SpeculativeDecoder:
    if kind == "auto":
        draft = same_vocab_draft(target)
        decoder = SpeculativeDecoder(
            target, "auto", draft_model=draft, suffix=True, costs=(CostTable(FLAT), CostTable({w: 0.002 for w in FLAT}))
        )
        decoder.engine.clock = on_virtual_clock(target, decoder.engine.controller.target_cost.measured)
        return decoder
    drafter = {
        "draft model": lambda: same_vocab_draft(target),
        "draft tree": lambda: ModelDrafter(same_vocab_draft(target), width=2),
        "draft tree by path": lambda: ModelDrafter(same_vocab_draft(target), width=2, nodes=8),
        "ngram": lambda: "ngram",
        "suffix": lambda: "suffix",
        "suffix tree": lambda: SuffixCacheDrafter(width=2),  # fixed candidates (no q) under sampling
        "ngram tree": lambda: NgramDrafter(width=2),  # prompt lookup's continuations: fixed candidates too
        "string:": lambda: CrossVocabDrafter(draft_lm(), target, "string"),
        "intersect:": lambda: CrossVocabDrafter(draft_lm(), target, "intersect"),
    }[kind]()
    return SpeculativeDecoder(target, drafter, k=N - 1)


KINDS = [
    *("draft model", "ngram", "suffix", "auto", "string:", "intersect:", "draft tree", "draft tree by path"),
    "suffix tree",
    "ngram tree",
]


@pytest.fixture(scope="module")
def toy():
    return toy_target()


@pytest.mark.parametrize("kind, filters", [(kind, list(FILTERS)[i % 2]) for i, kind in enumerate(KINDS)])
def test_every_drafter_samples_the_target_through_the_engine(toy, kind, filters):
    target, prompt = toy
    config = GenerationConfig(max_new_tokens=N, chat=False, **FILTERS[filters])
    expected = exact_outcomes(target, prompt, config.sampling, N)
    decoder = toy_decoder(kind, target)
    counts = sampled_outcomes(decoder, prompt, config)
    chi2, chi2_max, tv, tv_max = distance(counts, expected)
    assert chi2 < chi2_max and tv < tv_max, (kind, chi2, chi2_max, tv, tv_max)
    # the test means something only if drafts of several tokens were made and some were kept
    stats = decoder.engine.controller.decisions if kind == "auto" else None
    if stats is not None:
        used = {key.split(":")[0] for key in stats if key != "plain"}
        assert {"ngram", "suffix", "draft"} <= used, stats


@pytest.mark.parametrize("kind", ["draft model", "draft tree", "draft tree by path"])
@pytest.mark.parametrize("rule", VERIFICATION_RULES)
def test_every_rule_samples_the_target_through_the_engine(toy, rule, kind):
    """The draft model's real q, its chains and its trees, verified by each rule
    (GenerationConfig.verification: a tree node by node, or walked from its leaves up), in the
    harness's batches: the target's distribution (tests/test_verify_rules.py holds the rules
    themselves, block verification exactly)."""
    target, prompt = toy
    config = GenerationConfig(max_new_tokens=N, chat=False, verification=rule, **FILTERS["t1-top3"])
    expected = exact_outcomes(target, prompt, config.sampling, N)
    counts = sampled_outcomes(toy_decoder(kind, target), prompt, config)
    chi2, chi2_max, tv, tv_max = distance(counts, expected)
    assert chi2 < chi2_max and tv < tv_max, (rule, kind, chi2, chi2_max, tv, tv_max)


def test_every_drafter_drafts_long_and_is_sometimes_right(toy):
    """What the distribution tests above exercise: for each kind, drafts of 4 tokens, some kept
    (the bonus token from p) and some rejected (the recovered token from the residual); for the
    same-vocabulary kinds, some 4-token drafts kept whole. (The toy draft of another vocabulary
    is unrelated to the target: its drafts are kept at the first position only.)"""
    target, prompt = toy
    config = GenerationConfig(max_new_tokens=N, chat=False, **FILTERS["t1-top3"])
    for kind in KINDS:
        decoder = toy_decoder(kind, target)
        results = [
            r
            for start in range(0, 400, batch_size(decoder))
            for r in decoder.generate_batch([prompt] * min(batch_size(decoder), 400), config, seed=start)
        ]
        drafted = sum(r.stats.drafted for r in results)
        accepted = sum(r.stats.accepted for r in results)
        assert 0 < accepted < drafted, (kind, accepted, drafted)
        assert max(len(r.stats.drafted_at) for r in results) == N - 1, kind
        if kind not in ("string:", "intersect:"):
            assert any(r.stats.accepted_at[N - 2 :] == [1] for r in results), (kind, "no 4-token draft kept whole")


def broken_residual(p_row, q_row):
    return p_row  # the classic bug: the rejected token may come back


def break_residuals(patch) -> None:
    """The classic bug in every rule: token by token (sampling.residual), block verification
    (sampling.block_residual) and its tree form (sampling._after_cut) sample from p after a
    rejection."""
    import specdec.sampling

    patch.setattr(specdec.sampling, "residual", broken_residual)
    patch.setattr(specdec.sampling, "block_residual", lambda p_row, q_row, weight: p_row)
    patch.setattr(specdec.sampling, "_after_cut", lambda m, row: row)


@pytest.mark.parametrize("kind", ["draft model", "ngram", "draft tree"])
def test_the_harness_fails_a_verifier_that_resamples_from_p(toy, kind, monkeypatch):
    """Power: with the residual replaced by p, a rejected draft token comes back too often; the
    harness above must reject it far beyond its threshold, for a real q and for one-hot drafts."""

    target, prompt = toy
    config = GenerationConfig(max_new_tokens=N, chat=False, **FILTERS["t1-top3"])
    expected = exact_outcomes(target, prompt, config.sampling, N)
    break_residuals(monkeypatch)
    chi2, chi2_max, tv, tv_max = distance(sampled_outcomes(toy_decoder(kind, target), prompt, config), expected)
    assert chi2 > 3 * chi2_max and tv > tv_max, (chi2, chi2_max, tv, tv_max)


def test_the_harness_fails_a_fixed_candidate_rule_that_forgets_the_rejected(toy, monkeypatch):
    """Power for the suffix cache's trees, whose nodes are fixed candidates (no q): with each
    rejected candidate left in what the next one is tried against and what the token is drawn
    from, a rejected candidate comes back too often; the harness must reject that far beyond its
    threshold (the chain rules' power checks above never reach this rule)."""
    import specdec.sampling

    real = specdec.sampling.verify_candidates

    def forgetful(p_row, candidates, q_row, rng, replacement=True):
        if q_row is not None:
            return real(p_row, candidates, q_row, rng, replacement)
        for i, x in enumerate(candidates):
            if rng.random() < p_row[x]:
                return i, int(x)
        return -1, specdec.sampling.sample(p_row, rng)  # the bug: p, not p without the candidates

    target, prompt = toy
    config = GenerationConfig(max_new_tokens=N, chat=False, **FILTERS["t1-top3"])
    expected = exact_outcomes(target, prompt, config.sampling, N)
    monkeypatch.setattr(specdec.sampling, "verify_candidates", forgetful)
    chi2, chi2_max, tv, tv_max = distance(
        sampled_outcomes(toy_decoder("suffix tree", target), prompt, config), expected
    )
    assert chi2 > 3 * chi2_max and tv > tv_max, (chi2, chi2_max, tv, tv_max)


# -- the torch backend: batched rows in one forward (tiny random Llama, tests/tiny_hf.py) ---------

TORCH_N = 4


@pytest.fixture(scope="module")
def torch_pair():
    from .conftest import needs_torch

    needs_torch()
    from specdec.models.transformers import TransformersModel

    from . import tiny_hf
    from .toy import ToyTokenizer

    target, draft = tiny_hf.pair("llama", 8, seed=3, damp=1.0)
    tok = ToyTokenizer(8, eog=())
    target, draft = TransformersModel(target, tok, name="t"), TransformersModel(draft, tok, name="d")
    target.path = draft.path = None
    return target, draft


def torch_decoder(kind: str, target, draft, tmp_path=None) -> SpeculativeDecoder:
    if kind.startswith("head "):  # a random head drafting from 6 of the 8 tokens (q is 0 at the others)
        from specdec.drafters.head import HeadDrafter

        from .drafters.heads import random_head

        head = kind.split()[1]
        drafter = HeadDrafter(target, random_head(target, head, tmp_path / f"{head}.head", vocab=6, scale=0.5))
        assert drafter._torch is not None  # the chain runs in torch, rows batched
        return SpeculativeDecoder(target, drafter, k=TORCH_N - 1)
    if kind == "early exit":  # the target's first layer, its cache shared, every row's exit in one forward
        from specdec.drafters.early_exit import EarlyExitDrafter

        return SpeculativeDecoder(target, EarlyExitDrafter(target, 1), k=TORCH_N - 1)
    if kind == "early exit tree":  # its tree: the 3 likeliest paths of its 2 draws a depth
        from specdec.drafters.early_exit import EarlyExitDrafter

        return SpeculativeDecoder(target, EarlyExitDrafter(target, 1, width=2, nodes=3), k=TORCH_N - 1)
    if kind == "early exit block":  # and a block after it (a damped copy of layer 1) with its own cache
        import copy

        import torch

        from specdec.drafters.early_exit import EarlyExitDrafter
        from specdec.models.transformers import TransformersModel

        own = TransformersModel(copy.deepcopy(target.model), target.tokenizer, name="t+block")
        block = copy.deepcopy(own._decoder_layers()[1])
        with torch.no_grad():
            block.self_attn.o_proj.weight.mul_(0.5)
        own.attach_exit_blocks(1, [block])
        return SpeculativeDecoder(own, EarlyExitDrafter(own, 1, blocks=1), k=TORCH_N - 1)
    drafter = {"draft model": draft, "draft tree": ModelDrafter(draft, width=2)}.get(kind, kind)
    return SpeculativeDecoder(target, drafter, k=TORCH_N - 1)


@pytest.mark.parametrize(
    "kind",
    [
        *("draft model", "ngram", "draft tree", "head medusa", "head prophet"),
        *("early exit", "early exit tree", "early exit block"),
    ],
)
def test_batched_torch_rows_sample_the_target(torch_pair, kind, tmp_path):
    """2 000 rows in each forward (auto's choice is the toy harness's: it is the same controller
    on any backend, and at batch sizes where it drafts, the torch runs take minutes). A head's
    rows draft side by side in one batched chain, each token drawn from its own row's q; so do
    the early exit's, through the target's first layer (and a trained block's stand-in)."""
    target, draft = torch_pair
    prompt = [1, 2, 3, 4, 1, 2, 3]
    config = GenerationConfig(max_new_tokens=TORCH_N, chat=False, **FILTERS["t1-top3"])
    expected = exact_outcomes(target, prompt, config.sampling, TORCH_N)
    decoder = torch_decoder(kind, target, draft, tmp_path)
    chi2, chi2_max, tv, tv_max = distance(sampled_outcomes(decoder, prompt, config), expected)
    assert chi2 < chi2_max and tv < tv_max, (kind, chi2, chi2_max, tv, tv_max)


def test_the_torch_harness_fails_a_verifier_that_resamples_from_p(torch_pair, monkeypatch):

    target, draft = torch_pair
    prompt = [1, 2, 3, 4, 1, 2, 3]
    config = GenerationConfig(max_new_tokens=TORCH_N, chat=False, **FILTERS["t1-top3"])
    expected = exact_outcomes(target, prompt, config.sampling, TORCH_N)
    break_residuals(monkeypatch)
    chi2, chi2_max, tv, tv_max = distance(
        sampled_outcomes(torch_decoder("draft model", target, draft), prompt, config), expected
    )
    assert chi2 > 3 * chi2_max and tv > tv_max, (chi2, chi2_max, tv, tv_max)


# -- the NumPy backend: early exit, whose drafts come from the target's own first layers ------------

EARLY_ROWS = 1_500


@pytest.mark.parametrize("shape", [{}, {"width": 3, "nodes": 4}], ids=["chain", "tree"])
def test_early_exit_samples_the_target_on_the_numpy_backend(tmp_path, shape):
    """A tiny random 4-layer GPT-2 (tests/models/test_numpy_ref.py) drafting with its first layer,
    a chain or a tree (the 4 likeliest paths of 3 draws a depth); top-k 3 keeps the outcomes
    enumerable over its 300-token vocabulary, and temperature 3 spreads this random model's peaked
    logits (at 1.0 one outcome has 0.99). Power: the broken residual fails the same harness."""
    from specdec.drafters.early_exit import EarlyExitDrafter
    from specdec.models.numpy_ref import load_numpy_model

    from .models.test_numpy_ref import write_tiny_gguf

    path = tmp_path / "tiny-gpt2-4.gguf"
    write_tiny_gguf(path, "gpt2", seed=3, n_layer=4)
    target = load_numpy_model(path)
    prompt = target.tokenizer.encode("the cat in a hat", add_special=False)
    config = GenerationConfig(max_new_tokens=TORCH_N, chat=False, temperature=3.0, top_k=3)
    expected = exact_outcomes(target, prompt, config.sampling, TORCH_N)

    def run() -> Counter:
        decoder = SpeculativeDecoder(target, EarlyExitDrafter(target, 1, **shape), k=TORCH_N - 1)
        return sampled_outcomes(decoder, prompt, config, EARLY_ROWS, per_batch=500, seed=0)

    chi2, chi2_max, tv, tv_max = distance(run(), expected, rows=EARLY_ROWS)
    assert chi2 < chi2_max and tv < tv_max, (chi2, chi2_max, tv, tv_max)
    with pytest.MonkeyPatch.context() as patch:
        break_residuals(patch)
        chi2, chi2_max, tv, tv_max = distance(run(), expected, rows=EARLY_ROWS)
    assert chi2 > 3 * chi2_max and tv > tv_max, (chi2, chi2_max, tv, tv_max)


@pytest.mark.parametrize("kind", ["medusa", "prophet", "early-exit", "medusa tree", "prophet tree"])
def test_a_trained_head_samples_the_target(tmp_path, kind, monkeypatch):
    """A head drafts from the target's hidden states with its own q over a draft vocabulary (q is 0
    outside it): the same tiny GPT-2 and harness as early exit above, with a random head file of
    each kind (early-exit: the draft model built from the target's first layer and the head's
    block), and Medusa's and the prophet's trees shaped by their paths' probabilities (siblings
    drawn without replacement). Power: the broken residual fails it."""
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    from specdec.models.numpy_ref import load_numpy_model
    from specdec.spec import parse

    from .drafters.heads import random_head
    from .models.test_numpy_ref import write_tiny_gguf

    path = tmp_path / "tiny-gpt2-4.gguf"
    write_tiny_gguf(path, "gpt2", seed=3, n_layer=4)
    target = load_numpy_model(path)
    head_kind, _, tree = kind.partition(" ")
    head = random_head(target, head_kind, tmp_path / f"{head_kind}.head", vocab=200)
    prompt = target.tokenizer.encode("the cat in a hat", add_special=False)
    config = GenerationConfig(max_new_tokens=TORCH_N, chat=False, temperature=3.0, top_k=3)
    expected = exact_outcomes(target, prompt, config.sampling, TORCH_N)
    shape = {"width": 3, "nodes": 5} if tree else {}

    def run() -> Counter:
        decoder = SpeculativeDecoder.from_spec(target, parse(f"head:{head}", k=TORCH_N - 1, **shape))
        return sampled_outcomes(decoder, prompt, config, EARLY_ROWS, per_batch=500, seed=0)

    kept = SpeculativeDecoder.from_spec(target, parse(f"head:{head}", k=3, **shape)).generate_batch(
        [prompt] * 50, config
    )
    assert sum(r.stats.accepted for r in kept) > 0  # its drafts are kept, not only rejected
    counts = run()
    chi2, chi2_max, tv, tv_max = distance(counts, expected, rows=EARLY_ROWS)
    assert chi2 < chi2_max and tv < tv_max, (chi2, chi2_max, tv, tv_max)
    if kind in ("medusa", "early-exit", "medusa tree"):
        with pytest.MonkeyPatch.context() as patch:
            break_residuals(patch)
            chi2, chi2_max, tv, tv_max = distance(run(), expected, rows=EARLY_ROWS)
        assert chi2 > 3 * chi2_max and tv > tv_max, (chi2, chi2_max, tv, tv_max)
