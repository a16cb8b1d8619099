"""A draft model of another vocabulary: the intersection rule by exact enumeration, string-level
drafting by exact enumeration with the real drafter, greedy equality in the engine, and the token
boundaries (text that ends mid-token, split UTF-8, special tokens, the draft's resync after a
rejection), on two toy vocabularies that overlap partly."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from specdec import SpeculativeDecoder
from specdec.drafters import model_drafter
from specdec.drafters.cross_vocab import CrossVocabDrafter, intersect_q, retokenize, shared_tokens, whole_utf8
from specdec.drafters.model import ModelDrafter
from specdec.errors import SpecdecError, VocabMismatchError
from specdec.sampling import SamplingParams, logits_to_probs, residual, sample, verify_stochastic
from specdec.spec import parse

from ..test_engine import reference_greedy
from ..test_sampling import chi2_statistic, chi2_threshold, tv_threshold
from ..toy import ToyLM, piece_lm

# The target's vocabulary: characters, two merges, the two bytes of "é", and an end token.
TARGET = [b"", b"a", b"b", b"c", b" ", b"ab", b"ca", b"\xc3", b"\xa9", b"\n"]
TARGET_NAMES = {0: "<|end|>"}
# The draft's: pairs of characters, "é" whole and as byte-fallback bytes, a byte-fallback twin of
# "a" (token 15), the pieces of "<|end|>" as plain text, and its own end and begin tokens.
DRAFT = [
    b"",
    b"",
    b"a",
    b"b",
    b"c",
    b" ",
    b"aa",
    b"ab",
    b"ba",
    b"bc",
    b"cab",
    b" a",
    b"\xc3\xa9",
    b"\xc3",
    b"\xa9",
    b"a",
    b"\n",
    b"<",
    b"|",
    b"end",
    b">",
]
DRAFT_NAMES = {0: "</s>", 1: "<s>"}


def target_lm(seed=1, cls=None, **kw):
    return piece_lm(TARGET, seed, names=TARGET_NAMES, **kw)


def draft_lm(seed=2, **kw):
    return piece_lm(DRAFT, seed, bos=1, names=DRAFT_NAMES, **kw)


def row_text(model, row) -> bytes:
    """The text a toy model's row holds in its cache."""
    return b"".join(model.tokenizer.token_bytes(t) for t in model._row_states()[row])


# ---------------------------------------------------------------------------- the vocabulary map


def test_shared_tokens_match_bytes_and_skip_special_tokens():
    d_ids, t_ids = shared_tokens(draft_lm(), target_lm())
    pairs = dict(zip(d_ids.tolist(), t_ids.tolist()))
    # a, b, c, space, ab, the two bytes of é, the twin of a, newline; nothing that prints nothing
    assert pairs == {2: 1, 3: 2, 4: 3, 5: 4, 7: 5, 13: 7, 14: 8, 15: 1, 16: 9}
    assert list(d_ids) == sorted(d_ids)


def test_intersect_q_restricts_renormalises_and_sums_twins():
    d_ids, t_ids = shared_tokens(draft_lm(), target_lm())
    q = np.zeros(len(DRAFT))
    q[[2, 15, 6, 12]] = [0.2, 0.1, 0.5, 0.2]  # a, its twin, aa and é: only a is shared
    over_shared, over_target = intersect_q(q, d_ids, t_ids, len(TARGET))
    np.testing.assert_allclose(over_target[1], 1.0)
    np.testing.assert_allclose(over_shared[list(d_ids).index(2)], 2 / 3)
    assert over_target.shape == (len(TARGET),) and over_target.sum() == pytest.approx(1.0)
    q[:] = 0
    q[6] = 1.0  # all its mass on "aa", which the target lacks
    assert intersect_q(q, d_ids, t_ids, len(TARGET)) is None


# ---------------------------------------------------------------------------- exact distribution
#
# As in tests/test_sampling.py: the target's distribution is fixed per output position, so the
# first M emitted tokens must follow prod_pos p_pos exactly, whatever the drafter does.

