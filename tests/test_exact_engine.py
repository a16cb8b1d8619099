"""Sampled output follows the target's distribution EXACTLY through the whole engine: every random
decision of a step (the drafter's draws, its tree's siblings, each verification rule's
accept-or-reject and the token after) is enumerated with its probability (tests/enumerate.py),
through the real Engine.step, controllers and drafters, so the engine's own choices (the room
for a tree, the rule it dispatches to, a draft cut at its end-of-generation token) are what is
tested, not a copy of them.

The check: the first L tokens' joint probability (the step's emitted tokens, then the target
alone) against the target's own, enumerated from its logits; the total variation must be below
1e-9 (rounding). Power, by mutants that the suite must catch: the tree fallback of 0af4022 (a
sampled tree swapped for its first branch where its leaves do not fit, so the draws choose
between node-by-node and block verification: TV 3.2e-2 here), a head whose q is not the
distribution it drew from, a batch whose rows are verified with another row's parameters, and
the residual replaced by p. With no sampling error, every one of them fails by orders of magnitude
(each test asserts TV > 1e-4; the smallest measured is in its docstring), and a shift of TV 0.01
or far less cannot pass.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest

from specdec import GenerationConfig, SpeculativeDecoder
from specdec.drafters.model import ModelDrafter
from specdec.engine import Engine
from specdec.sampling import VERIFICATION_RULES, logits_to_probs

from .enumerate import exact, total_variation
from .test_sampled_engine import exact_outcomes
from .toy import ToyLM

EOG = -1  # an outcome's marker: generation ended there (as tests/test_sampled_engine.py)
V = 5  # token 0 ends generation
K = 3  # draft tokens in the step
L = K + 1  # tokens compared: all a step may emit
PROMPT = [1, 2, 3, 1, 2]
# temperature 1 and top-p 0.8: q's support is one token at some positions and two or three at
# others, so a fishbone's leaf count depends on what the draft drew (a sibling needs room in q)
PARAMS = dict(temperature=1.0, top_p=0.8)
TIGHT = 1e-9


def target_lm(seed: int = 2, eog_boost: float = 0.0) -> ToyLM:
    target = ToyLM(vocab_size=V, seed=seed, sharpness=1.0)
    target.table[:, :, 0] += eog_boost  # make ending likely, to draft end-of-generation tokens
    target.path = None
    return target


def draft_lm(target: ToyLM, seed: int = 6) -> ToyLM:
    draft = ToyLM(vocab_size=V, seed=seed, noise_from=target, noise=2.5, sharpness=1.0)
    draft.tokenizer, draft.name, draft.path = target.tokenizer, "toy-draft", None
    return draft


def target_joint(target, prompt, config: GenerationConfig, n: int) -> dict[tuple, float]:
    """P(first n emitted tokens) under the target alone; an outcome ends with EOG where the target
    ended first (the sampled harness's enumeration)."""
    return exact_outcomes(target, prompt, config.sampling, n)


def then_target(step: dict[tuple, float], target, prompt, config, n: int = L) -> dict[tuple, float]:
    """The first n tokens' joint: each step outcome (its emitted tokens), then the target alone."""
    out: dict[tuple, float] = defaultdict(float)
    for emitted, w in step.items():
        if (emitted and emitted[-1] == EOG) or len(emitted) >= n:
            out[emitted] += w
            continue
        for rest, pr in target_joint(target, [*prompt, *emitted], config, n - len(emitted)).items():
            out[emitted + rest] += w * pr
    return dict(out)


def one_step(decoder: SpeculativeDecoder, prompt, configs) -> tuple:
    """One engine step over a row per config; each row's emitted tokens (EOG where it ended)."""
    engine = decoder.engine
    requests = [engine.add(list(prompt), config) for config in configs]
    engine.step()
    return tuple(tuple(r.context[len(prompt) :]) + ((EOG,) if r.stats.finish_reason == "eog" else ()) for r in requests)


def step_distribution(make, configs, row: int = 0) -> dict[tuple, float]:
    """Row `row`'s one-step outcomes, exactly, with a fresh decoder (make()) on every branch."""
    joint = exact(lambda: one_step(make(), PROMPT, configs))
    out: dict[tuple, float] = defaultdict(float)
    for outcome, w in joint.items():
        out[outcome[row]] += w
    return dict(out)


def step_tv(step: dict[tuple, float], config: GenerationConfig, target) -> float:
    """The total variation between a step's outcomes followed by the target and the target alone."""
    return total_variation(then_target(step, target, PROMPT, config), target_joint(target, PROMPT, config, L))


def tv_of(make, config: GenerationConfig, target_factory=target_lm) -> float:
    return step_tv(step_distribution(make, [config]), config, target_factory())


def fishbone(room: int | None, width: int = 2, nodes: int = 0, eog_boost: float = 0.0):
    """A fresh decoder whose target lends `room` leaves a step (llama.cpp's sequence ids; None:
    no limit), drafting K deep with the draft model's fishbone (or a tree of `nodes`)."""

    def make() -> SpeculativeDecoder:
        target = target_lm(eog_boost=eog_boost)
        if room is not None:
            target.tree_leaves = room
        draft = draft_lm(target)
        if eog_boost:  # the draft's own penalty on ending undone, and the boost given it too
            draft.table[:, :, 0] += 4.0 + eog_boost
        return SpeculativeDecoder(target, ModelDrafter(draft, width=width, nodes=nodes), k=K)

    return make


def config(rule: str = "block", **kw) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=L, chat=False, verification=rule, **{**PARAMS, **kw})


