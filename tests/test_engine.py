"""The decode loop on toy models: greedy equality, rollback bookkeeping, stop rules, streaming."""

from __future__ import annotations

import numpy as np
import pytest

from specdec import GenerationConfig, SpeculativeDecoder
from specdec.drafters.base import Declared, Draft
from specdec.drafters.model import ModelDrafter
from specdec.errors import ContextOverflowError, SpecdecError

from .toy import ToyLM, on_virtual_clock

PROMPT = [5, 6, 7, 5, 6, 7, 8, 5, 6]


def reference_greedy(model: ToyLM, prompt, n: int) -> list[int]:
    """Plain greedy decoding written out naively: recompute everything from the full history."""
    tokens, out = list(prompt), []
    for _ in range(n):
        model.reset()
        token = int(np.argmax(model.forward(tokens)[-1]))
        if token in model.tokenizer.eog_ids:
            break
        tokens.append(token)
        out.append(token)
    return out


class ScriptedLM(ToyLM):
    """Greedy output is `script`, whatever the context: row i of the output has its argmax at
    script[i]."""

    def __init__(self, script, prompt_len, **kw):
        super().__init__(**kw)
        self.script, self.prompt_len = list(script), prompt_len

    def forward(self, tokens, n_rows=None):
        start = len(self.cache)
        rows = super().forward(tokens, n_rows=None) * 0
        for i in range(len(tokens)):
            pos = start + i + 1 - self.prompt_len  # index of the token this row predicts
            rows[i, self.script[min(max(pos, 0), len(self.script) - 1)]] = 10.0
        n_rows = len(tokens) if n_rows is None else n_rows
        return rows[len(rows) - n_rows :]


class WrongDrafter(Declared):
    """Always proposes k tokens the target never picks first (every draft is rejected)."""

    name = kind = "wrong"
    takes = frozenset()

    def __init__(self, target):
        self.target = target
        self.asked: list[int] = []  # every k asked for, for tests

    def begin(self, row, prompt, params, rng):
        pass

    def end(self, rows):
        pass

    def propose(self, contexts, ks, leaves=None):
        self.asked += ks.values()
        return {row: Draft([(contexts[row][-1] * 7 + i) % 31 + 1 for i in range(k)]) for row, k in ks.items()}

    def accept(self, n_accepted):
        pass


@pytest.fixture
def target():
    return ToyLM(vocab_size=32, seed=1)


def test_plain_greedy_matches_reference(target):
    result = SpeculativeDecoder(target, None).generate(PROMPT, max_new_tokens=40)
    assert result.tokens == reference_greedy(ToyLM(vocab_size=32, seed=1), PROMPT, 40)
    assert result.stats.steps == len(result.tokens)
    assert result.stats.mean_accepted_length == pytest.approx(1.0)


@pytest.mark.parametrize("k", [1, 2, 4, 7])
@pytest.mark.parametrize("noise", [0.0, 1.0, 5.0])
def test_model_draft_greedy_equals_plain(target, k, noise):
    plain = SpeculativeDecoder(target, None).generate(PROMPT, max_new_tokens=60).tokens
    draft = ToyLM(vocab_size=32, seed=2, noise_from=target, noise=noise)
    result = SpeculativeDecoder(target, draft, k=k).generate(PROMPT, max_new_tokens=60)
    assert result.tokens == plain
    s = result.stats
    assert s.drafted == sum(s.drafted_at) and s.accepted == sum(s.accepted_at)
    if noise == 0.0:  # a perfect draft: every token accepted, k + 1 tokens per step
        assert s.acceptance_rate == 1.0
        assert s.mean_accepted_length > k


@pytest.mark.parametrize("k", [1, 3, 8])
def test_ngram_and_wrong_drafts_equal_plain(target, k):
    plain = SpeculativeDecoder(target, None).generate(PROMPT, max_new_tokens=60).tokens
    assert SpeculativeDecoder(target, "ngram", k=k).generate(PROMPT, max_new_tokens=60).tokens == plain
    wrong = SpeculativeDecoder(target, WrongDrafter(target), k=k).generate(PROMPT, max_new_tokens=60)
    assert wrong.tokens == plain


