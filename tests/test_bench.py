"""specdec bench: method names, the suite, pairwise speedups, and one tiny real run."""

from __future__ import annotations

import ast
import json
import subprocess
import sys

import pytest

from specdec import bench
from specdec.compare import ROUNDING_GAP
from specdec.errors import SpecdecError
from specdec.spec import DraftSpec

from .conftest import SHIPPED_COSTS, Stopped, captured_call


def test_parse_method():
    assert bench.parse_method("plain") == ("specdec", DraftSpec("none", k=0), 0)
    assert bench.parse_method("draft:4") == ("specdec", DraftSpec("model", k=4), 4)  # the bench's draft model
    assert bench.parse_method("ngram:8") == ("specdec", DraftSpec("ngram", k=8), 8)
    assert bench.parse_method("auto") == ("specdec", DraftSpec("auto", k=0), 0)
    assert bench.parse_method("llama.cpp:draft:4") == ("llama.cpp", "draft", 4)
    assert bench.parse_method("llama.cpp:ngram-simple:8") == ("llama.cpp", "ngram-simple", 8)
    assert bench.parse_method("llama.cpp:plain") == ("llama.cpp", "plain", 0)
    assert bench.parse_method("hf:prompt-lookup:10") == ("hf", "prompt-lookup", 10)
    assert bench.parse_method("vllm:plain") == ("vllm", "plain", 0)
    assert bench.parse_method("vllm:ngram:8") == ("vllm", "ngram", 8)
    assert bench.parse_method("vllm:specdec:auto:16") == ("vllm", "specdec:auto", 16)
    # a peer's K is a count as ours are (ASCII digits: int() alone took "+4" and other scripts' digits)
    for bad in ("vllm:specdec:magic:4", "vllm:ngram", "vllm:ngram:0", "vllm:specdec:auto", "vllm:ngram:+4"):
        with pytest.raises(SpecdecError, match="unknown method"):
            bench.parse_method(bad)
    assert bench.parse_method("early-exit:20:4") == ("specdec", DraftSpec("early-exit", k=4, layers=20), 4)
    assert bench.parse_method("suffix:8") == ("specdec", DraftSpec("suffix", k=8), 8)
    assert bench.parse_method("auto:suffix") == ("specdec", DraftSpec("auto", k=0, suffix=True), 0)
    assert bench.parse_method("auto:nosuffix") == ("specdec", DraftSpec("auto", k=0, suffix=False), 0)
    for bad in (
        "draft",
        "draft:0",
        "draft:x",
        "magic:3",
        "hf:ngram:3",
        "llama.cpp:auto",
        "auto:ngram",
        "suffix",
        "hf:suffix:3",
        "early-exit:0:4",
        "llama.cpp:draft:\u0663",
        "hf:assisted:1_0",
        "early-exit:2",
        "early-exit:2:x",
        "ngram:-1",
    ):
        with pytest.raises(SpecdecError, match="unknown method"):
            bench.parse_method(bad)


def test_the_shipped_suite():
    prompts = bench.load_suite(bench.DEFAULT_SUITE)
    assert len(prompts) == 40 and len({p["id"] for p in prompts}) == 40
    assert {p["category"] for p in prompts} == set(bench.CATEGORIES)
    subset = bench.load_suite(bench.DEFAULT_SUITE, per_category=2)
    assert len(subset) == 10
    assert [p["id"] for p in bench.load_suite(bench.DEFAULT_SUITE, categories=["math"], limit=3)] == [
        "math-01",
        "math-02",
        "math-03",
    ]


def test_bad_suite(tmp_path):
    bad = tmp_path / "suite.jsonl"
    bad.write_text('{"id": "x"}\n')
    with pytest.raises(SpecdecError, match="suite.jsonl:1"):
        bench.load_suite(bad)
    with pytest.raises(SpecdecError, match="cannot read"):
        bench.load_suite(tmp_path / "missing.jsonl")