V, M, N_SAMPLES = len(TARGET), 3, 200_000
PARAMS = SamplingParams(temperature=0.9, top_k=8, top_p=0.95)


def exact_distribution(p_tab):
    joint = p_tab[0]
    for pos in range(1, M):
        joint = np.multiply.outer(joint, p_tab[pos])
    return joint.reshape(-1)


def check(counts, exact, label):
    stat, df = chi2_statistic(counts, N_SAMPLES * exact)
    tv = 0.5 * np.abs(counts / N_SAMPLES - exact).sum()
    print(f"{label}: chi2 {stat:.1f} df {df} threshold {chi2_threshold(df):.1f}; TV {tv:.4f}")
    return counts[exact == 0].sum() == 0 and stat < chi2_threshold(df) and tv < tv_threshold(exact, N_SAMPLES)


def intersect_tables(seed, k):
    """Target probabilities per position [M + k, V]; the draft's per position over its own vocabulary,
    related to the target's on the shared tokens, its twin of "a" as likely as "a"."""
    rng = np.random.default_rng(seed)
    n_pos = M + k
    p_logits = rng.normal(0.0, 1.0, size=(n_pos, V))
    d_logits = rng.normal(0.0, 1.0, size=(n_pos, len(DRAFT)))
    d_ids, t_ids = shared_tokens(draft_lm(), target_lm())
    d_logits[:, d_ids] = p_logits[:, t_ids] + rng.normal(0.0, 0.7, size=(n_pos, len(d_ids)))
    d_logits[:, 15] = d_logits[:, 2]
    d_logits[:, [0, 1]] = -30.0  # the draft's special tokens, as a model rarely writes them
    return logits_to_probs(p_logits, PARAMS), logits_to_probs(d_logits, PARAMS), d_ids, t_ids


def run_intersect(seed, k, q_of=None):
    """Counts of the first M emitted tokens when the drafter samples draft tokens from the draft's
    q restricted to the shared tokens and the target verifies the mapped tokens with that q.
    `q_of(q_draft_row, d_ids, t_ids)` replaces the q passed to verification (a broken rule)."""
    p_tab, d_tab, d_ids, t_ids = intersect_tables(seed, k)
    steps = [intersect_q(row, d_ids, t_ids, V) for row in d_tab]  # per position, or None
    rng, draft_rng = np.random.default_rng([seed, 1]), np.random.default_rng([seed, 2])
    counts = np.zeros(V**M, dtype=np.int64)
    for _ in range(N_SAMPLES):
        out = []
        while len(out) < M:
            pos = len(out)
            tokens, qs = [], []
            for j in range(k):
                shared = steps[pos + j]
                if shared is None:
                    break
                over_shared, over_target = shared
                i = sample(over_shared, draft_rng)
                tokens.append(int(t_ids[i]))
                qs.append(over_target if q_of is None else q_of(d_tab[pos + j], d_ids, t_ids, i))
            q = np.stack(qs) if qs else None
            n, nxt = verify_stochastic(p_tab[pos : pos + len(tokens) + 1], tokens, q, rng)
            out += tokens[:n] + [nxt]
        counts[(out[0] * V + out[1]) * V + out[2]] += 1
    return counts, exact_distribution(p_tab)


@pytest.mark.parametrize("seed, k", [(21, 1), (22, 3)])
def test_intersection_rule_is_lossless(seed, k):
    counts, exact = run_intersect(seed, k)
    assert check(counts, exact, f"intersect k={k}")


def _unnormalised(q_draft, d_ids, t_ids, i):
    """Broken: the restricted q without renormalising (its mass is below 1)."""
    return np.bincount(t_ids, weights=q_draft[d_ids], minlength=V)