def test_target_cache_tracks_context(target):
    """After every step the target's row holds exactly prompt + generated - 1 tokens (the last
    emitted token is fed by the next step), whatever was rejected on the way."""
    draft = ToyLM(vocab_size=32, seed=3, noise_from=target, noise=2.0)
    engine = SpeculativeDecoder(target, draft, k=4).engine
    request = engine.add(list(PROMPT), GenerationConfig(max_new_tokens=30))
    while not request.done:
        engine.step()
        if request.row is not None:
            with target.use_row(request.row):
                assert target.cache == request.context[:-1]
    assert engine.rows == {} and target._states == {}  # the row was freed when it finished


def test_model_drafter_cache_stays_in_step(target):
    draft_model = ToyLM(vocab_size=32, seed=4, noise_from=target, noise=1.5)
    drafter = ModelDrafter(draft_model, target)
    engine = SpeculativeDecoder(target, drafter, k=3).engine
    request = engine.add(list(PROMPT), GenerationConfig(max_new_tokens=40))
    while not request.done:
        engine.step()
        if request.done:
            break
        with draft_model.use_row(drafter._rows[request.row].model_row):
            # the draft's cache is always a prefix of the context (never a rejected token)
            assert draft_model.cache == request.context[: len(draft_model.cache)]
            assert len(draft_model.cache) >= len(request.context) - 2  # at most bonus + last draft pending
    assert draft_model._states == {}


def test_all_accepted_draft_catches_up_in_one_forward(target):
    draft_model = ToyLM(vocab_size=32, seed=1)  # identical to the target: everything is accepted
    SpeculativeDecoder(target, draft_model, k=4).generate(PROMPT, max_new_tokens=20)
    # the prompt, then per step: 2 tokens to catch up (last draft + bonus) and 3 single-token drafts
    assert draft_model.forward_calls[0] == len(PROMPT)
    assert set(draft_model.forward_calls[1:]) <= {1, 2}


def test_sampled_runs_are_repeatable_with_a_seed(target):
    draft = ToyLM(vocab_size=32, seed=5, noise_from=target, noise=1.0)
    cfg = GenerationConfig(max_new_tokens=40, temperature=0.8, top_p=0.95, seed=123)
    a = SpeculativeDecoder(target, draft, k=3).generate(PROMPT, cfg).tokens
    b = SpeculativeDecoder(target, draft, k=3).generate(PROMPT, cfg).tokens
    c = SpeculativeDecoder(target, draft, k=3).generate(PROMPT, cfg, seed=124).tokens
    assert a == b and a != c


def test_max_tokens_is_exact_even_mid_draft(target):
    draft_model = ToyLM(vocab_size=32, seed=1)
    for n in (1, 2, 5, 7):
        result = SpeculativeDecoder(target, draft_model, k=4).generate(PROMPT, max_new_tokens=n)
        assert len(result.tokens) == n and result.stats.finish_reason == "length"


def test_eog_stops_and_is_not_emitted():
    script = [9, 10, 11, 0, 12, 13]
    model = ScriptedLM(script, prompt_len=len(PROMPT))
    for drafter in (None, "ngram", ScriptedLM(script, prompt_len=len(PROMPT))):
        result = SpeculativeDecoder(model, drafter, k=3).generate(PROMPT, max_new_tokens=50)
        assert result.tokens == [9, 10, 11]
        assert result.stats.finish_reason == "eog"


