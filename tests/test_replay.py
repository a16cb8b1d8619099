"""Offline replay of drafting policies (specdec_lab.replay): the ceilings bound every controller."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import numpy as np
import pytest

from specdec.controller import CostAwareController, FixedController
from specdec.drafters.ngram import NgramDrafter
from specdec_lab.replay import copy_ceiling, oracle_speedup, replay_speedup

from .test_controller import CURVE


def edited_copy(seed: int, n_prompt: int = 300, edits: int = 6):
    """A prompt of random tokens and an output that copies a stretch of it with a few tokens changed."""
    rng = np.random.default_rng(seed)
    prompt = [int(t) for t in rng.integers(0, 500, n_prompt)]
    output = prompt[50:250]
    for pos in rng.choice(len(output), edits, replace=False):
        output[pos] = int(rng.integers(500, 600))  # tokens the prompt never had
    return prompt, output


@pytest.mark.parametrize("seed", range(4))
def test_ceilings_bound_every_controller(seed):
    prompt, output = edited_copy(seed)
    ceiling = copy_ceiling(prompt, output, CURVE)
    oracle = oracle_speedup(prompt, output, CURVE)
    auto, decisions = replay_speedup(prompt, output, CURVE, CostAwareController(NgramDrafter(), None, CURVE))
    fixed, _ = replay_speedup(prompt, output, CURVE, FixedController(NgramDrafter(), 8))
    assert ceiling >= oracle - 1e-9 and oracle >= auto - 1e-9 and oracle >= fixed - 1e-9
    assert auto > 1.5 and fixed > 1.5  # a copy with six edits pays well
    assert sum(n for key, n in decisions.items() if key != "plain") > 0


def test_nothing_to_copy_means_plain_speed():
    prompt = list(range(100))
    output = list(range(1000, 1200))  # every token new
    assert copy_ceiling(prompt, output, CURVE) == pytest.approx(1.0)
    assert oracle_speedup(prompt, output, CURVE) == pytest.approx(1.0)
    auto, decisions = replay_speedup(prompt, output, CURVE, CostAwareController(NgramDrafter(), None, CURVE))
    assert auto == pytest.approx(1.0) and decisions == {"plain": len(output)}


def test_each_replayed_step_is_priced_at_its_own_depth():
    from specdec.costs import CostTable
    from specdec_lab.replay import clairvoyant_speedup, curve_at

    prompt, output = edited_copy(0)
    curve = {w: float(c) for w, c in enumerate(CURVE, 1)}
    # a deep curve that costs what the shallow one does: the same replay as the curve alone
    level = CostTable(curve, deep=curve, depth=128, deep_depth=1024)
    for ceiling in (copy_ceiling, oracle_speedup, clairvoyant_speedup):
        assert ceiling(prompt, output, level) == pytest.approx(ceiling(prompt, output, CURVE))
    assert replay_speedup(prompt, output, level, CostAwareController(NgramDrafter(), None, level))[0] == pytest.approx(
        replay_speedup(prompt, output, CURVE, CostAwareController(NgramDrafter(), None, CURVE))[0]
    )
    # a deep curve where every width costs one more one-token forward (one token twice as dear): the
    # plain time is the one-token cost at each position's depth, and relative to it width is cheaper
    # deep in the prompt, so the clairvoyant controller gains
    deep = CostTable(curve, deep={w: 2 * curve[1] + c - curve[1] for w, c in curve.items()}, depth=128, deep_depth=1024)
    at = [curve_at(deep, len(prompt) + i) for i in range(len(output))]
    assert at[0][0] == pytest.approx(deep(1, len(prompt))) and at[-1][0] > at[0][0]
    no_drafts = FixedController(None, 0)
    assert replay_speedup(prompt, output, deep, no_drafts) == (pytest.approx(1.0), {"plain": len(output)})
    assert oracle_speedup(prompt, output, deep) > oracle_speedup(prompt, output, CURVE)


def test_a_wrong_guess_costs_a_wider_step():
    # the prompt says 1 2 3 4 then 1 2 3 5; the output copies neither continuation after "1 2 3"
    prompt, output = [9, 1, 2, 3, 4, 8, 1, 2, 3], [7, 7, 7, 7]
    speedup, decisions = replay_speedup(prompt, output, CURVE, FixedController(NgramDrafter(), 4))
    # step one drafts [4, 8, 1, 2] from "1 2 3" and keeps none; later steps draft from "7"
    assert decisions["ngram:4"] >= 1 and speedup < 1.0


# -- a draft model replayed from its recorded agreement ----------------------------------------


def test_draft_run_is_the_run_of_agreements():
    from specdec_lab.replay import draft_run

    assert [draft_run("1101110", i, 4) for i in range(7)] == [2, 1, 0, 3, 2, 1, 0]
    assert draft_run("1111", 0, 2) == 2 and draft_run("11", 1, 4) == 1


def test_the_recorded_drafter_is_accepted_exactly_as_recorded_and_pays_its_forwards():
    """Fixed draft:K replayed: every step keeps the recorded run; a draft that always agrees and
    costs nothing gives the ceiling's tokens per step, a costly draft model less."""
    from specdec_lab.replay import RecordedDrafter, draft_ceiling, draft_seconds

    rng = np.random.default_rng(0)
    prompt, output = list(range(10)), [int(t) for t in rng.integers(100, 200, 120)]
    agrees = "".join("1" if x < 0.8 else "0" for x in rng.random(len(output)))
    recorded = RecordedDrafter({tuple(prompt): (output, agrees)})
    flat = [1.0] * 16  # a GPU-like curve: width is free
    free = [0.0] * 16
    speedup, decisions = replay_speedup(prompt, output, flat, FixedController(recorded, 4), recorded, free)
    steps = sum(decisions.values())
    assert speedup == pytest.approx(len(output) / steps)
    assert set(decisions) <= {"draft:4", "draft:3", "draft:2", "draft:1", "plain"}
    # a step keeps the run of agreements: the mean is what the agreement string says
    pos, expected_steps = 0, 0
    while pos < len(output):
        k = min(4, len(output) - pos - 1)
        n = 0
        while n < k and agrees[pos + n] == "1":
            n += 1
        pos, expected_steps = pos + n + 1, expected_steps + 1
    assert steps == expected_steps
    costly = [0.5] * 16  # a draft forward costs half a target forward
    slower, _ = replay_speedup(prompt, output, flat, FixedController(recorded, 4), recorded, costly)
    assert slower < speedup
    assert draft_seconds(costly, 3, 4) == pytest.approx(0.5 + 3 * 0.5)
    assert draft_ceiling(prompt, output, agrees, flat, free) >= speedup - 1e-9
    assert draft_ceiling(prompt, output, "0" * len(output), flat, free) == pytest.approx(1.0)