def _twins_not_summed(q_draft, d_ids, t_ids, i):
    """Broken: q of the drafted token alone, not summed over the draft tokens of the same bytes."""
    restricted = q_draft[d_ids] / q_draft[d_ids].sum()
    q = np.zeros(V)
    q[t_ids] = restricted  # a later twin overwrites the earlier one
    return q


@pytest.mark.parametrize("broken", [_unnormalised, _twins_not_summed])
def test_the_enumeration_catches_a_wrong_intersection_q(broken):
    counts, exact = run_intersect(22, 3, broken)
    assert not check(counts, exact, broken.__name__)


def test_the_draft_row_holds_the_targets_text_on_any_walk():
    """Whatever the order of the contexts (a rejection, a correction, a jump elsewhere), after a
    proposal the draft row's cache holds the target's text in the draft's tokens, then the draft
    tokens it fed itself; its bookkeeping matches its cache."""
    draft = draft_lm()
    drafter = CrossVocabDrafter(draft, target_lm(), "string")
    prompt = [1, 4, 2]
    drafter.begin(0, prompt, PARAMS, np.random.default_rng(0))
    rng = np.random.default_rng(5)
    context = list(prompt)
    for _ in range(300):
        if rng.random() < 0.3 and len(context) > len(prompt):  # back to an earlier point
            context = context[: rng.integers(len(prompt), len(context))]
        tail = rng.choice([1, 2, 3, 4, 5, 6, 9, 7], size=rng.integers(1, 4)).tolist()
        if context[-1] == 7:  # the second byte of "é" follows its first
            tail = [8] + tail
        for i in range(len(tail) - 1, -1, -1):  # only the last "é" may stay half-written
            if tail[i] == 7 and i < len(tail) - 1:
                tail.insert(i + 1, 8)
        context = context + tail
        draft_ = drafter.propose({0: context}, {0: 3})[0]
        state = drafter._rows[0]
        cache = draft._row_states()[state.model_row]
        assert cache == state.fed and row_text(draft, state.model_row) == bytes(state.fed_bytes)
        rendered = b"".join(TARGET[t] for t in context)
        text, held = whole_utf8(rendered)
        if not held:
            assert bytes(state.fed_bytes).startswith(rendered)
        else:
            assert draft_.tokens == []
        assert 0 not in draft_.tokens and draft_.q is None


_STATE = ("fed", "ends", "fed_bytes", "head", "rendered", "n_rendered", "context", "synced")


def _snapshot(state):
    return {name: copy.copy(getattr(state, name)) for name in _STATE}, state.decoder.getstate()


def _restore(state, snapshot):
    fields, decoder = snapshot
    for name, value in fields.items():
        setattr(state, name, copy.copy(value))
    state.decoder.setstate(decoder)


def run_string(seed, k, verify_fn=verify_stochastic):
    """Counts of the first M tokens when the real string-level drafter (toy draft model, the
    other vocabulary) proposes and verify_fn verifies; the target is fixed per position.

    A proposal is a function of the context and of the drafter's state (the draft tokens its row
    holds, which depend on the path taken): each (context, state) is computed once by the real
    drafter and its outcome, the proposal and the state after it, replayed when met again."""
    rng_tab = np.random.default_rng(seed)
    p_tab = logits_to_probs(rng_tab.normal(0.0, 1.0, size=(M + k + 1, V)), PARAMS)
    draft = draft_lm(seed=seed)
    drafter = CrossVocabDrafter(draft, target_lm(), "string")
    prompt = [3, 4, 1, 5]
    drafter.begin(0, prompt, PARAMS, np.random.default_rng(0))
    drafter.propose({0: prompt}, {0: 1})
    row = drafter._rows[0].model_row
    memo = {}
    rng = np.random.default_rng([seed, 1])
    counts = np.zeros(V**M, dtype=np.int64)
    for _ in range(N_SAMPLES):
        out = []
        while len(out) < M:
            pos = len(out)
            key = (tuple(out), tuple(drafter._rows[0].fed))
            if key not in memo:
                tokens = drafter.propose({0: prompt + out}, {0: k})[0].tokens
                memo[key] = (tokens, _snapshot(drafter._rows[0]), list(draft._row_states()[row]))
            tokens, state, cache = memo[key]
            _restore(drafter._rows[0], state)
            draft._row_states()[row] = list(cache)
            n, nxt = verify_fn(p_tab[pos : pos + len(tokens) + 1], tokens, None, rng)
            out += tokens[:n] + [nxt]
        counts[(out[0] * V + out[1]) * V + out[2]] += 1
    drafted = sum(len(t) for t, _, _ in memo.values())
    return counts, exact_distribution(p_tab), drafted