def test_a_draft_ends_at_its_first_eog():
    """Tokens after an end-of-generation token are never emitted, so the engine does not widen the
    target's forward with them: an 8-token draft whose 4th token is EOG is verified as 4."""
    script = [9, 10, 11, 0, 12, 13]
    model = ScriptedLM(script, prompt_len=len(PROMPT))
    result = SpeculativeDecoder(model, ScriptedLM(script, prompt_len=len(PROMPT)), k=8).generate(
        PROMPT, max_new_tokens=50
    )
    assert result.tokens == [9, 10, 11] and result.stats.finish_reason == "eog"
    assert model.forward_calls[-1] == 5  # [last, 9, 10, 11, 0]: one step, five rows
    q = np.eye(4)[[1, 0, 2, 3]]
    cut = Draft([1, 0, 2, 3], q, {"match": 7}).upto(frozenset({0}))
    assert cut.tokens == [1, 0] and cut.q.shape == (2, 4) and cut.evidence == {"match": 7}
    whole = Draft([1, 2, 0])
    assert whole.upto(frozenset({0})) is whole and whole.upto(frozenset()) is whole


class OutOfVocabDrafter(WrongDrafter):
    """Proposes the target's own greedy token, then ids outside its vocabulary (a damaged suffix
    cache file's): -1, vocab_size, and 10**6."""

    name = kind = "out-of-vocab"

    def propose(self, contexts, ks, leaves=None):
        self.asked += ks.values()
        reference = ToyLM(vocab_size=32, seed=1)
        return {
            row: Draft([int(np.argmax(reference.forward(list(contexts[row]))[-1])), -1, 32, 10**6][:k])
            for row, k in ks.items()
        }


def test_a_draft_token_outside_the_vocabulary_never_reaches_the_target(target):
    """The draft ends before its first token outside the vocabulary: the step goes on, the output
    is plain greedy, and the good first token is still kept."""
    result = SpeculativeDecoder(target, OutOfVocabDrafter(target), k=4).generate(PROMPT, max_new_tokens=24)
    assert result.tokens == reference_greedy(ToyLM(vocab_size=32, seed=1), PROMPT, 24)
    assert result.stats.drafted == result.stats.accepted > 0
    cut = Draft([3, 40, 5]).upto(frozenset(), vocab_size=32)
    assert cut.tokens == [3] and Draft([-1]).upto(frozenset(), vocab_size=32).tokens == []


def test_stream_is_utf8_safe_and_matches_text():
    # tokens 1 and 2 are the two bytes of "é": no piece may hold half of it
    script = [4, 1, 2, 5, 1, 2, 6, 0]
    model = ScriptedLM(script, prompt_len=len(PROMPT))
    stream = SpeculativeDecoder(model, None).stream(PROMPT, max_new_tokens=50)
    pieces = list(stream)
    assert "".join(pieces) == stream.result.text == "eéfég"
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_cuts_text_and_generation():
    script = [7, 8, 9, 10, 11, 12, 13, 14]  # "hijklmno"
    model = ScriptedLM(script, prompt_len=len(PROMPT))
    stream = SpeculativeDecoder(model, "ngram", k=4).stream(PROMPT, max_new_tokens=50, stop=("klm",))
    pieces = list(stream)
    assert stream.result.text == "hij" == "".join(pieces)
    assert stream.result.stats.finish_reason == "stop"


def test_context_full_stops_cleanly():
    model = ToyLM(vocab_size=32, seed=1, n_ctx=len(PROMPT) + 10)
    result = SpeculativeDecoder(model, ToyLM(vocab_size=32, seed=1, n_ctx=64), k=4).generate(PROMPT, max_new_tokens=100)
    assert result.stats.finish_reason in ("context", "eog")
    assert len(PROMPT) + len(result.tokens) <= model.n_ctx + 1


def test_user_errors(target):
    with pytest.raises(SpecdecError, match="k"):
        SpeculativeDecoder(target, None, k=-1)
    with pytest.raises(SpecdecError, match="0..32"):
        SpeculativeDecoder(target, None, k=1000)
    # request.py's one empty-prompt rule: whitespace is refused as a chat turn, kept as raw text
    with pytest.raises(SpecdecError, match="empty"):
        SpeculativeDecoder(target, None).generate("  \n ", chat=True)
    with pytest.raises(SpecdecError, match="empty"):
        SpeculativeDecoder(target, None).generate("")
    assert SpeculativeDecoder(target, None).generate("  \n ", max_new_tokens=2).stats.prompt_tokens > 0
    with pytest.raises(SpecdecError, match="max_new_tokens"):
        GenerationConfig(max_new_tokens=0)
    with pytest.raises(SpecdecError, match="top_p"):
        GenerationConfig(top_p=0.0)
    with pytest.raises(ContextOverflowError, match="context"):
        SpeculativeDecoder(target, None).generate(list(range(1, 20)) * 40)
    with pytest.raises(SpecdecError, match="empty"):
        SpeculativeDecoder(target, None).generate([])
    with pytest.raises(SpecdecError, match="drafter"):
        SpeculativeDecoder(target, 42)