def test_the_report_loads_no_model():
    """The report (tables, summary.md, plots) works from results.jsonl alone: importing it imports
    no model backend, no matplotlib, and nothing of specdec's beyond what the front door's decoder
    loads (`import specdec` itself loads nothing until a name is used)."""
    code = (
        "import sys; from specdec import SpeculativeDecoder; before = set(sys.modules); import specdec.bench.report; "
        "print(sorted(m for m in set(sys.modules) - before if m.startswith('specdec'))); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('llama_cpp', 'torch', 'transformers', 'matplotlib')))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    added, heavy = (ast.literal_eval(line) for line in proc.stdout.splitlines())
    assert heavy == []
    assert all(m.startswith("specdec.bench") for m in added), added


def test_the_package_keeps_every_name_its_callers_use():
    """cli.py, scripts/ and benchmarks/ use these as bench.<name> or from specdec.bench."""
    names = (
        "Bench CATEGORIES DEFAULT_METHODS DEFAULT_SUITE FULL_METHODS HF_METHODS LLAMA_CPP_METHODS Row "
        "_category_tables _noise_lines load_suite mark_partings parse_method plot prompt_text run_bench write_summary"
    )
    for name in names.split():
        assert hasattr(bench, name), name


def test_speedups_are_pair_by_pair():
    def row(pid, method, tps, repeat=0):
        return bench.Row(pid, "chat", method, repeat, 10, 10 / tps, tps)

    rows = [row("a", "plain", 10), row("a", "ngram:4", 20), row("b", "plain", 40), row("b", "ngram:4", 40)]
    assert sorted(bench.speedups(rows)[("chat", "ngram:4")]) == [1.0, 2.0]


def test_passes_ask_the_suite_again_and_pair_within_a_pass(tmp_path):
    """--passes 2: every prompt again in the same process, reported as its own category and
    compared with plain decoding of the same pass."""

    class Fake:
        def __init__(self):
            self.seen = []

        def run(self, item, method, repeat):
            self.seen.append((item["id"], method))
            # a method that remembers: twice as fast the second time it sees a prompt
            second = (
                sum(
                    i == item["id"].split("#")[0]
                    for i, m in ((i.split("#")[0], m) for i, m in self.seen if m == method)
                )
                > 1
            )
            tps = 20.0 if method == "suffix:8" and second else 10.0
            return bench.Row(item["id"], item["category"], method, repeat, 10, 10 / tps, tps)

    fake = Fake()
    items = [{"id": "a", "category": "chat", "prompt": "x"}, {"id": "b", "category": "math", "prompt": "y"}]
    rows = bench.run_bench(fake, items, ["plain", "suffix:8"], 1, tmp_path, passes=2)
    assert [r.prompt_id for r in rows if r.method == "plain"] == ["a", "b", "a#2", "b#2"]
    ups = bench.speedups(rows)
    assert ups[("chat", "suffix:8")] == [1.0] and ups[("chat (pass 2)", "suffix:8")] == [2.0]


def test_learning_methods_keep_repeats_and_batch_sizes_apart(monkeypatch):
    """auto and suffix:K learn across prompts, one decoder per method for the whole run, but never
    across repeats or batch sizes: a second repeat that shared the first one's suffix cache would
    copy its output (the exact-repeat workload, which --passes measures on purpose)."""
    import specdec.decoder

    monkeypatch.setattr(specdec.decoder.SpeculativeDecoder, "from_spec", lambda *a, **kw: object())
    b = bench.Bench.__new__(bench.Bench)
    b.target, b.drafter, b.learners, b.suffix_cap, b.draft_corpus, b.costs = None, None, {}, 0, None, None
    auto, suffix = (bench.parse_method(m)[1] for m in ("auto", "suffix:8"))
    first = b._decoder(auto, repeat=0)
    assert b._decoder(auto, repeat=0) is first  # learns across prompts
    others = [
        b._decoder(auto, repeat=1),
        b._decoder(auto, repeat=0, batch=4),
        b._decoder(suffix, repeat=0),
        b._decoder(suffix, repeat=1),
    ]
    assert len({id(d) for d in [first, *others]}) == 5


def test_every_method_in_a_batch_steps_by_the_targets_cost_curve(monkeypatch):
    """A batch's decoder, whatever the method, gets the target's cost curve (its forwards split
    where that is cheaper, as a server's rows are); alone none does, and auto keeps its own."""
    import specdec.costs
    import specdec.decoder

    given, timed = [], []
    monkeypatch.setattr(specdec.decoder.SpeculativeDecoder, "from_spec", lambda *a, **kw: given.append(kw["costs"]))
    monkeypatch.setattr(specdec.costs, "measure_cost_table", lambda model: timed.append(model) or ["curve"])
    b = bench.Bench.__new__(bench.Bench)
    b.target, b.drafter, b.learners, b.suffix_cap, b.draft_corpus, b.costs = None, None, {}, 0, None, None
    b.batch_curve = None
    for method in ("plain", "ngram:4", "suffix:8", "auto"):
        for batch in (1, 4):
            b._decoder(bench.parse_method(method)[1], batch=batch)
    assert given == [None, (["curve"], None)] * 3 + [None, None]
    # timed once a run; every decoder its own copy (a table learns its decoder's drift)
    assert len(timed) == 1 and len({id(costs[0]) for costs in given if costs}) == 3
    # a learner asked for again is the one made before: no new decoder, no new copy of the curve
    copies = []
    monkeypatch.setattr(bench.run.copy, "deepcopy", lambda x: copies.append(x) or x)
    b._decoder(bench.parse_method("suffix:8")[1], batch=4)
    assert len(given) == 8 and copies == []


@pytest.mark.real_models
def test_tiny_bench_end_to_end(tmp_path, target_model, draft_model):
    suite = tmp_path / "suite.jsonl"
    suite.write_text(
        json.dumps({"id": "chat-01", "category": "chat", "prompt": "Say hi."})
        + "\n"
        + json.dumps(
            {"id": "code-editing-01", "category": "code-editing", "prompt": "Rename x to y:\n\nx = 1\nprint(x)\n"}
        )
        + "\n"
    )
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "specdec.cli",
            "bench",
            "--suite",
            str(suite),
            "-n",
            "12",
            "--methods",
            "plain",
            "ngram:4",
            "auto",
            "--costs",
            str(SHIPPED_COSTS),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    # plain#2: plain decoding again, the bench's own noise
    assert len(rows) == 8 and {r["method"] for r in rows} == {"plain", "plain#2", "ngram:4", "auto"}
    for r in rows:  # every greedy run is plain's text, or parts from it at a named rounding tie
        assert r["identical_to_plain"] or r["logit_gap"] < ROUNDING_GAP, (r["method"], r["logit_gap"])
    summary = (out / "summary.md").read_text()
    assert "| chat |" in summary and "| code-editing |" in summary and "cores" in summary
    assert "Noise: plain decoding run again (plain#2" in summary


# -- like with like -------------------------------------------------------------------------------


def test_compare_text():
    assert bench.compare_text(" the cat sat\n", "the cat sat") == "identical"
    # llama-speculative-simple keeps whole drafts past -n: more tokens, the same start
    assert bench.compare_text("the cat sat on the mat", "the cat sat") == "prefix"
    assert bench.compare_text("the cat", "the cat sat") == "prefix"
    assert bench.compare_text("the dog sat", "the cat sat") == "differs"


def test_a_run_that_ended_early_at_end_of_generation_parted_from_plain():
    """Texts that agree as far as the shorter goes: where the shorter run ended at an
    end-of-generation token (credited in its tokens, not in its token_ids) and the other wrote on,
    the two wrote different tokens there: a parting for mark_partings to score, not a prefix (a
    bench once counted auto's 98 tokens + end of generation against plain's 127 as agreeing). A run
    that went on past the other's token budget, or whose texts agree but token ids were not kept,
    stays a prefix."""
    plain = bench.Row("p", "c", "plain", 0, 6, 1.0, 6.0, text="a b c d e", token_ids=[1, 2, 3, 4, 5])
    ended = bench.Row("p", "c", "auto", 0, 4, 1.0, 4.0, text="a b c", token_ids=[1, 2, 3])
    assert bench.compare_text(ended.text, plain.text) == "prefix"
    assert bench.match_of(ended, plain) == "differs" and bench.match_of(plain, ended) == "differs"
    budget = bench.Row("p", "c", "auto", 0, 3, 1.0, 3.0, text="a b c", token_ids=[1, 2, 3])  # hit -n
    assert bench.match_of(budget, plain) == "prefix"
    over = bench.Row("p", "c", "llama.cpp:ngram-mod:8", 0, 7, 1.0, 7.0, text="a b c d e f")
    assert bench.match_of(over, plain) == "prefix"
    assert bench.match_of(plain, plain) == "identical"


class FakeBench:
    """run_bench's side of Bench: canned texts and speeds per method (the peer writes more tokens
    than plain, draft:4 parts from plain on prompt b)."""

    def __init__(self):
        self.calls = []

    def run(self, item, method, repeat):
        self.calls.append((item["id"], method, repeat))
        text = {
            "plain": "one two three",
            "llama.cpp:ngram-mod:8": "one two three four",
            "draft:4": "one two three" if item["id"] == "a" else "one two tree",
        }[method]
        tokens = len(text.split())
        tps = {"plain": 10.0, "draft:4": 20.0, "llama.cpp:ngram-mod:8": 15.0}[method] + repeat
        return bench.Row(item["id"], item["category"], method, repeat, tokens, tokens / tps, tps, text=text)


def test_run_bench_records_every_text_and_flags_pairs_that_differ(tmp_path):
    prompts = [{"id": "a", "category": "chat", "prompt": "x"}, {"id": "b", "category": "math", "prompt": "y"}]
    fake = FakeBench()
    rows = bench.run_bench(fake, prompts, ["draft:4", "llama.cpp:ngram-mod:8"], 3, tmp_path)
    assert len(rows) == 2 * 3 * 3
    assert {(pid, m, r) for pid, m, r in fake.calls if r >= 0} == {
        (p["id"], m, r) for p in prompts for m in ("plain", "draft:4", "llama.cpp:ngram-mod:8") for r in range(3)
    }
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert len(records) == 18 and all(r["text"] for r in records)
    match = {(r["prompt_id"], r["method"]): r["text_match"] for r in records}
    assert match[("a", "draft:4")] == "identical" and match[("b", "draft:4")] == "differs"
    assert match[("a", "llama.cpp:ngram-mod:8")] == "prefix"
    per_prompt = bench.prompt_speedups(rows)
    # the median over the three repeats of 20/10, 21/11, 22/12
    assert per_prompt[("a", "draft:4")][1] == pytest.approx(21 / 11)
    assert per_prompt[("b", "draft:4")][2] is False and per_prompt[("a", "draft:4")][2] is True


def test_summary_reports_all_pairs_agreeing_pairs_and_token_counts():
    rows = []
    for pid, cat, draft_text, tps in (("a", "chat", "same", 30.0), ("b", "math", "other", 12.0)):
        rows.append(bench.Row(pid, cat, "plain", 0, 256, 25.6, 10.0, text="same"))
        rows.append(
            bench.Row(
                pid, cat, "draft:4", 0, 256, 256 / tps, tps, text=draft_text, identical_to_plain=draft_text == "same"
            )
        )
        rows.append(
            bench.Row(pid, cat, "llama.cpp:ngram-mod:8", 0, 300, 20.0, 15.0, text="same more", identical_to_plain=True)
        )
    lines = "\n".join(bench._category_tables(rows, ["plain", "draft:4", "llama.cpp:ngram-mod:8"]))
    # draft:4: all pairs 3.0x and 1.2x (median 2.1x), the agreeing pair alone 3.0x, worst b
    assert "| draft:4 | - | - | 1/2 | 2.10x | 3.00x | 1.20x (b) | 256 (256-256) |" in lines
    assert "| llama.cpp:ngram-mod:8 | - | - | 2/2 | 1.50x | 1.50x | 1.50x (a) | 300 (300-300) |" in lines


def test_prompt_text_of_a_multi_turn_item():
    class Tok:
        def apply_chat_template(self, messages):
            return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    class Model:
        is_instruct, tokenizer = True, Tok()

    turns = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "book it"},
    ]
    assert (
        bench.prompt_text(Model(), {"prompt": "flat", "messages": turns})
        == "<user>hi<assistant>hello<user>book it<assistant>"
    )
    assert bench.prompt_text(Model(), {"prompt": "flat"}) == "<user>flat<assistant>"
    Model.is_instruct = False
    assert bench.prompt_text(Model(), {"prompt": "flat", "messages": turns}) == "flat"