def step_seeing_drafts(make, cfg: GenerationConfig, seen) -> dict[tuple, float]:
    """Row 0's one-step outcomes, exactly (a fresh decoder, make(), on every branch), telling
    seen(draft) of every draft its drafter makes."""

    def run():
        decoder = make()
        drafter = decoder.engine.controller.drafter
        propose = drafter.propose

        def spy(*args, **kwargs):
            drafts = propose(*args, **kwargs)
            for draft in drafts.values():
                seen(draft)
            return drafts

        drafter.propose = spy
        return one_step(decoder, PROMPT, [cfg])

    step: dict[tuple, float] = defaultdict(float)
    for outcome, w in exact(run).items():
        step[outcome[0]] += w
    return dict(step)


def leaf_counts(make) -> set[int]:
    """The leaf counts of the drafts a fresh decoder's drafter makes for the step (all branches)."""
    counts: set[int] = set()
    step_seeing_drafts(make, config(), lambda draft: counts.add(draft.leaves()))
    return counts


@pytest.mark.parametrize("room", [None, 4, 3, 2, 0])
@pytest.mark.parametrize("rule", VERIFICATION_RULES)
def test_a_sampled_tree_is_exact_whatever_room_the_target_has(room, rule):
    """The draft model's fishbone (width 2, K deep: up to K + 1 leaves, fewer where q had no room
    for a sibling) under every rule, with the target lending no limit, room for every tree, room
    for some of them (3), for none (2) and no trees at all (0): the engine fixes the room before
    drafting and the drafter shapes its tree within it, so one rule verifies every draft of the
    step and the output is the target's, exactly."""
    assert tv_of(fishbone(room), config(rule)) < TIGHT


def test_the_tree_fallback_mixture_fails_the_exact_check(monkeypatch):
    """Power, and the bug of 0af4022 (issue 93): a tree kept where its leaves fit the target's room
    and swapped for its first branch where they do not (then verified by the chain's block rule,
    the tree node by node). The leaf counts of this case's trees vary with the draws (checked), so
    the draws choose the rule: measured TV 3.2e-2 here, against < 1e-9 for the engine as it is."""
    assert {1, 2, 3, 4} & leaf_counts(fishbone(None)) >= {3, 4}  # some fit a room of 3, some do not

    def old_room(self, rows):
        return {}  # nothing reserved before drafting

    def old_fit(self, drafter, draft, most):
        room = getattr(self.target, "tree_leaves", None)
        if draft.parents is not None and room is not None and draft.leaves() > room:
            return draft.first_branch()
        return draft

    monkeypatch.setattr(Engine, "_tree_room", old_room)
    monkeypatch.setattr(Engine, "_fitted", old_fit)
    tv = tv_of(fishbone(3), config("block"))
    assert tv > 1e-4, tv
    # the same mixture is exact where the fallback is verified token by token (node by node on a
    # chain): the two rules agree given the first branch, which is all the choice depends on here
    assert tv_of(fishbone(3), config("token")) < TIGHT


