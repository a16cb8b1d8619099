"""Constrained output (grammar.py) through the real engine: exact under every rule, greedy equal to
plain decoding, forced tokens drafted free, and bad schemas or grammars refused in one line.

The exact checks enumerate every random decision of one engine step (tests/enumerate.py) on a
toy vocabulary of five tokens under a grammar that forbids some tokens and forces others
(`start: ("e" | "dé")+`: after "d" the two bytes of "é" are forced, one token each; the end of
generation is allowed only after a whole item), and compare the first L tokens' joint with the
target's own under the grammar: p masked to the allowed tokens, renormalised, then the sampling
filters, enumerated here without the engine.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict

import numpy as np
import pytest

from specdec import GenerationConfig, SpeculativeDecoder
from specdec.drafters.model import ModelDrafter
from specdec.drafters.ngram import NgramDrafter
from specdec.engine import Engine
from specdec.errors import FieldError, SpecdecError
from specdec.grammar import Grammars, GrammarSpec, constraint_spec
from specdec.sampling import VERIFICATION_RULES, masked

from .enumerate import exact, total_variation
from .test_sampled_engine import exact_outcomes
from .toy import ToyLM, ToyTokenizer

V, K = 5, 3
L = K + 1
EOG = -1
PROMPT = [3, 4, 3, 1, 2, 4]
GRAMMAR = GrammarSpec("lark", 'start: ("e" | "dé")+')
TIGHT = 1e-9


class ByteTokenizer(ToyTokenizer):
    """The toy's five tokens, encoded by their bytes (llguidance tokenizes forced bytes with it)."""

    def encode(self, text: str, add_special: bool = True, special: bool = True) -> list[int]:
        ids = {b"\xc3": 1, b"\xa9": 2, b"d": 3, b"e": 4}
        return [ids[bytes([b])] for b in text.encode()]


def toy(seed: int, **kw) -> ToyLM:
    model = ToyLM(vocab_size=V, seed=seed, sharpness=1.0, **kw)
    model.tokenizer, model.path = ByteTokenizer(V), None
    return model


def target_lm() -> ToyLM:
    return toy(2)


def config(rule: str = "block", temperature: float = 1.0, **kw) -> GenerationConfig:
    return GenerationConfig(
        max_new_tokens=L, chat=False, verification=rule, temperature=temperature, grammar=GRAMMAR, **kw
    )


def constrained_joint(target, prompt, cfg: GenerationConfig, n: int, emitted: tuple = ()) -> dict[tuple, float]:
    """P(the n tokens after `emitted`) under the target alone, masked by the grammar at every
    position (the grammar reads the output from its first token; an outcome ends with EOG where
    the target ended first)."""
    grammars = Grammars(target)

    def allowed(prefix: tuple):
        c = grammars.constraint(cfg.constraint)
        c.consume(emitted + prefix)
        return c.allowed()

    return exact_outcomes(target, [*prompt, *emitted], cfg.sampling, n, allowed)


def one_step(decoder: SpeculativeDecoder, cfg) -> tuple:
    r = decoder.engine.add(list(PROMPT), cfg)
    decoder.engine.step()
    return tuple(r.context[len(PROMPT) :]) + ((EOG,) if r.stats.finish_reason == "eog" else ())


def step_tv(make, cfg) -> float:
    """TV between one engine step then the target alone, and the target alone, under the grammar."""
    step = exact(lambda: one_step(make(), cfg))
    target = target_lm()
    joint: dict[tuple, float] = defaultdict(float)
    for emitted, w in step.items():
        if (emitted and emitted[-1] == EOG) or len(emitted) >= L:
            joint[emitted] += w
            continue
        for rest, pr in constrained_joint(target, PROMPT, cfg, L - len(emitted), emitted).items():
            joint[emitted + rest] += w * pr
    return total_variation(dict(joint), constrained_joint(target, PROMPT, cfg, L))


def with_draft_model():
    target = target_lm()
    draft = toy(6, noise_from=target, noise=2.5)
    draft.name = "toy-draft"
    return SpeculativeDecoder(target, ModelDrafter(draft), k=K)


def with_lookup(k: int = K):
    return SpeculativeDecoder(target_lm(), NgramDrafter(n_min=1), k=k)


