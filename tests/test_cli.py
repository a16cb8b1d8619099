"""The `specdec` command end to end: real runs, --help, the demo. (Bad input: tests/test_user_errors.py.)"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from specdec import catalog

from .conftest import SHIPPED_COSTS, Stopped, captured_call
from .test_user_errors import specdec  # the user-error table lives in tests/test_user_errors.py


@pytest.mark.real_models
def test_generate_json_end_to_end(draft_model):
    proc = specdec(
        "generate",
        "--target",
        "qwen2.5-coder-0.5b",
        "--draft",
        "ngram",
        "-n",
        "24",
        "--json",
        "-p",
        "Write a Python function that reverses a string.",
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert len(out["tokens"]) == 24 and out["text"] and out["draft"] == "ngram"
    assert out["stats"]["generated_tokens"] == 24 and out["stats"]["steps"] >= 1


@pytest.mark.real_models
def test_generate_streams_and_reads_stdin(draft_model):
    proc = specdec(
        "generate",
        "--target",
        "qwen2.5-coder-0.5b",
        "--draft",
        "ngram",
        "-n",
        "16",
        "--stats",
        stdin="Say hello in French.",
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
    assert "acceptance rate" in proc.stderr and "tokens/s" in proc.stderr


@pytest.mark.real_models
def test_compare_end_to_end(target_model, draft_model):
    proc = specdec(
        "compare", "-n", "24", "--costs", str(SHIPPED_COSTS), "-p", "Write a Python function that adds two numbers."
    )
    assert proc.returncode == 0, proc.stderr
    assert "specdec: timing" not in proc.stderr  # auto took the curves it was given
    for label in (
        "plain",
        "speculative",
        "speedup",
        "acceptance rate",
        "mean accepted length",
        "acceptance by position",
        "drafter vs target",
        "outputs",
    ):
        assert label in proc.stdout
    # the default drafter (auto) against plain decoding: identical, or parting at a named tie
    verdict = next(line for line in proc.stdout.splitlines() if line.startswith("outputs"))
    assert verdict.split()[1] == "identical" or "a rounding tie" in verdict, verdict
    proc = specdec(
        "compare",
        "-n",
        "24",
        "--json",
        "--draft",
        "ngram",
        "-p",
        "Write a Python class for a stack with push, pop and peek.",
    )
    out = json.loads(proc.stdout)
    assert out["plain"]["stats"]["generated_tokens"] == len(out["plain"]["tokens"]) == 24
    assert out["identical"] or "a rounding tie" in out["verdict"], out["verdict"]
    assert out["speculative"]["stats"]["drafted"] > 0


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


def test_generate_logprobs_are_the_targets(tmp_path):
    """`generate --logprobs N`: each generated token's log-probability and its N likeliest
    alternatives equal the log-softmax of a plain forward of the target over everything before
    it, though the tokens came from 4-token verification forwards (early-exit drafts, k 3): in
    --json, with ids, texts and bytes; in the text mode, a table on stderr, a line a token, and
    stdout the text alone."""
    import ast
    import re

    import numpy as np

    from specdec import request
    from specdec.models.numpy_ref import load_numpy_model

    from .models.test_numpy_ref import write_tiny_gguf

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    args = ["generate", "--backend", "numpy", "--target", str(path), "--no-chat", "-n", "10", "-p", "the cat"]
    args += ["--draft", "early-exit:1", "-k", "3", "--logprobs", "3"]
    proc = specdec(*args, "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["stats"]["drafted"] > 0 and len(out["logprobs"]) == len(out["tokens"]) == 10

    model = load_numpy_model(path)
    prompt = request.tokens(model, "the cat", chat=False)
    want = []
    for i in range(len(out["tokens"])):
        model.reset()
        logits = model.forward(prompt + out["tokens"][:i])[-1].astype(np.float64)
        want.append(logits - logits.max() - np.log(np.exp(logits - logits.max()).sum()))
    for entry, token, logp in zip(out["logprobs"], out["tokens"], want):
        assert entry["id"] == token and bytes(entry["bytes"]) == model.tokenizer.token_bytes(token)
        assert entry["logprob"] == pytest.approx(logp[token], abs=1e-4)
        top = list(np.argsort(-logp, kind="stable")[:3])
        assert [t["id"] for t in entry["top_logprobs"]] == top
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(list(logp[top]), abs=1e-4)

    proc = specdec(*args)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == out["text"] + "\n"  # the text alone
    lines = proc.stderr.splitlines()
    table = lines[lines.index(next(line for line in lines if line.startswith("--- logprobs"))) + 2 :]
    assert len(table) == 10
    # a token: "its text", b'its bytes' (part of a character) or <its name> (it prints nothing)
    shown = r"""("(?:[^"\\]|\\.)*"|b'(?:[^'\\]|\\.)*'|b"(?:[^"\\]|\\.)*"|<\S+>)\s+(-?\d+\.\d+)"""
    for i, (line, token, logp) in enumerate(zip(table, out["tokens"], want, strict=True)):
        index, rest = line.split(maxsplit=1)
        (text, value), *alternatives = re.findall(shown, rest)
        assert int(index) == i
        if text.startswith("<"):
            assert text == model.tokenizer.token_text(token) and not model.tokenizer.token_bytes(token)
        else:
            literal = ast.literal_eval(text)
            assert (literal if isinstance(literal, bytes) else literal.encode()) == model.tokenizer.token_bytes(token)
        assert float(value) == pytest.approx(logp[token], abs=2e-4)
        top = sorted(logp, reverse=True)[:3]
        assert [float(v) for _, v in alternatives] == pytest.approx(top, abs=2e-4)


def _subparsers():
    from specdec.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices


@pytest.mark.parametrize(
    "command", ["generate", "compare", "demo", "bench", "models", "fetch", "serve", "costs", "train", "check"]
)
def test_help_shows_every_default(command):
    parser = _subparsers()[command]
    formatter = parser._get_formatter()
    for action in parser._actions:
        if action.nargs == 0 or not action.option_strings or action.required:  # none to show
            continue
        assert "default" in formatter._get_help_string(action), (command, action.option_strings)
    parser.format_help()  # every help string formats (a stray % would raise here)


def test_the_cli_reference_is_what_the_parsers_say(tmp_path):
    """docs/guide/cli.md is written from the parsers (`make cli-docs`): a flag added, removed or reworded
    without rewriting it fails here. Its check mode fails on a stale copy and passes on a fresh one."""
    from specdec.cli import reference

    committed = Path(__file__).resolve().parents[1] / "docs" / "guide" / "cli.md"
    text = reference.markdown()
    assert committed.read_text(encoding="utf-8") == text, "docs/guide/cli.md is stale: run `make cli-docs`"
    for command in _subparsers():
        assert f"\n## specdec {command}\n" in text
    assert "| `-k K`, `--draft-tokens K` |" in text and "(default: 4)" in text
    stale = tmp_path / "cli.md"
    stale.write_text(text.replace("--max-batch", "--max-rows"), encoding="utf-8")
    assert reference.main(["--check", str(stale)]) == 1
    assert reference.main([str(stale)]) == 0 and reference.main(["--check", str(stale)]) == 0


def test_help_says_what_k_and_temperature_do():
    parser = _subparsers()["generate"]
    helps = {action.dest: parser._get_formatter()._get_help_string(action) % vars(action) for action in parser._actions}
    assert "ignored under --draft auto" in helps["draft_tokens"] and "default: 4" in helps["draft_tokens"]
    assert "not batch-invariant" in helps["temperature"] and "near-tie" in helps["temperature"]
    assert "default: auto" in helps["draft"]


@pytest.mark.parametrize("command", ["generate", "compare"])
@pytest.mark.parametrize(
    "flag, field, help_phrase",
    [
        ("--special-in-turns", "special_in_turns", "prompt injection"),
        ("--reproducible", "reproducible", "sample by position"),
    ],
)
def test_a_request_switch_reaches_the_config(command, flag, field, help_phrase):
    from specdec.cli import build_parser
    from specdec.cli.prompt import _config

    parser = build_parser()
    assert getattr(_config(parser.parse_args([command, "-p", "x", flag])), field) is True
    assert getattr(_config(parser.parse_args([command, "-p", "x"])), field) is False  # off unless asked
    assert help_phrase in _subparsers()[command].format_help()
    assert flag in _subparsers()["serve"].format_help()  # the server's own, for every request


@pytest.mark.parametrize("command", ["generate", "compare"])
def test_verification_reaches_the_config(command):
    from specdec.cli import build_parser
    from specdec.cli.prompt import _config

    parser = build_parser()
    assert _config(parser.parse_args([command, "-p", "x"])).verification == "block"  # the default
    assert _config(parser.parse_args([command, "-p", "x", "--verification", "token"])).verification == "token"
    assert "block verification" in " ".join(_subparsers()[command].format_help().split())


@pytest.mark.real_models
def test_demo_shows_where_auto_pays_and_where_it_steps_aside(target_model, draft_model):
    proc = specdec("demo", "--costs", str(SHIPPED_COSTS), timeout=600)  # plain runs twice; a loaded machine is slow
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "1. code edit" in out and "2. open generation" in out
    assert out.count("predicted") == 2 and out.count("a target forward of 2 tokens costs") == 2
    assert out.count("(two runs, ") == 2  # plain decoding ran twice: the verdicts know the noise
    verdicts = ("auto stepped aside", "auto won, beyond", "auto lost, beyond", "no measured difference")
    assert sum(out.count(v) for v in verdicts) == 2, out


@pytest.mark.real_models
def test_the_suffix_cache_is_saved_at_exit_and_drafts_the_next_run(tmp_path, draft_model):
    from specdec.drafters.suffix import SuffixCacheDrafter

    cache = tmp_path / "cache.npz"
    args = (
        "generate",
        "--target",
        "qwen2.5-coder-0.5b",
        "--draft",
        "suffix",
        "--suffix-cache",
        str(cache),
        "-n",
        "24",
        "--json",
        "-p",
        "Write a Python function that reverses a string.",
    )
    first = specdec(*args)
    assert first.returncode == 0, first.stderr
    saved = SuffixCacheDrafter()
    assert saved.load(cache) >= 24 + json.loads(first.stdout)["prompt_tokens"]  # the prompt and the answer
    second = specdec(*args)
    assert second.returncode == 0, second.stderr
    again = json.loads(second.stdout)
    assert again["tokens"] == json.loads(first.stdout)["tokens"]
    stats = again["stats"]  # the answer, drafted from the saved run
    assert stats["accepted"] >= 0.9 * stats["drafted"] and stats["accepted"] >= 16, stats
    assert SuffixCacheDrafter().load(cache) > saved.tokens_stored  # saved again, with both runs


def test_serve_passes_the_scheduling_flags_to_the_service(monkeypatch):
    """--prefill-stall and --objective reach build_service (its engine and auto's controller); the
    objective is latency unless asked."""
    from specdec.cli import build_parser, serve
    from specdec.server import app

    seen = captured_call(monkeypatch, app, "build_service")
    monkeypatch.setattr(
        serve,
        "_model_loader",
        lambda args, rows: lambda *a, **k: __import__("types").SimpleNamespace(name="t", n_ctx=64),
    )
    monkeypatch.setattr(serve, "_suffix_cache", lambda args, target: None)
    args = build_parser().parse_args(
        ["serve", "--draft", "none", "--prefill-stall", "3.5", "--prefill-waste", "inf", "--objective", "throughput"]
        + ["--long-step-share", "0.02", "--cache-ram", "16"]
    )
    with pytest.raises(Stopped):
        serve.cmd_serve(args)
    assert (seen["prefill_stall"], seen["prefill_waste"], seen["objective"]) == (3.5, float("inf"), "throughput")
    assert seen["long_step_share"] == 0.02
    assert seen["prefix_cache"] is True and seen["host_cache"] == 16 << 20
    with pytest.raises(Stopped):
        serve.cmd_serve(
            build_parser().parse_args(["serve", "--draft", "none", "--no-prefix-cache", "--cache-ram", "-1"])
        )
    assert seen["prefix_cache"] is False and seen["host_cache"] is None
    with pytest.raises(Stopped):  # llama-server's default, as MiB
        serve.cmd_serve(build_parser().parse_args(["serve", "--draft", "none"]))
    assert seen["host_cache"] == __import__("specdec.engine").engine.HOST_CACHE_MIB << 20
    # unless asked, a server maximises its batch's tokens per second with no step past LATENCY_STEP
    assert seen["objective"] == "bounded"
    assert seen["long_step_share"] == __import__("specdec.controller").controller.LONG_STEP_SHARE


def test_serve_reads_a_config_file_and_the_environment_below_its_flags(tmp_path, monkeypatch):
    """`serve --config FILE` (YAML, keys are flags, - or _) and SPECDEC_<FLAG>: a flag given wins
    over the environment, which wins over the file; switches read true/false alike."""
    from specdec.cli import main
    from specdec.cli import serve as serve_cli

    seen = []
    monkeypatch.setattr(serve_cli, "cmd_serve", lambda args: seen.append(args) or 0)
    config = tmp_path / "serve.yaml"
    config.write_text("max_batch: 8\nport: 9000\nreproducible: true\nobjective: latency\nmax-queue: 3\n")
    monkeypatch.setenv("SPECDEC_PORT", "9100")
    monkeypatch.setenv("SPECDEC_NO_PREFIX_CACHE", "yes")
    assert main(["serve", "--config", str(config), "--max-queue", "5"]) == 0
    args = seen[-1]
    assert (args.max_batch, args.port, args.reproducible, args.objective) == (8, 9100, True, "latency")
    assert args.max_queue == 5 and args.prefix_cache is False
    monkeypatch.delenv("SPECDEC_PORT")
    monkeypatch.delenv("SPECDEC_NO_PREFIX_CACHE")
    assert main(["serve"]) == 0  # nothing given: the parser's own defaults
    assert (seen[-1].max_batch, seen[-1].port, seen[-1].prefix_cache) == (4, 8000, True)