def test_token_ids_of_another_vocabulary_are_refused(target):
    """A ModelDrafter proposes the draft's token ids as they are: only for one vocabulary. (A model
    of another vocabulary given to SpeculativeDecoder drafts across tokenizers instead:
    tests/drafters/test_cross_vocab.py.)"""
    from specdec.drafters.cross_vocab import CrossVocabDrafter
    from specdec.errors import VocabMismatchError

    with pytest.raises(VocabMismatchError, match="40 tokens"):
        ModelDrafter(ToyLM(vocab_size=40), target)
    other = ToyLM(vocab_size=32)
    other.tokenizer._bytes[7] = b"different"
    with pytest.raises(VocabMismatchError, match="token 7"):
        ModelDrafter(other, target)
    assert isinstance(SpeculativeDecoder(target, other).drafter, CrossVocabDrafter)


def test_drafts_never_outrun_the_tokens_wanted(target):
    """-k 32 -n 4 used to draft 64 tokens for 4: a draft is capped at the tokens still wanted - 1."""
    drafter = WrongDrafter(target)
    result = SpeculativeDecoder(target, drafter, k=32).generate(PROMPT, max_new_tokens=4)
    assert len(result.tokens) == 4
    assert drafter.asked and max(drafter.asked) <= 3
    assert sum(drafter.asked) <= 3 + 2 + 1  # wants 4, 3, 2, 1 -> k 3, 2, 1, 0 (no draft)


def test_row_joins_a_running_batch_and_equals_its_solo_run(target):
    draft = ToyLM(vocab_size=32, seed=2, noise_from=target, noise=1.0)
    decoder = SpeculativeDecoder(target, draft, k=3)
    solo = {p: decoder.generate(p, max_new_tokens=30).tokens for p in ((5, 6, 7), (9, 9, 4, 3))}
    engine = decoder.engine
    first = engine.add([5, 6, 7], GenerationConfig(max_new_tokens=30))
    for _ in range(3):
        engine.step()
    assert len(first.context) > 3 and not first.done
    second = engine.add([9, 9, 4, 3], GenerationConfig(max_new_tokens=30))
    engine.step()
    assert len(engine.rows) == 2  # the second joined while the first runs
    engine.run([first, second])
    assert first.result.tokens == solo[(5, 6, 7)]
    assert second.result.tokens == solo[(9, 9, 4, 3)]


def test_cancel_frees_the_row_at_once(target):
    draft = ToyLM(vocab_size=32, seed=2, noise_from=target, noise=1.0)
    decoder = SpeculativeDecoder(target, draft, k=3, max_rows=1)
    engine = decoder.engine
    a = engine.add(list(PROMPT), GenerationConfig(max_new_tokens=200))
    b = engine.add([5, 6, 7], GenerationConfig(max_new_tokens=5))
    engine.step()
    assert a.row is not None and b.row is None and b in engine.queue  # one row: b waits
    engine.cancel(a)
    assert a.done and a.result.stats.finish_reason == "cancelled"
    assert target._states == {} and draft._states == {}  # caches freed now
    engine.step()
    assert b.row is not None  # b takes the row
    engine.run([b])
    assert b.result.tokens == decoder.generate([5, 6, 7], max_new_tokens=5).tokens