@pytest.mark.parametrize("seed, k", [(31, 2), (32, 4)])
def test_string_level_drafts_are_lossless(seed, k):
    counts, exact, drafted = run_string(seed, k)
    assert drafted > 0
    assert check(counts, exact, f"string k={k}")


def test_the_enumeration_catches_a_wrong_one_hot_residual():
    def residual_is_p(p, tokens, q, rng):  # broken: the correction sampled from p, not p - onehot
        for i, x in enumerate(tokens):
            if rng.random() < p[i, x]:
                continue
            return i, sample(p[i], rng)
        return len(tokens), sample(p[len(tokens)], rng)

    counts, exact, _ = run_string(32, 4, residual_is_p)
    assert not check(counts, exact, "residual is p")
    assert residual(np.array([0.5, 0.5]), np.array([1.0, 0.0]))[1] == 1.0  # the honest one


# ---------------------------------------------------------------------------- in the engine


@pytest.mark.parametrize("mode", ["string", "intersect"])
@pytest.mark.parametrize("prompt", [[1, 4, 2], [7, 8, 1, 5], [3, 3, 3, 9, 4, 6]])
def test_greedy_output_is_the_targets(mode, prompt):
    target = target_lm()
    expected = reference_greedy(target_lm(), prompt, 40)
    drafter = CrossVocabDrafter(draft_lm(), target, mode)
    result = SpeculativeDecoder(target, drafter, k=4).generate(prompt, max_new_tokens=40)
    assert result.tokens == expected
    assert result.stats.drafted > 0


@pytest.mark.parametrize("mode", ["string", "intersect"])
def test_rows_of_a_batch_equal_their_solo_runs(mode):
    prompts = [[1, 4, 2], [7, 8, 1, 5], [3, 3, 3, 9, 4, 6]]
    solo = [
        SpeculativeDecoder(target_lm(), CrossVocabDrafter(draft_lm(), target_lm(), mode), k=3).generate(
            p, max_new_tokens=30, temperature=0.8, seed=7 + i
        )
        for i, p in enumerate(prompts)
    ]
    target = target_lm()
    batch = SpeculativeDecoder(target, CrossVocabDrafter(draft_lm(), target, mode), k=3).generate_batch(
        prompts, max_new_tokens=30, temperature=0.8, seed=7
    )
    assert [r.tokens for r in batch] == [r.tokens for r in solo]


SCRIPT = b"ab cab\nab ca\xc3\xa9 abba cab ab\n" * 3


class TextOracle(ToyLM):
    """Writes SCRIPT: its argmax is the longest piece of its vocabulary that continues the script
    from the text its cache holds (its end token once the text leaves the script)."""

    def forward(self, tokens, n_rows=None):
        tok = self.tokenizer
        rows = []
        for t in tokens:
            self.cache.append(int(t))
            text = b"".join(tok.token_bytes(x) for x in self.cache)
            row = np.zeros(self.vocab_size, dtype=np.float32)
            best = 0
            if SCRIPT.startswith(text):
                rest = SCRIPT[len(text) :]
                fits = [i for i, p in enumerate(tok.pieces) if p and rest.startswith(p)]
                best = max(fits, key=lambda i: (len(tok.pieces[i]), -i)) if fits else 0
            row[best] = 10.0
            rows.append(row)
        n_rows = len(tokens) if n_rows is None else n_rows
        return np.array(rows[len(rows) - n_rows :]).reshape(n_rows, self.vocab_size)