def test_the_dev_suite():
    """benchmarks/dev-prompts.jsonl: at least 8 prompts in each of seven categories, each with its
    source and licence (scripts/build_dev_suite.py builds it from public datasets)."""
    path = bench.DEFAULT_SUITE.parent / "dev-prompts.jsonl"
    prompts = bench.load_suite(path)
    categories = {p["category"] for p in prompts}
    assert categories == {"translation", "summarisation", "qa", "math", "rag", "multi-turn", "code"}
    assert all(sum(p["category"] == c for p in prompts) >= 8 for c in categories)
    assert all(p["source"] and p["license"] for p in prompts) and len({p["id"] for p in prompts}) == len(prompts)
    assert not any("Spec-Bench" in p["source"] for p in prompts)
    assert all(p["messages"][-1]["role"] == "user" for p in prompts if "messages" in p)


def test_partings_get_their_first_token_and_top2_gap(tmp_path):
    """A greedy run of ours whose text parts from plain's gets the first token where they part and
    the target's top-2 logit gap there (plain's context, one token at a time); results.jsonl is
    rewritten with them and the summary lists each parting with its verdict."""
    import numpy as np

    from tests.toy import ToyLM

    target = ToyLM(vocab_size=32, seed=3)
    prompt = [5, 6, 7]
    b = bench.Bench.__new__(bench.Bench)
    b.target, b.prompt_ids = target, {"a": prompt}

    def row(method, tokens, match):
        return bench.Row(
            "a",
            "chat",
            method,
            0,
            len(tokens),
            1.0,
            float(len(tokens)),
            text="t",
            token_ids=tokens,
            text_match=match,
            identical_to_plain=match != "differs",
        )

    rows = [
        row("plain", [9, 10, 11, 12], None),
        row("auto", [9, 10, 4, 12], "differs"),
        row("ngram:4", [9, 10, 11, 12], "identical"),
    ]
    parted = bench.mark_partings(b, rows, tmp_path)
    assert [r.method for r in parted] == ["auto"] and rows[1].first_difference == 2
    logits = target.table[9, 10].astype(np.float64)  # the toy's logits after ... 9, 10
    top2 = np.sort(logits)[-2:]
    assert rows[1].logit_gap == pytest.approx(top2[1] - top2[0], abs=1e-5)
    assert rows[2].logit_gap is None and target.cache == []  # its scoring row is gone
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["first_difference"] for r in records] == [None, 2, None]
    table = "\n".join(bench._partings_table(rows))
    verdict = "rounding tie" if rows[1].logit_gap < 0.5 else "NOT a tie"
    assert f"| a | auto | 0 | 2 | {rows[1].logit_gap:.4f} | {verdict} |" in table