def test_interleaved_streams_are_independent(target):
    decoder = SpeculativeDecoder(target, "ngram", k=3)
    config = GenerationConfig(max_new_tokens=25)
    alone = [decoder.generate(p, config).text for p in (PROMPT, [4, 4, 5])]
    s1, s2 = decoder.stream(PROMPT, config), decoder.stream([4, 4, 5], config)
    i1, i2 = iter(s1), iter(s2)
    texts = ["", ""]
    for piece in i2:  # read one piece of the second, then the whole first, then the rest
        texts[1] += piece
        break
    texts[0] = "".join(i1)
    texts[1] += "".join(i2)
    assert texts == alone
    assert [s1.result.text, s2.result.text] == alone


def test_abandoned_stream_is_cancelled(target):
    decoder = SpeculativeDecoder(target, None)
    it = iter(decoder.stream(PROMPT, max_new_tokens=100))
    next(it)
    it.close()
    assert decoder.engine.rows == {} and not decoder.engine.queue


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_are_the_targets_log_probabilities(target, temperature):
    """Each generated token's log-probability (and its top alternatives) is the target's own, at
    its position, from a plain forward over everything before it, however many tokens the step
    that emitted it verified; streamed, they come in order and add up to the whole."""
    draft = ToyLM(vocab_size=32, seed=2, noise_from=target, noise=0.3)
    decoder = SpeculativeDecoder(target, draft, k=4)
    config = GenerationConfig(max_new_tokens=30, temperature=temperature, seed=7, logprobs=3)
    result = decoder.generate(PROMPT, config)
    assert result.stats.accepted > 0 and len(result.logprobs) == len(result.tokens) == 30
    reference = ToyLM(vocab_size=32, seed=1)
    for i, entry in enumerate(result.logprobs):
        reference.reset()
        logits = reference.forward(list(PROMPT) + result.tokens[:i])[-1].astype(np.float64)
        logp = logits - np.log(np.sum(np.exp(logits - logits.max()))) - logits.max()
        assert entry.token == result.tokens[i]
        assert entry.logprob == pytest.approx(logp[entry.token], abs=1e-9)
        top = np.argsort(-logp, kind="stable")[:3]
        assert [t for t, _ in entry.top] == list(top)
        assert [lp for _, lp in entry.top] == pytest.approx(list(logp[top]), abs=1e-9)
    stream = decoder.stream(PROMPT, config)
    pieces = []
    for _ in stream:
        pieces += stream.request.read_logprobs()
    pieces += stream.request.read_logprobs()
    assert pieces == result.logprobs
    assert decoder.generate(PROMPT, max_new_tokens=5).logprobs is None  # off unless asked
    with pytest.raises(SpecdecError, match="logprobs"):
        GenerationConfig(logprobs=21)


class CountedRows:
    """Records what each forward_rows call feeds, per row: the tokens, and whether logits came back."""

    def __init__(self, model):
        self.calls: list[dict[int, tuple[int, bool]]] = []
        inner = model.forward_rows

        def forward_rows(tokens, n_logits=None):
            self.calls.append({row: (len(t), row in (n_logits or {})) for row, t in tokens.items()})
            return inner(tokens, n_logits)

        model.forward_rows = forward_rows


def _join_while_decoding(target, costs, stall, prompt_len=40, steps=4):
    """A row decodes; a second with a long prompt joins. The engine's forwards as CountedRows saw them."""
    from specdec.controller import FixedController
    from specdec.engine import Engine

    counted = CountedRows(target)
    engine = Engine(target, FixedController(None, 0), costs=costs, prefill_stall=stall)
    first = engine.add([5, 6, 7], GenerationConfig(max_new_tokens=60))
    engine.step()  # alone: its prompt at once
    engine.step()
    late = engine.add([(i * 5) % 31 + 1 for i in range(prompt_len)], GenerationConfig(max_new_tokens=10))
    counted.calls.clear()
    for _ in range(steps):
        engine.step()
    return engine, first, late, counted.calls


