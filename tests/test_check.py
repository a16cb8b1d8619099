"""`specdec check` on the toy models: it passes our engine (greedy and sampled, a draft model and
prompt lookup, alone and batched), fails deliberately broken verifiers (one that keeps a wrong
greedy token; one that accepts with min(1, 1.1 p/q)), checks a server of ours in-process through
its HTTP API (with and without a plain endpoint), and its power numbers are what the noncentral
chi-square says. Bad input (exit 2) is in tests/test_user_errors.py's table."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import specdec.engine
import specdec.sampling
from specdec import SpeculativeDecoder
from specdec.check import PROMPTS, check_decoder, detectable_tv, goodness_of_fit, greedy_parting, two_sample
from specdec.cli import main
from specdec.sampling import SamplingParams, logits_to_probs, residual, sample, verify, verify_greedy

from .toy import ToyLM

pytest.importorskip("scipy")

SETTINGS = (SamplingParams(1.0), SamplingParams(1.0, top_k=20, top_p=0.9))


def toy_models():
    target = ToyLM(seed=1)
    draft = ToyLM(seed=5, noise_from=target, noise=0.7)
    draft.tokenizer, draft.name = target.tokenizer, "toy-draft"
    return target, draft


def decoder(drafter: str, batch: int = 1) -> SpeculativeDecoder:
    target, draft = toy_models()
    return SpeculativeDecoder(target, draft if drafter == "draft model" else drafter, k=4, max_rows=batch)


def keeps_a_wrong_token(logits, draft_tokens, q, params, rng, rule="block"):
    """Broken greedy verification: the first draft token is always kept."""
    if not draft_tokens or not params.greedy:
        return verify(logits, draft_tokens, q, params, rng, rule)  # the real one, not the patched
    n, token = verify_greedy(logits[1:], draft_tokens[1:])
    return n + 1, token


def accepts_too_often(logits, draft_tokens, q, params, rng, rule="block"):
    """Broken sampled verification: accepts a draft token with min(1, 1.1 p/q)."""
    if params.greedy:
        return verify_greedy(logits, draft_tokens)
    p = logits_to_probs(logits, params)  # [k + 1, vocab]
    for i, x in enumerate(draft_tokens):
        qx = 1.0 if q is None else q[i, x]
        if qx > 0 and specdec.sampling.accept(rng, 1.1 * p[i, x], qx):  # (the same draw as rng.random() * qx < ...)
            continue
        q_row = q[i] if q is not None else np.eye(p.shape[1])[x]
        return i, sample(residual(p[i], q_row), rng)
    return len(draft_tokens), sample(p[-1], rng)


# -- in-process -----------------------------------------------------------------------------------


@pytest.mark.parametrize("drafter", ["draft model", "ngram"])
@pytest.mark.parametrize("batch", [1, 4])
def test_passes_our_engine_greedy(drafter, batch):
    report = check_decoder(decoder(drafter, batch), PROMPTS, greedy_tokens=48, samples=0, batch=batch)
    assert report.passed and report.greedy_identical == report.greedy_prompts == len(PROMPTS)
    assert report.to_dict()["lossless"] is True


@pytest.mark.parametrize("drafter", ["draft model", "ngram"])
def test_passes_our_engine_sampled(drafter):
    report = check_decoder(
        decoder(drafter, 8), PROMPTS[:1], greedy_tokens=0, samples=1000, batch=8, settings=SETTINGS, seed=7
    )
    assert len(report.tests) == 4 and report.passed, "\n".join(report.lines())
    assert all(t.detectable_tv is not None and t.detectable_tv < 0.15 for t in report.tests)


@pytest.mark.parametrize("exact", [False, True])
def test_fails_a_verifier_that_keeps_a_wrong_greedy_token(monkeypatch, exact):
    """Where the wrong token was one of a near-tie (the toy's top two logits are often within
    ROUNDING_GAP) the parting alone passes as a tie, but the output soon leaves the greedy path by
    more; in the exact mode (the toy is batch-invariant, as that mode's target) every parting fails."""
    monkeypatch.setattr(specdec.sampling, "verify", keeps_a_wrong_token)
    d = decoder("draft model")
    d.target.exact = exact
    report = check_decoder(d, PROMPTS, greedy_tokens=48, samples=0)
    assert not report.passed and report.exact == exact
    assert any(p.kind == "bug" for p in report.partings) and all(p.gap is not None for p in report.partings)
    assert all(p.kind == "bug" for p in report.partings) or not exact
    assert "NOT LOSSLESS" in report.lines()[-1]


def test_fails_a_verifier_that_accepts_with_1_1_p_over_q(monkeypatch):
    """The power check: min(1, 1.1 p/q) moves the sampled distribution by a few percent of
    total variation; 2 000 samples find it (p-values ~1e-6 and ~1e-18 at the first positions in
    the run that set these numbers, against a level of 0.01/4)."""
    monkeypatch.setattr(specdec.sampling, "verify", accepts_too_often)
    report = check_decoder(
        decoder("draft model", 8), PROMPTS[:1], greedy_tokens=0, samples=2000, batch=8, settings=SETTINGS, seed=0
    )
    assert not report.passed
    first = [t for t in report.tests if "target's p" in t.name]
    assert all(not t.passed for t in first), "\n".join(report.lines())


def test_greedy_parting_at_a_tie_is_allowed_and_not_in_the_exact_mode():
    """A parting where the target's top two logits tie is a rounding tie (and the output must stay
    greedy after it); in the exact mode the same parting is a bug."""
    target = ToyLM(seed=1)
    prompt = [3, 4]
    row = target.table[3, 4]
    a, b = np.argsort(row)[-2:]
    target.table[3, 4, a] = target.table[3, 4, b]  # a tie after the prompt
    plain = SpeculativeDecoder(target, None).generate(prompt, max_new_tokens=8).tokens
    other = int(a if plain[0] == b else b)
    spec = [other] + SpeculativeDecoder(target, None).generate(prompt + [other], max_new_tokens=7).tokens
    first, gap, problem = greedy_parting(target, prompt, plain, spec)
    assert (first, gap, problem) == (0, 0.0, None)
    assert "exact mode" in greedy_parting(target, prompt, plain, spec, exact=True)[2]
    wrong = spec[:3] + [(spec[3] + 1) % 32] + spec[4:]  # a wrong token after the tie
    assert "not a rounding tie" in greedy_parting(target, prompt, plain, wrong)[2]


# -- the statistics -------------------------------------------------------------------------------


def test_detectable_shift_is_the_noncentral_chi_square_bound():
    """df = 1, level 0.05, power 0.8: the noncentrality is 7.849 (the classic 2.8^2), so the
    shift is sqrt(7.849 / (4 n)); it shrinks as 1/sqrt(n)."""
    assert detectable_tv(1, 0.05, 1000) == pytest.approx(math.sqrt(7.849 / 4000), rel=1e-3)
    assert detectable_tv(10, 0.01, 4000) == pytest.approx(detectable_tv(10, 0.01, 1000) / 2, rel=1e-9)
    assert detectable_tv(0, 0.01, 1000) is None


def test_goodness_of_fit_pools_rare_cells_and_names_impossible_outcomes():
    from collections import Counter

    probs = {0: 0.5, 1: 0.3, 2: 0.19, 3: 0.01}
    counts = Counter({0: 50, 1: 30, 2: 19, 3: 1})
    stat, df, bad = goodness_of_fit(counts, probs)
    assert stat == pytest.approx(0.0, abs=1e-9) and df == 2 and bad == 0  # 3 pooled into the smallest cell
    assert goodness_of_fit(counts + Counter({9: 1}), probs)[2] == 1
    assert goodness_of_fit(counts + Counter({9: 1}), probs, complete=False)[2] == 0
    assert two_sample(Counter({0: 50, 1: 50}), Counter({0: 50, 1: 50})) == (0.0, 1)


# -- the command ----------------------------------------------------------------------------------


def test_cli_reports_json_and_exit_codes(monkeypatch, capsys):
    """`specdec check` exits 0 with a JSON report for our engine, 1 under a broken verifier."""
    import specdec.cli.loading

    monkeypatch.setattr(specdec.cli.loading, "_decoder", lambda args: decoder("draft model", args.batch_size))
    argv = ["check", "--samples", "0", "-n", "32", "--json", "--batch", "2"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["lossless"] is True and out["greedy"]["prompts"] == len(PROMPTS)
    assert "batch 2" in out["engine"]
    monkeypatch.setattr(specdec.sampling, "verify", keeps_a_wrong_token)
    assert main(argv[:-3]) == 1
    text = capsys.readouterr().out
    assert "FAIL" in text and "NOT LOSSLESS" in text


# -- a server of ours, in-process -----------------------------------------------------------------


def test_a_server_off_by_a_little_fails_the_remote_check(monkeypatch):
    """Power over a URL, where the check sees only what the server answers: a toy server whose
    verifier accepts with min(1, 1.1 p/q) (the in-process power check's mutant). 2 000 samples
    through its HTTP API fail the test of every position against the probabilities the server
    itself reports at each prefix (measured p = 3e-6; the honest server p = 0.07), where the old
    check's position 0 alone, never speculated, passes it (p = 0.85). (Its exact TV on this toy's
    32-token vocabulary is out of the enumeration's reach; tests/test_exact_engine.py pins
    shifts of 1e-9 on a smaller toy.)"""
    pytest.importorskip("fastapi")
    from specdec.check import check_remote
    from specdec.spec import DraftSpec

    from .server.helpers import toy_server

    args = dict(greedy_tokens=0, samples=2000, sample_tokens=4, settings=(SamplingParams(1.0),), concurrency=8)
    with toy_server(policy=DraftSpec("model", k=4), unique=True) as (url, _):
        assert check_remote(url, None, PROMPTS[:1], **args).passed  # the honest server first
        monkeypatch.setattr(specdec.sampling, "verify", accepts_too_often)
        report = check_remote(url, None, PROMPTS[:1], **args)
    assert not report.passed and len(report.tests) == 1, "\n".join(report.lines())


def test_remote_passes_our_server_and_fails_it_broken(monkeypatch):
    """A speculative server (toy draft model, k = 4) against a plain one: greedy equality with the
    gap from the plain side's logprobs, position 0 against the server's own reported
    probabilities, two samples at position 3. Then the same servers with a broken verifier."""
    pytest.importorskip("fastapi")
    from specdec.check import check_remote
    from specdec.spec import DraftSpec

    from .server.helpers import toy_server

    args = dict(greedy_tokens=24, samples=400, sample_tokens=4, settings=(SamplingParams(1.0),), concurrency=8)
    with toy_server(policy=DraftSpec("model", k=4)) as (url, _), toy_server(policy=DraftSpec("none")) as (plain, _):
        report = check_remote(url, plain, PROMPTS[:3], **args)
        assert report.passed, "\n".join(report.lines())
        assert report.greedy_identical == 3 and len(report.tests) == 2
        assert {"0..3 vs the server's reported p" in t.name for t in report.tests} == {True, False}
        alone = check_remote(url + "/v1", None, PROMPTS[:1], **args)  # logprobs alone: one test
        assert alone.passed and len(alone.tests) == 1 and not alone.greedy_plain and alone.greedy_prompts == 1
        assert any("--plain-url" in note for note in alone.notes)
        # the toy is batch-invariant, as a server in the exact mode: no tie allowance (its top two
        # logits are often closer than ROUNDING_GAP, and chat prompts all end in the same template)
        monkeypatch.setattr(specdec.sampling, "verify", keeps_a_wrong_token)
        args.update(samples=0, greedy_tokens=48, exact=True)
        broken = check_remote(url, plain, PROMPTS[:3], **args)
        assert not broken.passed and any(p.kind == "bug" for p in broken.partings), "\n".join(broken.lines())
        assert not check_remote(url, None, PROMPTS[:3], **args).passed  # its own logprobs tell


# -- the real 0.5B ----------------------------------------------------------------------------------


@pytest.mark.real_models
def test_passes_our_engine_on_the_real_0_5b(draft_model):
    """The 0.5B GGUF as the target, prompt lookup drafting: greedy on 2 prompts (partings allowed
    only at rounding ties) and 60 samples of its first 2 tokens against its own probabilities, on
    a prompt whose answer copies it (so prompt lookup drafts from the first token on)."""
    d = SpeculativeDecoder(draft_model, "ngram", k=6)
    prompts = [PROMPTS[2], PROMPTS[0]]
    report = check_decoder(d, prompts, greedy_tokens=24, samples=60, sample_tokens=2, settings=SETTINGS[:1])
    assert report.passed, "\n".join(report.lines())
    assert report.greedy_prompts == 2 and len(report.tests) == 1


@pytest.mark.parametrize("params", SETTINGS)
def test_a_server_is_asked_for_every_filter_even_the_ones_that_are_off(monkeypatch, params):
    """llama-server filters by top-k 40, top-p 0.95 and min-p 0.05 where a request names none, so
    "temperature 1, no filters" must say top_k 0, top_p 1 and min_p 0 (without them its first token
    failed the test against its own reported probabilities, p = 0.0006, 2026-11-26)."""
    pytest.importorskip("httpx")
    from specdec.check import Endpoint

    sent = []

    def answer(self, method, path, body=None):
        sent.append(body)
        return {"choices": [{"message": {"content": "x"}, "finish_reason": "length"}]}

    monkeypatch.setattr(Endpoint, "_request", answer)
    monkeypatch.setattr(Endpoint, "_first_model", lambda self: "m")
    Endpoint("http://localhost:1").complete("hi", 4, params, seed=3)
    assert {k: sent[0][k] for k in ("temperature", "top_k", "top_p", "min_p", "seed")} == {
        "temperature": params.temperature,
        "top_k": params.top_k,
        "top_p": params.top_p,
        "min_p": params.min_p,
        "seed": 3,
    }


def test_ctrl_c_during_a_server_check_exits_130():
    """Ctrl-C while requests are in flight: exit 130 at once, one line, whatever the server does."""
    pytest.importorskip("fastapi")
    import time

    from .server.helpers import toy_server
    from .test_user_errors import _interrupt

    with toy_server(delay=0.05) as (url, _):
        started = time.monotonic()
        code, out, err = _interrupt(
            ["check", "--url", url, "-n", "100", "--samples", "100", "--batch", "4"],
            lambda proc: time.monotonic() - started > 3,
        )
    assert code == 130, (code, err)
    assert err.strip().splitlines() == ["specdec: interrupted"] and "Traceback" not in err


def rounding_at_the_cut(target, top_k: int, shift: float = 0.2):
    """The target's logits in forwards of several tokens (speculation's verification) carry the
    token just outside the top k onto the cut (a tie, which top-k keeps) where it lies within
    `shift` of it, as llama.cpp's batch rounding may (up to ~0.35 of logit measured); one-token
    forwards (plain decoding, the check's reference) are untouched."""
    forward_rows = target.forward_rows

    def rounded(tokens, n_logits=None, **kw):
        out = forward_rows(tokens, n_logits, **kw)
        for row, logits in out.items():
            if len(tokens[row]) > 1:
                for r in logits:  # [vocab]
                    order = np.argsort(-r, kind="stable")
                    inside, outside = order[top_k - 1], order[top_k]
                    if r[inside] - r[outside] < shift:
                        r[outside] = r[inside]
        return out

    target.forward_rows = rounded


def test_a_token_rounded_across_a_top_k_cut_is_no_false_alarm():
    """Outside the exact mode the engine's verification logits may differ from a one-token step's
    by rounding, enough to move a token across a top-k (or top-p, min-p) cut: sampling it is then
    no bug. The check counts such a token as possible (with no expected mass) and passes; with no
    tolerance for rounding (the exact mode's rule) the same samples are zero-probability outcomes
    and fail. Reproduces the false alarm that `specdec check`'s defaults (top-k 20, top-p 0.9)
    could raise on llama.cpp. Here ties within 0.2 of logit put 2 samples of 1 000 across the cut;
    within 0.3 they put 64, which both checks fail by their chi-square (measured): the tolerance
    excuses a rounding's few samples, not a shifted distribution."""
    params = (SamplingParams(1.0, top_k=3),)
    d = decoder("draft model", 8)  # it drafts every step: every token comes from a verification forward
    rounding_at_the_cut(d.target, top_k=3)
    args = dict(greedy_tokens=0, samples=1000, batch=8, settings=params, seed=3)
    report = check_decoder(d, PROMPTS[:1], **args)
    assert report.passed, "\n".join(report.lines())
    d.target.exact = True  # no tolerance: any sample the reference cuts is impossible
    strict = check_decoder(d, PROMPTS[:1], **args)
    assert not strict.passed and "probability 0" in "\n".join(strict.lines()), "\n".join(strict.lines())