def test_a_vllm_method_that_parted_is_scored_by_vllm_s_own_plain_engine(tmp_path):
    """vLLM's methods part from vllm:plain (not from our plain, whose weights differ); the gap there
    is vLLM's own top-2 logprob gap on vllm:plain's context, asked of its still-open engine."""

    class Engine:  # the open vllm:plain engine (peers.VllmPeer)
        def __init__(self):
            self.asked = []

        def run(self, ids, max_tokens, logprobs=0):
            self.asked.append((list(ids), max_tokens, logprobs))
            self.last = {"logprobs": [{"4": -0.9, "11": -0.7, "3": -4.0}]}

    b = bench.Bench.__new__(bench.Bench)
    b.prompt_ids, b.vllm = {"a": [5, 6, 7]}, {("vllm:plain", 0): Engine()}

    def row(method, tokens, match):
        return bench.Row("a", "chat", method, 0, len(tokens), 1.0, 4.0, text="t", token_ids=tokens, text_match=match)

    rows = [
        row("plain", [1, 2, 3, 4], None),  # ours: a different text, never vLLM's base
        row("vllm:plain", [9, 10, 11, 12], "differs"),  # against our plain: engines differ, not scored
        row("vllm:ngram:8", [9, 10, 4, 12], "differs"),
        row("vllm:specdec:auto:16", [9, 10, 4, 13], "differs"),  # the same parting: asked once
    ]
    parted = bench.mark_partings(b, rows, tmp_path)
    assert [r.method for r in parted] == ["vllm:ngram:8", "vllm:specdec:auto:16"]
    assert [r.first_difference for r in parted] == [2, 2]
    assert parted[0].logit_gap == pytest.approx(0.2) and b.vllm[("vllm:plain", 0)].asked == [([5, 6, 7, 9, 10], 1, 2)]
    assert "| a | vllm:ngram:8 | 0 | 2 | 0.2000 | rounding tie |" in "\n".join(bench._partings_table(rows))