def test_a_joining_prompt_rides_in_the_decoding_rows_forward(target):
    """Mixed steps: while one row decodes, the joining row's prompt chunks go in the SAME forward
    (no logits for them), one forward a step; on a steep curve (cost = width) at prefill_stall 3
    the chunk is the 2 tokens that keep the step within 3 plain steps."""
    engine, first, late, calls = _join_while_decoding(target, lambda w, depth=None: float(w), 3.0)
    assert len(calls) == 4  # four steps, four forwards
    for call in calls:
        assert call[first.row] == (1, True)  # the decoding row's [last], with logits
        assert call[late.row] == (2, False)  # a chunk within the budget, no logits
    assert late.prefilled == 8 and first.stats.generated_tokens == 6


def test_a_flat_curve_takes_the_whole_prompt_in_one_step(target):
    """Where width costs nothing (a GPU's flat curve), the joining prompt rides whole in one step and
    the row decodes from the next; its output is its solo run's."""
    engine, first, late, calls = _join_while_decoding(target, lambda w, depth=None: 1.0, 2.0, steps=1)
    assert calls == [{first.row: (1, True), late.row: (39, False)}]  # the last prompt token opens decoding
    engine.run([first, late])
    solo = SpeculativeDecoder(target, None, 0)
    assert late.result.tokens == solo.generate(late.prompt_tokens, max_new_tokens=10).tokens
    assert first.result.tokens == solo.generate([5, 6, 7], max_new_tokens=60).tokens


def test_a_step_already_past_the_budget_still_moves_the_first_joiner(target):
    """A curve on which no chunk fits (the decoding rows' own step is already at the limit) still
    gives the first joining row one token a step, so it cannot starve; the second waits. (On this
    curve two one-row forwards cost less than one of both rows, so the step makes two.)"""
    from specdec.controller import FixedController
    from specdec.engine import Engine

    counted = CountedRows(target)
    engine = Engine(target, FixedController(None, 0), costs=lambda w, depth=None: float(w) ** 3, prefill_stall=1.0)
    first = engine.add([5, 6, 7], GenerationConfig(max_new_tokens=30))
    engine.step()
    a = engine.add(list(range(1, 12)), GenerationConfig(max_new_tokens=3))
    b = engine.add(list(range(2, 13)), GenerationConfig(max_new_tokens=3))
    counted.calls.clear()
    engine.step()
    assert counted.calls == [{first.row: (1, True)}, {a.row: (1, False)}]
    assert (a.prefilled, b.prefilled) == (1, 0)
    engine.run([first, a, b])
    solo = SpeculativeDecoder(target, None, 0)
    assert b.result.tokens == solo.generate(b.prompt_tokens, max_new_tokens=3).tokens