def oracle(pieces, names, **kw):
    model = piece_lm(pieces, 0, names=names, **kw)
    model.__class__ = TextOracle
    return model


def test_a_draft_that_writes_the_same_text_is_accepted_across_tokenizers():
    """Draft and target write the same text in their own tokens: string-level proposals are the
    target's own tokens (the boundaries handled), the draft row follows every correction, and
    the output is the target's."""
    target = oracle(TARGET, TARGET_NAMES)
    prompt = target.tokenizer.encode("ab ca", add_special=False)
    expected = reference_greedy(oracle(TARGET, TARGET_NAMES), prompt, 60)
    assert b"\xc3\xa9" in b"".join(TARGET[t] for t in expected)  # "é" goes through its two bytes
    # string-level re-reads the draft's "cab", "ba" and whole "é" (not in the intersection) as
    # target tokens; the intersection can only propose the shared pieces, and misses there
    for mode, least in (("string", 0.9), ("intersect", 0.3)):
        drafter = CrossVocabDrafter(oracle(DRAFT, DRAFT_NAMES, bos=1), target, mode)
        result = SpeculativeDecoder(target, drafter, k=4).generate(prompt, max_new_tokens=60)
        assert result.tokens == expected
        s = result.stats
        assert s.accepted / s.drafted >= least, (mode, s.accepted, s.drafted)


# ---------------------------------------------------------------------------- the boundaries


def test_whole_utf8_holds_back_a_split_character():
    assert whole_utf8(b"ab\xc3") == ("ab", 1)
    assert whole_utf8(b"ab\xc3\xa9") == ("ab\u00e9", 0)
    assert whole_utf8(b"a\xa9b") == ("a\ufffdb", 0)  # a stray byte inside: replaced, not held


def test_retokenize_drops_the_token_that_may_still_grow():
    tok = target_lm().tokenizer
    special = frozenset({0})
    # "ab" + draft "c" "a" "b": the target reads "ab", "ca", "b"; the last may grow into more
    assert retokenize(tok, [5], b"ab", b"cab", special) == [6]
    # one stable token needs a second one after it
    assert retokenize(tok, [5], b"ab", b"c", special) == []


def test_retokenize_reads_the_draft_text_in_the_targets_context():
    tok = target_lm().tokenizer
    special = frozenset({0})
    # context ends "...c"; draft text "ab c": with the anchor the target reads c, ab, " ", c
    assert retokenize(tok, [3], b"c", b"ab c", special) == [5, 4]
    # context ends with "a"; draft text "b c": "a" + "b" merge into "ab", which the target cannot
    # take back: the draft text is read on its own from the end of the context
    assert retokenize(tok, [1], b"a", b"b c", special) == [2, 4]


def test_retokenize_never_proposes_special_tokens():
    tok = target_lm().tokenizer
    # the draft writes "<|end|>" as text; the target's tokenizer reads its end token there
    assert retokenize(tok, [1], b"a", b"b<|end|>ab", frozenset({0})) == [2]


def test_retokenize_holds_back_a_split_character():
    tok = target_lm().tokenizer
    # the draft's text ends inside "é": its first byte is not proposed yet
    assert retokenize(tok, [1], b"a", b"b \xc3", frozenset({0})) == [2]
    # the context ends inside "é" and the draft text starts with its second byte
    assert retokenize(tok, [7], b"\xc3", b"\xa9ab c", frozenset({0})) == [8, 5, 4]