def test_every_runner_is_credited_its_tokens_alike():
    """The same work counts the same for every runner: our engine does not emit an
    end-of-generation token but spends a forward on it, llama.cpp counts it; llama.cpp's
    speculative binary stops only past -n. So a run is credited the tokens it produced, an
    end-of-generation token included, at most -n + 1 (a 21-token answer with nothing drafted
    read as 5% faster under llama.cpp's count)."""
    from specdec.peers import PeerRun
    from tests.toy import ToyLM

    assert bench.produced(21, True, 256) == 22 and bench.produced(256, False, 256) == 256
    assert bench.produced(300, False, 256) == 257 and bench.produced(22, False, 256) == 22

    class Peer:
        def __init__(self, tokens):
            self.tokens = tokens

        def run(self, text, max_tokens, spec_type, k):
            return PeerRun(text="x", tokens=self.tokens, seconds=2.0, drafted=8, accepted=8)

    b = bench.Bench.__new__(bench.Bench)
    b.target, b.max_tokens, b.temperature, b.seed = ToyLM(vocab_size=32, seed=1), 8, 0.0, None
    b.reproducible, b.verification = False, "block"
    b.learners, b.prompt_ids, b.suffix_cap, b.draft_corpus, b.drafter = {}, {}, 0, None, None
    item = {"id": "a", "category": "chat", "prompt": "abc"}
    b.llama_cpp = Peer(tokens=40)  # an accepted draft past -n
    row = b.run(item, "llama.cpp:ngram-mod:8", 0)
    assert row.tokens == 9 and row.tokens_per_second == pytest.approx(4.5)
    b.llama_cpp = Peer(tokens=5)  # ended on its end-of-generation token
    assert b.run(item, "llama.cpp:ngram-mod:8", 0).tokens == 5
    ours = b.run(item, "plain", 0)
    result = b._decoder(bench.parse_method("plain")[1]).generate(b.prompt_text(item), b._config())
    assert ours.tokens == len(result.tokens) + (result.stats.finish_reason == "eog")
    assert ours.tokens_per_second == pytest.approx(ours.tokens / ours.seconds)