def test_rows_on_the_curves_cliff_step_in_two_forwards_with_their_solo_tokens(target):
    """Where the cost curve prices 8 rows in one forward above two forwards of 4 (ggml's tiled
    matmul on a CPU: costs.SPLIT_GAIN), each step feeds them in two; every row keeps its solo
    run's tokens, and the controller hears both forwards' passes."""
    from specdec.controller import FixedController
    from specdec.engine import Engine

    class Heard(FixedController):
        def observe(self, outcomes, passes, target_seconds, depth=None):
            heard.append(list(passes))

    heard: list[list[int]] = []
    cliff = lambda w, depth=None: w * (1.5 if 8 <= w < 16 else 1.0)  # noqa: E731
    engine = Engine(target, Heard(None, 0), costs=cliff)
    prompts = [[(i * 7 + j) % 31 + 1 for j in range(3 + i)] for i in range(8)]
    requests = [engine.add(p, GenerationConfig(max_new_tokens=5)) for p in prompts]
    engine.step()  # the prompts, read together
    counted = CountedRows(target)
    heard.clear()
    engine.step()
    rows = sorted(r.row for r in requests)
    assert counted.calls == [{row: (1, True) for row in rows[:4]}, {row: (1, True) for row in rows[4:]}]
    assert heard == [[4, 4]]
    engine.run(requests)
    solo = SpeculativeDecoder(target, None, 0)
    for prompt, r in zip(prompts, requests):
        assert r.result.tokens == solo.generate(prompt, max_new_tokens=5).tokens
    # 16 rows are past the cliff: one forward
    engine = Engine(target, FixedController(None, 0), costs=cliff)
    requests = [engine.add(p, GenerationConfig(max_new_tokens=3)) for p in prompts * 2]
    engine.step()
    counted = CountedRows(target)
    engine.step()
    assert len(counted.calls) == 1 and len(counted.calls[0]) == 16
    # the Python API's plain decoding given the curve steps the same way; without one, one forward
    for costs, forwards in ((({w: cliff(w) for w in range(1, 33)}, None), 2), (None, 1)):
        decoder = SpeculativeDecoder(target, None, 0, costs=costs)
        counted = CountedRows(target)
        decoder.generate_batch(prompts, GenerationConfig(max_new_tokens=3))
        decoding = [call for call in counted.calls if all(n == 1 for n, _ in call.values())]
        assert decoding and all(len(call) == 8 // forwards for call in decoding)


def test_a_joiner_waits_where_its_chunk_would_cost_too_much(target):
    """On a concave curve (a CPU's: a few tokens cost more each than many), the 3 tokens that fit a
    step at prefill_stall 2 would cost twice, per token, what the prompt costs read alone: the
    joiner waits rather than crawl, for as many steps as the crawl would take (39 tokens, 3 a
    step: 13), then rides; the decoding row steps at its plain width meanwhile, and both rows
    keep their solo runs' tokens."""
    engine, first, late, calls = _join_while_decoding(target, lambda w, depth=None: w**0.5, 2.0, steps=14)
    assert calls[:13] == [{first.row: (1, True)}] * 13  # waiting: the decoding row alone
    assert calls[13] == {first.row: (1, True), late.row: (3, False)}  # patience spent: it rides
    assert late.prefilled == 3
    engine.run([first, late])
    solo = SpeculativeDecoder(target, None, 0)
    assert late.result.tokens == solo.generate(late.prompt_tokens, max_new_tokens=10).tokens
    assert first.result.tokens == solo.generate([5, 6, 7], max_new_tokens=60).tokens


def test_a_waiting_joiner_reads_its_prompt_at_once_when_the_decoding_rows_end(target):
    """The same curve, with a decoding row that ends before the joiner's patience does: the joiner
    reads its whole prompt in one forward (nobody decodes), then decodes."""
    from specdec.controller import FixedController
    from specdec.engine import Engine

    counted = CountedRows(target)
    engine = Engine(target, FixedController(None, 0), costs=lambda w, depth=None: w**0.5, prefill_stall=2.0)
    first = engine.add([5, 6, 7], GenerationConfig(max_new_tokens=5))
    engine.step()
    late = engine.add([(i * 5) % 31 + 1 for i in range(40)], GenerationConfig(max_new_tokens=4))
    engine.step()  # admitted (its row is freed when it ends)
    row = late.row
    counted.calls.clear()
    engine.run([first, late])
    prompt_reads = [call[row][0] for call in counted.calls if row in call and not call[row][1]]
    assert prompt_reads == [39]
    assert (
        late.result.tokens == SpeculativeDecoder(target, None, 0).generate(late.prompt_tokens, max_new_tokens=4).tokens
    )


def test_the_engine_says_when_its_next_step_only_reads_prompts(target):
    """reads_prompts_only, the server's cue to wait for more requests: requests are in, no row
    decodes, and a row is free; not when idle, nor while a row decodes, nor with every row taken."""
    from specdec.controller import FixedController
    from specdec.engine import Engine

    engine = Engine(target, FixedController(None, 0), max_rows=2, costs=lambda w, depth=None: w**0.5, prefill_stall=2.0)
    assert not engine.reads_prompts_only  # idle
    first = engine.add([5, 6, 7], GenerationConfig(max_new_tokens=3))
    assert engine.reads_prompts_only
    engine.step()
    assert not engine.reads_prompts_only  # first decodes
    late = engine.add([(i * 5) % 31 + 1 for i in range(40)], GenerationConfig(max_new_tokens=2))
    while not first.done:
        engine.step()
    assert late.prefilled == 0 and engine.reads_prompts_only  # it waited (its chunks cost too much)
    engine.add([5, 6], GenerationConfig(max_new_tokens=2))
    assert not engine.reads_prompts_only  # both rows taken


def test_prefill_waste_inf_lets_every_chunk_ride(target):
    """prefill_waste=inf: the joiner rides from its first step, as before the waste rule."""
    from specdec.controller import FixedController
    from specdec.engine import Engine

    counted = CountedRows(target)
    engine = Engine(
        target,
        FixedController(None, 0),
        costs=lambda w, depth=None: w**0.5,
        prefill_stall=2.0,
        prefill_waste=float("inf"),
    )
    first = engine.add([5, 6, 7], GenerationConfig(max_new_tokens=30))
    engine.step()
    late = engine.add([(i * 5) % 31 + 1 for i in range(40)], GenerationConfig(max_new_tokens=4))
    counted.calls.clear()
    engine.step()
    assert counted.calls == [{first.row: (1, True), late.row: (3, False)}]


def test_joining_rows_under_auto_keep_their_solo_output(target):
    """auto's engine sizes chunks by its own cost curve; rows joining a running batch of
    speculating rows at a steep curve still give their solo runs' tokens."""
    steep = {w: 0.05 * w for w in range(1, 65)}
    decoder = SpeculativeDecoder(target, "auto", costs=(steep, None))
    # forwards take the curve's time on a virtual clock: the drift the engine learns live (and the
    # chunks it sizes by it) is then the curve's, not this machine's load (on the wall clock the
    # chunk assertion below failed 4 runs in 20 alone)
    decoder.engine.clock = on_virtual_clock(target, lambda w: 0.05 * w)
    prompts = [list(PROMPT) * 3, [9, 9, 4, 3] * 5, [5, 6, 7] * 6]
    solo = [decoder.generate(p, max_new_tokens=40).tokens for p in prompts]
    engine = decoder.engine
    assert engine.costs is engine.controller.target_cost
    first = engine.add(prompts[0], GenerationConfig(max_new_tokens=40))
    engine.step()
    engine.step()
    others = [engine.add(p, GenerationConfig(max_new_tokens=40)) for p in prompts[1:]]
    engine.step()
    assert 0 < others[0].prefilled < len(prompts[1]) - 1  # chunked behind the decoding row
    engine.run([first, *others])
    assert [r.result.tokens for r in (first, *others)] == solo


def test_prefill_waste_below_one_is_refused(target):
    from specdec.controller import FixedController
    from specdec.engine import Engine

    with pytest.raises(SpecdecError, match="prefill_waste must be at least 1"):
        Engine(target, FixedController(None, 0), prefill_waste=0.9)


def test_prefill_stall_below_one_is_refused(target):
    from specdec.controller import FixedController
    from specdec.engine import Engine

    with pytest.raises(SpecdecError, match="prefill_stall must be at least 1"):
        Engine(target, FixedController(None, 0), prefill_stall=0.5)


def test_a_request_carries_its_policy_to_the_controller_with_its_row():
    """Engine.add(tokens, config, policy): the request holds its policy and the engine hands it
    to the controller with the row (Controller.begin), so a controller that speculates each
    request its own way (the server's router) needs no pointer back into the engine."""
    from specdec.build import Drafters
    from specdec.controller import FixedController
    from specdec.server.policy import RoutingController
    from specdec.spec import DraftSpec

    class Told(FixedController):
        def begin(self, row, prompt, policy=None):
            seen.append((row, policy))

    seen = []
    decoder = SpeculativeDecoder(ToyLM(seed=1), None)
    decoder.engine.controller = Told(None, 0)
    policy = DraftSpec("ngram", k=3)
    request = decoder.engine.add([1, 2, 3], GenerationConfig(max_new_tokens=2, chat=False), policy)
    decoder.engine.run([request])
    assert request.policy is policy and [p for _, p in seen] == [policy]
    router = RoutingController(None, Drafters(None))
    assert not hasattr(router, "engine") and not hasattr(router, "policies")
    with pytest.raises(ValueError, match="its own policy"):
        router.begin(0, [1, 2], None)