@pytest.mark.parametrize("rule", VERIFICATION_RULES)
def test_a_sampled_draft_is_verified_exactly_against_the_masked_target(rule):
    """The draft model draws under no mask (so it drafts tokens the grammar refuses) and its whole
    draft is verified against p masked at every position: exact under every rule."""
    drafted = []
    real = ModelDrafter.propose

    def spy(self, *a, **kw):
        out = real(self, *a, **kw)
        drafted.extend(d.tokens for d in out.values())
        return out

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ModelDrafter, "propose", spy)
        assert step_tv(with_draft_model, config(rule)) < TIGHT
    allowed_first = {3, 4}  # the grammar's first position: "d" or "e"
    assert any(d and d[0] not in allowed_first for d in drafted)  # refused draws were verified


@pytest.mark.parametrize("k", [1, K])
@pytest.mark.parametrize("rule", VERIFICATION_RULES)
def test_lookup_drafts_cut_at_the_grammar_and_its_forced_tokens_are_exact(rule, k):
    """Prompt lookup's draft cut at its first refused token and followed by the grammar's forced
    tokens (a function of the context alone): exact under every rule; with k = 1 a draft that
    ends in "d" is followed by the two forced halves of "é", drafted and always kept."""
    assert step_tv(lambda: with_lookup(k), config(rule)) < TIGHT
    r = with_lookup(k).generate(list(PROMPT), GenerationConfig(max_new_tokens=24, chat=False, grammar=GRAMMAR))
    if k == 1:
        assert r.stats.forced_drafted >= 4 and r.stats.forced_kept == r.stats.forced_drafted


def test_sampled_by_position_under_a_grammar_is_exact():
    cfg = config("block", seed=5, reproducible=True)
    # by position the noise is fixed by the seed: the enumeration is over the draft's draws only,
    # so compare with the same seed's plain decoding instead, token for token
    plain = SpeculativeDecoder(target_lm(), None).generate(list(PROMPT), cfg).tokens
    assert with_lookup().generate(list(PROMPT), cfg).tokens == plain
    assert with_draft_model().generate(list(PROMPT), cfg).tokens == plain


def test_verifying_against_the_unmasked_target_fails_the_exact_check(monkeypatch):
    """Power: the draft positions verified against p without the mask (the bonus token masked):
    acceptance ratios from the wrong p."""

    def bonus_only(self, rows, drafts, logits):
        for row, r in rows.items():
            if r.constraint is not None:
                m = r.constraint.masks(drafts[row])
                keep = np.ones_like(m)
                keep[-1] = m[-1]
                logits[row] = masked(logits[row], keep)

    monkeypatch.setattr(Engine, "_mask", bonus_only)
    try:
        tv = step_tv(with_draft_model, config("token"))
    except SpecdecError as e:  # a token the grammar refuses was emitted: the output left the grammar
        assert "refused an emitted token" in str(e)
    else:
        assert tv > 1e-4, tv


def test_cutting_a_sampled_draft_at_a_refused_draw_fails_the_exact_check(monkeypatch):
    """Power, and why Engine._constrain leaves a sampled draft whole: cut where a draw was refused,
    its rule would be chosen by the draw."""
    real = Engine._constrain

    def cut_sampled(self, rows, plan, drafts):
        for row, r in rows.items():
            drafter, draft = plan[row]
            if r.constraint is not None and draft is not None and draft.q is not None:
                n = r.constraint.valid(draft.tokens)
                plan[row] = (drafter, draft._first(n))
                drafts[row] = draft.tokens[:n]
        return real(self, rows, plan, drafts)

    monkeypatch.setattr(Engine, "_constrain", cut_sampled)
    tv = step_tv(with_draft_model, config("token"))
    assert tv > 1e-4, tv


@pytest.mark.parametrize("make", [with_lookup, with_draft_model])
def test_greedy_under_a_grammar_is_plain_decoding_under_it(make):
    cfg = GenerationConfig(max_new_tokens=24, chat=False, grammar=GRAMMAR)
    plain = SpeculativeDecoder(target_lm(), None).generate(list(PROMPT), cfg)
    spec = make().generate(list(PROMPT), cfg)
    assert spec.tokens == plain.tokens
    assert set(spec.text) <= set("deé") and spec.text