def test_a_drafter_that_overflows_its_reserved_room_stops_the_step(monkeypatch):
    """A sampled tree whose drafter ignored the room the step reserved is refused with a clear
    error, never cut after the draws (which would bias the output)."""
    from specdec.drafters import model

    monkeypatch.setattr(model, "fit_tree", lambda width, nodes, k, most: (width, nodes))
    decoder = fishbone(2)()
    decoder.engine.add(list(PROMPT), config())
    with pytest.raises(Exception, match="sampled tree of .* leaves where the step reserved 2"):
        for _ in range(20):
            decoder.engine.step()


@pytest.mark.parametrize("rule", VERIFICATION_RULES)
def test_a_grown_tree_is_exact_within_a_small_room(rule):
    """A tree grown best first to 4 nodes (width 2), where the target lends 3 leaves: the drafter
    grows at most 3 nodes, decided before it draws."""
    assert tv_of(fishbone(3, width=2, nodes=4), config(rule)) < TIGHT


@pytest.mark.parametrize("width", [1, 2])
@pytest.mark.parametrize("rule", VERIFICATION_RULES)
def test_drafts_cut_at_their_end_of_generation_token_are_exact(rule, width):
    """The engine cuts a draft after its first end-of-generation token (Draft.upto; a tree loses
    what hangs below it): a choice made after drafting. It is exact under every rule because
    nothing after an accepted end is emitted, and a draft whose end is rejected is examined no
    further (token by token), or has no prefix past it to keep (block: the chain's weights past
    the end are never reached by an emitted token). Here the end is likely (checked: drafts
    with it are cut)."""
    cut: list[bool] = []  # per draft: an end before its last token, which the engine cuts after
    step = step_seeing_drafts(
        fishbone(None, width=width, eog_boost=2.5), config(rule), lambda draft: cut.append(0 in draft.tokens[:-1])
    )
    assert any(cut)
    assert step_tv(dict(step), config(rule), target_lm(eog_boost=2.5)) < TIGHT


def test_the_harness_fails_a_verifier_that_resamples_from_p(monkeypatch):
    """Power for the chain rules: with the residual replaced by p (sampling.residual and
    block_residual), a rejected draft token comes back too often."""
    import specdec.sampling

    monkeypatch.setattr(specdec.sampling, "residual", lambda p_row, q_row: p_row)
    monkeypatch.setattr(specdec.sampling, "block_residual", lambda p_row, q_row, weight: p_row)
    assert tv_of(fishbone(None, width=1), config("block")) > 1e-3


# -- a batch of a greedy row and a sampled row -----------------------------------------------


def mixed(make_target=target_lm):
    def make() -> SpeculativeDecoder:
        target = make_target()
        return SpeculativeDecoder(target, ModelDrafter(draft_lm(target)), k=K)

    return make


GREEDY = GenerationConfig(max_new_tokens=L, chat=False)


def greedy_tokens(n: int) -> tuple:
    target = target_lm()
    return tuple(SpeculativeDecoder(target).generate(PROMPT, GREEDY).tokens[:n])


def test_a_batch_of_a_greedy_and_a_sampled_row_is_exact_for_both():
    """One step over a greedy row and a sampled row together (the draft model drafts for both in
    one forward, the target scores both in one): the greedy row emits its plain greedy tokens on
    every branch, and the sampled row's outcome follows the target exactly."""
    joint = exact(lambda: one_step(mixed()(), PROMPT, [GREEDY, config()]))
    greedy = {outcome[0] for outcome in joint}
    assert len(greedy) == 1
    emitted = next(iter(greedy))
    assert emitted and emitted == greedy_tokens(len(emitted))
    step: dict[tuple, float] = defaultdict(float)
    for outcome, w in joint.items():
        step[outcome[1]] += w
    assert step_tv(dict(step), config(), target_lm()) < TIGHT


def test_the_mixed_batch_fails_when_rows_share_one_rows_parameters(monkeypatch):
    """Power: an engine that verifies every row of the batch with the first row's sampling
    parameters (a batching bug) fails the check above for the sampled row."""
    import specdec.engine
    import specdec.sampling

    real = specdec.sampling.verify
    first = {}

    def shared(logits, draft_tokens, q, params, rng, rule="block"):
        first.setdefault("params", params)
        return real(logits, draft_tokens, q, first["params"], rng, rule)

    def run():
        first.clear()
        return one_step(mixed()(), PROMPT, [config(temperature=0.5), config()])

    monkeypatch.setattr(specdec.sampling, "verify", shared)
    step: dict[tuple, float] = defaultdict(float)
    for outcome, w in exact(run).items():
        step[outcome[1]] += w
    tv = step_tv(dict(step), config(), target_lm())
    assert tv > 1e-3, tv


