"""The `specdec` command: user errors give one line and exit code 2; real runs end to end."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from specdec import catalog


def specdec(*args, stdin: str | None = None, timeout: float = 600):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "specdec.cli", *args], capture_output=True, text=True,
                          input=stdin if stdin is not None else "", timeout=timeout, env=env)


def assert_user_error(proc, *fragments):
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("specdec: error:") and "Traceback" not in proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.mark.parametrize("args, fragment", [
    (["generate", "-p", "x", "-k", "-1"], "must be >= 0"),
    (["generate", "-p", "x", "--top-p", "1.5"], "--top-p"),
    (["generate", "-p", "x", "--top-p", "0"], "(0, 1]"),
    (["generate", "-p", "x", "--temperature", "-0.1"], "--temperature"),
    (["generate", "-p", "x", "--max-tokens", "0"], "--max-tokens"),
    (["generate", "-p", "x", "--min-p", "2"], "--min-p"),
    (["generate", "-p", "x", "--threads", "zero"], "--threads"),
    (["compare", "--bogus"], "unrecognized arguments"),
    (["generate", "-p", "x", "--draft", "early-exit:3"], "needs --backend numpy"),
    (["generate", "-p", "x", "--draft", "early-exit:x", "--backend", "numpy"], "early-exit:L"),
    (["generate", "-p", "x", "--backend", "cuda"], "invalid choice"),
    (["generate", "-p", "x", "--backend", "torch", "--device", "cuda:7"], "no CUDA GPU"),
    (["generate", "-p", "x", "--dtype", "float8"], "invalid choice"),
    (["bench", "--methods", "magic:3"], "unknown method"),
    (["nonsense"], "invalid choice"),
])
def test_bad_flags(args, fragment):
    assert_user_error(specdec(*args), fragment)


def test_unknown_model_and_missing_file(tmp_path):
    assert_user_error(specdec("generate", "-p", "x", "--target", "gpt-17"), "unknown model 'gpt-17'")
    assert_user_error(specdec("generate", "-p", "x", "--target", str(tmp_path / "no.gguf")), "not found")
    assert_user_error(specdec("fetch", "gpt-17"), "unknown model")
    assert_user_error(specdec("generate", "--prompt-file", str(tmp_path / "none.txt")),
                      "cannot read --prompt-file")


def test_no_prompt_is_an_error():
    assert_user_error(specdec("generate", stdin=""), "no prompt")


@pytest.mark.real_models
def test_corrupt_and_truncated_gguf(tmp_path, draft_model):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"this is not a model")
    assert_user_error(specdec("generate", "-p", "x", "--target", str(bad)), "not a GGUF file")
    truncated = tmp_path / "truncated.gguf"
    with open(draft_model.path, "rb") as src:
        truncated.write_bytes(src.read(8 << 20))
    assert_user_error(specdec("generate", "-p", "x", "--target", str(truncated), "--draft", "ngram"),
                      "corrupt, truncated")


@pytest.mark.real_models
def test_vocabulary_mismatch(target_model):
    from .conftest import _real_model
    _real_model("gemma-3-270m")  # make sure it is assembled
    assert_user_error(specdec("generate", "-p", "x", "--draft", "gemma-3-270m"), "262144 tokens")


@pytest.mark.real_models
def test_prompt_longer_than_context(draft_model):
    proc = specdec("generate", "--target", "qwen2.5-coder-0.5b", "--draft", "ngram", "--ctx", "64",
                   "-p", "word " * 3000)   # llama.cpp may round a tiny --ctx up; 3000 tokens exceed it
    assert_user_error(proc, "the prompt has", "--ctx")


@pytest.mark.real_models
def test_generate_json_end_to_end(draft_model):
    proc = specdec("generate", "--target", "qwen2.5-coder-0.5b", "--draft", "ngram", "-n", "24",
                   "--json", "-p", "Write a Python function that reverses a string.")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert len(out["tokens"]) == 24 and out["text"] and out["draft"] == "ngram"
    assert out["stats"]["generated_tokens"] == 24 and out["stats"]["steps"] >= 1


@pytest.mark.real_models
def test_generate_streams_and_reads_stdin(draft_model):
    proc = specdec("generate", "--target", "qwen2.5-coder-0.5b", "--draft", "ngram", "-n", "16",
                   "--stats", stdin="Say hello in French.")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
    assert "acceptance rate" in proc.stderr and "tokens/s" in proc.stderr


@pytest.mark.real_models
def test_compare_end_to_end(target_model, draft_model):
    proc = specdec("compare", "-n", "24", "-p", "Write a Python function that adds two numbers.")
    assert proc.returncode == 0, proc.stderr
    for label in ("plain", "speculative", "speedup", "acceptance rate", "mean accepted length",
                  "acceptance by position", "drafter vs target", "outputs"):
        assert label in proc.stdout
    proc = specdec("compare", "-n", "24", "--json", "--draft", "ngram", "-p",
                   "Write a Python class for a stack with push, pop and peek.")
    out = json.loads(proc.stdout)
    assert out["plain"]["stats"]["generated_tokens"] == len(out["plain"]["tokens"]) == 24
    assert out["identical"] or "tie" in out["verdict"]


def test_models_lists_the_catalog():
    proc = specdec("models")
    assert proc.returncode == 0
    for name in catalog.CATALOG:
        assert name in proc.stdout


def test_compare_and_generate_on_the_numpy_backend(tmp_path):
    """The whole CLI path on --backend numpy, with a tiny random gpt2 GGUF written here."""
    from .models.test_numpy_ref import write_tiny_gguf

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    common = ["--backend", "numpy", "--target", str(path), "--no-chat", "-n", "12", "-p", "hello"]
    proc = specdec("compare", *common, "--draft", "early-exit:1", "-k", "2")
    assert proc.returncode == 0, proc.stderr
    assert "backend numpy" in proc.stdout and "outputs" in proc.stdout
    proc = specdec("generate", *common, "--draft", "ngram", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["stats"]["generated_tokens"] >= 1