def test_reproducible_and_verification_reach_every_runs_config(monkeypatch):
    """bench --reproducible samples by position (GenerationConfig.reproducible), so a seeded
    sampled run of any method can be held against plain's text; off unless asked. --verification
    picks the sampled chain rule (block by default)."""
    from specdec.cli import build_parser
    from specdec.cli.bench import cmd_bench

    Bench = bench.Bench
    seen = captured_call(monkeypatch, bench, "Bench")
    for argv, expected in (
        (["--reproducible", "-t", "0.8", "--seed", "7", "--verification", "token"], (True, "token")),
        ([], (False, "block")),
    ):
        seen.clear()
        with pytest.raises(Stopped):
            cmd_bench(build_parser().parse_args(["bench", "--methods", "plain", *argv]))
        assert (seen["reproducible"], seen["verification"]) == expected
    b = Bench.__new__(Bench)
    b.max_tokens, b.temperature, b.seed, b.reproducible, b.verification = 8, 0.8, 7, True, "token"
    config = b._config()
    assert config.reproducible and config.seed == 7 and config.temperature == 0.8 and config.verification == "token"


def test_the_bench_measures_its_own_noise(tmp_path):
    """noise=True: every prompt's plain decoding runs twice, interleaved with the methods, and the
    summary opens with how far the second run strayed from the first: the smallest difference
    that counts."""

    class Drifting:
        def __init__(self):
            self.calls = []

        def run(self, item, method, repeat):
            if repeat >= 0:  # not the warm-up
                self.calls.append((item["id"], method))
            tps = {
                "plain": 10.0,
                "plain#2": 10.0 * (1.1 if item["id"] == "a" else 0.95),
                "ngram:4": 15.0,
                "draft:4": 1,
            }[method]
            return bench.Row(item["id"], item["category"], method, repeat, 10, 10 / tps, tps, text="same")

    prompts = [{"id": "a", "category": "chat", "prompt": "x"}, {"id": "b", "category": "math", "prompt": "y"}]
    runner = Drifting()
    rows = bench.run_bench(runner, prompts, ["ngram:4"], 1, tmp_path, noise=True)
    assert sorted(m for pid, m in runner.calls if pid == "a") == ["ngram:4", "plain", "plain#2"]
    assert bench.parse_method("plain#2")[1].kind == "none"
    lines = bench._noise_lines(rows)
    assert lines[0].startswith("Noise: plain decoding run again (plain#2") and "0.95-1.10x over 2 prompts" in lines[0]
    assert "within 1 +- 0.10 is no difference" in lines[0]
    assert "| plain#2 |" in "\n".join(bench._category_tables(rows, ["plain", "plain#2", "ngram:4"]))
    assert bench._noise_lines([r for r in rows if r.method != "plain#2"]) == []