# -- a trained head's q, on the NumPy backend --------------------------------------------------


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory):
    """A tiny random 4-layer GPT-2 (tests/models/test_numpy_ref.py) and a random head file of each
    kind over 200 of its 300 tokens (tests/drafters/heads.py): q is 0 outside them."""
    from specdec.models.numpy_ref import load_numpy_model

    from .drafters.heads import random_head
    from .models.test_numpy_ref import write_tiny_gguf

    folder = tmp_path_factory.mktemp("tiny-gpt2")
    path = folder / "tiny-gpt2-4.gguf"
    write_tiny_gguf(path, "gpt2", seed=3, n_layer=4)
    target = load_numpy_model(path)
    heads = {kind: random_head(target, kind, folder / f"{kind}.head", vocab=200) for kind in ("medusa", "prophet")}
    return target, heads


# temperature 3 spreads this random model's peaked logits; top-k 3 keeps its outcomes enumerable
HEAD_CONFIG = GenerationConfig(max_new_tokens=4, chat=False, temperature=3.0, top_k=3)
# the NumPy backend computes a row's logits in float32 with the rounding of the forward's shape
# (k + 1 tokens, against one at a time in target_joint): its outcomes differ by ~1e-7
ROUNDING = 1e-5


def head_tv(tiny_gpt2, kind: str, shape: dict, monkeypatch) -> float:
    from specdec.spec import parse

    monkeypatch.setenv("SPECDEC_HOME", str(tiny_gpt2[1][kind].parent / "home"))
    target, heads = tiny_gpt2
    prompt = target.tokenizer.encode("the cat in a hat", add_special=False)
    spec = parse(f"head:{heads[kind]}", k=K, **shape)

    drafted = []
    engine = SpeculativeDecoder.from_spec(target, spec).engine  # its rows end with each branch's request

    def run():  # the whole generation: a head drafts from the second step on (its first has no state)
        request = engine.add(list(prompt), HEAD_CONFIG)
        engine.run([request])
        drafted.append(request.stats.drafted)
        return tuple(request.result.tokens) + ((EOG,) if request.stats.finish_reason == "eog" else ())

    tv = total_variation(exact(run), target_joint(target, prompt, HEAD_CONFIG, HEAD_CONFIG.max_new_tokens))
    assert max(drafted) >= 2  # drafts of several tokens were verified
    return tv


@pytest.mark.parametrize("kind, shape", [("medusa", {}), ("prophet", {})])
def test_a_heads_drafts_are_exact(tiny_gpt2, kind, shape, monkeypatch):
    """A head drafts from the target's hidden states with its own q over a draft vocabulary (0
    outside it): exact through the engine, four tokens of a generation (the first step has no
    hidden state to draft from). (A head's tree, 2 x 3 nodes, enumerates in 100 s: its trees are
    the sampled harness's, tests/test_sampled_engine.py, and trees' rules are exact here above.)"""
    assert head_tv(tiny_gpt2, kind, shape, monkeypatch) < ROUNDING


def test_a_head_whose_q_is_not_what_it_drew_from_fails(tiny_gpt2, monkeypatch):
    """Power for the heads' q: a head that draws from its filtered distribution but reports q from
    before the top-k cut (a plausible bug: the draft processed unlike the target) fails."""
    from dataclasses import replace

    from specdec.drafters.head import HeadDrafter

    real = HeadDrafter._token

    def unfiltered(self, head_logits, params, rng):
        token, _ = real(self, head_logits, params, rng)
        logits = np.full(self.target.vocab_size, -np.inf, np.float32)
        logits[self.vocab] = head_logits
        return token, logits_to_probs(logits, replace(params, top_k=0))

    monkeypatch.setattr(HeadDrafter, "_token", unfiltered)
    tv = head_tv(tiny_gpt2, "medusa", {}, monkeypatch)
    assert tv > 1e-4, tv