def test_a_heads_runs_replay_as_fixed_chains_and_a_ceiling():
    """A trained head replayed from its runs (how many of its guesses the target keeps at each
    position): a fixed head:K step keeps min(run, K) and costs the target's k + 1 tokens plus K head
    steps; the first position (right after the prefill) drafts nothing; the ceiling drafts exactly
    the run, and a head that is never right never drafts."""
    from specdec_lab.replay import fixed_speedup, head_ceiling, head_replay, head_steps

    rng = np.random.default_rng(1)
    prompt, output = list(range(10)), [int(t) for t in rng.integers(100, 200, 90)]
    runs = [None, *(int(r) for r in rng.integers(0, 4, len(output) - 1))]
    flat = [1.0] * 16
    curves = [flat] * len(output)
    pos, steps = 0, 0
    while pos < len(output):  # head:3 by hand: position 0 is a plain step
        pos, steps = pos + (min(runs[pos], 3) if runs[pos] is not None else 0) + 1, steps + 1
    speedup, per_step = fixed_speedup(runs, head_steps(curves, 0.0), curves, 3)
    assert per_step == pytest.approx(len(output) / steps) and speedup == pytest.approx(per_step)
    slower, same = fixed_speedup(runs, head_steps(curves, 0.25), curves, 3)
    assert same == per_step and slower < speedup
    kept, same = fixed_speedup(runs, head_steps(curves, 0.0, keep=0.5), curves, 3)  # every step 1.5x
    assert same == per_step and kept == pytest.approx(speedup / 1.5)
    assert head_ceiling(runs, head_steps(curves, 0.0), curves) >= speedup - 1e-9
    assert head_ceiling([None] + [0] * (len(output) - 1), head_steps(curves, 0.0), curves) == pytest.approx(1.0)
    record = {"prompt": prompt, "output": output, "draft_agrees": "1" * len(output)}
    row = head_replay(record, runs, flat, [0.0] * 16, 0.0)
    assert row["first"] == pytest.approx(np.mean([r > 0 for r in runs[1:]]))
    assert row["head"][2] == pytest.approx(speedup) and row["tokens_per_step"][2] == pytest.approx(per_step)
    assert row["draft4"] == pytest.approx(len(output) / -(-len(output) // 5))  # every draft:4 step keeps 4


def test_auto_uses_a_recorded_draft_model_when_it_pays():
    from specdec_lab.replay import RecordedDrafter

    prompt, output = list(range(10)), list(range(1000, 1200))  # nothing to copy: lookup is useless
    recorded = RecordedDrafter({tuple(prompt): (output, "1" * len(output))})
    flat = [1.0 + 0.01 * i for i in range(16)]
    auto = CostAwareController(NgramDrafter(), recorded, flat, [0.05] * 16)
    speedup, decisions = replay_speedup(prompt, output, flat, auto, recorded, [0.05] * 16)
    assert speedup > 2 and any(key.startswith("draft:") for key in decisions)


# -- fitting priors and leaving one category out (recorded data shipped in the repository) ----------

RECORDINGS = [
    Path(__file__).resolve().parents[1] / "benchmarks" / name
    for name in ("greedy-1.5b-0.5b.jsonl", "dev-greedy-1.5b-0.5b.jsonl", "greedy256-1.5b-0.5b.jsonl")
]


def load_recording(path):
    lines = path.read_text().splitlines()
    return json.loads(lines[0]), [json.loads(line) for line in lines[1:]]


def test_the_fitted_match_prior_trusts_longer_matches_more():
    from specdec.controller import MATCH_BUCKETS, MatchAcceptance
    from specdec_lab.replay import fit_match_prior, match_statistics

    _, records = load_recording(RECORDINGS[0])
    stats = match_statistics(records)
    assert set(stats) == set(MatchAcceptance.KINDS)
    assert sum(sum(checked) for _, checked in stats.values()) > 500
    for kind, values in fit_match_prior(records).items():
        assert len(values) == len(MATCH_BUCKETS) and all(0 < v < 1 for v in values)
        assert list(values) == sorted(values), kind


def test_the_draft_prior_is_the_run_of_agreements():
    from specdec_lab.replay import draft_statistics

    right, checked = draft_statistics([{"draft_agrees": "1101"}])
    # from 0: 1,1,0 (3 checked); from 1: 1,0; from 2: 0; from 3: 1
    assert checked[:4] == [4, 2, 1, 0] and right[:4] == [3, 1, 0, 0]


@pytest.mark.parametrize("path", RECORDINGS, ids=lambda p: p.name)
def test_leave_one_category_out(path, monkeypatch):
    """Every category is replayed with priors fitted on the others only (the fit never sees it),
    and the clairvoyant controller over the same two drafters bounds auto on each."""
    import specdec_lab.replay as replay

    assert path.exists(), f"the shipped recording {path.name} is missing"
    header, records = load_recording(path)
    seen = []
    fit = replay.fit_match_prior

    def spy(train):
        seen.append({r["category"] for r in train})
        return fit(train)

    monkeypatch.setattr(replay, "fit_match_prior", spy)
    costs, draft_costs = header["costs"], header.get("draft_costs") or [c / 3 for c in header["costs"]]
    result = replay.leave_one_category_out(records, costs, draft_costs, frozenset(header.get("eog", ())))
    categories = {r["category"] for r in records}
    assert set(result) == categories and len(seen) == len(categories)
    for held_out, train in zip(result, seen):
        assert held_out not in train and train == categories - {held_out}
    for r in result.values():
        assert 0 < r["worst"] <= r["auto"] <= r["clairvoyant"] + 1e-9 and r["ratio"] <= 1 + 1e-9


def test_copy_runs_split_whole_copies_from_partial_ones():
    """A response that copies its prompt from its first token counts as a whole copy at every
    position; one that writes 30 tokens of its own first only reaches a long match later, partial."""
    from specdec_lab.replay import copy_runs

    prompt = list(range(100)) + [500] + list(range(20))
    whole = copy_runs([{"prompt": prompt, "output": list(range(20, 60))}])
    # every one of the 40 positions matches 20+ tokens and its guesses run to the end of the output
    assert whole["whole"][1] == (40, 40) and whole["whole"][16] == (25, 25) and whole["whole"][63] == (0, 0)
    assert whole["partial"][1] == (0, 0)
    partial = copy_runs([{"prompt": list(range(100)), "output": [600 + i for i in range(30)] + list(range(40))}])
    # the match reaches 16 tokens at position 46, where 0.8 of the response would be 37 tokens
    assert partial["partial"][1] == (24, 24) and partial["whole"][1] == (0, 0)


# -- peers' policies and the verdict ------------------------------------------------------------


def test_adaptive_k_picks_the_k_that_pays_per_step():
    """vLLM's rule: the K maximising (1 + a_1 + ... + a_K) / (K c + 1) from the acceptance seen."""
    from specdec_lab.replay import AdaptiveKController

    free = AdaptiveKController(NgramDrafter(), 8, 0.0)
    assert free.choose() == 8  # nothing seen: every position counts as kept
    free.drafted, free.kept = [10] * 8, [9, 5, 0, 0, 0, 0, 0, 0]
    assert free.choose() == 2  # positions 3+ add nothing, and ties go to the shorter draft
    costly = AdaptiveKController(NgramDrafter(), 8, 0.5)
    costly.drafted, costly.kept = [10] * 8, [9, 6, 3, 1, 0, 0, 0, 0]
    # (1.9, 2.5, 2.8, 2.9) / (1.5, 2, 2.5, 3): 1.27, 1.25, 1.12, 0.97 -> K = 1
    assert costly.choose() == 1


def test_llama_cpps_draft_policy_drafts_while_the_draft_is_sure_and_pays_each_look():
    """llama.cpp's draft-simple, replayed: it drafts while the draft's own token's probability is
    at least p_min, at most n_max; a first guess below p_min drafts nothing but the draft model's
    catch-up forward is paid; a stop below p_min paid one more forward than a stop at n_max. The
    confidences are each position's greedy token's softmax share of the 10 best, floored."""
    from specdec_lab.replay import ConfidenceController, RecordedDrafter, draft_confidences

    assert draft_confidences(np.log(np.array([[0.75, 0.25], [0.2, 0.8], [0.7499, 0.2501]]))) == [0.75, 0.8, 0.749]
    # among the 10 best candidates only, as llama.cpp's draft sampler reads them
    assert draft_confidences(np.log([[0.5] + [0.05] * 9 + [0.01] * 50])) == [0.526]
    prompt, output = list(range(10)), list(range(100, 112))
    agrees = "111011111111"
    p = [0.9, 0.8, 0.76, 0.9, 0.2, 0.95, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9]
    recorded = RecordedDrafter({tuple(prompt): (output, agrees, None, p)})
    flat, draft = [1.0] * 16, [0.25] * 16
    _, decisions = replay_speedup(prompt, output, flat, ConfidenceController(recorded, 0.75, 3), recorded, draft)
    # pos 0: sure 3 deep (n_max), all kept -> pos 4 (0.2): a look, nothing drafted -> pos 5: 3 kept
    # -> pos 9: 3 more, the output's last
    assert decisions == {"draft:3": 3, "plain": 1}

    # what a look that drafts nothing costs: the catch-up forward, and the context is fed
    recorded.begin(0, prompt)
    controller = ConfidenceController(recorded, 0.95, 16)
    [(drafter, proposal)] = controller.draft({0: prompt + output[:4]}, {0: 8}).values()
    assert drafter is recorded and proposal.tokens == []
    assert recorded.last_cost_rows == (len(prompt) + 4, 1) and recorded.lag(0, prompt + output[:4]) == 0
    recorded.end([0])
    # a stop below p_min after 2 drafted tokens (0.9, 0.8, then 0.76): the catch-up, then a forward
    # for each of the two; a stop at n_max: none after the last
    for p_min, n_max, drafted, rows in ((0.8, 16, 2, (10, 3)), (0.5, 2, 2, (10, 2))):
        recorded.begin(0, prompt)
        [(_, proposal)] = ConfidenceController(recorded, p_min, n_max).draft({0: prompt}, {0: 8}).values()
        assert proposal.tokens == output[:drafted] and recorded.last_cost_rows == rows
        recorded.end([0])


def test_a_recorded_draft_model_is_cut_by_its_recorded_confidence_as_the_real_one_is():
    """auto's ChainCut on the replay's draft model: asked as ModelDrafter asks it (take each token
    by its recorded confidence, feed it while another may follow), it drafts what the cut takes,
    says their confidences, and pays the catch-up and one forward per fed token; a cut that takes
    nothing still paid the catch-up, and the context is fed."""
    from specdec_lab.replay import RecordedDrafter

    class Scripted:  # takes a token of confidence >= 0.5, and feeds every token it takes
        fed = 0

        def take(self, p):
            return p >= 0.5

        def feed(self):
            self.fed += 1
            return True

    prompt, output = list(range(10)), list(range(100, 110))
    p = [0.9, 0.9, 0.9, 0.3, 0.2, 0.9, 0.9, 0.9, 0.9, 0.9]
    recorded = RecordedDrafter({tuple(prompt): (output, "1" * 10, None, p)})
    recorded.begin(0, prompt)
    [draft] = recorded.propose({0: prompt}, {0: 8}, cuts={0: Scripted()}).values()
    assert draft.tokens == output[:3] and draft.evidence["confidence"] == [0.9, 0.9, 0.9]
    assert recorded.last_cost_rows == (len(prompt), 4)  # the catch-up, then 3 fed (the third told 0.3)
    recorded.accept({0: 3})
    context = prompt + output[:4]
    [draft] = recorded.propose({0: context}, {0: 8}, cuts={0: Scripted()}).values()
    # the catch-up reads the bonus token and the third draft token (accept keeps k - 1 fed, as ModelDrafter)
    assert draft.tokens == [] and recorded.last_cost_rows == (2, 1)
    assert recorded.lag(0, context) == 0  # the look fed the context
    recorded.end([0])


def test_the_verdict_names_the_best_fixed_method_and_peer_and_checks_the_bars(tmp_path):
    """On a shipped recording: every category gets auto held out, the clairvoyant, the best of the
    fixed methods and of the peers (by their medians), and three bars, each read prompt by prompt
    (auto's speedup over the other's on the same prompt); `verdict --check` exits 1 exactly when
    one fails."""
    import subprocess
    import sys

    from specdec_lab.replay import verdict

    path = RECORDINGS[1]
    header, records = load_recording(path)
    stops = frozenset(header.get("eog", ()))
    result = verdict(records, header["costs"], None, stops)
    assert set(result) == {r["category"] for r in records}
    for category, r in result.items():
        assert r["best fixed"][0].startswith("ngram:") and r["best peer"][1] > 0
        assert r["holds"]["0.9 clairvoyant"] == (r["ratio"] >= 0.9)
        # the fixed method is compared prompt by prompt: auto's speedup over its own on each prompt
        name, k = r["best fixed"][0], int(r["best fixed"][0].split(":")[1].split("x")[0])
        width = int(name.split("x")[1]) if "x" in name else 1
        test = [x for x in records if x["category"] == category]
        theirs = [
            replay_speedup(
                x["prompt"], x["output"], header["costs"], FixedController(NgramDrafter(width=width), k), stops=stops
            )[0]
            for x in test
        ]
        assert r["best fixed"][1] == pytest.approx(statistics.median(theirs))
        assert r["vs fixed"] == pytest.approx(statistics.median(a / b for a, b in zip(r["speedups"], theirs)))
        assert r["holds"]["best fixed - 3%"] == (r["vs fixed"] >= 0.97)
        assert r["holds"]["best peer - 3%"] == (r["vs peer"] >= 0.97)
    failing = any(not ok for r in result.values() for ok in r["holds"].values())
    script = Path(__file__).resolve().parents[1] / "scripts" / "replay_controller.py"
    proc = subprocess.run(
        [sys.executable, str(script), "verdict", "--recording", str(path), "--check"], capture_output=True, text=True
    )
    assert proc.returncode == (1 if failing else 0), proc.stderr
    assert "best peer" in proc.stdout and ("FAILS" in proc.stdout) == failing


def test_loo_refuses_a_constant_it_would_not_set():
    """`loo --set NAME=VALUE` with an upper-case NAME that neither the controller nor the acceptance
    tables define is a one-line error and exit 2 (REACH, once a constant, is now the argument
    `reach`: setting the old name used to change nothing, silently)."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "scripts" / "replay_controller.py"
    proc = subprocess.run(
        [sys.executable, str(script), "loo", "--recording", str(RECORDINGS[1]), "--set", "REACH=1"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "error: --set: no constant REACH in specdec.controller or specdec.acceptance"
    ]


def test_draft_ranks_break_ties_by_id_and_trees_replay_as_chains_at_width_one():
    """A rank counts the candidates above the token, and an equal logit of a smaller id (argmax's
    and the greedy siblings' order); ranks past the cap read 9, and a tree wider than a rank can
    tell is refused. A fishbone of width 1 keeps what the chain keeps."""
    from specdec_lab.replay import RANK_CAP, draft_ranks, draft_run, tree_run

    logits = np.array([[1.0, 3.0, 3.0, 0.0], [1.0, 3.0, 3.0, 0.0], [5.0, 1.0, 1.0, 1.0]])
    assert draft_ranks(logits, [2, 1, 3]) == "103"
    assert draft_ranks(-np.arange(20.0)[None, :], [15]) == str(RANK_CAP)
    with pytest.raises(ValueError, match="widths 1..9"):
        tree_run("000", 0, 2, RANK_CAP + 1)
    ranks = "0010023000"
    agrees = "".join("1" if r == "0" else "0" for r in ranks)
    for pos in range(len(ranks)):
        for k in (1, 2, 4):
            assert tree_run(ranks, pos, k, 1) == draft_run(agrees, pos, k)
    assert [tree_run(ranks, 0, 4, w) for w in (1, 2, 3)] == [2, 3, 3]  # the miss at depth 3 is rank 1
    assert tree_run(ranks, 3, 4, 2) == 2 and tree_run(ranks, 3, 4, 3) == 3  # two 0s, then rank 2


@pytest.mark.parametrize("path", RECORDINGS, ids=lambda p: p.name)
def test_the_shipped_ranks_agree_with_the_shipped_agreement(path):
    """Every shipped recording holds the draft's ranks, taken on the same outputs as its greedy
    agreement: rank 0 exactly where the draft agreed; its confidences, one a position; and its top
    probabilities, best first, its confidence a share of a softmax whose best is the first."""
    _, records = load_recording(path)
    for r in records:
        assert len(r["draft_ranks"]) == len(r["output"]) == len(r["draft_p"]) == len(r["draft_top"])
        assert all(0.1 <= p <= 1.0 for p in r["draft_p"])  # of 10 candidates, the best holds >= 1/10
        for p, top in zip(r["draft_p"], r["draft_top"]):
            assert len(top) == 4 and top == sorted(top, reverse=True) and top[0] <= p + 1e-3 and sum(top) <= 1.001
        assert [c == "0" for c in r["draft_ranks"]] == [c == "1" for c in r["draft_agrees"]], r["id"]


def test_the_trees_table_sets_the_best_tree_against_the_best_chain(tmp_path):
    """`replay_controller.py trees`: a row per category whose best chain and best tree are the
    fixed_tree medians' best, the tree set against the chain prompt by prompt (the median of the
    per-prompt ratios); --check exits 1 exactly when the tree bar fails (a ratio under 1, or most
    not above it); a recording without ranks is a one-line error and exit 2."""
    import subprocess
    import sys

    from specdec_lab.replay import fixed_tree

    path = RECORDINGS[1]
    header, records = load_recording(path)
    script = Path(__file__).resolve().parents[1] / "scripts" / "replay_controller.py"
    args = [sys.executable, str(script), "trees", "--recording", str(path), "--chains", "2", "4", "--trees", "2x2"]
    proc = subprocess.run(args + ["--check"], capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "category" not in line]
    assert len(lines) == len({r["category"] for r in records})
    ratios = []
    for line in lines:
        category = line.split("|")[1].strip()
        rows = [r for r in records if r["category"] == category]
        runs = {
            (k, w): [fixed_tree(r, header["costs"], header["draft_costs"], k, w)[0] for r in rows]
            for k, w in ((2, 1), (4, 1), (2, 2))
        }
        chain = max(((2, 1), (4, 1)), key=lambda s: np.median(runs[s]))
        ratios.append(np.median([a / b for a, b in zip(runs[(2, 2)], runs[chain])]))
        assert f"draft:2x2 {np.median(runs[(2, 2)]):.2f}x" in line and f"{np.median(runs[chain]):.2f}x" in line
        assert line.split("|")[7].strip() == f"{ratios[-1]:.4f}"
    fails = min(ratios) < 1 or sum(x > 1 for x in ratios) <= len(ratios) / 2
    assert proc.returncode == (1 if fails else 0) and ("FAILS" in proc.stdout) == fails
    bare = tmp_path / "bare.jsonl"
    bare.write_text(
        "\n".join(
            [json.dumps(header)] + [json.dumps({k: v for k, v in r.items() if k != "draft_ranks"}) for r in records]
        )
        + "\n"
    )
    proc = subprocess.run([*args[:4], str(bare)], capture_output=True, text=True)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "no draft ranks" in proc.stderr
    proc = subprocess.run([*args[:5], "--trees", "8y2"], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.startswith("error: --trees 8y2: want KxW")
    # a shaped tree: 4 candidates a depth are recorded, and a node or more; counts as bench's methods write them
    for shape in ("4x5/4", "4x2/0", "+4x2", "4x2/1_0"):
        proc = subprocess.run([*args[:5], "--trees", shape], capture_output=True, text=True)
        assert proc.returncode == 2 and proc.stderr.startswith(f"error: --trees {shape}: want KxW")
    proc = subprocess.run([*args[:5], "--drafter", "ngram", "--trees", "4x2/4"], capture_output=True, text=True)
    assert proc.returncode == 2 and "for the draft model, KxW/N" in proc.stderr  # prompt lookup's trees have no budget
    untopped = tmp_path / "untopped.jsonl"
    untopped.write_text(
        "\n".join(
            [json.dumps(header)] + [json.dumps({k: v for k, v in r.items() if k != "draft_top"}) for r in records]
        )
        + "\n"
    )
    proc = subprocess.run([*args[:4], str(untopped), "--trees", "4x2/4"], capture_output=True, text=True)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "no top probabilities" in proc.stderr
    # a shaped tree's row: its median is fixed_tree's, and the bounds past the first miss order it
    shaped = {}
    for past in ("sure", "recorded", "unsure"):
        proc = subprocess.run(
            [*args[:5], "--chains", "4", "--trees", "4x3/4", "--past-miss", past], capture_output=True, text=True
        )
        assert proc.returncode == 0 and f"past a shaped tree's first miss: {past}" in proc.stdout
        line = next(line for line in proc.stdout.splitlines() if line.startswith(f"| {records[0]['category']} |"))
        shaped[past] = float(line.split("draft:4x3/4 ")[1].split("x")[0])
    rows = [r for r in records if r["category"] == records[0]["category"]]
    want = np.median([fixed_tree(r, header["costs"], header["draft_costs"], 4, 3, nodes=4)[0] for r in rows])
    assert shaped["recorded"] == round(want, 2)
    proc = subprocess.run([*args[:5], "--chains", "0", "4"], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.strip() == "error: --chains 0: a chain drafts 1 token or more"
    for flag, value, message in (
        ("--tree-costs", str(tmp_path / "missing.json"), "not a benchmarks/tree_costs.py report"),
        ("--tree-cost", "0", "a tree's forward costs more than nothing"),
    ):
        proc = subprocess.run([*args, flag, value], capture_output=True, text=True)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and message in proc.stderr


def test_ranks_from_another_machine_follow_the_recorded_agreement():
    """Where the draft's greedy guess parts from the recorded one at a rounding tie, its rank 0
    and 1 trade places so that rank 0 is where the recording agreed; elsewhere nothing changes."""
    from specdec_lab.replay import reconcile_ranks

    assert reconcile_ranks("0312", "1000") == ("0312", 0)
    assert reconcile_ranks("1302", "1001") == ("0310", 3)


def test_the_clairvoyant_over_trees_bounds_every_fixed_tree_and_the_chains_clairvoyant():
    """With the draft's ranks the clairvoyant may also draft its trees of auto's widths: it is never
    below the chains-only clairvoyant, nor below any fixed tree, on a flat (GPU-like) curve."""
    from specdec_lab.replay import clairvoyant_speedup, fixed_tree

    header, records = load_recording(RECORDINGS[1])
    flat = [0.01 * (1 + 0.01 * w) for w in range(16)]
    draft = [0.004] * 16
    gains = []
    for r in records[::14][:4]:
        chains = clairvoyant_speedup(r["prompt"], r["output"], flat, r["draft_agrees"], draft)
        trees = clairvoyant_speedup(r["prompt"], r["output"], flat, r["draft_agrees"], draft, r["draft_ranks"])
        assert trees >= chains - 1e-9
        gains.append(trees / chains)
        for k, w in ((2, 2), (4, 3), (8, 4)):
            assert trees >= fixed_tree(r, flat, draft, k, w)[0] - 1e-9
    assert max(gains) > 1.01  # the trees are used where the draft misses


def test_a_fixed_tree_pays_the_draft_models_read_of_the_prompt_as_a_replayed_chain_does():
    """fixed_tree at width 1 is the chain draft:K, and it costs what the recorded drafter's chain
    replayed step by step costs, the draft model's first catch-up over the whole prompt included
    (ModelDrafter catches up lazily: its first draft reads the prompt). Before, fixed trees paid a
    one-token catch-up at their first step and beat chains and `auto` by the prompt's read."""
    from specdec_lab.replay import RecordedDrafter, fixed_tree

    rng = np.random.default_rng(3)
    prompt, output = list(range(300)), [int(t) for t in rng.integers(1000, 2000, 100)]
    agrees = "".join("1" if x < 0.7 else "0" for x in rng.random(len(output)))
    # every step's catch-up is 1 token (2 after a whole draft is kept): both cost one forward here,
    # and the prompt's read 300 of them
    flat = [0.01 * (1 + 0.02 * w) for w in range(16)]
    draft = [0.004, 0.004] + [0.004 * w for w in range(3, 17)]
    ranks = "".join("0" if a == "1" else "1" for a in agrees)  # each miss: the draft's second guess
    record = {"prompt": prompt, "output": output, "draft_agrees": agrees, "draft_ranks": ranks}
    for k in (1, 3, 6):
        recorded = RecordedDrafter.of([record])
        chain, _ = replay_speedup(prompt, output, flat, FixedController(recorded, k), recorded, draft)
        assert fixed_tree(record, flat, draft, k, 1)[0] == pytest.approx(chain, rel=1e-9)
    # the prompt's read is the difference: a 1-token prompt makes the same tree faster
    short = {**record, "prompt": [0]}
    assert fixed_tree(short, flat, draft, 3, 2)[0] > fixed_tree(record, flat, draft, 3, 2)[0] * 1.05


def test_the_fixed_methods_include_prompt_lookups_trees_priced_as_trees():
    """Every fixed method of every drafter: prompt lookup's trees ngram:KxW (2-4 branches) are
    fixed methods beside its chains, each replayed step by step with a tree's forward at
    `tree_cost` times a chain's of as many tokens; their decisions read depth x branches."""
    from specdec_lab.replay import FIXED_NGRAM_K, NGRAM_WIDTHS, policy_runs

    # a phrase copied twice and then edited two ways: the output copies it a third time
    rng = np.random.default_rng(5)
    phrase = [int(t) for t in rng.integers(0, 300, 12)]
    prompt = phrase + [900, 901] + phrase + [902, 903] + [int(t) for t in rng.integers(0, 300, 20)] + phrase[:4]
    output = phrase[4:] + [902, 903] + [int(t) for t in rng.integers(300, 600, 30)]
    records = [{"category": "c", "prompt": prompt, "output": output}]
    flat = [0.01 * (1 + 0.01 * w) for w in range(16)]
    speedups = {name: one for name, (one,) in policy_runs(records, flat, tree_cost=1.2)["c"].items()}
    assert {f"ngram:{k}x{w}" for k in FIXED_NGRAM_K for w in NGRAM_WIDTHS} <= set(speedups)
    tree, decisions = replay_speedup(
        prompt, output, flat, FixedController(NgramDrafter(width=2), 12), stops=frozenset(), tree_cost=1.2
    )
    assert speedups["ngram:12x2"] == pytest.approx(tree)
    assert any(key.startswith("ngram:") and "x2" in key for key in decisions), decisions
    cheaper, _ = replay_speedup(prompt, output, flat, FixedController(NgramDrafter(width=2), 12), tree_cost=1.0)
    assert cheaper > tree  # the tree steps were priced at tree_cost


def test_prompt_lookups_sibling_rate_counts_only_failures_where_its_tree_branches():
    """Where the context's last tokens occurred twice and went on differently, the tree's first
    branch continues the longer match (9) and another branch the shorter (10): the recorded token
    10 is a sibling's hit, 11 a miss, and 9 then a miss one deeper, where nothing branches, is not
    counted at all."""
    from specdec_lab.replay import fit_ngram_sibling_prior, ngram_sibling_statistics

    prompt = [8, 0, 1, 2, 3, 9, 5, 0, 1, 2, 3, 10, 8, 0, 1, 2, 3]
    tree = NgramDrafter(width=4).propose({0: prompt}, {0: 4})[0]
    assert tree.tokens[0] == 9 and tree.parents is not None
    record = {"prompt": prompt, "category": "c"}
    assert ngram_sibling_statistics([{**record, "output": [10]}], 4) == (1, 1)
    assert ngram_sibling_statistics([{**record, "output": [11]}], 4) == (0, 1)
    assert ngram_sibling_statistics([{**record, "output": [9, 4]}], 4) == (0, 0)
    assert ngram_sibling_statistics([{**record, "output": [10]}], 1) == (0, 0)  # chains: no tree
    rate = fit_ngram_sibling_prior([{**record, "output": [10]}, {**record, "output": [11]}], 4)
    assert 0.0 < rate < 1.0