def test_ratio_of_sums_and_its_standard_error():
    """The paired benchmarks' ratio estimator: sum(a) / sum(b), and a standard error that is 0 where
    every pair has that ratio and grows with the pairs' spread around it."""
    from specdec_lab.helpers import ratio_of_sums

    assert ratio_of_sums([(2.0, 1.0), (4.0, 2.0), (6.0, 3.0)]) == (2.0, 0.0)
    r, se = ratio_of_sums([(1.0, 1.0), (3.0, 1.0)])
    assert r == 2.0 and abs(se - 1.0) < 1e-12  # sqrt(((1 - 2)^2 + (3 - 2)^2) / 2) / 1


def test_the_speedup_plot_draws_the_spread_and_the_noise(tmp_path, monkeypatch):
    """The plot shows each method's median with its prompts' quartiles as error bars, and the band
    plain decoding read against itself (plain#2): a speedup inside it is no difference."""
    pytest.importorskip("matplotlib")
    import matplotlib.axes

    from specdec.bench.report import plot

    def row(pid, category, method, tps):
        return bench.Row(pid, category, method, 0, 10, 10 / tps, tps)

    rows = [
        row(f"p{i}", "chat", method, tps)
        for i, base in enumerate([10.0, 12.0, 11.0, 9.0])
        for method, tps in (("plain", base), ("plain#2", base * (1.05 if i % 2 else 0.93)), ("auto", base * 1.2 + i))
    ]
    bars, bands = [], []
    monkeypatch.setattr(matplotlib.axes.Axes, "axhspan", lambda self, lo, hi, **kw: bands.append((lo, hi)))
    real_bar = matplotlib.axes.Axes.bar
    monkeypatch.setattr(
        matplotlib.axes.Axes, "bar", lambda self, *a, **kw: bars.append(kw.get("yerr")) or real_bar(self, *a, **kw)
    )
    paths = plot(rows, ["plain", "plain#2", "auto"], tmp_path)
    assert [p.name for p in paths] == ["speedup.png", "acceptance.png"] and paths[0].stat().st_size > 0
    assert bands == [(0.93, 1.05)]
    assert all(err is not None and len(err) == 2 for err in bars) and len(bars) == 2
    low, high = bars[-1]  # auto's: the quartiles lie around the median
    assert low[0] > 0 and high[0] > 0