def test_the_draft_row_follows_the_accepted_text_after_a_rejection():
    """The draft row's cache is the target's text, re-encoded in the draft's tokens, after any
    proposal: a rejected draft is rolled back, a correction token fed."""
    target, draft = target_lm(), draft_lm()
    drafter = CrossVocabDrafter(draft, target, "string")
    drafter.begin(0, [1], SamplingParams(), np.random.default_rng(0))
    context = [1, 2, 4, 3, 6]  # "ab cca"
    drafter.propose({0: context}, {0: 4})
    row = drafter._rows[0].model_row
    assert row_text(draft, row).startswith(b"ab cca")
    drafter.accept({0: 0})  # all rejected; the target said "b"
    context = context + [2]
    drafter.propose({0: context}, {0: 4})
    held = row_text(draft, row)
    assert held.startswith(b"ab ccab")
    assert draft._row_states()[row][0] == 1  # still opened by the draft's <s>
    assert drafter.lag(0, context + [1, 1]) == 2


def test_a_split_character_is_held_back_from_the_draft():
    """The target has emitted half of "é" (byte-level tokens): the draft waits for the other half
    rather than read a broken character, then reads "é" as its own whole token."""
    target, draft = target_lm(), draft_lm()
    drafter = CrossVocabDrafter(draft, target, "string")
    drafter.begin(0, [1], SamplingParams(), np.random.default_rng(0))
    assert drafter.propose({0: [1, 4, 7]}, {0: 4})[0].tokens == []
    row = drafter._rows[0].model_row
    assert row_text(draft, row) == b"a "
    drafter.propose({0: [1, 4, 7, 8]}, {0: 4})
    assert draft._row_states()[row][:4] == [1, 2, 5, 12]  # <s> a " " é


def test_special_tokens_are_rendered_for_the_draft_and_never_proposed():
    target = target_lm()
    drafter = CrossVocabDrafter(oracle(DRAFT, DRAFT_NAMES, bos=1), target, "intersect")
    assert 0 not in drafter.t_ids and 0 not in drafter.d_ids and 1 not in drafter.d_ids
    drafter = CrossVocabDrafter(draft_lm(), target, "string")
    drafter.begin(0, [0, 1], SamplingParams(), np.random.default_rng(0))
    drafter.propose({0: [0, 1]}, {0: 2})
    assert bytes(drafter._rows[0].rendered) == b"<|end|>a"


# ---------------------------------------------------------------------------- names and wiring


def test_grammar_names_the_mode():
    assert parse("gemma-3-270m").vocab == ""
    spec = parse("string:gemma-3-270m")
    assert (spec.kind, spec.model, spec.vocab) == ("model", "gemma-3-270m", "string")
    spec = parse("intersect:/models/x.gguf")
    assert (spec.kind, spec.model, spec.vocab) == ("model", "/models/x.gguf", "intersect")
    with pytest.raises(SpecdecError, match="intersect:MODEL"):
        parse("intersect:")


def test_a_model_of_another_vocabulary_drafts_across_tokenizers():
    target = target_lm()
    assert isinstance(model_drafter(draft_lm(), target), CrossVocabDrafter)
    assert model_drafter(draft_lm(), target).mode == "string"
    assert model_drafter(draft_lm(), target, "intersect").mode == "intersect"
    assert isinstance(model_drafter(target_lm(seed=3), target), ModelDrafter)
    assert isinstance(SpeculativeDecoder(target, draft_lm()).drafter, CrossVocabDrafter)
    with pytest.raises(VocabMismatchError):
        ModelDrafter(draft_lm(), target)  # token ids alone still need one vocabulary


def test_a_full_draft_context_stops_the_draft_not_the_generation():
    """The draft's tokens of the context may outnumber the target's: past the draft model's
    context window it proposes nothing, and generation goes on."""
    target = target_lm()
    draft = piece_lm(DRAFT, 2, bos=1, names=DRAFT_NAMES)
    draft.n_ctx = 12
    prompt = [1, 4, 2, 4, 3, 4]
    expected = reference_greedy(target_lm(), prompt, 30)
    for mode in ("string", "intersect"):
        result = SpeculativeDecoder(target, CrossVocabDrafter(draft, target, mode), k=4).generate(
            prompt, max_new_tokens=30
        )
        assert result.tokens == expected