def test_plain_decoding_drafts_nothing_not_even_forced_tokens():
    cfg = GenerationConfig(max_new_tokens=8, chat=False, grammar=GRAMMAR)
    r = SpeculativeDecoder(target_lm(), None).generate([3, 4, 3], cfg)
    assert r.stats.forced_drafted == 0 and r.stats.drafted == 0


# -- the API's shapes and its errors ----------------------------------------------------------


def test_response_format_shapes():
    assert constraint_spec({"type": "text"}) is None and constraint_spec(None) is None
    assert json.loads(constraint_spec({"type": "json_object"}).text) == {"type": "object"}
    schema = {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}}
    spec = constraint_spec({"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}})
    assert list(json.loads(spec.text)["properties"]) == ["b", "a"]  # the schema's key order is the output's
    assert constraint_spec(None, 'root ::= "a"').kind == "gbnf"


@pytest.mark.parametrize(
    "response_format, grammar, message",
    [
        ({"type": "xml"}, None, "response_format type must be text, json_object or json_schema"),
        ({"type": "json_schema"}, None, "needs"),
        ({"type": "json_schema", "json_schema": {"schema": []}}, None, "must be a JSON object"),
        ("json", None, 'must be an object with a "type"'),
        ({"type": "json_object"}, 'root ::= "a"', "not both"),
        (None, "", "non-empty string"),
    ],
)
def test_bad_response_formats_are_one_line_field_errors(response_format, grammar, message):
    with pytest.raises(FieldError, match=message) as e:
        GenerationConfig(response_format=response_format, grammar=grammar)
    assert "\n" not in str(e.value) and e.value.param in ("response_format", "grammar")


@pytest.mark.parametrize(
    "spec, message",
    [
        (GrammarSpec.json_schema({"type": "objec"}), "JSON schema is not valid"),
        (GrammarSpec.json_schema({"type": "string", "pattern": "(("}), "JSON schema is not valid"),
        (GrammarSpec.json_schema({"type": "array", "uniqueItems": True}), "does not support.*uniqueItems"),
        (GrammarSpec.json_schema({"not": {"type": "string"}}), "does not support"),
        (GrammarSpec("gbnf", "root ::= ("), "not valid"),
        (GrammarSpec("lark", "start: x\nx: x"), "not valid|accepts no output"),
        (GrammarSpec("lark", 'start: "q"'), "accepts no output"),  # "q" is no token of the toy's
    ],
)
def test_bad_grammars_are_one_line_field_errors(spec, message):
    with pytest.raises(FieldError, match=message) as e:
        Grammars(target_lm()).constraint(spec)
    assert "\n" not in str(e.value)


def test_a_grammar_that_compiles_too_long_is_refused_and_the_caller_is_not_held(monkeypatch):
    grammars = Grammars(target_lm(), seconds=0.2)
    real = grammars._compile
    monkeypatch.setattr(grammars, "_compile", lambda spec: time.sleep(1.0) or real(spec))
    t = time.monotonic()
    with pytest.raises(FieldError, match="took over 0.2 s to compile"):
        grammars.constraint(GRAMMAR)
    assert time.monotonic() - t < 0.9


def test_trial_masks_through_an_end_of_generation_leave_the_state_as_it_was():
    """A draft that ends with the end-of-generation token: its masks are computed without
    consuming the end (llguidance's rollback does not count a stop token, so a trial through it
    would roll an earlier token back too), and the state after is the state before."""
    c = Grammars(target_lm()).constraint(GRAMMAR)
    c.consume([4])
    before = c.allowed().tolist()
    masks = c.masks([3, 1, 2, 0])
    assert masks[4].tolist() == [True, False, False, True, True]  # after "dé": end, d or e
    assert c.allowed().tolist() == before
    assert c.extend([4, 0], 8) == ([4, 0], 2) and c.allowed().tolist() == before  # nothing forced after an end
    c.consume([3, 1, 2, 0])
    assert c.stopped


def test_a_compiled_grammar_is_cached_by_its_hash():
    grammars = Grammars(target_lm())
    calls = []
    real = grammars._compile
    grammars._compile = lambda spec: calls.append(spec) or real(spec)
    a, b = grammars.constraint(GRAMMAR), grammars.constraint(GrammarSpec("lark", GRAMMAR.text))
    assert len(calls) == 1 and a.m is not b.m  # each request its own copy
    a.consume([4])
    assert b.allowed().tolist() == [False, False, False, True, True]  # b is not advanced by a
