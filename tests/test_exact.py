"""The exact mode (--exact, load_model(exact=True)): on llama.cpp every row's logits from a forward
of W tokens are bit-identical to a one-token forward's at the same position, alone or beside
another row, so speculative greedy output IS plain greedy output, token for token, with no
rounding tie to name. Each check runs in a process of its own (tests/exact_run.py): a process
loads llama.cpp's exact build or its default one, never both.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import _real_model

pytestmark = pytest.mark.real_models

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=900, check=False
    )


def _exact_run(what: str, exact: bool) -> dict:
    for name in ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"):
        _real_model(name)  # fails (or skips) with the reason where a model is missing
    done = _run(str(ROOT / "tests" / "exact_run.py"), what, *(["--exact"] if exact else []))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_forward_of_many_tokens_is_bit_identical_to_one_token_steps():
    checks = _exact_run("forwards", exact=True)["checks"]
    assert sorted({c["width"] for c in checks}) == list(range(2, 34))  # every width a step verifies
    assert len(checks) == 2 * 32
    bad = [c for c in checks if not (c["one_row"] and c["two_rows"])]
    assert not bad, bad


def test_without_the_exact_mode_they_differ():
    """The power check of the test above: llama.cpp's default kernels give a verification forward
    other last bits than one-token steps (which is why greedy runs part at rounding ties), and the
    comparison sees it."""
    checks = _exact_run("forwards", exact=False)["checks"]
    assert any(not c["one_row"] for c in checks), checks
    assert max(c["max_diff"] for c in checks) > 1e-3


def test_speculative_greedy_is_plain_greedy_token_for_token():
    """No tie rule here (tests/lossless.py allows one in the default mode): every prompt, every
    drafter, alone and in a batch of 4 rows, equals plain decoding exactly; and so does seeded
    sampling by position (--reproducible)."""
    out = _exact_run("greedy", exact=True)
    plain = out["plain"]
    for name in ("draft model", "ngram"):
        assert out[name] == plain, name
        assert out[name + " accepted"] > 0, name
    assert out["draft model, batch of 4"] == plain[:4]
    assert out["draft model, batch of 4 accepted"] > 0
    # sampled by position (--reproducible): a seed is one text, whatever drafted it, bit for bit here
    for name in ("sampled ngram", "sampled draft model"):
        assert out[name] == out["sampled plain"], name
    assert out["sampled draft model, batch of 4"] == out["sampled plain, seeds 7.."]
    assert out["sampled ngram accepted"] + out["sampled draft model accepted"] > 0


def test_exact_and_default_builds_never_share_a_process():
    code = (
        "import sys; sys.path.insert(0, 'src')\n"
        "from specdec import load_model\n"
        "from specdec.errors import SpecdecError\n"
        "load_model('qwen2.5-coder-0.5b', n_ctx=64, progress=False)\n"
        "try:\n"
        "    load_model('qwen2.5-coder-0.5b', n_ctx=64, progress=False, exact=True)\n"
        "except SpecdecError as exc:\n"
        "    print(exc)\n"
    )
    _real_model("qwen2.5-coder-0.5b")
    done = _run("-c", code)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "cannot share a process" in done.stdout


def test_a_missing_exact_build_is_one_line_naming_the_command(tmp_path):
    env = dict(os.environ, SPECDEC_HOME=str(tmp_path))
    code = (
        "import sys; sys.path.insert(0, 'src')\n"
        "from specdec.models.llama_cpp import _lib\n"
        "from specdec.errors import SpecdecError\n"
        "try:\n"
        "    _lib(exact=True)\n"
        "except SpecdecError as exc:\n"
        "    print(exc)\n"
    )
    done = _run("-c", code, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "install_llama_cpp.py --exact" in done.stdout and str(tmp_path) in done.stdout
    assert len(done.stdout.strip().splitlines()) == 1


def test_in_the_exact_mode_any_greedy_parting_is_called_a_bug():
    """compare's verdict: the default mode names a small top-2 gap a rounding tie; the exact mode,
    where a verification forward scores tokens as one-token steps do, calls every parting a bug."""
    from specdec.compare import ROUNDING_GAP, Comparison
    from specdec.engine import GenerationResult
    from specdec.stats import GenerationStats

    def result(tokens):
        return GenerationResult("", tokens, [], GenerationStats())

    for exact in (False, True):
        parted = Comparison(result([1, 2, 3]), result([1, 2, 4]), greedy=True, exact=exact)
        parted.first_difference, parted.logit_gap = 2, ROUNDING_GAP / 10
        verdict = parted.verdict()
        assert ("please report it" in verdict) == exact and ("rounding tie" in verdict) == (not exact), verdict
        assert Comparison(result([1]), result([1]), greedy=True, exact=exact).verdict() == "identical"


def test_a_tree_asked_for_under_the_exact_mode_is_said_to_be_drafted_as_its_chain():
    """The exact mode keeps a cache stream per row, and a tree's nodes would share cells, so it
    verifies chains only: a tree asked for (--draft-width 2) is drafted as its chain, and the run
    says so in one line on stderr and in --json's stats, instead of silently."""
    from .test_user_errors import specdec

    _real_model("qwen2.5-coder-0.5b")
    proc = specdec(
        *("generate", "--exact", "--target", "qwen2.5-coder-0.5b", "--draft", "ngram", "--draft-width", "2"),
        *("-n", "8", "--json", "-p", "Say hi."),
    )
    assert proc.returncode == 0, proc.stderr
    notes = [line for line in proc.stderr.splitlines() if line.startswith("specdec: note:")]
    assert len(notes) == 1 and "--exact" in notes[0] and "drafted as its chain" in notes[0], proc.stderr
    assert json.loads(proc.stdout)["stats"]["notes"] == [notes[0].removeprefix("specdec: note: ")]
